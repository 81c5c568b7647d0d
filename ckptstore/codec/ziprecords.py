"""The records of a stored zip archive: signatures, bounds, the central directory.

Shared by the streaming decoders (:mod:`.zipstream`) and the streaming checker
(:mod:`.zipcheck`). In: bytes of an archive (its tail, its local headers). Out: the
members its central directory lists (:func:`parse_directory`), or an ``IntegrityError``
that says what is wrong with it; ``NotStreamable`` for a valid archive that is not laid
out as ``torch.save`` writes it.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable

from ..errors import IntegrityError
from .torchzip import _compressed

__all__ = ["MAX_DIRECTORY_BYTES", "MAX_RECORD_BYTES", "NotStreamable", "parse_directory"]


#: Bounds on hostile archives: the central directory and the small records (data.pkl,
#: byteorder, version) are held in memory; a real one has a few hundred bytes per member.
MAX_DIRECTORY_BYTES = 64 << 20
MAX_RECORD_BYTES = 256 << 20
#: How much of the end of the file is searched for the end-of-central-directory record
#: (22 bytes, a comment of at most 64 KiB, a zip64 locator and record before it).
_TAIL = (64 << 10) + 22 + 20 + 56
_EOCD = 0x06054B50
_EOCD64 = 0x06064B50
_LOC64 = 0x07064B50
_CDH = 0x02014B50
_LFH = 0x04034B50


class _Member:
    __slots__ = ("crc", "data_start", "dest", "head", "lho", "name", "size")

    def __init__(self, name: str, lho: int, size: int, crc: int = 0) -> None:
        self.crc = crc  # the CRC-32 the central directory gives
        self.name = name
        self.lho = lho
        self.size = size
        self.data_start = -1  # known once its local header streamed by
        self.head = bytearray()
        self.dest: memoryview | None = None


class NotStreamable(Exception):
    """The archive is valid but not laid out as ``torch.save`` writes it."""


def _bad(where: str, what: str) -> IntegrityError:
    return IntegrityError(f"{where}: not a readable torch zip archive: {what}")


def parse_directory(size: int, read: Callable[[int, int], memoryview], where: str) -> list[_Member]:
    """The members of a stored zip of ``size`` bytes, from its (checked) central directory.

    Args:
        size: the file's size.
        read: ``read(offset, length)``: those bytes of the file, already checked.
        where: names the file in messages.

    Returns:
        The members in file order, each with its local header offset and stored size.

    Raises:
        IntegrityError: no end record, a directory out of bounds or over
            :data:`MAX_DIRECTORY_BYTES`, a compressed member, or members that overlap.
        NotStreamable: a multi-disk archive, or anything else torch.save never writes.
    """
    tail_len = min(size, _TAIL)
    tail = bytes(read(size - tail_len, tail_len))
    at = tail.rfind(struct.pack("<I", _EOCD))
    if at < 0 or at + 22 > len(tail):
        raise _bad(where, "no end of central directory record (truncated?)")
    _, disk, cd_disk, _, count, cd_size, cd_off, _ = struct.unpack("<IHHHHIIH", tail[at : at + 22])
    if disk or cd_disk:
        raise NotStreamable
    if 0xFFFF in (count,) or 0xFFFFFFFF in (cd_size, cd_off):
        loc = at - 20
        if loc < 0 or struct.unpack("<I", tail[loc : loc + 4])[0] != _LOC64:
            raise _bad(where, "zip64 end record locator missing")
        (z64,) = struct.unpack("<Q", tail[loc + 8 : loc + 16])
        rec_at = z64 - (size - tail_len)
        if not 0 <= rec_at <= len(tail) - 56:
            raise NotStreamable  # a zip64 record out of the tail: not torch.save's layout
        sig, _, _, _, _, _, _, count, cd_size, cd_off = struct.unpack(
            "<IQHHIIQQQQ", tail[rec_at : rec_at + 56]
        )
        if sig != _EOCD64:
            raise _bad(where, "zip64 end record missing")
    if cd_size > MAX_DIRECTORY_BYTES or cd_off + cd_size > size or count > cd_size // 46:
        raise _bad(where, f"central directory of {cd_size} bytes at {cd_off} is out of bounds")
    cd = bytes(read(cd_off, cd_size))
    members: list[_Member] = []
    pos = 0
    for _ in range(count):
        if pos + 46 > len(cd) or struct.unpack("<I", cd[pos : pos + 4])[0] != _CDH:
            raise _bad(where, "central directory entry malformed")
        (flags, method, _, _, crc, csize, usize, nlen, xlen, clen, disk_no, _, _, lho) = (
            struct.unpack("<HHHHIIIHHHHHII", cd[pos + 8 : pos + 46])
        )
        name_b = cd[pos + 46 : pos + 46 + nlen]
        extra = cd[pos + 46 + nlen : pos + 46 + nlen + xlen]
        pos += 46 + nlen + xlen + clen
        if pos > len(cd):
            raise _bad(where, "central directory entry runs past its end")
        if method != 0:
            raise _compressed(where, name_b.decode("utf-8", "replace"), method, csize, usize)
        if flags & 1:
            raise _bad(where, f"member {name_b!r} is encrypted")
        # zip64 extra: the fields that are 0xFFFFFFFF in the entry, in this order.
        want = [v == 0xFFFFFFFF for v in (usize, csize, lho)] + [disk_no == 0xFFFF]
        if any(want):
            vals = _zip64_extra(extra, sum(want[:3]), where)
            it = iter(vals)
            usize = next(it) if want[0] else usize
            csize = next(it) if want[1] else csize
            lho = next(it) if want[2] else lho
        if csize != usize:
            raise _bad(where, f"member {name_b!r} is stored in {csize} bytes but holds {usize}")
        members.append(_Member(name_b.decode("utf-8", "replace"), lho, usize, crc))
    members.sort(key=lambda m: m.lho)
    end = 0
    for m in members:
        # 30 header bytes at least, then the data: members may not overlap or pass the
        # central directory (a hostile one could point two members at one range).
        if m.lho < end or m.lho + 30 + m.size > cd_off:
            raise _bad(where, f"member {m.name!r} overlaps another or the central directory")
        end = m.lho + 30 + m.size
    return members


def _zip64_extra(extra: bytes, n: int, where: str) -> list[int]:
    pos = 0
    while pos + 4 <= len(extra):
        hid, hlen = struct.unpack("<HH", extra[pos : pos + 4])
        if hid == 1:
            if hlen < 8 * n or pos + 4 + 8 * n > len(extra):
                break
            return list(struct.unpack(f"<{n}Q", extra[pos + 4 : pos + 4 + 8 * n]))
        pos += 4 + hlen
    raise _bad(where, "zip64 sizes missing from a member's extra field")


def _lfh_lengths(head: bytearray) -> int:
    nlen, xlen = struct.unpack("<HH", head[26:30])
    return int(nlen + xlen)


_DD = 0x08074B50
#: Most bytes of a record whose size its local header leaves to the data descriptor and
#: data.pkl does not give (data.pkl itself, byteorder, version, ...): searched for its end.
_MAX_SCANNED = MAX_RECORD_BYTES
#: Most members followed front to back (a central directory of its bound holds no more).
_MAX_MEMBERS = MAX_DIRECTORY_BYTES // 46


def _held_directory(where: str, base: int, tail: bytearray, size: int) -> list[_Member]:
    """The central directory of a ``size``-byte archive, parsed from its held tail.

    ``tail`` holds the archive's bytes from ``base`` on (a stream decoder's last bytes);
    a directory that points outside them is refused.
    """

    def read(offset: int, length: int) -> memoryview:
        if offset < base or offset + length > size:
            raise _bad(where, "the central directory is not where the members end")
        return memoryview(tail)[offset - base : offset - base + length]

    return parse_directory(size, read, where)


def _has_zip64(extra: bytes) -> bool:
    pos = 0
    while pos + 4 <= len(extra):
        hid, hlen = struct.unpack("<HH", extra[pos : pos + 4])
        if hid == 1:
            return True
        pos += 4 + hlen
    return False


_DD_RE = re.compile(re.escape(struct.pack("<I", _DD)))


def _find(mv: memoryview, start: int) -> int:
    """Where the next data descriptor signature in ``mv`` starts (-1: none); no copy."""
    m = _DD_RE.search(mv, start)
    return -1 if m is None else m.start()


def _keep_tail(recent: bytearray, b: memoryview) -> None:
    """Keep the last bytes before a zip's directory: its end record is searched there."""
    if len(b) >= _TAIL:
        recent[:] = b[-_TAIL:]
    else:
        recent += b
        if len(recent) > 2 * _TAIL:
            del recent[:-_TAIL]

"""Checking the stored zip inside a compressed payload as it streams by (``verify``).

In: the archive's bytes, in order, in slices of any size. Out: the number of members once
the stream ended and the archive checked whole (every member stored, its CRC-32 right,
the central directory listing exactly the members that went by), or an
``IntegrityError``. Holds a few KiB, not the file; needs no torch.
"""

from __future__ import annotations

import struct
import zlib

from ..errors import IntegrityError
from .torchzip import _compressed
from .ziprecords import (
    _CDH,
    _DD,
    _EOCD,
    _LFH,
    _MAX_MEMBERS,
    _TAIL,
    MAX_DIRECTORY_BYTES,
    _bad,
    _find,
    _has_zip64,
    _held_directory,
    _keep_tail,
    _lfh_lengths,
    _zip64_extra,
)

__all__ = ["ZipStreamChecker"]


class ZipStreamChecker:
    """Checks a stored zip front to back as it streams by, holding a few KiB, not the file.

    What :func:`check_zip` with ``deep`` checks of a whole archive, for the content of a
    compressed payload (``verify``): every member stored, not encrypted, its CRC-32
    right, and the central directory at the end (bounded by :data:`MAX_DIRECTORY_BYTES`)
    listing exactly the members that streamed by, with their sizes and CRCs. A member
    whose size its local header leaves to a data descriptor (``torch.save`` writes them
    so) ends at the first descriptor that gives the bytes before it and their CRC-32; the
    CRC runs along the data, so looking costs no second pass. Needs no torch.
    """

    def __init__(self, where: str) -> None:
        """Check the archive named ``where`` in messages."""
        self.where = where
        #: (name, local header offset, size, CRC-32) of the members seen, in file order.
        self.members: list[tuple[str, int, int, int]] = []
        self._pos = 0
        self._state = "head"
        self._buf = bytearray()  # a header or the directory
        self._name = ""
        self._lho = 0
        self._sized = True
        self._zip64 = False
        self._size = 0  # of the current member: known, or its bytes so far
        self._done = 0  # bytes of a member of known size seen
        self._want_crc = 0
        self._crc = 0
        self._carry = bytearray()  # unsized member: its last bytes, a descriptor may start there
        self._mismatch = ""  # the first member whose descriptor's sizes fit but not its CRC
        self._recent = bytearray()
        self._tail_base = -1
        #: The most bytes held at once.
        self.peak = 0

    def __call__(self, offset: int, chunk: memoryview) -> None:
        """Check the next ``chunk`` of the archive, found at ``offset`` (in order)."""
        if offset != self._pos:
            raise ValueError(f"bytes at {offset} fed after {self._pos}: feed in order")
        mv = memoryview(chunk).cast("B")
        while len(mv):
            state = self._state
            if state == "dir":
                self._buf += mv
                if len(self._buf) > MAX_DIRECTORY_BYTES + 2 * _TAIL:
                    raise _bad(self.where, "central directory over its bound")
                n = len(mv)
            elif state == "head":
                n = self._header(mv)
            elif state == "data":
                n = min(self._size - self._done, len(mv))
                self._crc = zlib.crc32(mv[:n], self._crc)
                self._done += n
                if self._done == self._size:
                    self._state = "desc" if not self._sized else "head"
                    if self._sized:
                        self._end_member(self._want_crc, self._size, self._size)
            elif state == "desc":
                n = self._descriptor(mv)
            else:
                n = self._scan(mv)
            if state != "dir":
                _keep_tail(self._recent, mv[:n])
            self._pos += n
            mv = mv[n:]
        self.peak = max(self.peak, len(self._buf) + len(self._recent) + len(self._carry))

    def _header(self, mv: memoryview) -> int:
        buf = self._buf
        need = 30 if len(buf) < 30 else 30 + _lfh_lengths(buf)
        take = min(need - len(buf), len(mv))
        buf += mv[:take]
        if len(buf) >= 4:
            sig = struct.unpack("<I", buf[:4])[0]
            if sig in (_CDH, _EOCD):  # __call__ keeps these bytes in _recent too
                self._buf = bytearray(self._recent) + mv[:take]
                self._tail_base = self._pos + take - len(self._buf)
                self._state = "dir"
                return take
            if sig != _LFH:
                raise _bad(self.where, f"no local header at byte {self._pos + take - len(buf)}")
        if len(buf) < 30 or len(buf) < 30 + _lfh_lengths(buf):
            return take
        (flags, method, _, _, crc, csize, usize, nlen, xlen) = struct.unpack(
            "<HHHHIIIHH", buf[6:30]
        )
        name = bytes(buf[30 : 30 + nlen]).decode("utf-8", "replace")
        extra = bytes(buf[30 + nlen : 30 + nlen + xlen])
        if method != 0:
            raise _compressed(self.where, name, method, csize, usize)
        if flags & 1:
            raise _bad(self.where, f"member {name!r} is encrypted")
        if len(self.members) >= _MAX_MEMBERS:
            raise _bad(self.where, f"more than {_MAX_MEMBERS} members")
        self._name, self._lho = name, self._pos + take - len(buf)
        self._zip64 = _has_zip64(extra)
        self._sized = not flags & 8
        self._crc = 0
        self._done = 0
        buf.clear()
        if self._sized:
            if self._zip64:
                usize, csize = _zip64_extra(extra, 2, self.where)
            if csize != usize:
                raise _bad(self.where, f"member {name!r} is stored in {csize} bytes, holds {usize}")
            self._size, self._want_crc = usize, crc
            self._state = "data"
            if not usize:
                self._state = "head"
                self._end_member(crc, 0, 0)
        else:
            self._size = 0
            self._carry.clear()
            self._state = "scan"
        return take

    def _dlen(self) -> int:
        return 24 if self._zip64 else 16

    def _desc(self, d: bytes | bytearray | memoryview) -> tuple[int, int, int, int]:
        sig, crc = struct.unpack("<II", d[:8])
        csize, usize = struct.unpack("<QQ" if self._zip64 else "<II", d[8 : self._dlen()])
        return sig, crc, csize, usize

    def _descriptor(self, mv: memoryview) -> int:
        take = min(self._dlen() - len(self._buf), len(mv))
        self._buf += mv[:take]
        if len(self._buf) == self._dlen():
            sig, crc, csize, usize = self._desc(self._buf)
            self._buf.clear()
            if sig != _DD:
                raise _bad(self.where, f"member {self._name!r} has no data descriptor")
            self._end_member(crc, csize, usize)
            self._state = "head"
        return take

    def _scan(self, mv: memoryview) -> int:
        """Member data of unknown size: its end is the first descriptor that matches it.

        ``_carry`` holds the last bytes of the member not yet known to be data (fewer than
        a descriptor: one may start in them); ``_size`` and ``_crc`` cover the bytes
        before. The carried bytes are looked at again with the next few.
        """
        carry = self._carry
        if not carry:
            return self._scan_buf(mv)
        held, dlen = len(carry), self._dlen()
        if len(mv) < dlen:  # a tiny piece: carried bytes and piece scanned as one
            head = bytes(carry) + bytes(mv)
            carry.clear()
            return self._scan_buf(memoryview(head)) - held
        # Every descriptor that starts in the carried bytes ends in the next dlen - 1.
        head = bytes(carry) + bytes(mv[: dlen - 1])
        q = _find(memoryview(head), 0)
        while 0 <= q < held:
            _, crc, csize, usize = self._desc(head[q : q + dlen])
            if csize == usize == self._size + q and crc == zlib.crc32(head[:q], self._crc):
                self._size, self._crc = self._size + q, crc
                carry.clear()
                self._end_member(crc, csize, usize)
                self._state = "head"
                return q + dlen - held
            if csize == usize == self._size + q:
                self._mismatch = self._mismatch or self._name
            q = _find(memoryview(head), q + 1)
        self._crc = zlib.crc32(carry, self._crc)
        self._size += held
        carry.clear()
        return self._scan_buf(mv)

    def _scan_buf(self, buf: memoryview) -> int:
        """Scan ``buf`` (the next bytes of the member); returns how many were used."""
        dlen = self._dlen()
        start = 0  # buf[:start] is data, counted in _size and _crc
        p = _find(buf, 0)
        while p >= 0 and p + dlen <= len(buf):
            _, crc, csize, usize = self._desc(buf[p : p + dlen])
            if csize == usize == self._size + p - start:  # cheap: the CRC only then
                self._crc = zlib.crc32(buf[start:p], self._crc)
                self._size += p - start
                start = p
                if crc == self._crc:
                    self._end_member(crc, csize, usize)
                    self._state = "head"
                    return p + dlen
                self._mismatch = self._mismatch or self._name  # its data, or a look-alike
            p = _find(buf, p + 1)
        keep = max(start, len(buf) - (dlen - 1))
        self._crc = zlib.crc32(buf[start:keep], self._crc)
        self._size += keep - start
        self._carry += buf[keep:]
        return len(buf)

    def _end_member(self, crc: int, csize: int, usize: int) -> None:
        if csize != usize or usize != self._size:
            raise _bad(self.where, f"member {self._name!r}: its sizes disagree")
        if crc != self._crc:
            raise IntegrityError(f"{self.where}: zip member {self._name!r} fails its CRC-32 check")
        self.members.append((self._name, self._lho, self._size, crc))

    def finish(self) -> int:
        """Check the central directory against the members; returns their number.

        Raises:
            IntegrityError: the archive is truncated, or its directory disagrees.
        """
        if self._state != "dir":
            if self._mismatch:  # a descriptor of the right size was passed over: its CRC
                raise IntegrityError(
                    f"{self.where}: zip member {self._mismatch!r} fails its CRC-32 check"
                )
            raise _bad(self.where, "the stream ended before the archive did")
        listed = _held_directory(self.where, self._tail_base, self._buf, self._pos)
        if not any(n.endswith("/data.pkl") or n == "data.pkl" for n, *_ in self.members):
            raise IntegrityError(
                f"{self.where}: zip archive has no data.pkl; not a torch.save file"
            )
        got = [(m.name, m.lho, m.size, m.crc) for m in listed]
        if got != self.members:
            raise _bad(self.where, "the central directory disagrees with the local headers")
        return len(self.members)

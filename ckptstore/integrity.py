"""Checksums and verify reports.

Checksums are CRC32C (Castagnoli): the ``crc32c`` package runs at about 17 GB/s a core and
releases the GIL, and S3 and GCS compute the same checksum server-side. They are computed on
the bytes as they are written, never in a second pass over the file.
"""

from __future__ import annotations

import dataclasses
import errno
import threading
from typing import IO, Any, Protocol

import crc32c as _crc32c

from .errors import IntegrityError

__all__ = [
    "BLOCK",
    "BlockCRC",
    "CRCWriter",
    "SubBlocks",
    "VerifyReport",
    "block_count",
    "check_blocks",
    "crc32c_combine",
    "crc32c_of",
    "format_crc",
    "parse_crc",
]

#: Bytes covered by one per-block CRC32C of a payload file (``FileEntry.blocks``). A DTensor
#: chunk's blocks are smaller (``chunks.BLOCK``).
BLOCK = 4 << 20


def crc32c_of(data: Any, crc: int = 0) -> int:
    """CRC32C of a bytes-like object, continuing from ``crc``."""
    return int(_crc32c.crc32c(data, crc))


def format_crc(crc: int) -> str:
    """The manifest's spelling of a checksum: 8 lowercase hex digits."""
    return f"{crc:08x}"


def parse_crc(text: str) -> int:
    """Inverse of :func:`format_crc`; raises ``ValueError`` on anything else."""
    if not isinstance(text, str) or len(text) != 8:
        msg = f"a crc32c is 8 hex digits, got {text!r}"
        raise ValueError(msg)
    return int(text, 16)


def block_count(nbytes: int, block: int = BLOCK) -> int:
    """How many CRCs of ``block`` bytes a file of ``nbytes`` bytes has (the last one short)."""
    return -(-nbytes // block)


# ---- combining CRCs (zlib's crc32_combine, for the Castagnoli polynomial) -----------------
#
# A writer checksums each block of a file on its own (``FileEntry.blocks``) and needs the
# whole file's CRC too: combining the block CRCs costs a few microseconds a block, where a
# second pass over the bytes would cost a second CRC of every byte (0.2 s for 3 GB).

_POLY = 0x82F63B78  # CRC32C, reflected


def _times(mat: tuple[int, ...], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(mat, mat[n]) for n in range(32))


def _tables(cols: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """A linear map given by its 32 columns as four byte-wise lookup tables (1,020 XORs)."""
    out = []
    for k in range(4):
        t = [0] * 256
        for b in range(1, 256):
            low = b & -b
            t[b] = t[b ^ low] ^ cols[8 * k + low.bit_length() - 1]
        out.append(tuple(t))
    return tuple(out)


def _apply(t: tuple[tuple[int, ...], ...], crc: int) -> int:
    return t[0][crc & 0xFF] ^ t[1][(crc >> 8) & 0xFF] ^ t[2][(crc >> 16) & 0xFF] ^ t[3][crc >> 24]


#: ``_POWERS[k]``: "append 2**k zero bytes" as lookup tables, made on first use (~0.2 ms each).
_POWERS: list[tuple[tuple[int, ...], ...]] = []
_powers_lock = threading.Lock()


def _power(k: int) -> tuple[tuple[int, ...], ...]:
    if k < len(_POWERS):
        return _POWERS[k]
    with _powers_lock:
        while len(_POWERS) <= k:
            if not _POWERS:
                one_bit = (_POLY, *(1 << n for n in range(31)))  # one zero bit
                m = one_bit
                for _ in range(3):  # 8 zero bits: one byte
                    m = _square(m)
                _POWERS.append(_tables(m))
            else:  # twice the previous length: the previous map applied to its own columns
                prev = _POWERS[-1]
                cols = tuple(_apply(prev, _apply(prev, 1 << i)) for i in range(32))
                _POWERS.append(_tables(cols))
        return _POWERS[k]


def _shift(crc: int, nbytes: int) -> int:
    """The register ``crc`` after ``nbytes`` zero bytes (one table lookup per set bit)."""
    while nbytes:
        low = nbytes & -nbytes
        crc = _apply(_power(low.bit_length() - 1), crc)
        nbytes ^= low
    return crc


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32C of ``a + b`` from ``crc1 = crc32c(a)``, ``crc2 = crc32c(b)``, ``len(b)``.

    A few microseconds for any length: the shift by ``len2`` zero bytes is made of the
    shifts by its powers of two (tables built once per process).
    """
    if len2 <= 0:
        return crc1
    return _shift(crc1, len2) ^ crc2


class SubBlocks:
    """The CRC32C of every ``block`` bytes of one stretch of a stream, the last one short.

    Fed by :meth:`BlockCRC.update` (``sub=``) with CRCs of pieces that never cross one of
    its blocks; :attr:`crcs` is complete once :meth:`close` was called.
    """

    def __init__(self, block: int) -> None:
        self.block = block
        self.crcs: list[int] = []
        self.fill = 0  # bytes of the current block
        self.nbytes = 0  # bytes folded in
        self._cur = 0

    def fold(self, crc: int, nbytes: int) -> None:
        """Append a piece of ``nbytes`` (at most what the current block lacks) and its CRC."""
        self._cur = crc32c_combine(self._cur, crc, nbytes) if self.fill else crc
        self.fill += nbytes
        self.nbytes += nbytes
        if self.fill == self.block:
            self.crcs.append(self._cur)
            self.fill = 0

    def close(self) -> list[int]:
        """The CRCs, with the short last block's."""
        if self.fill:
            self.crcs.append(self._cur)
            self.fill = 0
        return self.crcs


class BlockCRC:
    """Running CRC32C of a byte stream, per :data:`BLOCK` and for the whole.

    Each byte is checksummed once; the whole-stream CRC is combined from the block CRCs.
    """

    def __init__(self, block: int = BLOCK) -> None:
        self.block = block
        self.blocks: list[int] = []
        self.nbytes = 0
        self._whole = 0  # CRC of the completed blocks
        self._cur = 0  # CRC of the current, incomplete block
        self._fill = 0  # bytes in the current block

    def update(self, data: Any, sub: SubBlocks | tuple[SubBlocks, ...] | None = None) -> None:
        """Fold ``data`` (any bytes-like object) into the checksums.

        ``sub``: ``data`` continues one or more stretches of the stream whose own blocks need
        CRCs too (a tensor in a shard file, an object store's part). Each byte is still read
        once: in pieces cut at every grid, each piece's CRC combined into the stream's block
        and into each stretch's.
        """
        mv = memoryview(data).cast("B")
        done = 0
        n = len(mv)
        subs = () if sub is None else (sub,) if isinstance(sub, SubBlocks) else sub
        if subs:
            while done < n:
                k = min(n - done, self.block - self._fill)
                for s in subs:
                    k = min(k, s.block - s.fill)
                c = int(_crc32c.crc32c(mv[done : done + k]))
                self._cur = crc32c_combine(self._cur, c, k) if self._fill else c
                for s in subs:
                    s.fold(c, k)
                self._fill += k
                done += k
                if self._fill == self.block:
                    self._close_block()
            self.nbytes += n
            return
        while done < n:
            k = min(n - done, self.block - self._fill)
            self._cur = int(_crc32c.crc32c(mv[done : done + k], self._cur))
            self._fill += k
            done += k
            if self._fill == self.block:
                self._close_block()
        self.nbytes += n

    def _close_block(self) -> None:
        self.blocks.append(self._cur)
        self._whole = crc32c_combine(self._whole, self._cur, self._fill)
        self._cur = 0
        self._fill = 0

    @property
    def crc(self) -> int:
        """CRC32C of everything so far."""
        return crc32c_combine(self._whole, self._cur, self._fill)

    def block_crcs(self) -> tuple[int, ...] | None:
        """The per-block CRCs of the stream, or ``None`` when it fits in one block."""
        if self.nbytes <= self.block:
            return None
        return (*self.blocks, self._cur) if self._fill else tuple(self.blocks)


class BlockedFile(Protocol):
    """What :func:`check_blocks` reads of a manifest row (a ``FileEntry``).

    A protocol rather than the class, so that the manifest can use this module's checksums
    without an import cycle.
    """

    @property
    def bytes(self) -> int:
        """The file's size as stored."""

    @property
    def blocks(self) -> tuple[int, ...] | None:
        """The CRC32C of each 4 MiB block, or ``None``."""


def check_blocks(entry: BlockedFile, offset: int, data: Any, where: str) -> int:
    """Check the CRC32C of every whole block of a payload file that ``data`` covers.

    Args:
        entry: the file's manifest row; it must have ``blocks``.
        offset: the file offset of ``data[0]``, a multiple of :data:`BLOCK`.
        data: bytes of the file as stored (compressed bytes for ``.zst`` files).
        where: names the file in messages.

    Returns:
        How many leading bytes of ``data`` were checked: every whole block, and the file's
        last (short) block when ``data`` reaches the end of the file. A block that ``data``
        only begins is not checked (bytes beyond the returned count are unverified).

    Raises:
        IntegrityError: a block does not match its CRC (the message names the file, the
            block and its byte range), or ``data`` runs past the end of the file.
        ValueError: ``offset`` is not block-aligned, or ``entry.blocks`` is ``None`` (an
            old manifest, or a file of one block: check its whole-file ``crc32c``).
    """
    if entry.blocks is None:
        msg = f"{where}: the manifest has no block CRCs for it; check its whole-file crc32c"
        raise ValueError(msg)
    if offset % BLOCK or offset < 0:
        msg = f"check_blocks needs a block-aligned offset, got {offset}"
        raise ValueError(msg)
    mv = memoryview(data).cast("B")
    end = offset + len(mv)
    if end > entry.bytes:
        raise IntegrityError(
            f"{where}: {len(mv)} bytes at {offset} run past the end of the file "
            f"({entry.bytes} bytes); it is longer than the manifest says"
        )
    checked = 0
    k = offset // BLOCK
    while True:
        lo = k * BLOCK
        hi = min(lo + BLOCK, entry.bytes)
        if hi > end or hi <= lo:
            break
        crc = int(_crc32c.crc32c(mv[lo - offset : hi - offset]))
        if crc != entry.blocks[k]:
            raise IntegrityError(
                f"{where}: block {k} (bytes {lo}..{hi}) crc32c {format_crc(crc)} does not match "
                f"the manifest's {format_crc(entry.blocks[k])}; the file is corrupt"
            )
        checked = hi - offset
        k += 1
    return checked


class BlockSums:
    """``crc`` and ``blocks`` of a writer that folds what it writes into ``self._sum``."""

    _sum: BlockCRC

    @property
    def crc(self) -> int:
        """CRC32C of what was written."""
        return self._sum.crc

    @property
    def blocks(self) -> tuple[int, ...] | None:
        """Per-block CRC32Cs of what was written (``None`` for one block or less)."""
        return self._sum.block_crcs()


class CRCWriter(BlockSums):
    """A write-only file object that checksums and counts every byte passing through.

    ``torch.save`` and our own encoders write into it, so the checksum is computed on the
    way to the disk.
    """

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self._sum = BlockCRC()

    @property
    def nbytes(self) -> int:
        """Bytes written."""
        return self._sum.nbytes

    #: :meth:`write` takes ``sub=`` (``safetensors.write_laid_out`` asks).
    sub_blocks = True

    def write(self, data: Any, sub: SubBlocks | None = None) -> int:
        """Write ``data`` and fold it into the checksum (and into ``sub``'s blocks)."""
        mv = memoryview(data).cast("B")
        self._sum.update(mv, sub)
        # A raw file may write less than asked (write(2) near a full disk, or after a
        # signal): write the rest, or fail; a short file must never be committed.
        done = 0
        while done < len(mv):
            n = self.raw.write(mv[done:])
            if n is None:  # an old-style file object (paramiko's): it wrote it all
                break
            if n <= 0:
                raise OSError(errno.EIO, f"short write: {done} of {len(mv)} bytes written")
            done += n
        return len(mv)

    def flush(self) -> None:
        """Flush the underlying file object."""
        self.raw.flush()

    def writable(self) -> bool:
        """Always true: this is a sink."""
        return True

    def seekable(self) -> bool:
        """Never: checksumming needs the bytes in order."""
        return False

    def tell(self) -> int:
        """Bytes written so far."""
        return self.nbytes


@dataclasses.dataclass
class VerifyReport:
    """The outcome of verifying one checkpoint or one file.

    Attributes:
        target: what was verified (a step directory or a file path).
        step: the step, for checkpoints.
        deep: whether checksums were computed (else only structure and sizes).
        problems: one line per problem found; empty when all is well.
        files: number of files checked.
        bytes_checked: bytes read to check checksums.
        elsewhere: ranks whose files this copy of the step does not hold (a node's copy on
            node-local roots): they are not checked here, they live on other nodes.
        deleted: the step was deleted while it was verified (a running job's retention):
            what its reads found missing is no problem of the store's.
    """

    target: str
    step: int | None = None
    deep: bool = True
    problems: list[str] = dataclasses.field(default_factory=list)
    files: int = 0
    bytes_checked: int = 0
    elsewhere: list[int] = dataclasses.field(default_factory=list)
    deleted: bool = False

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def add(self, problem: str) -> None:
        """Record one problem."""
        self.problems.append(problem)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form, used by ``ckptstore verify --json``."""
        return {
            "target": self.target,
            "step": self.step,
            "deep": self.deep,
            "ok": self.ok,
            "problems": list(self.problems),
            "files": self.files,
            "bytes_checked": self.bytes_checked,
            "elsewhere": list(self.elsewhere),
            "deleted": self.deleted,
        }

    def __bool__(self) -> bool:
        return self.ok

"""``.pt`` payloads: ``torch.save`` zip archives, read only with ``weights_only=True``.

``torch.load`` does not check the CRC-32 its zip stores per member, so a flipped byte loads
silently; ckptstore checks its own CRC32C first, then every member's CRC-32 before
``torch.load`` sees the archive (:func:`load_tensor_dict`), and ``verify`` walks the zip
central directory and member CRCs without unpickling anything (and without importing torch).

Restores stream the archive instead of handing it whole to ``torch.load``: see
:mod:`ckptstore.codec.zipstream`.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import struct
import zipfile
import zlib
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Any, cast

from ..errors import IntegrityError, UnsafeCheckpointError

if TYPE_CHECKING:
    import torch

__all__ = [
    "check_stored",
    "check_zip",
    "load_tensor_dict",
    "write_torch",
]


def write_torch(sink: IO[bytes] | Any, tensors: Mapping[str, torch.Tensor]) -> None:
    """``torch.save`` a flat ``{name: tensor}`` dict into a writable file object.

    Raises:
        OSError: writing to ``sink`` failed (disk full, I/O error), as ``sink`` raised it.
    """
    import torch

    rec = _Recording(sink)
    try:
        torch.save(dict(tensors), cast("IO[bytes]", rec))  # torch needs write() and flush()
    except RuntimeError:
        # torch's zip writer turns an exception of the file object into a RuntimeError
        # ("[enforce fail at inline_container.cc] unexpected pos ..."), losing the errno
        # that says the disk is full: raise the file object's own error instead.
        if rec.error is not None:
            raise rec.error from None
        raise


class _Recording:
    """Passes writes through to a file object and keeps the first exception it raised."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        try:
            return int(self.raw.write(data))
        except BaseException as e:
            if self.error is None:
                self.error = e
            raise

    def flush(self) -> None:
        flush = getattr(self.raw, "flush", None)
        if flush is not None:
            flush()


def load_tensor_dict(data: bytes | bytearray | memoryview, where: str) -> dict[str, torch.Tensor]:
    """Load a flat tensor dict saved by :func:`write_torch`, never unpickling code.

    Every member's CRC-32 is checked first (:func:`check_zip` with ``deep``), over the
    bytes where they lie.

    Raises:
        IntegrityError: the archive is malformed, a member fails its CRC-32, or what it
            holds is not a flat dict of tensors.
        UnsafeCheckpointError: its pickle asks for more than tensors and plain data.
    """
    import torch

    check_zip(data, where, deep=True)
    try:
        reader = cast(IO[bytes], MemoryReader(data))
        obj = torch.load(reader, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        msg = (
            f"{where}: refused to load: the pickle inside asks for more than tensors and plain "
            f"data ({e}). ckptstore never falls back to weights_only=False"
        )
        raise UnsafeCheckpointError(msg) from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise IntegrityError(f"{where}: torch.load failed: {e}") from None
    if not isinstance(obj, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    ):
        raise IntegrityError(f"{where}: payload is not a flat dict of tensors")
    return obj


def check_stored(zf: zipfile.ZipFile, where: str) -> None:
    """Refuse a zip with a compressed member, from its central directory alone.

    ``torch.save`` stores every member uncompressed. A deflated member is not what it
    writes, and a few kilobytes of it can inflate to gigabytes (a zip bomb) in
    ``torch.load`` or in a CRC check; nothing of it is inflated here.

    Raises:
        IntegrityError: a member is compressed, or its sizes disagree.
    """
    for info in zf.infolist():
        if info.compress_type != zipfile.ZIP_STORED:
            raise _compressed(
                where, info.filename, info.compress_type, info.compress_size, info.file_size
            )
        if info.compress_size != info.file_size:
            raise IntegrityError(
                f"{where}: zip member {info.filename!r} is stored uncompressed in "
                f"{info.compress_size} bytes but says it holds {info.file_size}; the archive "
                "is corrupt"
            )


def _compressed(where: str, name: str, method: int, csize: int, usize: int) -> IntegrityError:
    what = _METHODS.get(method, f"method {method}")
    return IntegrityError(
        f"{where}: zip member {name!r} is compressed ({what}, {csize} bytes said to inflate "
        f"to {usize}); torch.save stores every member uncompressed, so this is not a "
        "torch.save archive as written, and it is refused without inflating anything. Load "
        "it with code you trust and save it again with torch.save"
    )


#: Names of the zip compression methods (``zipfile`` constants).
_METHODS = {
    zipfile.ZIP_DEFLATED: "deflate",
    zipfile.ZIP_BZIP2: "bzip2",
    zipfile.ZIP_LZMA: "lzma",
    93: "zstd",
}


def check_zip(data: bytes | bytearray | memoryview | IO[bytes], where: str, *, deep: bool) -> int:
    """Check a ``.pt`` zip: its central directory, and with ``deep`` every member's CRC-32.

    The CRC-32s of an archive in memory are computed over the bytes where they lie
    (:func:`_first_bad`); a file object's are read through ``zipfile``'s ``testzip``.

    Returns:
        The number of members.

    Raises:
        IntegrityError: the archive is truncated (no central directory), two members share
            a name, a member is compressed (:func:`check_stored`) or, with ``deep``, fails
            its CRC.
    """
    mv = memoryview(data).cast("B") if isinstance(data, bytes | bytearray | memoryview) else None
    fobj = MemoryReader(data) if isinstance(data, bytes | bytearray | memoryview) else data
    try:
        with zipfile.ZipFile(fobj) as zf:
            names = zf.namelist()
            seen: set[str] = set()
            for n in names:
                if n in seen:  # ambiguous: a reader may take either (the loader refuses it)
                    raise IntegrityError(f"{where}: zip archive has two members named {n!r}")
                seen.add(n)
            if not any(n.endswith("/data.pkl") or n == "data.pkl" for n in names):
                raise IntegrityError(f"{where}: zip archive has no data.pkl; not a torch.save file")
            check_stored(zf, where)
            if deep:
                bad = zf.testzip() if mv is None else _first_bad(zf, mv)
                if bad is not None:
                    raise IntegrityError(f"{where}: zip member {bad!r} fails its CRC-32 check")
            return len(names)
    except IntegrityError:  # ours, raised above: a ValueError, so keep it from the last clause
        raise
    except zipfile.BadZipFile as e:
        msg = (
            f"{where}: not a readable torch zip archive ({e}); the file is truncated or corrupt "
            "(no valid zip central directory)"
        )
        raise IntegrityError(msg) from None
    except (EOFError, OSError, ValueError) as e:
        raise IntegrityError(f"{where}: zip archive unreadable ({e})") from None


def _first_bad(zf: zipfile.ZipFile, mv: memoryview) -> str | None:
    """The first member of an archive in ``mv`` that ``testzip`` would fail, without a copy.

    As ``ZipFile.open`` does on a file: its local header must be one, and name the member;
    its bytes (stored: :func:`check_stored` ran) must lie in the archive and match their
    CRC-32; an offset before the file's start is an ``OSError``.
    """
    for info in zf.infolist():
        lho = info.header_offset
        if lho < 0:  # a file cannot seek there: testzip raises what its seek does
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        head = bytes(mv[lho : lho + 30])
        if len(head) < 30 or head[:4] != b"PK\x03\x04":
            return info.filename
        nlen, xlen = struct.unpack("<HH", head[26:30])
        fname = bytes(mv[lho + 30 : lho + 30 + nlen])
        encoding = "utf-8" if info.flag_bits & 0x800 else "cp437"
        if fname.decode(encoding, "replace") != info.orig_filename:
            return info.filename
        start = lho + 30 + nlen + xlen
        end = start + info.compress_size
        if end > len(mv) or zlib.crc32(mv[start:end]) != info.CRC:
            return info.filename
    return None


class MemoryReader(io.RawIOBase):
    """A seekable read-only file over a buffer, without copying it (``io.BytesIO`` does)."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        super().__init__()
        self._mv = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        """Always true."""
        return True

    def seekable(self) -> bool:
        """Always true."""
        return True

    def tell(self) -> int:
        """The current position."""
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Move the position like a file does."""
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._mv)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        """Copy the next bytes into ``b``."""
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), len(self._mv) - self._pos))
        out[:n] = self._mv[self._pos : self._pos + n]
        self._pos += n
        return n

    def read(self, size: int = -1) -> bytes:
        """The next ``size`` bytes (all that remain by default)."""
        end = len(self._mv) if size is None or size < 0 else min(len(self._mv), self._pos + size)
        start, self._pos = self._pos, max(self._pos, end)
        return bytes(self._mv[start:end])

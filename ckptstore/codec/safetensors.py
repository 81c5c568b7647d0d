"""A streaming writer and a validating, zero-copy reader of the ``.safetensors`` format.

The files are standard: ``safetensors.torch.load_file`` reads them. We write them ourselves
so that tensor bytes stream from the tensor's memory to the file (no serialized copy of the
whole file in memory, as ``safetensors.torch.save`` makes) while the checksum is computed on
the way. Tensors are laid out largest element first, so every tensor's data is aligned to
its element size (the header is padded to 8 bytes) and reads can view the buffer in place.

The reader trusts nothing: the header length, every dtype, shape and offset are bounded and
checked against the file size, and overlapping or gapped ranges are refused. Validating a
header needs no torch (``verify`` runs without it); torch is imported where tensors are made.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from .._prefault import Prefaulter
from ..errors import IntegrityError
from .dtypes import ITEMSIZE, SAFETENSORS_CODES

if TYPE_CHECKING:
    import torch

    from ..integrity import SubBlocks

    #: safetensors dtype code <-> torch dtype (built on first use: see ``__getattr__``).
    ST_TO_DTYPE: dict[str, torch.dtype]
    DTYPE_TO_ST: dict[torch.dtype, str]

__all__ = [
    "DTYPE_TO_ST",
    "ST_TO_DTYPE",
    "Header",
    "declared_size",
    "encode_header",
    "file_order",
    "parse_header",
    "read_header",
    "read_tensors",
    "tensor_bytes",
    "write_laid_out",
    "write_safetensors",
]


@functools.cache
def _dtype_tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    import torch

    st_to = {code: getattr(torch, name) for code, name in SAFETENSORS_CODES.items()}
    return st_to, {v: k for k, v in st_to.items()}


def __getattr__(name: str) -> Any:
    # PEP 562: ST_TO_DTYPE and DTYPE_TO_ST hold torch dtypes, so they are made on first use
    # and importing this module does not import torch.
    if name == "ST_TO_DTYPE":
        return _dtype_tables()[0]
    if name == "DTYPE_TO_ST":
        return _dtype_tables()[1]
    msg = f"module {__name__!r} has no attribute {name!r}"
    raise AttributeError(msg)


#: The safetensors library refuses headers over 100 MB; so do we.
MAX_HEADER_BYTES = 100_000_000


class _Sink(Protocol):
    def write(self, data: Any, /) -> int: ...


def has_own_bytes(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor with memory of its own (``data_ptr``), not a wrapper.

    A ``DTensor`` (and any other wrapper subclass) reports its global shape, is
    "contiguous" and has no storage: its ``data_ptr()`` is 0. Writing its bytes would
    write to address 0 onwards, so no byte path may take one for a plain tensor.
    """
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return not is_traceable_wrapper_subclass(t)


def fits(t: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> bool:
    """Whether bytes of a ``dtype`` tensor of ``shape`` can be read straight into ``t``."""
    return (
        t.dtype == dtype
        and list(t.shape) == shape
        and t.device.type == "cpu"
        and t.is_contiguous()
        and has_own_bytes(t)
    )


def fits_device(t: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> bool:
    """Whether bytes of a ``dtype`` tensor of ``shape`` can go straight into GPU tensor ``t``.

    ``t`` must be contiguous and on a CUDA device: no host tensor in between.
    """
    return (
        t.dtype == dtype
        and list(t.shape) == shape
        and t.device.type == "cuda"
        and t.is_contiguous()
        and has_own_bytes(t)
    )


class _DeviceBytes:
    """A GPU tensor's bytes as a decoder's destination.

    ``dest[a:b] = data`` copies ``data`` from host memory into the device tensor,
    synchronously (the read buffer holding ``data`` is reused once it returns).
    """

    def __init__(self, t: torch.Tensor) -> None:
        import torch

        self.flat = t.detach().reshape(-1).view(torch.uint8)

    def __setitem__(self, at: slice, data: memoryview) -> None:
        import warnings

        import torch

        if len(data):
            with warnings.catch_warnings():  # a read-only buffer (mmap): only read here
                warnings.simplefilter("ignore", UserWarning)
                src = torch.frombuffer(data, dtype=torch.uint8)
            self.flat[at].copy_(src)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying (valid while ``t`` lives)."""
    if not t.is_contiguous() or t.device.type != "cpu" or not has_own_bytes(t):
        msg = "tensor_bytes needs a contiguous CPU tensor with memory of its own (not a DTensor)"
        raise ValueError(msg)
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    buf = (ctypes.c_char * n).from_address(t.data_ptr())
    return memoryview(buf).cast("B")


def _layout(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    if sum(size(t) for t in tensors.values()) < BLOCK_LAYOUT_MIN:  # the classic order
        return sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))

    # A large file: tensors whose size is a multiple of DATA_ALIGN first, each then on a
    # block boundary of the file, so an async save writes it with O_DIRECT straight from
    # its staging buffer in whole requests, and a 0-d optimizer `step` among them cannot
    # leave every later tensor misaligned (copies into misaligned memory run at half
    # speed). The rest by decreasing element size: each aligned to its element size.
    def key(kv: tuple[str, torch.Tensor]) -> tuple[bool, int, str]:
        n = size(kv[1])
        return (n == 0 or n % DATA_ALIGN != 0, -kv[1].element_size(), kv[0])

    return sorted(tensors.items(), key=key)


#: Tensor data in files we write starts at a multiple of this many bytes (the O_DIRECT
#: block, directio.ALIGN) once they hold at least BLOCK_LAYOUT_MIN bytes of it; smaller
#: files keep the 8-byte alignment the safetensors library itself writes.
DATA_ALIGN = 4096
BLOCK_LAYOUT_MIN = 1 << 20


def build_header(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[tuple[str, torch.Tensor]]]:
    """The 8-byte length prefix plus the padded JSON header, and the tensors in file order."""
    order = _layout(tensors)
    return encode_header(order, metadata), order


def file_order(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The order :func:`build_header` lays ``tensors`` out in (see ``_layout``)."""
    return _layout(tensors)


def encode_header(
    order: list[tuple[str, torch.Tensor]], metadata: Mapping[str, str] | None = None
) -> bytes:
    """The 8-byte length prefix plus the padded JSON header of tensors stored in ``order``.

    Each tensor's data follows the previous one's with no gap (the format allows none).
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, t in order:
        st = _dtype_tables()[1].get(t.dtype)
        if st is None:
            msg = f"tensor {name!r}: dtype {t.dtype} has no safetensors equivalent"
            raise ValueError(msg)
        n = t.numel() * t.element_size()
        header[name] = {"dtype": st, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    # Spaces up to the boundary (the format allows header padding): in a large file,
    # tensor data starts on a block boundary, for at most 4 KB of spaces.
    align = DATA_ALIGN if offset >= BLOCK_LAYOUT_MIN else 8
    raw += b" " * (-(8 + len(raw)) % align)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(
    sink: _Sink, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> int:
    """Stream a ``.safetensors`` file of ``tensors`` (contiguous CPU) into ``sink``.

    Returns:
        The number of bytes written.
    """
    head, order = build_header(tensors, metadata)
    return write_laid_out(sink, head, order)


def write_laid_out(
    sink: _Sink,
    head: bytes,
    order: list[tuple[str, torch.Tensor]],
    subs: Mapping[str, SubBlocks] | None = None,
) -> int:
    """Stream a safetensors file whose header ``head`` lists ``order`` (see :func:`encode_header`).

    ``subs``: for a sink that checksums block by block as it writes (``sub_blocks``: a
    ``DirectWriter``, ``S3Upload``, ``CRCWriter``), the tensors whose own blocks need CRCs
    too, each fed from the same pass over its bytes (``write_segment(data, address, sub)``
    where the sink has it, else ``write(data, sub)``).

    Returns:
        The number of bytes written.
    """
    sink.write(head)
    total = len(head)
    # A DirectWriter takes a tensor whole and, where its memory lines up with its place in
    # the file (async staging arranges that), sends it to the disk without copying it.
    segment = getattr(sink, "write_segment", None)
    if not getattr(sink, "sub_blocks", False):
        subs = None
    for key, t in order:
        mv = tensor_bytes(t)
        sub = subs.get(key) if subs is not None else None
        if sub is not None and segment is not None:
            segment(mv, t.data_ptr(), sub)
        elif segment is not None:
            segment(mv, t.data_ptr())
        else:
            # Large tensors go in slices so a file-like sink never needs one giant write.
            step = 64 << 20
            put: Any = sink.write  # a ``sub_blocks`` sink's takes ``sub`` too
            for i in range(0, len(mv), step):
                if sub is not None:
                    put(mv[i : i + step], sub)
                else:
                    put(mv[i : i + step])
        total += len(mv)
    return total


class Header:
    """A validated safetensors header.

    Attributes:
        data_start: file offset of the first tensor byte.
        codes: name -> (safetensors dtype code, shape, start, end), offsets relative to
            ``data_start``.
        metadata: the ``__metadata__`` strings.
    """

    def __init__(
        self,
        data_start: int,
        codes: dict[str, tuple[str, list[int], int, int]],
        metadata: dict[str, str],
    ) -> None:
        self.data_start = data_start
        self.codes = codes
        self.metadata = metadata

    @functools.cached_property
    def entries(self) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
        """Name -> (torch dtype, shape, start, end), offsets relative to ``data_start``."""
        st_to = _dtype_tables()[0]
        return {n: (st_to[c], shape, a, b) for n, (c, shape, a, b) in self.codes.items()}


def _reject(where: str, what: str) -> IntegrityError:
    return IntegrityError(f"{where}: not a valid safetensors file: {what}")


def parse_header(head: bytes | bytearray | memoryview, file_size: int, where: str) -> Header:
    """Validate the header at the start of a safetensors file of ``file_size`` bytes.

    ``head`` must hold at least the first ``8 + header length`` bytes of the file (the whole
    file is fine). Raises :class:`IntegrityError` on any inconsistency.
    """
    if file_size < 8 or len(head) < 8:
        raise _reject(where, f"{file_size} bytes is shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", bytes(head[:8]))
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise _reject(where, f"header length {n} runs past the file ({file_size} bytes)")
    if len(head) < 8 + n:
        msg = "parse_header needs the whole header"
        raise ValueError(msg)
    return _check_header(_header_json(head, n, where), n, file_size, where)


def read_header(f: Any, file_size: int, where: str) -> Header:
    """Read and validate the header of the safetensors file ``f`` (at its start).

    Its length first, then no more than the file and :data:`MAX_HEADER_BYTES` allow.
    """
    head = f.read(8)
    if len(head) == 8:
        n = int.from_bytes(head, "little")
        if 8 + n <= file_size and n <= MAX_HEADER_BYTES:
            head += f.read(n)
    return parse_header(head, file_size, where)


#: No tensor holds as many bytes (its sizes as int64, with every zero dim taken as 1).
_MAX_BYTES = 1 << 62


def _check_header(doc: dict[str, Any], n: int, file_size: int, where: str) -> Header:
    """Validate the parsed JSON ``doc`` of an ``n``-byte header of a ``file_size``-byte file."""
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _reject(where, "__metadata__ must map strings to strings")
    data_len = file_size - 8 - n
    entries: dict[str, tuple[str, list[int], int, int]] = {}
    for name, info in doc.items():
        if not isinstance(info, dict):
            raise _reject(where, f"entry {name!r} is not an object")
        st_dtype = info.get("dtype")
        # A list or object here is unhashable: look it up only when it is a string.
        dtype = SAFETENSORS_CODES.get(st_dtype) if isinstance(st_dtype, str) else None
        if dtype is None or not isinstance(st_dtype, str):
            raise _reject(where, f"entry {name!r} has unknown dtype {info.get('dtype')!r}")
        shape, offs = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(_nonneg(s) for s in shape):
            raise _reject(where, f"entry {name!r} has a malformed shape {shape!r}")
        if not isinstance(offs, list) or len(offs) != 2 or not all(_nonneg(o) for o in offs):
            raise _reject(where, f"entry {name!r} has malformed data_offsets {offs!r}")
        start, end = offs
        if math.prod(max(1, s) for s in shape) * ITEMSIZE[dtype] >= _MAX_BYTES:
            # A zero in the shape makes the entry empty, and its other dims then escaped
            # every check: [0, 2**64] passed verify and failed the restore in torch.empty.
            raise _reject(where, f"entry {name!r} has a shape {shape} no tensor can have")
        size = math.prod(shape) * ITEMSIZE[dtype]
        if end < start or end - start != size:
            raise _reject(
                where, f"entry {name!r}: offsets [{start}, {end}] do not fit shape {shape}"
            )
        if end > data_len:
            raise _reject(
                where,
                f"entry {name!r}: data [{start}, {end}] runs past the file ({data_len} data bytes)",
            )
        entries[name] = (st_dtype, shape, start, end)
    pos = 0
    for name, (_, _, start, end) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if start < pos:
            raise _reject(where, f"entry {name!r} overlaps the tensor before it")
        if start > pos:
            raise _reject(where, f"a gap of {start - pos} bytes before entry {name!r}")
        pos = end
    if pos != data_len:
        raise _reject(where, f"{data_len - pos} bytes after the last tensor")
    return Header(8 + n, entries, meta)


def _header_json(head: bytes | bytearray | memoryview, n: int, where: str) -> dict[str, Any]:
    try:
        doc = json.loads(bytes(head[8 : 8 + n]).decode("utf-8"), object_pairs_hook=_no_dups)
    except RecursionError:
        raise _reject(where, "header nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise _reject(where, f"header is not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise _reject(where, "header is not a JSON object")
    return doc


def declared_size(head: bytes | bytearray | memoryview, where: str) -> int | None:
    """The size of the whole file, as the header at its start declares it.

    For a file that arrives piece by piece (decompressed): the bytes after the header are
    exactly the tensors' data, so the header alone says how long the file must be.

    Args:
        head: the first bytes of the file (any number of them).
        where: names the file in error messages.

    Returns:
        The file's size, or None while ``head`` does not yet hold the whole header.

    Raises:
        IntegrityError: the header is invalid (too long, not JSON, bad entries).
    """
    got = declared_header(head, where)
    return None if got is None else got[0]


def declared_header(head: bytes | bytearray | memoryview, where: str) -> tuple[int, Header] | None:
    """As :func:`declared_size`, with the validated header: ``(file size, header)``.

    The JSON is parsed once (a header of a few thousand tensors takes tens of
    milliseconds), so a stream decoder can take the header as it is
    (``StreamDecoder(..., header=)``) instead of parsing it again.
    """
    if len(head) < 8:
        return None
    n = int.from_bytes(head[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise _reject(where, f"header length {n} is over the {MAX_HEADER_BYTES}-byte limit")
    if len(head) < 8 + n:
        return None
    doc = _header_json(head, n, where)
    end: int = 0
    for name, info in doc.items():
        offs = info.get("data_offsets") if isinstance(info, dict) else None
        if name != "__metadata__" and isinstance(offs, list) and len(offs) == 2:
            last = offs[1]
            if isinstance(last, int) and _nonneg(last):
                end = max(end, last)
    size = 8 + n + end
    return size, _check_header(doc, n, size, where)  # every entry checked against that size


def _nonneg(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _no_dups(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            msg = f"duplicate key {k!r}"
            raise ValueError(msg)
        out[k] = v
    return out


def read_tensors(buf: bytearray, where: str) -> dict[str, torch.Tensor]:
    """Parse a whole safetensors file held in ``buf`` into tensors.

    Every tensor gets its own storage (one copy out of ``buf``): a tensor that viewed the
    file buffer would keep the whole file alive, and ``torch.save`` of it would write the
    whole file again.
    """
    import torch

    header = parse_header(buf, len(buf), where)
    out: dict[str, torch.Tensor] = {}
    base = (
        torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    )
    for name, (dtype, shape, start, end) in header.entries.items():
        raw = base[header.data_start + start : header.data_start + end]
        t = torch.empty(shape, dtype=dtype)
        if end > start:
            t.view(-1).view(torch.uint8).copy_(raw)
        out[name] = t
    return out


def _address(chunk: memoryview) -> tuple[int | None, Any]:
    """The address of ``chunk``'s first byte, and the object that holds its buffer exported.

    Drop that object before the buffer is given back. ``(None, None)`` for a read-only (or
    empty) buffer, which has no address to copy from.
    """
    if chunk.readonly or not len(chunk):
        return None, None
    anchor = ctypes.c_char.from_buffer(chunk)
    return ctypes.addressof(anchor), anchor


class StreamDecoder:
    """Decodes a safetensors file from the chunks of a verified stream, without a file copy.

    The header is parsed from the first bytes; every tensor's bytes are then copied straight
    from the read buffers into its destination: a tensor the caller passed in ``into`` (the
    model's own parameter, when dtype, shape and layout match) or a fresh one. Nothing may
    be trusted until the stream's checksum has been checked (``Storage.stream_file``).
    ``header``, where the caller validated it already (:func:`declared_header`), is taken
    as it is: the header bytes that stream by are then skipped.

    Bytes go into CPU memory by ``memmove``, which releases the GIL: the stream's read
    threads issue their next requests meanwhile. (A memoryview slice assignment held the
    GIL through each copy, up to 32 MiB into new memory, so a restore into new tensors had
    one read in flight most of the time.) With ``prefault``, once the header is known a
    thread of its own faults the destinations' pages in, in file order, ahead of the bytes
    (``_prefault.Prefaulter``); :meth:`close` stops and joins it, and callers close the
    decoder once the stream ended or failed. Both together: the first restore of the plain
    bench's 768 MB in a new process, into a ``to_empty`` model and a fresh AdamW, 0.72 ->
    0.58 s (medians of 8, alternating); into touched targets no change.
    """

    def __init__(
        self,
        file_size: int,
        where: str,
        into: Mapping[str, torch.Tensor] | None = None,
        *,
        header: Header | None = None,
        prefault: bool = False,
    ) -> None:
        self._prefault: Prefaulter | None = None
        self._wants_prefault = prefault
        self.file_size = file_size
        self.where = where
        self.into = dict(into or {})
        self._head = bytearray()
        self.header: Header | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        # File start, end, and where the bytes go: a CPU address, or a device's bytes.
        self._ranges: list[tuple[int, int, Any]] = []
        self._i = 0
        self.reused = 0
        if header is not None:  # validated already, for a file of ``file_size`` bytes
            self._setup(header)

    def _setup(self, header: Header | None = None) -> None:
        import torch

        if header is None:
            header = parse_header(self._head, self.file_size, self.where)
        self.header = header
        ranges: list[tuple[int, int, Any]] = []
        for name, (dtype, shape, start, end) in header.entries.items():
            t = self.into.get(name)
            dest: Any = None
            if t is not None and fits(t, dtype, shape):
                self.reused += 1
            elif t is not None and fits_device(t, dtype, shape):
                self.reused += 1
                dest = _DeviceBytes(t)
            else:
                t = torch.empty(shape, dtype=dtype)
            self.tensors[name] = t
            if end > start:
                if dest is None:
                    tensor_bytes(t)  # a contiguous CPU tensor with bytes of its own
                    dest = t.data_ptr()
                ranges.append((header.data_start + start, header.data_start + end, dest))
        ranges.sort(key=lambda r: r[0])
        self._ranges = ranges
        if self._wants_prefault:
            spans = sorted(
                (start, t.data_ptr(), t.numel() * t.element_size())
                for name, (_, _, start, _) in header.entries.items()
                if (t := self.tensors[name]).device.type == "cpu" and t.numel()
            )
            self._prefault = Prefaulter((a, n) for _, a, n in spans)
            self._prefault.__enter__()

    def close(self) -> None:
        """Stop and join the prefault thread (see the class's doc), if one runs."""
        pre, self._prefault = self._prefault, None
        if pre is not None:
            pre.__exit__(None, None, None)

    def __call__(self, offset: int, chunk: memoryview) -> None:
        """Consume the bytes ``chunk`` found at ``offset`` of the file."""
        if self.header is None:
            need = 8
            if len(self._head) >= 8:
                need = 8 + int.from_bytes(self._head[:8], "little")
            take = max(0, min(len(chunk), need - len(self._head)))
            if offset == len(self._head) and take:
                self._head += chunk[:take]
            if len(self._head) >= 8 and self.header is None:
                n = int.from_bytes(self._head[:8], "little")
                if n > MAX_HEADER_BYTES or 8 + n > self.file_size:
                    parse_header(self._head, self.file_size, self.where)  # raises
                if len(self._head) < 8 + n and take < len(chunk):
                    more = min(len(chunk) - take, 8 + n - len(self._head))
                    self._head += chunk[take : take + more]
                if len(self._head) >= 8 + n:
                    self._setup()
            if self.header is None:
                return
        end = offset + len(chunk)
        ranges = self._ranges
        i = self._i
        while i < len(ranges) and ranges[i][1] <= offset:
            i += 1
        self._i = i
        base, anchor = _address(chunk)
        try:
            while i < len(ranges) and ranges[i][0] < end:
                start, stop, dest = ranges[i]
                a = max(start, offset)
                b = min(stop, end)
                if not isinstance(dest, int):  # a device's bytes
                    dest[a - start : b - start] = chunk[a - offset : b - offset]
                elif base is not None:  # the GIL dropped for the copy
                    ctypes.memmove(dest + (a - start), base + (a - offset), b - a)
                else:  # a read-only buffer: copied through a view of the destination
                    view = memoryview((ctypes.c_char * (b - a)).from_address(dest + a - start))
                    view.cast("B")[:] = chunk[a - offset : b - offset]
                if stop > end:
                    break
                i += 1
        finally:
            del anchor

    def result(self) -> dict[str, torch.Tensor]:
        """The decoded tensors (call after the stream verified)."""
        if self.header is None:
            parse_header(self._head, self.file_size, self.where)  # raises the real problem
            raise IntegrityError(f"{self.where}: not a valid safetensors file: no header")
        return self.tensors

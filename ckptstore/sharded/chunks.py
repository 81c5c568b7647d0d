"""The chunk index of a sharded (DTensor) checkpoint: where each saved shard lies, and its CRCs.

A DTensor checkpoint stores every saved shard ("chunk": a box of the full tensor, given by
its offsets and sizes) as one tensor of a per-rank safetensors file. ``dtensors.json``, listed
in the manifest with its own CRC32C like any file, records for every tensor its dtype, full
shape, the mesh and placements it was saved with, and for every chunk the file, the byte
offset of its data and a CRC32C per :data:`BLOCK` bytes of it.

Why per block: a rank that restores on another world size reads only the byte ranges that
overlap its own shard, so it cannot check a whole-file CRC; it reads whole blocks around the
range it needs and checks each one before any byte is used. Hence small blocks (256 KiB; the
index records the size, and a reader takes any size the index gives: older stores have 4 MiB):
a shard restored on 3 ranks from 2 cuts most chunks in the middle, and with 4 MiB blocks the
ranks of a GPT-2-shaped state read 1.79x the bytes they needed (1.13x with 256 KiB).

The index is typed JSON, validated as hostile input (names, bounds, exact cover of every
tensor by its chunks); which saved chunks overlap a target shard is computed from it
(``targets.read_items``). DCP's own ``.metadata`` file is a pickle; a store never holds one
(only ``ckptstore export --dcp`` writes one, and ``import`` reads one, outside any store).
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..codec import strictjson
from ..codec.dtypes import ITEMSIZE, SAFETENSORS_CODES
from ..codec.safetensors import MAX_HEADER_BYTES
from ..errors import IntegrityError, ManifestError
from ..integrity import crc32c_of, format_crc, parse_crc
from ..manifest import FileEntry, validate_file_name

if TYPE_CHECKING:
    import torch

__all__ = [
    "BLOCK",
    "INDEX_FILE",
    "Chunk",
    "ChunkIndex",
    "TensorEntry",
    "block_crcs",
    "box_byte_range",
    "check_disjoint",
    "check_entries",
    "check_tiling",
    "entry_key",
    "parse_chunk",
    "read_box",
    "shard_file",
]

#: Bytes covered by one CRC32C of a chunk, in the indexes this version writes (smaller than
#: the per-block CRCs of whole payload files, ``integrity.BLOCK``: see the module docstring).
BLOCK = 256 << 10
#: The chunk index of a DTensor checkpoint.
INDEX_FILE = "dtensors.json"
#: The index format version.
INDEX_FORMAT = 1
#: Bounds on hostile input: a real index has a few chunks per tensor per rank.
MAX_INDEX_BYTES = 512 << 20
_MAX_NDIM = 64
_MAX_DIM = 1 << 48
_MAX_CHUNKS = 1 << 22


def shard_file(rank: int, part: int = 0) -> str:
    """A file a rank writes its DTensor shards into (no state key can produce the name).

    A rank with many bytes to write splits them over several files (``part`` 1, 2, ...),
    written concurrently (see :func:`ckptstore.sharded.plan.write_shards`); the chunk index
    says which file holds each chunk, so readers need no rule to find them.
    """
    if part:
        return f"_shards.rank{rank:05d}.{part}.safetensors"
    return f"_shards.rank{rank:05d}.safetensors"


def block_crcs(data: memoryview | bytes | bytearray, block: int = BLOCK) -> list[int]:
    """CRC32C of every ``block`` bytes of ``data`` (the last block may be short)."""
    mv = memoryview(data).cast("B")
    return [crc32c_of(mv[i : i + block]) for i in range(0, len(mv), block)]


#: ``codec.tree.SUPPORTED_DTYPES`` once a tensor entry's torch dtype was first asked for
#: (torch is imported only then: ``ls`` and ``verify`` read indexes without it).
_TORCH_DTYPES: dict[str, torch.dtype] = {}


def _torch_dtypes() -> dict[str, torch.dtype]:
    from ..codec.tree import SUPPORTED_DTYPES

    _TORCH_DTYPES.update(SUPPORTED_DTYPES)
    return _TORCH_DTYPES


#: Chunks and tensor entries compare and hash by value, as frozen dataclasses do, but are
#: built without a frozen class's ``object.__setattr__`` per field (2.0 us an object against
#: 0.5): a restoring rank makes two of them per chunk it reads, ~3,500 for the bench's 2 -> 1
#: restore. Nothing assigns to one once made.
@dataclasses.dataclass(slots=True, unsafe_hash=True)
class Chunk:
    """One saved shard of a tensor: a box of the full tensor, stored contiguously."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    start: int
    nbytes: int
    crcs: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "offsets": list(self.offsets),
            "sizes": list(self.sizes),
            "file": self.file,
            "start": self.start,
            "bytes": self.nbytes,
            "crc32c": [format_crc(c) for c in self.crcs],
        }


@dataclasses.dataclass(slots=True, unsafe_hash=True)
class TensorEntry:
    """A sharded tensor: dtype, full shape, how it was laid out, and its chunks."""

    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    mesh: tuple[int, ...] = ()
    mesh_dims: tuple[str, ...] = ()
    placements: tuple[str, ...] = ()

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype as a torch dtype."""
        return (_TORCH_DTYPES or _torch_dtypes())[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of the full tensor."""
        return math.prod(self.shape) * ITEMSIZE[self.dtype]

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        out: dict[str, Any] = {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "chunks": [c.to_json() for c in self.chunks],
        }
        if self.mesh:
            out["mesh"] = list(self.mesh)
            out["mesh_dims"] = list(self.mesh_dims)
            out["placements"] = list(self.placements)
        return out


@dataclasses.dataclass(frozen=True)
class ChunkIndex:
    """Every sharded tensor of a checkpoint, by its flat name (see ``sharding.py``)."""

    tensors: Mapping[str, TensorEntry]
    block: int = BLOCK

    def to_bytes(self) -> bytes:
        """Serialize as JSON (sorted, compact)."""
        doc = {
            "ckptstore_chunks": INDEX_FORMAT,
            "block": self.block,
            "tensors": {k: v.to_json() for k, v in sorted(self.tensors.items())},
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_bytes(
        cls, data: bytes | bytearray, files: Mapping[str, FileEntry], where: str
    ) -> ChunkIndex:
        """Parse and validate an index against the manifest's file table.

        Every chunk must lie inside a safetensors file of the manifest, hold exactly the
        bytes its box needs, carry one CRC per block, and the chunks of a tensor must cover
        it exactly (no gap, no overlap): a full load can never return uninitialised memory.
        No two chunks, of one tensor or of two, may share a byte of a file
        (:func:`check_disjoint`): with exact cover and ``bytes`` equal to each box's size,
        what a load allocates for a tensor is then bounded by the payload bytes.

        Raises:
            IntegrityError: the index is malformed, inconsistent or hostile.
        """
        if len(data) > MAX_INDEX_BYTES:
            raise IntegrityError(f"{where}: {len(data)} bytes is larger than any real index")
        try:
            doc = strictjson.loads(data)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise IntegrityError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("ckptstore_chunks") != INDEX_FORMAT:
            raise IntegrityError(f"{where}: not a ckptstore chunk index of format {INDEX_FORMAT}")
        block = doc.get("block")
        if isinstance(block, bool) or not isinstance(block, int) or not 4096 <= block <= 1 << 30:
            raise IntegrityError(f"{where}: 'block' must be an integer in [4096, 2**30]")
        raw = doc.get("tensors")
        if not isinstance(raw, dict):
            raise IntegrityError(f"{where}: 'tensors' must be an object")
        budget = [_MAX_CHUNKS]
        payloads: dict[str, FileEntry] = {}
        tensors = {
            str(name): _tensor_entry(name, row, files, block, budget, where, payloads)
            for name, row in raw.items()
        }
        check_disjoint(((n, c) for n, t in tensors.items() for c in t.chunks), where)
        return cls(tensors=tensors, block=block)


def _ints(v: object, what: str, where: str, *, hi: int = _MAX_DIM) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > _MAX_NDIM:
        raise IntegrityError(f"{where}: {what} must be a list of at most {_MAX_NDIM} integers")
    out = []
    for x in v:
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= hi:
            raise IntegrityError(f"{where}: {what} must hold integers in [0, {hi}], got {x!r}")
        out.append(x)
    return tuple(out)


def _strs(v: object, what: str, where: str) -> tuple[str, ...]:
    if not isinstance(v, list) or len(v) > _MAX_NDIM or not all(isinstance(x, str) for x in v):
        raise IntegrityError(f"{where}: {what} must be a list of strings")
    return tuple(str(x)[:200] for x in v)


def _tensor_entry(  # noqa: PLR0917 - a private validator with one call site
    name: object,
    row: object,
    files: Mapping[str, FileEntry],
    block: int,
    budget: list[int],
    where: str,
    payloads: dict[str, FileEntry],
) -> TensorEntry:
    at = f"{where}: tensor {name!r}"
    if not isinstance(name, str) or not name or len(name) > 4096:
        raise IntegrityError(f"{at}: a tensor name is a non-empty string")
    if not isinstance(row, dict):
        raise IntegrityError(f"{at}: entry must be an object")
    dtype = row.get("dtype")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise IntegrityError(f"{at}: unsupported dtype {dtype!r}")
    itemsize = ITEMSIZE[dtype]
    shape = _ints(row.get("shape"), "shape", at)
    raw_chunks = row.get("chunks")
    if not isinstance(raw_chunks, list) or not raw_chunks:
        raise IntegrityError(f"{at}: 'chunks' must be a non-empty list")
    budget[0] -= len(raw_chunks)
    if budget[0] < 0:
        raise IntegrityError(f"{where}: more than {_MAX_CHUNKS} chunks; the index is hostile")
    chunks = []
    for i, c in enumerate(raw_chunks):
        chunk = fast_chunk(c, shape, itemsize, files, block, payloads)
        if chunk is None:
            chunk = _chunk(c, shape, dtype, itemsize, files, block, f"{at} chunk {i}")
        chunks.append(chunk)
    check_tiling(chunks, shape, at)
    mesh = _ints(row.get("mesh", []), "mesh", at)
    dims = _strs(row.get("mesh_dims", []), "mesh_dims", at)
    placements = _strs(row.get("placements", []), "placements", at)
    return TensorEntry(dtype, shape, tuple(chunks), mesh, dims, placements)


def check_tiling(chunks: Sequence[Chunk], shape: tuple[int, ...], at: str) -> None:
    """Refuse chunks (each inside ``shape``) that do not tile the tensor exactly.

    Raises:
        IntegrityError: none at all, a gap or an overlap; ``at`` names the tensor.
    """
    if not chunks:
        raise IntegrityError(f"{at}: 'chunks' must be a non-empty list")
    if sum(math.prod(c.sizes) for c in chunks) != math.prod(shape) or _overlap(chunks):
        raise IntegrityError(
            f"{at}: its chunks do not cover the {list(shape)} tensor exactly (gaps or overlaps)"
        )


def parse_chunk(
    c: object, entry: TensorEntry, files: Mapping[str, FileEntry], block: int, where: str
) -> Chunk:
    """One chunk row of an index, checked against its tensor and the manifest's files.

    Raises:
        IntegrityError: the row is malformed, outside its tensor or its file.
    """
    return _chunk(c, entry.shape, entry.dtype, ITEMSIZE[entry.dtype], files, block, where)


def fast_chunk(  # noqa: PLR0917 - parse_chunk's arguments, and the caller's cache
    c: object,
    shape: tuple[int, ...],
    itemsize: int,
    files: Mapping[str, FileEntry],
    block: int,
    payloads: dict[str, FileEntry],
) -> Chunk | None:
    """The chunk row ``c`` as :func:`parse_chunk` returns it, or None where it has a doubt.

    The rows a save writes, checked in few steps: exact JSON types, a file name checked
    once per parse (``payloads``: the names found to be uncompressed safetensors payloads
    of ``files``, filled here), the CRCs decoded in one pass. A restoring rank parses every
    row of the index parts it reads before its first read: 1,176 rows for the middle rank
    of the bench's 2 -> 3 restore took 22 ms (19 us a row) through :func:`parse_chunk`
    alone. Where this returns None, the caller passes the row to :func:`parse_chunk`,
    which raises with its message, or returns the chunk of a spelling only it takes (a
    CRC with a ``0x`` prefix, an ``int`` subclass): the rows accepted, and the chunks
    made of them, are the same either way.
    """
    if type(c) is not dict:
        return None
    offsets, sizes = c.get("offsets"), c.get("sizes")
    n = len(shape)
    if type(offsets) is not list or type(sizes) is not list:
        return None
    if len(offsets) != n or len(sizes) != n:
        return None
    numel = 1
    for o, s, d in zip(offsets, sizes, shape, strict=True):  # shape checked: o, s <= _MAX_DIM
        if type(o) is not int or type(s) is not int or o < 0 or s < 0 or o + s > d:
            return None
        numel *= s
    fname = c.get("file")
    if type(fname) is not str:
        return None
    fe = payloads.get(fname)
    if fe is None:
        try:
            validate_file_name(fname)
        except ManifestError:  # parse_chunk says why
            return None
        fe = files.get(fname)
        if fe is None or fe.codec != "safetensors" or fe.compression is not None:
            return None
        payloads[fname] = fe
    start, nbytes = c.get("start"), c.get("bytes")
    if type(start) is not int or type(nbytes) is not int or start < 0:
        return None
    if nbytes != numel * itemsize or start + nbytes > fe.bytes:
        return None
    crcs_raw = c.get("crc32c")
    if type(crcs_raw) is not list:
        return None
    k = len(crcs_raw)
    if k != -(-nbytes // block):
        return None
    try:
        text = "".join(crcs_raw)  # TypeError: an item is not a string
        # Every item 8 characters: none longer, and 8 a piece in all. fromhex skips
        # whitespace, so a string of 8 k characters that decodes to 4 k bytes is all hex.
        if len(text) != 8 * k or (k and max(map(len, crcs_raw)) != 8):
            return None
        raw = bytes.fromhex(text)
    except (TypeError, ValueError):
        return None
    if len(raw) != 4 * k:
        return None
    crcs = struct.unpack(f">{k}I", raw)
    return Chunk(tuple(offsets), tuple(sizes), fname, start, nbytes, crcs)


def _chunk(  # noqa: PLR0917 - a private validator
    c: object,
    shape: tuple[int, ...],
    dtype: str,
    itemsize: int,
    files: Mapping[str, FileEntry],
    block: int,
    cat: str,
) -> Chunk:
    if not isinstance(c, dict):
        raise IntegrityError(f"{cat}: must be an object")
    offsets = _ints(c.get("offsets"), "offsets", cat)
    sizes = _ints(c.get("sizes"), "sizes", cat)
    if len(offsets) != len(shape) or len(sizes) != len(shape):
        raise IntegrityError(f"{cat}: offsets/sizes do not have {len(shape)} dimensions")
    if any(o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
        raise IntegrityError(f"{cat}: box {list(offsets)}+{list(sizes)} outside {list(shape)}")
    fname = c.get("file")
    try:
        validate_file_name(fname)
    except Exception:
        raise IntegrityError(f"{cat}: unsafe file name {fname!r}") from None
    fe = files.get(str(fname))
    if fe is None or fe.codec != "safetensors" or fe.compression is not None:
        raise IntegrityError(f"{cat}: {fname!r} is not an uncompressed payload of the manifest")
    start, nbytes = c.get("start"), c.get("bytes")
    if (
        isinstance(start, bool)
        or isinstance(nbytes, bool)
        or not isinstance(start, int)
        or not isinstance(nbytes, int)
        or start < 0
        or nbytes != math.prod(sizes) * itemsize
        or start + nbytes > fe.bytes
    ):
        raise IntegrityError(
            f"{cat}: bytes {start!r}+{nbytes!r} do not fit its box of {dtype} or its file"
        )
    crcs_raw = c.get("crc32c")
    if not isinstance(crcs_raw, list) or len(crcs_raw) != -(-nbytes // block):
        raise IntegrityError(f"{cat}: needs one crc32c per {block} bytes")
    try:
        crcs = tuple(parse_crc(x) for x in crcs_raw)
    except (ValueError, TypeError):
        raise IntegrityError(f"{cat}: crc32c values must be 8 hex digits") from None
    return Chunk(offsets, sizes, str(fname), start, nbytes, crcs)


#: Most box comparisons one tensor's overlap check may make: a real layout makes a few per
#: chunk; a hostile one that keeps many boxes in the sweep at once is refused, not run.
_OVERLAP_BUDGET = 1 << 24


def _overlap(chunks: Sequence[Chunk]) -> bool:
    """Whether two boxes intersect.

    A sweep along the dim whose offsets vary most (dim 0 for row chunks, dim 1 for the
    column chunks of ``Shard(1)``; a sweep along dim 0 of 8,000 column chunks compared every
    pair: 22 s), so a grid of chunks costs about n log n. Bounded: past
    :data:`_OVERLAP_BUDGET` comparisons the index is refused as hostile.

    Raises:
        IntegrityError: the layout would take more comparisons than any real one.
    """
    # Empty boxes overlap nothing; two chunks of one 0-d tensor fail the volume check.
    boxes = [c for c in chunks if 0 not in c.sizes]
    if len(boxes) < 2:
        return False
    if not boxes[0].offsets:
        return True
    ndim = len(boxes[0].offsets)
    dim = max(range(ndim), key=lambda d: len({c.offsets[d] for c in boxes}))
    boxes.sort(key=lambda c: c.offsets[dim])
    budget = _OVERLAP_BUDGET
    active: list[Chunk] = []
    for b in boxes:
        active = [a for a in active if a.offsets[dim] + a.sizes[dim] > b.offsets[dim]]
        budget -= len(active) + 1
        if budget < 0:
            msg = f"{len(chunks)} chunks laid out so that checking them for overlaps would not end"
            raise IntegrityError(f"{msg}; the index is hostile")
        for a in active:
            if all(
                ao < bo + bs and bo < ao + as_
                for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
            ):
                return True
        active.append(b)
    return False


def check_disjoint(chunks: Iterable[tuple[str, Chunk]], where: str) -> None:
    """Refuse two chunks whose byte ranges ``[start, start + bytes)`` in one file intersect.

    Bounds, the byte count of each box and exact cover all hold for an index whose chunks
    point at the same bytes again and again: a 42 KB index over a 1 MiB shard loaded as a
    300 MiB tensor, and the chunk budget allowed terabytes (issue 24 #7). A real save writes
    every box as its own safetensors entry, so no two chunks share a byte (the safetensors
    reader refuses overlapping entries of a file the same way). Zero-byte chunks overlap
    nothing.

    Sorted by ``(file, start)``, each chunk is compared with the one before it in its file
    (while none overlap, that one reaches furthest): O(n log n), and one sort key per chunk
    (the chunks are not copied).

    Args:
        chunks: ``(tensor name, chunk)`` pairs, across every tensor the caller read.
        where: names the index in the message.

    Raises:
        IntegrityError: two chunks overlap in a file; the index is corrupt or hostile.
    """
    pairs = [(n, c) for n, c in chunks if c.nbytes]
    pairs.sort(key=lambda nc: (nc[1].file, nc[1].start))
    prev: tuple[str, Chunk] | None = None
    for name, c in pairs:
        if prev is not None and prev[1].file == c.file:
            pname, p = prev
            if c.start < p.start + p.nbytes:
                raise IntegrityError(
                    f"{where}: chunk {list(p.offsets)} of {pname!r} and chunk "
                    f"{list(c.offsets)} of {name!r} overlap in {c.file}: bytes "
                    f"[{p.start}, {p.start + p.nbytes}) and [{c.start}, {c.start + c.nbytes}); "
                    "the chunk index is corrupt or hostile (no two chunks share a byte)"
                )
        prev = (name, c)


def entry_key(name: str, offsets: Iterable[int]) -> str:
    """The name of a chunk's entry in its shard file's safetensors header: ``name@o0,o1``.

    Every writer of shard files names a box so (``plan.write_shards``, ``import``); no
    state key holds an ``@`` there, and no padding entry (``_pad.N``) does.
    """
    return f"{name}@{','.join(str(int(o)) for o in offsets)}"


#: The first bytes of a shard file read for its header in one request (more only where the
#: header is longer: a rank's file of thousands of boxes).
HEAD_BYTES = 64 << 10


def check_entries(
    chunks: Iterable[tuple[str, str, Chunk]],
    read: Callable[[str, int, int], bytes | bytearray],
    where: str,
) -> None:
    """Refuse a chunk that is not its shard file's own safetensors entry for it.

    A chunk row says where its bytes are (``file``, ``start``, ``bytes``) and the layout
    says their dtype; only their CRC32Cs were checked, and those an index forged or mixed
    up carries along. The shard file's own header names each box ``name@offsets``
    (:func:`entry_key`) with its dtype, shape and byte range: a chunk must be exactly that
    entry. Without this a row pointed at the header (CRCs recomputed) returned the header
    as weights, and a layout and ``state.json`` both saying ``int32`` over ``F32`` entries
    returned float bits as integers, with verify passing both (found by review).

    Each file's header is read once (its first :data:`HEAD_BYTES`, or up to the first
    chunk's start where that is nearer; the rest only where the header is longer) and
    parsed once; each chunk is then a dict lookup. The header's own bytes need no CRC
    here: a damaged one can only fail to match, never make a chunk read other bytes.

    Args:
        chunks: ``(tensor name, its dtype name, chunk)`` of every chunk to check.
        read: ``read(file, offset, length)``: exactly those bytes (``RangeReader.read``),
            the file's size checked against the manifest.
        where: names the checkpoint in messages (each also names the file and tensor).

    Raises:
        IntegrityError: a file's header is not a safetensors header, or a chunk's byte
            range, dtype or shape is not its entry's.
    """
    by_file: dict[str, list[tuple[str, str, Chunk]]] = {}
    for row in chunks:
        by_file.setdefault(row[2].file, []).append(row)
    for file, rows in by_file.items():
        first = min(rows, key=lambda r: r[2].start)
        data_start, entries = _shard_header(file, first[0], first[2], read, where)
        for name, dtype, c in rows:
            key = entry_key(name, c.offsets)
            found = entries.get(key)
            at = c.start - data_start
            if (
                type(found) is dict
                and type(code := found.get("dtype")) is str
                and SAFETENSORS_CODES.get(code) == dtype
                and found.get("shape") == list(c.sizes)
                and found.get("data_offsets") == [at, at + c.nbytes]
            ):
                continue
            if type(found) is dict:
                says = (
                    f"its entry {key!r} is {found.get('dtype')!r} {found.get('shape')!r} at "
                    f"data offsets {found.get('data_offsets')!r} (from byte {data_start})"
                )
            else:
                says = f"its header has no entry {key!r}"
            raise IntegrityError(
                f"{where}: tensor {name!r}: the chunk at {list(c.offsets)} is {dtype} "
                f"{list(c.sizes)} at bytes [{c.start}, {c.start + c.nbytes}) of {file}, but "
                f"{says}; the chunk index is forged or not this save's"
            )


def _shard_header(
    file: str,
    name: str,
    chunk: Chunk,
    read: Callable[[str, int, int], bytes | bytearray],
    where: str,
) -> tuple[int, dict[str, Any]]:
    """``(data start, entries)`` of a shard file's header, parsed.

    ``chunk`` (of tensor ``name``) is the first of the file to check: in a file as
    written, the header ends at or before it.
    """
    at = f"{where}: {file}"
    first = chunk.start
    head = bytearray(read(file, 0, min(first, HEAD_BYTES))) if first >= 8 else bytearray()
    n = int.from_bytes(head[:8], "little") if first >= 8 else 0
    if first < 8 or n > MAX_HEADER_BYTES or 8 + n > first:
        raise IntegrityError(
            f"{where}: tensor {name!r}: the chunk at {list(chunk.offsets)} starts at byte "
            f"{first} of {file}, inside its safetensors header; the chunk index is forged or "
            "not this save's"
        )
    if 8 + n > len(head):
        head += read(file, len(head), 8 + n - len(head))
    try:
        doc = strictjson.loads(memoryview(head)[8 : 8 + n])
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise IntegrityError(f"{at}: not a valid safetensors header ({e})") from None
    if not isinstance(doc, dict):
        raise IntegrityError(f"{at}: not a valid safetensors header (not a JSON object)")
    return 8 + n, doc


def box_byte_range(
    chunk_sizes: Sequence[int], box_offsets: Sequence[int], lengths: Sequence[int], itemsize: int
) -> tuple[int, int]:
    """The smallest byte range of a row-major chunk that holds a sub-box of it.

    Returns:
        ``(first, end)`` byte offsets inside the chunk; ``first == end`` for an empty box.
    """
    if any(n == 0 for n in lengths):
        return 0, 0
    strides = _strides(chunk_sizes)
    first = sum(o * s for o, s in zip(box_offsets, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(box_offsets, lengths, strides, strict=True))
    return first * itemsize, (last + 1) * itemsize


def _strides(sizes: Sequence[int]) -> list[int]:
    out = [1] * len(sizes)
    for i in range(len(sizes) - 2, -1, -1):
        out[i] = out[i + 1] * sizes[i + 1]
    return out


def read_box(
    read: Any,
    chunk: Chunk,
    dtype: torch.dtype,
    box_offsets: Sequence[int],
    lengths: Sequence[int],
    *,
    block: int,
    where: str,
) -> torch.Tensor:
    """Read a sub-box of a saved chunk, checking the CRC of every block it touches.

    Args:
        read: ``read(file, offset, length) -> bytearray`` of exactly ``length`` bytes.
        chunk: the saved chunk.
        dtype: its dtype.
        box_offsets: the sub-box, relative to the chunk.
        lengths: the sub-box's sizes.
        block: the index's CRC block size.
        where: names the checkpoint in messages.

    Returns:
        A CPU tensor of shape ``lengths`` viewing verified bytes (not contiguous in general).

    Raises:
        IntegrityError: a block does not match its CRC32C.
    """
    import torch

    itemsize = dtype.itemsize
    first, end = box_byte_range(chunk.sizes, box_offsets, lengths, itemsize)
    if first == end:
        return torch.empty(list(lengths), dtype=dtype)
    b0, b1 = first // block, -(-end // block)
    lo, hi = b0 * block, min(b1 * block, chunk.nbytes)
    buf = read(chunk.file, chunk.start + lo, hi - lo)
    mv = memoryview(buf)
    for k in range(b0, b1):
        piece = mv[(k - b0) * block : min((k + 1) * block, hi) - lo]
        if crc32c_of(piece) != chunk.crcs[k]:
            raise IntegrityError(
                f"{where}: block {k} of its chunk at {list(chunk.offsets)} in {chunk.file} "
                f"(bytes {chunk.start + k * block}..) does not match its crc32c; the file is "
                "corrupt"
            )
    count = (end - first) // itemsize
    flat = torch.frombuffer(buf, dtype=dtype, offset=first - lo, count=count)
    return torch.as_strided(flat, list(lengths), _strides(chunk.sizes), 0)


def read_box_into(
    read_into: Callable[[str, int, list[memoryview]], None],
    chunk: Chunk,
    dtype: torch.dtype,
    box_offsets: Sequence[int],
    lengths: Sequence[int],
    *,
    dest: torch.Tensor,
    block: int,
    where: str,
    stage: bytearray | None = None,
) -> int | None:
    """Read a sub-box of a saved chunk into ``dest``'s memory, checking every block.

    Only where the box is one contiguous byte range of the chunk and ``dest`` is a
    contiguous CPU tensor of the chunk's dtype (a dim-0 shard restored into a whole tensor
    or into a row range of one, the common case); otherwise returns None and reads nothing,
    and the caller goes through :func:`read_box`. The covering blocks are read one after
    another, each CRC32C computed right after its read, while its bytes are still in the
    CPU's cache: one CRC pass per byte, never a second pass over memory.

    Without ``stage`` the box's bytes land straight in ``dest`` (one copy, the kernel's) and
    are checked there, the bytes of the blocks it shares with its neighbours in small side
    buffers: a block that fails its CRC leaves its bytes in ``dest``, so callers pass fresh
    tensors (or, for DCP's in-place load, tensors with no such promise). With ``stage`` (a
    buffer of at least ``min(block, chunk.nbytes)`` bytes) each block is read into it,
    checked, and only then copied into ``dest``: ``dest`` (a live restore target) never
    holds a byte that failed its check, at the cost of a copy out of the cache.

    Returns:
        The bytes read, or None where the box cannot be read in place.

    Raises:
        IntegrityError: a block does not match its CRC32C.
    """
    import ctypes

    if dest.dtype != dtype:
        return None
    itemsize = dtype.itemsize
    first, end = box_byte_range(chunk.sizes, box_offsets, lengths, itemsize)
    count = math.prod(lengths)
    if (
        first == end
        or (end - first) != count * itemsize
        or dest.device.type != "cpu"
        or not dest.is_contiguous()
        or dest.numel() != count
    ):
        return None
    b0, b1 = first // block, -(-end // block)
    lo, hi = b0 * block, min(b1 * block, chunk.nbytes)
    if stage is not None and len(stage) < min(block, hi - lo):
        return None
    base = dest.data_ptr()
    body = memoryview((ctypes.c_ubyte * (end - first)).from_address(base)).cast("B")
    staged = memoryview(stage) if stage is not None else None
    anchor = None if stage is None else (ctypes.c_char * len(stage)).from_buffer(stage)
    stage_at = 0 if anchor is None else ctypes.addressof(anchor)
    head = memoryview(bytearray(first - lo)) if staged is None and first > lo else None
    tail = memoryview(bytearray(hi - end)) if staged is None and hi > end else None
    for k in range(b0, b1):
        k_lo, k_hi = k * block, min((k + 1) * block, hi)
        a, b = max(k_lo, first), min(k_hi, end)  # the box's bytes in this block
        if staged is not None:
            pieces = [staged[: k_hi - k_lo]]
        else:
            pieces = [body[a - first : b - first]]
            if head is not None and k_lo < first:
                pieces.insert(0, head)
            if tail is not None and k_hi > end:
                pieces.append(tail)
        read_into(chunk.file, chunk.start + k_lo, pieces)
        crc = 0
        for mv in pieces:
            crc = crc32c_of(mv, crc)
        if crc != chunk.crcs[k]:
            raise IntegrityError(
                f"{where}: block {k} of its chunk at {list(chunk.offsets)} in {chunk.file} "
                f"(bytes {chunk.start + k * block}..) does not match its crc32c; the file is "
                "corrupt"
            )
        if staged is not None:
            # Checked: now, and only now, into the target (memmove releases the GIL).
            ctypes.memmove(base + (a - first), stage_at + (a - k_lo), b - a)
    return hi - lo


#: ``dtype_name``'s answers so far (``str(dtype)`` costs ~20 us; a save asks per tensor).
_DTYPE_NAMES: dict[Any, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """The index's name of a dtype (``float32``)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is not None:
        return name
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise KeyError(dtype)
    _DTYPE_NAMES[dtype] = name
    return name

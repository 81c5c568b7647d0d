"""The split chunk index (format 3): a layout of every tensor, and one part per rank.

A format-2 ``dtensors.json`` lists every chunk of every tensor: rank 0 builds it from every
rank's chunk table and every restoring rank reads all of it, so both grow with the world
size times the number of tensors (92 MB on 1,024 ranks of 600 DTensors). The split index
keeps a row per chunk only where the chunk was written:

- ``dtensors.json`` (rank 0): per tensor its dtype, shape, mesh and placements, and the
  device meshes' rank layouts (an affine map for the meshes ``init_device_mesh`` builds).
  Its size does not depend on the world size.
- ``_index.rankNNNNN.json`` (each rank, beside its shard files): the chunks that rank wrote,
  each with its file, byte range and block CRC32Cs, as format 2 lists them.

Which rank wrote a box follows from the layout alone: DTensor's own arithmetic gives the box
of every mesh coordinate, and :func:`ckptstore.sharded.plan.writes_here` picks one holder
of a replicated box. A restoring rank computes the boxes that overlap its target shards and
reads the parts of their writers only (:meth:`Layout.resolve`); ``verify``, ``inspect``,
``export`` and consolidation read every part (:func:`merged`) and check the whole, as
format 2 did. Every part is checked against its CRC32C in the manifest before it is parsed.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import zlib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from ..codec import strictjson
from ..codec.dtypes import ITEMSIZE
from ..errors import IntegrityError
from ..manifest import SPLIT_FORMAT_VERSION, STRIDED_FORMAT_VERSION, FileEntry, Manifest
from .chunks import (
    BLOCK,
    MAX_INDEX_BYTES,
    Chunk,
    ChunkIndex,
    TensorEntry,
    check_disjoint,
    check_tiling,
    shard_file,
)

__all__ = [
    "MAX_PART_CHUNKS",
    "SPLIT_FORMAT",
    "Layout",
    "global_bytes",
    "is_part",
    "is_split",
    "is_strided",
    "is_strided_format",
    "merged",
    "part_bytes",
    "part_file",
    "read_index",
    "splittable",
    "strided_problem",
    "volumes",
]

#: ``ckptstore_chunks`` of a split index's ``dtensors.json``.
SPLIT_FORMAT = 2
#: ``ckptstore_chunk_part`` of a part.
_PART_FORMAT = 1
#: Most chunk rows one part may hold (a rank writes a few per tensor): the bound that a
#: format-2 index puts on the whole, here on each part, so a store of any world size merges.
MAX_PART_CHUNKS = 1 << 22
#: Most mesh coordinates searched for one tensor whose placements are not plain
#: ``Shard``/``Replicate`` (their boxes are enumerated, not computed).
_MAX_ENUMERATED = 1 << 20
_MAX_MESH_RANKS = 1 << 24


def part_file(rank: int) -> str:
    """The index part a rank writes beside its shard files."""
    return f"_index.rank{rank:05d}.json"


def is_part(name: str) -> bool:
    """Whether a file name is an index part."""
    return name.startswith("_index.rank") and name.endswith(".json")


@dataclasses.dataclass(frozen=True, slots=True)
class _Placement:
    """A placement as an index spells it: ``S(dim)``, ``_S(dim, sf)`` or ``R`` (no dim).

    What the box arithmetic below asks of DTensor's own placements (``is_shard``, ``dim``,
    ``is_replicate``), without importing ``torch.distributed.tensor`` to read an index: that
    import took 0.34 s of a 3 s ``ckptstore export`` on the test VM. ``sf``: the split
    factor of a ``_StridedShard`` (FSDP2 over tensor parallelism), 0 for ``Shard``.
    """

    dim: int | None
    sf: int = 0

    def is_shard(self) -> bool:
        """Whether it is ``Shard(dim)`` or ``_StridedShard(dim, sf)``."""
        return self.dim is not None

    def is_replicate(self) -> bool:
        """Whether it is ``Replicate()``."""
        return self.dim is None


#: ``_placement_objects``' answers: a model's tensors share a few spellings, asked per box.
_PLACEMENTS: dict[tuple[str, ...], tuple[_Placement, ...] | None] = {}


def _number(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() and len(text) < 10 else None


def _placement_objects(placements: Sequence[str]) -> tuple[_Placement, ...] | None:
    """Placements from their index spelling (``R``, ``S(d)``, ``_S(d, sf)``); else ``None``.

    ``_S(d, sf)`` is ``str(_StridedShard(d, split_factor=sf))``. Whether a tensor's strided
    placements lay out boxes the index can compute is :func:`strided_problem`'s question.
    """
    key = tuple(placements)
    if key in _PLACEMENTS:
        return _PLACEMENTS[key]
    objs: list[_Placement] = []
    found: tuple[_Placement, ...] | None = None
    for p in key:
        if p == "R":
            objs.append(_Placement(None))
            continue
        if p.startswith("S(") and p.endswith(")") and (d := _number(p[2:-1])) is not None:
            objs.append(_Placement(d))
            continue
        if p.startswith("_S(") and p.endswith(")") and p.count(", ") == 1:
            d, sf = (_number(x) for x in p[3:-1].split(", "))
            if d is not None and sf is not None and sf >= 1:
                objs.append(_Placement(d, sf))
                continue
        break
    else:
        found = tuple(objs)  # frozen: safe to share
    if len(_PLACEMENTS) < 4096:  # spellings come from index files: bounded
        _PLACEMENTS[key] = found
    return found


def _order(objs: Sequence[Any]) -> dict[int, list[int]]:
    """The mesh dims that shard each tensor dim, in the order they split it.

    ``Shard`` dims split in mesh order, each what the one before left (as ``torch.chunk``).
    FSDP2 over tensor parallelism shards a column-wise weight ``(_StridedShard(d, sf=tp),
    Shard(d))``: the TP dim splits first, then the data-parallel dim splits each TP piece.
    Where :func:`strided_problem` finds nothing, that is the order reversed.
    """
    by_tdim: dict[int, list[int]] = {}
    for mdim, p in enumerate(objs):
        if p.is_shard():
            by_tdim.setdefault(p.dim, []).append(mdim)
    for mdims in by_tdim.values():
        if any(objs[m].sf for m in mdims):
            mdims.reverse()
    return by_tdim


def strided_problem(
    tshape: Sequence[int], mshape: Sequence[int], objs: Sequence[_Placement]
) -> str | None:
    """Why a layout with ``_StridedShard`` is not computed as nested chunks, or ``None``.

    The split index computes a strided layout's boxes in the one case
    :func:`ckptstore.state.strided.strided_problem` admits, FSDP2 over tensor parallelism's,
    in :func:`_order`'s order; such a save is format 5, any other keeps format 2's full
    chunk list.
    """
    from ..state.strided import strided_problem as problem

    return problem(tshape, mshape, [(p.dim, p.sf) for p in objs])


def _mesh_spec(mesh: Any) -> dict[str, Any]:
    """A device mesh's ranks: ``start`` and ``strides`` when affine, else the list."""
    ranks = mesh.mesh.reshape(-1).tolist()
    shape = [int(x) for x in mesh.mesh.shape]
    strides = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    strides.reverse()
    start = ranks[0]
    real = [ranks[s] - start if n > 1 else 0 for s, n in zip(strides, shape, strict=True)]
    # Readers take strides in [0, 2**48] (``_check_mesh``): a mesh whose ranks run downwards
    # along a dim (``DeviceMesh("cpu", [1, 0])``) is written as its list of ranks, which
    # every reader takes; with its stride of -1 the step committed and no reader took it.
    affine = all(st >= 0 for st in real) and all(
        ranks[i] == start + sum(c * st for c, st in zip(coord, real, strict=True))
        for i, coord in enumerate(itertools.product(*(range(n) for n in shape)))
    )
    if affine:
        return {"shape": shape, "start": start, "strides": real}
    return {"shape": shape, "ranks": ranks}


def splittable(flat: Mapping[str, Any], world_size: int) -> bool:
    """Whether a save of ``flat`` can use the split index.

    Every DTensor must lie on a mesh of every rank, however it was made (flattened dims
    included), with ``Shard``/``Replicate`` placements (or FSDP2 over TP's
    ``_StridedShard``, where :func:`strided_problem` finds nothing), or on a sub-mesh
    sliced by name from one (``mesh["tp"]``): its root mesh and placements there are
    recorded (:func:`~ckptstore.sharded.plan.root_view`, the other dims ``Replicate``), so
    the sub-meshes' copies are written once. Any other mesh (of some ranks only, and no
    slice by name) needs format 2, where rank 0 gathers every rank's chunks. Decided from
    the layout alone, so every rank decides alike.
    """
    from .plan import placement_names, root_view

    cache: dict[int, Any] = {}
    for t in flat.values():
        view = root_view(t, cache)
        if view is None or view[0].size() != world_size:
            return False
        mshape, _, names = placement_names(t, view)
        objs = _placement_objects(names)
        if objs is None:
            return False
        if any(p.sf for p in objs) and strided_problem(tuple(t.shape), mshape, objs):
            return False
    return True


def is_strided(flat: Mapping[str, Any]) -> bool:
    """Whether any DTensor of a split save has a ``_StridedShard``: format 5, not 4."""
    from .plan import placement_names, root_view

    cache: dict[int, Any] = {}
    for t in flat.values():
        view = root_view(t, cache)
        if view is not None and any(n.startswith("_S(") for n in placement_names(t, view)[2]):
            return True
    return False


def global_bytes(flat: Mapping[str, Any]) -> bytes:
    """Rank 0's ``dtensors.json``: every tensor's layout and the meshes' rank maps."""
    from .chunks import dtype_name
    from .plan import placement_names, root_view

    meshes: list[dict[str, Any]] = []
    seen: dict[int, int] = {}
    tensors: dict[str, Any] = {}
    cache: dict[int, Any] = {}
    for name in sorted(flat):
        t = flat[name]
        view = root_view(t, cache)
        if view is None:  # pragma: no cover - splittable() admitted every tensor
            raise ValueError(f"{name!r}: its device mesh is not a named slice of a root mesh")
        mesh = view[0]
        mid = seen.get(id(mesh))
        if mid is None:
            spec = _mesh_spec(mesh)
            mid = next((i for i, m in enumerate(meshes) if m == spec), None)
            if mid is None:
                meshes.append(spec)
                mid = len(meshes) - 1
            seen[id(mesh)] = mid
        shape, dims, placements = placement_names(t, view)
        tensors[name] = {
            "dtype": dtype_name(t.dtype),
            "shape": [int(x) for x in t.shape],
            "mesh": list(shape),
            "mesh_dims": list(dims),
            "placements": list(placements),
            "mesh_id": mid,
        }
    doc = {"ckptstore_chunks": SPLIT_FORMAT, "block": BLOCK, "meshes": meshes, "tensors": tensors}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def part_bytes(rank: int, chunks: Iterable[tuple[str, tuple[int, ...], Chunk]]) -> bytes:
    """A rank's index part: the chunks it wrote, by tensor."""
    rows: dict[str, list[Any]] = {}
    for name, _, chunk in chunks:
        rows.setdefault(name, []).append(chunk.to_json())
    doc = {"ckptstore_chunk_part": _PART_FORMAT, "rank": rank, "block": BLOCK, "chunks": rows}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def volumes(names: Sequence[str], chunks: Iterable[tuple[str, tuple[int, ...], Chunk]]) -> bytes:
    """The elements this rank wrote of each tensor, in ``names``' order, as int64 bytes.

    What a rank tells rank 0 of its chunks: one number a tensor, however many ranks there
    are. Rank 0 adds them up (:func:`check_volumes`).
    """
    import numpy as np

    at = {n: i for i, n in enumerate(names)}
    out = np.zeros(len(names), dtype=np.int64)
    for name, _, chunk in chunks:
        out[at[name]] += math.prod(chunk.sizes)
    return out.tobytes()


def check_volumes(
    meta: Mapping[str, tuple[str, tuple[int, ...]]], packed: Iterable[bytes]
) -> list[str]:
    """The tensors whose written elements, over every rank, are not exactly their size.

    DTensor boxes do not overlap and :func:`ckptstore.sharded.plan.writes_here` writes each
    once, so a tensor whose total is off has a box no rank wrote (or one written twice).
    """
    import numpy as np

    names = sorted(meta)
    total = np.zeros(len(names), dtype=np.int64)
    for blob in packed:
        got = np.frombuffer(blob, dtype=np.int64)
        if got.shape != total.shape:
            return names  # a rank that saw other tensors: nothing can be trusted
        total += got
    want = np.array([math.prod(meta[n][1]) for n in names], dtype=np.int64)
    return [names[i] for i in np.nonzero(total != want)[0].tolist()]


def _load_json(data: bytes | bytearray, where: str, what: str) -> dict[str, Any]:
    if len(data) > MAX_INDEX_BYTES:
        raise IntegrityError(f"{where}: {len(data)} bytes is larger than any real {what}")
    try:
        doc = strictjson.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise IntegrityError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise IntegrityError(f"{where}: not a {what}")
    return doc


class Layout:
    """A parsed split ``dtensors.json``: tensors without chunks, and where their chunks are."""

    def __init__(
        self,
        tensors: dict[str, TensorEntry],
        meshes: list[dict[str, Any]],
        mesh_of: dict[str, int],
        block: int,
    ) -> None:
        self.tensors = tensors
        self.meshes = meshes
        self.mesh_of = mesh_of
        self.block = block

    @classmethod
    def from_bytes(cls, data: bytes | bytearray, where: str, *, strided: bool = False) -> Layout:
        """Parse and check a split ``dtensors.json``.

        ``strided``: the step's format admits ``_StridedShard`` placements (format 5); a
        format-3 or 4 step has none, and one there is refused as hostile.

        Raises:
            IntegrityError: malformed or hostile.
        """
        from .chunks import _ints, _strs

        doc = _load_json(data, where, "chunk index")
        if doc.get("ckptstore_chunks") != SPLIT_FORMAT:
            raise IntegrityError(f"{where}: not a split chunk index of format {SPLIT_FORMAT}")
        block = doc.get("block")
        if isinstance(block, bool) or not isinstance(block, int) or not 4096 <= block <= 1 << 30:
            raise IntegrityError(f"{where}: 'block' must be an integer in [4096, 2**30]")
        raw_meshes = doc.get("meshes")
        if not isinstance(raw_meshes, list):
            raise IntegrityError(f"{where}: 'meshes' must be a list")
        meshes = [_check_mesh(m, f"{where}: mesh {i}") for i, m in enumerate(raw_meshes)]
        raw = doc.get("tensors")
        if not isinstance(raw, dict):
            raise IntegrityError(f"{where}: 'tensors' must be an object")
        tensors: dict[str, TensorEntry] = {}
        mesh_of: dict[str, int] = {}
        for name, row in raw.items():
            at = f"{where}: tensor {name!r}"
            if not isinstance(row, dict) or not isinstance(name, str) or not name:
                raise IntegrityError(f"{at}: entry must be an object under a name")
            dtype = row.get("dtype")
            if not isinstance(dtype, str) or dtype not in ITEMSIZE:
                raise IntegrityError(f"{at}: unsupported dtype {dtype!r}")
            shape = _ints(row.get("shape"), "shape", at)
            mesh = _ints(row.get("mesh"), "mesh", at)
            dims = _strs(row.get("mesh_dims", []), "mesh_dims", at)
            placements = _strs(row.get("placements"), "placements", at)
            mid = row.get("mesh_id")
            if isinstance(mid, bool) or not isinstance(mid, int) or not 0 <= mid < len(meshes):
                raise IntegrityError(f"{at}: 'mesh_id' names no mesh")
            if list(mesh) != meshes[mid]["shape"] or len(placements) != len(mesh):
                raise IntegrityError(f"{at}: its mesh and placements do not match mesh {mid}")
            objs = _placement_objects(placements)
            if objs is None or (not strided and any(p.sf for p in objs)):
                # a split index is written for these placements only (splittable)
                allowed = "R, S(dim) or _S(dim, sf)" if strided else "R or S(dim)"
                raise IntegrityError(f"{at}: placements {list(placements)} are not {allowed}")
            for p in objs:
                if p.dim is not None and not 0 <= p.dim < len(shape):
                    raise IntegrityError(f"{at}: placement S({p.dim}) of a {len(shape)}-d tensor")
            if any(p.sf for p in objs):
                problem = strided_problem(shape, mesh, objs)
                if problem is not None:  # never written so: splittable() sends it to format 2
                    raise IntegrityError(f"{at}: placements {list(placements)}: {problem}")
            tensors[name] = TensorEntry(dtype, shape, (), mesh, dims, placements)
            mesh_of[name] = mid
        return cls(tensors, meshes, mesh_of, block)

    # ---- which boxes, written by whom ----------------------------------------------------

    def boxes(
        self,
        name: str,
        lo: Sequence[int],
        hi: Sequence[int],
        cache: dict[Any, Any] | None = None,
    ) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        """``(offsets, sizes, writer)`` of each non-empty saved box of ``name`` in ``[lo, hi)``.

        ``cache`` (one per restore, never shared between two layouts: its keys name a mesh
        by its number in this layout) keeps the boxes, mesh coordinates and writers of each
        shape, mesh, placements and interval: the layers of a model repeat a few; only the
        writer of a replicated box depends on the name.
        """
        entry = self.tensors[name]
        mid = self.mesh_of[name]
        mesh = self.meshes[mid]
        objs = _placement_objects(entry.placements)
        if objs is None:  # pragma: no cover - from_bytes admitted every tensor's placements
            raise IntegrityError(f"{name!r}: placements {entry.placements} are not R or S(dim)")
        shape = tuple(mesh["shape"])
        key = (entry.shape, mid, entry.placements, tuple(lo), tuple(hi))
        found = cache.get(key) if cache is not None else None
        if found is None:
            found = []
            for coord in _candidates(entry.shape, shape, objs, lo, hi):
                offsets, sizes = _box(entry.shape, shape, coord, objs)
                if 0 in sizes and entry.shape:
                    continue
                if any(
                    o >= h or o + s <= low
                    for o, s, low, h in zip(offsets, sizes, lo, hi, strict=True)
                ):
                    continue
                found.append(
                    (
                        tuple(int(o) for o in offsets),
                        tuple(int(s) for s in sizes),
                        tuple(coord),
                    )
                )
            if cache is not None:
                cache[key] = found
        if not any(p.is_replicate() and n > 1 for p, n in zip(objs, shape, strict=True)):
            # No replicas: each box has one writer, the same for every tensor of this shape,
            # mesh and placements (the name picks among replicas only).
            writers = cache.get((key, "writers")) if cache is not None else None
            if writers is None:
                writers = [_writer(name, c, shape, objs, mesh) for _, _, c in found]
                if cache is not None:
                    cache[(key, "writers")] = writers
            return [(o, s, w) for (o, s, _), w in zip(found, writers, strict=True)]
        return [(o, s, _writer(name, c, shape, objs, mesh)) for o, s, c in found]

    def resolve(
        self,
        targets: Mapping[str, tuple[Sequence[int], Sequence[int]]],
        read_part: Callable[[int], bytes | bytearray],
        files: Mapping[str, FileEntry],
        where: str,
    ) -> ChunkIndex:
        """The chunks overlapping each target box ``name -> (lo, hi)``, from their writers' parts.

        Only the parts of the ranks that wrote those chunks are read (``read_part(rank)``,
        checked against the manifest by the caller). A box whose chunk a part lacks is an
        error: a partial result is never returned.

        Raises:
            IntegrityError: a part is missing, malformed or lacks a chunk.
        """
        want, sizes = self._written(targets)
        found: dict[str, list[Chunk]] = {n: [] for n in targets}
        read: list[tuple[str, Chunk]] = []
        for writer in sorted(want):
            pname = _listed_part(writer, files, where)
            chunks = self._parse_part(read_part(writer), writer, files, f"{where}/{pname}")
            read += ((name, c) for (name, _), c in chunks.items())
            for name, chunk in _boxes_of(chunks, writer, want[writer], sizes, f"{where}/{pname}"):
                found[name].append(chunk)
        # No two chunks of the parts read share a byte, whatever tensor they belong to. That
        # covers every chunk this rank reads, against each other and against the rest of
        # those parts, so what it allocates is bounded by bytes it reads (the boxes of a
        # tensor tile it, and each chunk holds exactly its box's bytes). A part lists only
        # chunks in its own rank's files (:meth:`_parse_part`), so a chunk of a part this
        # rank does not read cannot alias bytes it reads.
        check_disjoint(read, where)
        tensors = {
            n: TensorEntry(
                e.dtype,
                e.shape,
                tuple(sorted(found[n], key=lambda c: c.offsets)),
                e.mesh,
                e.mesh_dims,
                e.placements,
            )
            for n, e in self.tensors.items()
            if n in targets
        }
        return ChunkIndex(tensors=tensors, block=self.block)

    def _written(
        self, targets: Mapping[str, tuple[Sequence[int], Sequence[int]]]
    ) -> tuple[dict[int, set[_Key]], dict[_Key, tuple[int, ...]]]:
        """The boxes of ``targets`` each rank wrote, from the layout alone, and their sizes.

        ``({writer: {(name, offsets)}}, {(name, offsets): sizes})``: what a restore reads
        (:meth:`resolve`) and what verify requires of every part (:meth:`merged`).
        """
        want: dict[int, set[_Key]] = {}
        sizes: dict[_Key, tuple[int, ...]] = {}
        cache: dict[Any, Any] = {}
        for name, (lo, hi) in targets.items():
            for offsets, box, writer in self.boxes(name, lo, hi, cache):
                want.setdefault(writer, set()).add((name, offsets))
                sizes[(name, offsets)] = box
        return want, sizes

    def _parse_part(
        self,
        data: bytes | bytearray,
        rank: int,
        files: Mapping[str, FileEntry],
        where: str,
    ) -> dict[tuple[str, tuple[int, ...]], Chunk]:
        from .chunks import fast_chunk, parse_chunk

        doc = _load_json(data, where, "chunk index part")
        if doc.get("ckptstore_chunk_part") != _PART_FORMAT or doc.get("rank") != rank:
            raise IntegrityError(f"{where}: not the index part of rank {rank}")
        if doc.get("block") != self.block:
            raise IntegrityError(f"{where}: its block size is not the index's")
        rows = doc.get("chunks")
        if not isinstance(rows, dict):
            raise IntegrityError(f"{where}: 'chunks' must be an object")
        out: dict[tuple[str, tuple[int, ...]], Chunk] = {}
        payloads: dict[str, FileEntry] = {}  # fast_chunk's: the file names found good
        budget = MAX_PART_CHUNKS
        own = shard_file(rank).removesuffix("safetensors")  # "_shards.rank00001."
        for name, cs in rows.items():
            entry = self.tensors.get(name)
            if entry is None or not isinstance(cs, list):
                raise IntegrityError(f"{where}: {name!r} is not in the index, yet has chunks here")
            budget -= len(cs)
            if budget < 0:
                raise IntegrityError(
                    f"{where}: more than {MAX_PART_CHUNKS} chunks in one part; it is hostile"
                )
            itemsize = ITEMSIZE[entry.dtype]
            for i, c in enumerate(cs):
                chunk = fast_chunk(c, entry.shape, itemsize, files, self.block, payloads)
                if chunk is None:
                    chunk = parse_chunk(c, entry, files, self.block, f"{where}: {name!r} chunk {i}")
                if not chunk.file.startswith(own):
                    # A rank writes only its own files. Pointed at another rank's bytes (its
                    # CRCs copied), a chunk passed: each restoring rank checks the chunks of
                    # the parts it reads for overlaps, not those of parts it does not read,
                    # and restored the other rank's values (found by review).
                    raise IntegrityError(
                        f"{where}: {name!r} chunk {i} lies in {chunk.file}, which rank {rank} "
                        "did not write; the index part is forged or not this save's"
                    )
                out[(name, chunk.offsets)] = chunk
        return out

    def merged(
        self,
        read_part: Callable[[int], bytes | bytearray],
        files: Mapping[str, FileEntry],
        where: str,
        away: Collection[int] = (),
    ) -> ChunkIndex:
        """The whole index from every part the manifest lists, checked as format 2 is.

        Every chunk row as a restore checks it, each tensor tiled exactly by its chunks,
        and no two chunks sharing a byte: what ``ChunkIndex.from_bytes`` checks of a format-2
        index, without writing one. (Merged into one format-2 document, the index of a
        job of thousands of ranks, 600 DTensors each, was refused by that parser's bounds on
        a whole index: 4,194,304 chunks, 512 MB. A part keeps its own bound.)

        ``away``: ranks whose files are not here (a node's copy on node-local roots). Their
        parts are not read, and the chunks of the others are each checked, but not whether
        they cover their tensors (the other nodes hold the rest).
        """
        ranks = sorted(int(n[11:16]) for n in files if is_part(n) and n[11:16].isdigit())
        found: dict[str, list[Chunk]] = {n: [] for n in self.tensors}
        parts: dict[int, dict[_Key, Chunk]] = {}
        for rank in (r for r in ranks if r not in away):
            pname = part_file(rank)
            chunks = self._parse_part(read_part(rank), rank, files, f"{where}/{pname}")
            parts[rank] = chunks
            for (name, _), chunk in chunks.items():
                found[name].append(chunk)
        tensors = {
            n: dataclasses.replace(e, chunks=tuple(sorted(found[n], key=_offsets)))
            for n, e in self.tensors.items()
        }
        if not away:
            for n, e in tensors.items():
                at = f"{where}: tensor {n!r}"
                if len(n) > 4096:  # as format 2 bounds a name
                    raise IntegrityError(f"{at}: a tensor name is a non-empty string")
                check_tiling(e.chunks, e.shape, at)
        # Tiling is not enough: the chunks must be the boxes the mesh and placements lay out,
        # each in the part of the rank that wrote it, as a restore finds them (the same rule:
        # ``_written``, ``_listed_part``, ``_boxes_of``). A layout saying S(1) over parts of
        # S(0) boxes, or a mesh of ranks [0, 7], [0, 0] or of 4 ranks on a 2-rank job, passed
        # here while every restore refused it, and retention then deleted the older steps
        # (found by review).
        want, sizes = self._written(
            {n: ((0,) * len(e.shape), e.shape) for n, e in self.tensors.items()}
        )
        for writer in sorted(want):
            if writer in away:
                continue  # its node checks its own part
            pname = _listed_part(writer, files, where)
            held = parts.get(writer)
            if held is None:  # listed, yet not found by its name's digits
                held = self._parse_part(read_part(writer), writer, files, f"{where}/{pname}")
            _boxes_of(held, writer, want[writer], sizes, f"{where}/{pname}")
        for rank, chunks in parts.items():
            mine = want.get(rank, set())
            for key, chunk in chunks.items():
                if chunk.nbytes and key not in mine:
                    raise IntegrityError(
                        f"{where}/{part_file(rank)}: a chunk of {key[0]!r} at {list(key[1])}, "
                        f"which rank {rank} did not write; the index part is not this save's"
                    )
        # No two chunks share a byte (with nodes away: those here; theirs are theirs to check).
        check_disjoint(((n, c) for n, e in tensors.items() for c in e.chunks), where)
        return ChunkIndex(tensors=tensors, block=self.block)


#: A box of a tensor: ``(name, offsets)``.
_Key = tuple[str, tuple[int, ...]]


def _listed_part(writer: int, files: Mapping[str, FileEntry], where: str) -> str:
    """The index part of ``writer``, a rank the layout says wrote a box; the manifest must list it.

    Raises:
        IntegrityError: it does not (a mesh naming a rank the job did not have).
    """
    pname = part_file(writer)
    if pname not in files:
        raise IntegrityError(f"{where}: the manifest lists no {pname}")
    return pname


def _boxes_of(
    chunks: Mapping[_Key, Chunk],
    writer: int,
    keys: Iterable[_Key],
    sizes: Mapping[_Key, tuple[int, ...]],
    where: str,
) -> list[tuple[str, Chunk]]:
    """``(name, chunk)`` of each box of ``keys`` (written by ``writer``) in its part ``chunks``.

    Raises:
        IntegrityError: the part lacks one, or holds it at another size.
    """
    out = []
    for key in keys:
        chunk = chunks.get(key)
        if chunk is None or chunk.sizes != sizes[key]:
            raise IntegrityError(
                f"{where}: no chunk of {key[0]!r} at {list(key[1])}, which rank "
                f"{writer} wrote; the index part is not this save's"
            )
        out.append((key[0], chunk))
    return out


def merged(
    data: bytes | bytearray,
    read_part: Callable[[int], bytes | bytearray],
    manifest: Manifest,
    where: str,
    away: Collection[int] = (),
) -> ChunkIndex:
    """The whole chunk index of a step: format 2 as it is, a split one from all its parts.

    The manifest's format version says which (3 and up: split; 5: strided placements
    too), never the index file itself. ``away``: see :meth:`Layout.merged`.
    """
    if is_split(manifest):
        layout = Layout.from_bytes(data, where, strided=is_strided_format(manifest))
        return layout.merged(read_part, manifest.files, where, away)
    return ChunkIndex.from_bytes(data, manifest.files, where)


def is_split(manifest: Manifest) -> bool:
    """Whether a DTensor step's chunk index is split (format 3 and up)."""
    return manifest.format_version >= SPLIT_FORMAT_VERSION


def is_strided_format(manifest: Manifest) -> bool:
    """Whether a split index may spell ``_StridedShard`` placements (format 5)."""
    return manifest.format_version >= STRIDED_FORMAT_VERSION


def _check_mesh(m: object, where: str) -> dict[str, Any]:
    from .chunks import _ints

    if not isinstance(m, dict):
        raise IntegrityError(f"{where}: must be an object")
    shape = list(_ints(m.get("shape"), "shape", where))
    size = math.prod(shape)
    if not shape or size > _MAX_MESH_RANKS:
        raise IntegrityError(f"{where}: a mesh of {shape} ranks")
    if "ranks" in m:
        ranks = list(_ints(m.get("ranks"), "ranks", where))
        if len(ranks) != size:
            raise IntegrityError(f"{where}: {len(ranks)} ranks for a {shape} mesh")
        return {"shape": shape, "ranks": ranks}
    start = m.get("start")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise IntegrityError(f"{where}: 'start' must be a rank")
    strides = list(_ints(m.get("strides"), "strides", where))
    if len(strides) != len(shape):
        raise IntegrityError(f"{where}: one stride per mesh dim")
    return {"shape": shape, "start": start, "strides": strides}


def _writer(
    name: str,
    coord: Sequence[int],
    shape: Sequence[int],
    objs: Sequence[Any],
    mesh: Mapping[str, Any],
) -> int:
    """The rank that wrote the box at mesh coordinate ``coord`` (``writes_here``'s rule)."""
    replicas, box = 1, 0
    rep_dims = []
    for dim, p in enumerate(objs):
        if p.is_replicate():
            replicas *= shape[dim]
            rep_dims.append(dim)
        else:
            box = box * shape[dim] + coord[dim]
    replica = (zlib.crc32(name.encode()) + box) % replicas if replicas > 1 else 0
    full = list(coord)
    for dim in reversed(rep_dims):
        full[dim] = replica % shape[dim]
        replica //= shape[dim]
    if "ranks" in mesh:
        index = 0
        for c, n in zip(full, shape, strict=True):
            index = index * n + c
        return int(mesh["ranks"][index])
    return int(mesh["start"] + sum(c * s for c, s in zip(full, mesh["strides"], strict=True)))


def _box(
    tshape: Sequence[int], mshape: Sequence[int], coord: Sequence[int], objs: Sequence[Any]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)`` of the box at mesh coordinate ``coord``: DTensor's arithmetic.

    Each ``Shard(d)``, mesh dim after mesh dim (in :func:`_order`'s order where a
    ``_StridedShard`` is), splits what is left of dim ``d`` like ``torch.chunk`` (as
    :func:`_split` does). In integers: DTensor's own
    ``_compute_local_shape_and_global_offset`` makes an index tensor of 8 bytes per element
    of the shard's length, so a hostile layout's shape of 2**40 rows asked for 8 TiB before
    any chunk was read (issue 24 #7).
    """
    base = [0] * len(tshape)
    length = list(tshape)
    for d, mdims in _order(objs).items():
        for mdim in mdims:
            n, i = mshape[mdim], coord[mdim]
            size = -(-length[d] // n) if length[d] else 0
            first = min(i * size, length[d])
            base[d] += first
            length[d] = max(0, min(length[d], (i + 1) * size) - first)
    return tuple(base), tuple(length)


def _candidates(
    tshape: Sequence[int],
    mshape: Sequence[int],
    objs: Sequence[Any],
    lo: Sequence[int],
    hi: Sequence[int],
) -> list[tuple[int, ...]]:
    """Mesh coordinates (``Replicate`` dims at 0) whose box may overlap ``[lo, hi)``.

    For plain ``Shard`` placements DTensor splits a tensor dim like ``torch.chunk``, mesh
    dim after mesh dim: the indices of each mesh dim that can reach the interval are
    computed, not searched, so a rank restoring one shard of an N-way split looks at a
    few coordinates, not N.
    """
    # The mesh dims that shard each tensor dim, in the order they split it; Replicate dims
    # stay at 0.
    by_tdim = _order(objs)
    combos: list[dict[int, int]] = [{}]
    for tdim, mdims in by_tdim.items():
        options: list[dict[int, int]] = []
        _split(tshape[tdim], 0, mdims, mshape, lo[tdim], hi[tdim], {}, options)
        combos = [{**a, **b} for a in combos for b in options]
        if len(combos) > _MAX_ENUMERATED:
            raise IntegrityError(f"{len(combos)} boxes to search for one tensor; hostile index")
    out = [tuple(c.get(m, 0) for m in range(len(mshape))) for c in combos]
    return out


def _split(  # noqa: PLR0917 - recursion
    length: int,
    base: int,
    mdims: list[int],
    mshape: Sequence[int],
    lo: int,
    hi: int,
    chosen: dict[int, int],
    out: list[dict[int, int]],
) -> None:
    """Indices of ``mdims`` whose pieces meet ``[lo, hi)``, each full choice into ``out``.

    ``mdims`` split ``[base, base + length)`` like ``torch.chunk``, one inside the other.
    """
    if not mdims:
        out.append(dict(chosen))
        if len(out) > _MAX_ENUMERATED:
            raise IntegrityError(f"over {_MAX_ENUMERATED} boxes to search for one tensor; hostile")
        return
    n = mshape[mdims[0]]
    size = -(-length // n) if length else 0
    if size == 0:
        first, last = 0, n - 1  # every piece is empty: any index, the caller skips them
    else:
        first = max(0, (lo - base) // size)
        last = min(n - 1, max(first, (hi - 1 - base) // size))
    for i in range(first, last + 1):
        start = base + min(i * size, length)
        piece = max(0, min(length, (i + 1) * size) - min(i * size, length))
        chosen[mdims[0]] = i
        _split(piece, start, mdims[1:], mshape, lo, hi, chosen, out)
    chosen.pop(mdims[0], None)


def part_reader(storage: Any, step: int, files: Mapping[str, FileEntry]) -> Callable[[int], bytes]:
    """``read_part(rank)``: a part of ``step``, checked against its manifest entry."""

    def read_part(rank: int) -> bytes:
        name = part_file(rank)
        entry = files.get(name)
        if entry is None:
            raise IntegrityError(f"{storage.describe(step)}: the manifest lists no {name}")
        return bytes(storage.read_file(step, name, entry))

    return read_part


def read_index(
    storage: Any, manifest: Manifest, where: str, away: Collection[int] = ()
) -> ChunkIndex:
    """The whole chunk index of a DTensor step (format 2, or split and merged), checked.

    Every chunk is also checked against its shard file's own safetensors header
    (:func:`~ckptstore.sharded.chunks.check_entries`: the entry ``name@offsets`` at exactly
    its bytes, of the layout's dtype and the chunk's shape), so what ``verify``, ``inspect``,
    ``export`` and consolidation read from the index is what a restore reads.

    ``away``: ranks whose files another node holds (see :meth:`Layout.merged`).
    """
    from .chunks import INDEX_FILE, check_entries

    step, files = manifest.step, manifest.files
    entry = files.get(INDEX_FILE)
    if entry is None:
        raise IntegrityError(f"{storage.describe(step)}: the manifest lists no {INDEX_FILE}")
    raw = storage.read_file(step, INDEX_FILE, entry)
    index = merged(raw, part_reader(storage, step, files), manifest, where, away)
    rows = ((n, e.dtype, c) for n, e in index.tensors.items() for c in e.chunks)
    with storage.range_reader(step, files) as reader:
        check_entries(rows, reader.read, storage.describe(step))
    return index


def _offsets(c: Chunk) -> tuple[int, ...]:
    return c.offsets

"""The split chunk index (format 3): where each chunk is, computed rather than listed.

The box search is checked against DTensor's own layout arithmetic on random layouts, the
writer rule against the save's (``writes_here``), and a restoring rank is shown to read the
parts of the ranks whose boxes overlap its target only.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from typing import Any

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from ckptstore.errors import IntegrityError
from ckptstore.integrity import format_crc
from ckptstore.manifest import FileEntry
from ckptstore.sharded import chunks as chunks_mod
from ckptstore.sharded import plan as sharding
from ckptstore.sharded import split_index as si
from ckptstore.sharded.chunks import BLOCK, ChunkIndex, TensorEntry


def _names(objs: list[Any]) -> tuple[str, ...]:
    """The index's spelling of DTensor placements (as ``sharding.placement_names``)."""
    return tuple(
        str(p) if isinstance(p, _StridedShard) else f"S({p.dim})" if p.is_shard() else "R"
        for p in objs
    )


def _layout(shape: tuple[int, ...], mesh: tuple[int, ...], objs: list[Any]) -> si.Layout:
    strides = [math.prod(mesh[i + 1 :]) for i in range(len(mesh))]
    entry = TensorEntry("float32", shape, (), mesh, (), _names(objs))
    return si.Layout(
        {"t": entry}, [{"shape": list(mesh), "start": 0, "strides": strides}], {"t": 0}, BLOCK
    )


def _brute(
    shape: tuple[int, ...], mesh: tuple[int, ...], objs: list[Any], lo: list[int], hi: list[int]
) -> set[tuple[tuple[int, ...], tuple[int, ...]]]:
    out = set()
    for coord in itertools.product(*(range(n) for n in mesh)):
        if any(p.is_replicate() and c for p, c in zip(objs, coord, strict=True)):
            continue
        sizes, offs = _compute_local_shape_and_global_offset(shape, mesh, list(coord), objs)
        if 0 in sizes and shape:
            continue
        if any(o >= h or o + s <= low for o, s, low, h in zip(offs, sizes, lo, hi, strict=True)):
            continue
        out.add((tuple(offs), tuple(sizes)))
    return out


def test_the_box_search_finds_what_dtensor_lays_out() -> None:
    """Uneven splits, nested Shard on one dim, Replicate: the same boxes as a full search."""
    rnd = random.Random(1)
    for _ in range(1500):
        nd = rnd.randint(1, 3)
        shape = tuple(rnd.randint(0, 13) for _ in range(nd))
        mesh = tuple(rnd.randint(1, 4) for _ in range(rnd.randint(1, 3)))
        objs = [Replicate() if rnd.random() < 0.3 else Shard(rnd.randrange(nd)) for _ in mesh]
        lo = [rnd.randint(0, max(0, d - 1)) for d in shape]
        hi = [rnd.randint(a + 1, max(a + 1, d)) for a, d in zip(lo, shape, strict=True)]
        got = {(o, s) for o, s, _ in _layout(shape, mesh, objs).boxes("t", lo, hi)}
        assert got == _brute(shape, mesh, objs, lo, hi), (shape, mesh, _names(objs), lo, hi)


def _strided(rnd: random.Random) -> tuple[tuple[int, ...], tuple[int, ...], list[Any]]:
    """A random layout with FSDP2 over TP's ``(_StridedShard(d, sf), Shard(d))`` on two
    mesh dims and ``Replicate``/``Shard`` on the others, as HSDP over TP lays out."""
    nd = rnd.randint(1, 3)
    shape = tuple(rnd.randint(0, 24) for _ in range(nd))
    mesh = tuple(rnd.randint(1, 4) for _ in range(rnd.randint(2, 3)))
    first, then = sorted(rnd.sample(range(len(mesh)), 2))
    objs: list[Any] = [
        Replicate() if rnd.random() < 0.4 else Shard(rnd.randrange(nd)) for _ in mesh
    ]
    d = rnd.randrange(nd)
    objs[first], objs[then] = _StridedShard(d, split_factor=mesh[then]), Shard(d)
    for m, p in enumerate(objs):  # a third mesh dim on the same tensor dim is another layout
        if m not in {first, then} and p.is_shard() and p.dim == d:
            objs[m] = Replicate()
    return shape, mesh, objs


def test_strided_boxes_are_the_ones_dtensor_lays_out() -> None:
    """FSDP2 over TP: where the split factor divides the dim, every box and every box
    search agrees with DTensor's own arithmetic; where it does not, the layout is refused
    (DTensor's rows are then not nested chunks, and such a save keeps format 2)."""
    rnd = random.Random(7)
    checked = refused = 0
    for _ in range(1500):
        shape, mesh, objs = _strided(rnd)
        names = _names(objs)
        mine = si._placement_objects(names)
        assert mine is not None, names
        problem = si.strided_problem(shape, mesh, mine)
        if problem is not None:
            assert "does not divide" in problem, problem
            refused += 1
            continue
        checked += 1
        for coord in itertools.product(*(range(n) for n in mesh)):
            sizes, offs = _compute_local_shape_and_global_offset(shape, mesh, list(coord), objs)
            got = si._box(shape, mesh, coord, mine)
            if 0 in sizes and shape:
                assert 0 in got[1], (shape, mesh, names, coord)
            else:
                assert got == (tuple(offs), tuple(sizes)), (shape, mesh, names, coord)
        lo = [rnd.randint(0, max(0, d - 1)) for d in shape]
        hi = [rnd.randint(a + 1, max(a + 1, d)) for a, d in zip(lo, shape, strict=True)]
        got_boxes = {(o, s) for o, s, _ in _layout(shape, mesh, objs).boxes("t", lo, hi)}
        assert got_boxes == _brute(shape, mesh, objs, lo, hi), (shape, mesh, names, lo, hi)
    assert checked > 600, (checked, refused)
    assert refused > 100, (checked, refused)


def test_strided_layouts_the_index_cannot_compute_are_named() -> None:
    p = si._placement_objects
    assert si.strided_problem((8, 4), (2, 2), p(["_S(0, 2)", "S(0)"])) is None
    assert si.strided_problem((8, 4), (3, 2, 2), p(["R", "_S(0, 2)", "S(0)"])) is None
    assert "does not divide" in str(si.strided_problem((7, 4), (3, 2), p(["_S(0, 2)", "S(0)"])))
    assert "not the 3 ranks" in str(si.strided_problem((6, 4), (2, 3), p(["_S(0, 2)", "S(0)"])))
    assert "not as _S(d, sf) then S(d)" in str(
        si.strided_problem((8, 4), (2, 2), p(["S(0)", "_S(0, 2)"]))
    )
    assert "not as _S(d, sf) then S(d)" in str(
        si.strided_problem((8, 4), (2, 2, 2), p(["_S(0, 2)", "S(0)", "S(0)"]))
    )
    assert "not as _S(d, sf) then S(d)" in str(si.strided_problem((8,), (2,), p(["_S(0, 2)"])))
    for bad in ("_S(0,2)", "_S(0, 0)", "_S(-1, 2)", "_S(0, 2, 1)", "_S(\u00b2, 2)"):
        assert p([bad, "S(0)"]) is None, bad


class _Mesh:
    def __init__(self, shape: tuple[int, ...], coordinate: list[int]) -> None:
        self.shape = shape
        self._coordinate = coordinate

    def get_coordinate(self) -> list[int]:
        return self._coordinate


class _Held:
    def __init__(self, mesh: _Mesh, placements: list[Any]) -> None:
        self.device_mesh = mesh
        self.placements = placements


@pytest.mark.parametrize("kinds", ["R", "RS", "SR", "RSR", "R/S", "/SR"])
def test_the_writer_of_a_box_is_the_holder_that_wrote_it(kinds: str) -> None:
    """A restoring rank finds each box in the part of the rank writes_here made write it.

    ``/``: a ``_StridedShard`` whose split factor is the next mesh dim's size."""
    mesh = tuple(2 + i for i in range(len(kinds)))
    objs: list[Any] = [
        Replicate()
        if k == "R"
        else _StridedShard(0, split_factor=mesh[i + 1])
        if k == "/"
        else Shard(0)
        for i, k in enumerate(kinds)
    ]
    lay = _layout((24,), mesh, objs)
    strides = [math.prod(mesh[i + 1 :]) for i in range(len(mesh))]
    for name in ("model/w", "layers.3.attn.q_proj.weight", "b"):
        lay.tensors[name] = lay.tensors["t"]
        lay.mesh_of[name] = 0
        wrote: dict[tuple[int, ...], int] = {}
        for coord in itertools.product(*(range(n) for n in mesh)):
            if sharding.writes_here(_Held(_Mesh(mesh, list(coord)), objs), name):
                _, offs = _compute_local_shape_and_global_offset((24,), mesh, list(coord), objs)
                assert tuple(offs) not in wrote, (name, coord)  # one writer a box
                wrote[tuple(offs)] = sum(c * s for c, s in zip(coord, strides, strict=True))
        found = lay.boxes(name, [0], [24])
        assert len(found) == len(wrote)
        for offsets, _, writer in found:
            assert wrote[offsets] == writer, (name, offsets)


def _part(rank: int, name: str, boxes: list[tuple[int, int]]) -> bytes:
    chunks = [
        {
            "offsets": [o, 0],
            "sizes": [n, 4],
            "file": f"_shards.rank{rank:05d}.safetensors",
            "start": 0,
            "bytes": n * 16,
            "crc32c": [format_crc(0)],
        }
        for o, n in boxes
    ]
    doc = {"ckptstore_chunk_part": 1, "rank": rank, "block": BLOCK, "chunks": {name: chunks}}
    return json.dumps(doc).encode()


def _files(world: int, rows: int) -> dict[str, FileEntry]:
    files = {}
    for r in range(world):
        name = f"_shards.rank{r:05d}.safetensors"
        files[name] = FileEntry(bytes=rows * 16, crc32c=0, codec="safetensors", rank=r)
        files[si.part_file(r)] = FileEntry(bytes=1, crc32c=0, codec="json", rank=r)
    return files


def test_a_resharded_restore_reads_only_the_parts_it_needs() -> None:
    """A 64-way FSDP split restored on 16 ranks: each target reads 4 parts, not 64."""
    world, rows = 64, 640
    lay = _layout((rows, 4), (world,), [Shard(0)])
    lay.tensors = {"w": TensorEntry("float32", (rows, 4), (), (world,), (), ("S(0)",))}
    lay.mesh_of = {"w": 0}
    files = _files(world, rows)
    read: list[int] = []

    def read_part(rank: int) -> bytes:
        read.append(rank)
        return _part(rank, "w", [(rank * 10, 10)])

    index = lay.resolve({"w": ((40, 0), (80, 4))}, read_part, files, "test")
    assert read == [4, 5, 6, 7]
    assert [c.offsets for c in index.tensors["w"].chunks] == [(40, 0), (50, 0), (60, 0), (70, 0)]
    read.clear()
    lay.merged(read_part, files, "test")  # verify's view: every part
    assert read == list(range(world))


def test_a_part_that_lacks_its_box_or_lies_about_it_is_refused() -> None:
    lay = _layout((20, 4), (2,), [Shard(0)])
    lay.tensors = {"w": TensorEntry("float32", (20, 4), (), (2,), (), ("S(0)",))}
    lay.mesh_of = {"w": 0}
    files = _files(2, 20)
    with pytest.raises(IntegrityError, match=r"no chunk of 'w' at \[0, 0\], which rank 0 wrote"):
        lay.resolve({"w": ((0, 0), (20, 4))}, lambda r: _part(r, "w", []), files, "test")
    with pytest.raises(IntegrityError, match="no chunk of 'w'"):  # a box of another size
        lay.resolve({"w": ((0, 0), (20, 4))}, lambda r: _part(r, "w", [(r * 10, 9)]), files, "t")
    with pytest.raises(IntegrityError, match="not the index part of rank 1"):
        lay.resolve({"w": ((10, 0), (20, 4))}, lambda r: _part(0, "w", [(10, 10)]), files, "t")
    with pytest.raises(IntegrityError, match="not valid JSON"):
        lay.resolve({"w": ((10, 0), (20, 4))}, lambda r: b"{", files, "t")


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d: d.update(ckptstore_chunks=1), "not a split chunk index"),
        (lambda d: d["meshes"][0].update(shape=[1 << 30]), "a mesh of"),
        (lambda d: d["meshes"][0].update(start=-1), "'start'"),
        (lambda d: d["meshes"].__setitem__(0, {"shape": [2], "ranks": [0]}), "1 ranks for"),
        (lambda d: d["tensors"]["w"].update(mesh_id=3), "names no mesh"),
        (lambda d: d["tensors"]["w"].update(placements=["S(5)"]), r"placement S\(5\) of a 2-d"),
        # Digits int() refuses: refused as the index's fault, not a ValueError.
        (lambda d: d["tensors"]["w"].update(placements=["S(\u00b2)"]), "are not R or S"),
        (lambda d: d["tensors"]["w"].update(placements=["_StridedShard(0)"]), "are not R or S"),
        # A format-4 step holds no strided placement: refused, not computed.
        (lambda d: d["tensors"]["w"].update(placements=["_S(0, 1)"]), r"are not R or S\(dim\)$"),
        (lambda d: d["tensors"]["w"].update(dtype="float128"), "unsupported dtype"),
    ],
)
def test_a_hostile_layout_is_refused(edit: Any, expected: str) -> None:
    doc = {
        "ckptstore_chunks": si.SPLIT_FORMAT,
        "block": BLOCK,
        "meshes": [{"shape": [2], "start": 0, "strides": [1]}],
        "tensors": {
            "w": {
                "dtype": "float32",
                "shape": [20, 4],
                "mesh": [2],
                "mesh_dims": ["dp"],
                "placements": ["S(0)"],
                "mesh_id": 0,
            }
        },
    }
    si.Layout.from_bytes(json.dumps(doc).encode(), "ok")
    edit(doc)
    with pytest.raises(IntegrityError, match=expected):
        si.Layout.from_bytes(json.dumps(doc).encode(), "test")


@pytest.mark.parametrize(
    ("shape", "placements", "expected"),
    [
        ([20, 4], ["_S(0, 2)", "S(0)"], None),
        ([19, 4], ["_S(0, 2)", "S(0)"], "split factor 2 does not divide tensor dim 0"),
        ([20, 4], ["_S(0, 3)", "S(0)"], "split factor 3 is not the 2 ranks of mesh dim 1"),
        ([20, 4], ["S(0)", "_S(0, 2)"], r"not as _S\(d, sf\) then S\(d\)"),
        ([20, 4], ["_S(0, 2)", "S(1)"], r"not as _S\(d, sf\) then S\(d\)"),
        ([20, 4], ["_S(2, 2)", "S(0)"], r"placement S\(2\) of a 2-d tensor"),
        ([20, 4], ["_S(0, x)", "S(0)"], r"not R, S\(dim\) or _S\(dim, sf\)"),
    ],
)
def test_a_format_5_layout_admits_only_the_strided_shards_it_computes(
    shape: list[int], placements: list[str], expected: str | None
) -> None:
    doc = {
        "ckptstore_chunks": si.SPLIT_FORMAT,
        "block": BLOCK,
        "meshes": [{"shape": [2, 2], "start": 0, "strides": [2, 1]}],
        "tensors": {
            "w": {
                "dtype": "float32",
                "shape": shape,
                "mesh": [2, 2],
                "mesh_dims": ["dp", "tp"],
                "placements": placements,
                "mesh_id": 0,
            }
        },
    }
    data = json.dumps(doc).encode()
    if expected is None:
        lay = si.Layout.from_bytes(data, "ok", strided=True)
        # rank (i, j) holds part i of TP piece j: rows 0-4 (0,0), 10-14 (0,1), 5-9 (1,0) ...
        got = {w: o for o, _, w in lay.boxes("w", [0, 0], shape)}
        assert got == {0: (0, 0), 1: (10, 0), 2: (5, 0), 3: (15, 0)}
        with pytest.raises(IntegrityError, match="are not R or S"):
            si.Layout.from_bytes(data, "format 4")  # the same index in a format-4 step
        return
    with pytest.raises(IntegrityError, match=expected):
        si.Layout.from_bytes(data, "test", strided=True)


def test_a_layout_of_too_many_boxes_is_refused_before_they_are_made() -> None:
    """A hostile mesh of 2**12 x 2**12 ranks splitting one dim: bounded, not 16M boxes."""
    lay = _layout((1 << 30,), (1 << 12, 1 << 12), [Shard(0), Shard(0)])
    with pytest.raises(IntegrityError, match="boxes to search for one tensor"):
        lay.boxes("t", [0], [1 << 30])


# ---- chunks that share bytes of a file (issue 24 #7) ---------------------------------------


def _layout_of(
    tensors: dict[str, tuple[tuple[int, ...], str]], mesh: dict[str, Any] | None = None
) -> si.Layout:
    """Tensors ``name -> (shape, placement)``, float32 on one 1-D mesh of 4 ranks."""
    mesh = mesh or {"shape": [4], "start": 0, "strides": [1]}
    entries = {
        n: TensorEntry("float32", shape, (), (4,), ("dp",), (p,))
        for n, (shape, p) in tensors.items()
    }
    return si.Layout(entries, [mesh], dict.fromkeys(entries, 0), BLOCK)


def _parts(lay: si.Layout, alias: Any = None) -> tuple[dict[int, bytes], dict[str, FileEntry]]:
    """Every rank's part as a save writes it: each box its own bytes of its writer's file.

    ``alias(name, offsets, writer) -> (file rank, start) | None`` moves a chunk elsewhere.
    A zero-size tensor gets an empty chunk from rank 0, at the start of a real chunk, as
    a safetensors file places a zero-byte entry.
    """
    rows: dict[int, dict[str, list[Any]]] = {r: {} for r in range(4)}
    at = dict.fromkeys(range(4), 64)  # past a header
    for name, entry in sorted(lay.tensors.items()):
        if 0 in entry.shape:
            zero = [0] * len(entry.shape)
            chunk = {"offsets": zero, "sizes": list(entry.shape), "start": 64, "bytes": 0}
            rows[0].setdefault(name, []).append(
                {**chunk, "file": "_shards.rank00000.safetensors", "crc32c": []}
            )
            continue
        for offsets, sizes, writer in lay.boxes(name, [0] * len(entry.shape), entry.shape):
            nbytes = 4 * math.prod(sizes)
            file_rank, start = writer, at[writer]
            at[writer] += nbytes
            moved = alias(name, offsets, writer) if alias is not None else None
            if moved is not None:
                file_rank, start = moved
            rows[writer].setdefault(name, []).append(
                {
                    "offsets": list(offsets),
                    "sizes": list(sizes),
                    "file": f"_shards.rank{file_rank:05d}.safetensors",
                    "start": start,
                    "bytes": nbytes,
                    "crc32c": [format_crc(0)] * -(-nbytes // BLOCK),
                }
            )
    parts = {
        r: json.dumps(
            {"ckptstore_chunk_part": 1, "rank": r, "block": BLOCK, "chunks": rows[r]}
        ).encode()
        for r in range(4)
    }
    files = {}
    for r in range(4):
        files[f"_shards.rank{r:05d}.safetensors"] = FileEntry(at[r], 0, "safetensors", rank=r)
        files[si.part_file(r)] = FileEntry(len(parts[r]), 0, "json", rank=r)
    return parts, files


REAL = {
    "rows": ((40, 6), "S(0)"),
    "cols": ((6, 40), "S(1)"),
    "bias": ((6,), "R"),
    "empty": ((0, 6), "S(0)"),
}


def _full(lay: si.Layout) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    return {n: ((0,) * len(e.shape), e.shape) for n, e in lay.tensors.items()}


def test_real_split_layouts_share_no_bytes() -> None:
    """Row chunks, Shard(1) column chunks, a replicated and a zero-size tensor: restore
    (every target, one rank's share) and the merged whole all pass."""
    lay = _layout_of(REAL)
    parts, files = _parts(lay)
    index = lay.resolve(_full(lay), parts.__getitem__, files, "t")
    assert len(index.tensors["cols"].chunks) == 4
    lay.resolve({"rows": ((10, 0), (20, 6))}, parts.__getitem__, files, "t")
    merged = lay.merged(parts.__getitem__, files, "t")
    assert len(merged.tensors["rows"].chunks) == 4
    lay.merged(parts.__getitem__, files, "t", away={1, 2})


def test_the_whole_of_a_large_job_merges_and_a_part_keeps_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """verify's view of a job's index: a format-2 index holds at most ``_MAX_CHUNKS`` rows,
    but a split one of many ranks holds more in all (16,384 ranks of 600 DTensors: 9.8
    million); each part keeps that bound itself."""
    lay = _layout_of(REAL)
    parts, files = _parts(lay)
    whole = lay.merged(parts.__getitem__, files, "t")
    # The same chunks, and the same checks, as the format-2 parser makes of them.
    assert ChunkIndex.from_bytes(whole.to_bytes(), files, "t") == whole
    total = sum(len(e.chunks) for e in whole.tensors.values())
    per_part = max(sum(map(len, json.loads(p)["chunks"].values())) for p in parts.values())
    monkeypatch.setattr(chunks_mod, "_MAX_CHUNKS", total - 1)
    with pytest.raises(IntegrityError, match="chunks; the index is hostile"):
        ChunkIndex.from_bytes(whole.to_bytes(), files, "t")
    assert lay.merged(parts.__getitem__, files, "t") == whole
    assert total > per_part > 1
    monkeypatch.setattr(si, "MAX_PART_CHUNKS", per_part - 1)
    for call in (
        lambda: lay.merged(parts.__getitem__, files, "step-3/dtensors.json"),
        lambda: lay.resolve(_full(lay), parts.__getitem__, files, "step-3/dtensors.json"),
    ):
        with pytest.raises(IntegrityError, match=r"_index\.rank0000\d\.json: more than \d+ chunks"):
            call()


def test_the_merged_whole_refuses_a_tensor_its_parts_leave_uncovered() -> None:
    lay = _layout_of(REAL)
    parts, files = _parts(lay)
    doc = json.loads(parts[1])
    del doc["chunks"]["rows"]
    parts[1] = json.dumps(doc).encode()
    with pytest.raises(IntegrityError, match=r"t: tensor 'rows': its chunks do not cover"):
        lay.merged(parts.__getitem__, files, "t")
    lay.merged(parts.__getitem__, files, "t", away={1})  # rank 1's node checks its own
    parts, _ = _parts(lay)
    for r, data in parts.items():
        doc = json.loads(data)
        doc["chunks"].pop("bias", None)
        parts[r] = json.dumps(doc).encode()
    with pytest.raises(IntegrityError, match=r"tensor 'bias': 'chunks' must be a non-empty"):
        lay.merged(parts.__getitem__, files, "t")


def _chunk_of(lay: si.Layout, name: str) -> tuple[int, dict[str, Any]]:
    """The writer of ``name``'s first box, and that chunk's row, as a save writes them."""
    parts, _ = _parts(lay)
    for rank in range(4):
        rows = json.loads(parts[rank])["chunks"].get(name)
        if rows:
            return rank, rows[0]
    raise AssertionError(name)


def _refused(lay: si.Layout, alias: Any, expected: list[str], away: int) -> None:
    """Restore (every target), the merged whole, and a node's share (``away`` on another
    node) all refuse the index, naming the file and both byte ranges."""
    parts, files = _parts(lay, alias)
    calls = [
        lambda: lay.resolve(_full(lay), parts.__getitem__, files, "step-2/dtensors.json"),
        lambda: lay.merged(parts.__getitem__, files, "step-2/dtensors.json"),
        lambda: lay.merged(parts.__getitem__, files, "step-2/dtensors.json", away={away}),
    ]
    for call in calls:
        with pytest.raises(IntegrityError) as ei:
            call()
        msg = str(ei.value)
        assert msg.startswith("step-2/dtensors.json: "), msg
        assert "the chunk index is corrupt or hostile" in msg
        for e in expected:
            assert e in msg, msg


def test_a_chunk_in_another_ranks_file_is_refused() -> None:
    """Rank 1's part points its box of 'rows' at rank 0's bytes (the right size, its CRCs
    copied). A rank restoring rows 10..20 reads rank 1's part alone: it found no overlap
    there and loaded rank 0's rows as its own, with no error (found by review)."""
    lay = _layout_of(REAL)
    writer, row = _chunk_of(lay, "rows")
    assert writer == 0
    parts, files = _parts(
        lay, lambda name, offsets, w: (0, row["start"]) if (name, w) == ("rows", 1) else None
    )
    at = "step-2/dtensors.json"
    calls = [
        lambda: lay.resolve({"rows": ((10, 0), (20, 6))}, parts.__getitem__, files, at),
        lambda: lay.resolve(_full(lay), parts.__getitem__, files, at),
        lambda: lay.merged(parts.__getitem__, files, at),
        lambda: lay.merged(parts.__getitem__, files, at, away={3}),
    ]
    for call in calls:
        with pytest.raises(IntegrityError) as ei:
            call()
        assert str(ei.value) == (
            f"{at}/_index.rank00001.json: 'rows' chunk 0 lies in _shards.rank00000.safetensors, "
            "which rank 1 did not write; the index part is forged or not this save's"
        )


def test_a_mesh_of_one_writer_whose_boxes_share_bytes_is_refused() -> None:
    """A hostile layout: a mesh whose stride is 0 makes rank 0 the writer of all 4 boxes,
    and its part points all of them at the same 240 bytes."""
    lay = _layout_of({"rows": ((40, 6), "S(0)")}, {"shape": [4], "start": 0, "strides": [0]})
    _refused(
        lay,
        lambda name, offsets, writer: (0, 64),
        ["_shards.rank00000.safetensors: bytes [64, 304) and [64, 304)"],
        away=3,
    )


def test_chunks_of_two_tensors_that_share_bytes_are_refused() -> None:
    """The writer of 'bias' points its box of 'cols' 12 bytes into the bias's 24."""
    lay = _layout_of(REAL)
    writer, row = _chunk_of(lay, "bias")
    lo = row["start"]
    _refused(
        lay,
        lambda name, offsets, w: (writer, lo + 12) if (name, w) == ("cols", writer) else None,
        [
            f"of 'bias' and chunk [0, {10 * writer}] of 'cols' overlap in "
            f"_shards.rank{writer:05d}.safetensors: bytes [{lo}, {lo + 24}) and "
            f"[{lo + 12}, {lo + 252})"
        ],
        away=(writer + 1) % 4,
    )


class _RankMesh:
    """What ``_mesh_spec`` reads of a DeviceMesh: the tensor of its ranks."""

    def __init__(self, ranks: list[Any]) -> None:
        import torch

        self.mesh = torch.tensor(ranks)


@pytest.mark.parametrize(
    "ranks",
    [
        [0, 1, 2, 3],
        [1, 0],
        [3, 2, 1, 0],
        [[0, 1], [2, 3]],
        [[2, 3], [0, 1]],  # a root whose rank list runs downwards along dim 0
        [[1, 0], [3, 2]],
        [[3, 1], [2, 0]],
        [[0, 2], [1, 3]],
        [0, 2, 1, 3],  # not affine
    ],
)
def test_every_mesh_is_written_as_readers_take_it(ranks: list[Any]) -> None:
    """A mesh whose ranks run downwards (``DeviceMesh("cpu", [1, 0])``) was written with a
    stride of -1, which readers refuse: the step committed and nothing read it."""
    import torch

    spec = si._mesh_spec(_RankMesh(ranks))
    checked = si._check_mesh(json.loads(json.dumps(spec)), "mesh 0")
    flat = torch.tensor(ranks).reshape(-1).tolist()
    shape = checked["shape"]
    for i, coord in enumerate(itertools.product(*(range(n) for n in shape))):
        if "ranks" in checked:
            got = checked["ranks"][i]
        else:
            got = checked["start"] + sum(
                c * s for c, s in zip(coord, checked["strides"], strict=True)
            )
        assert got == flat[i], (coord, spec)


def test_a_layout_no_reader_takes_is_never_committed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 reads the split index back as a reader will, once per layout, before the step
    can commit: a layout the readers refuse fails the save (CommitError) instead."""
    from ckptstore.errors import CommitError
    from ckptstore.save import plan as save_plan

    bad = json.dumps(
        {
            "ckptstore_chunks": si.SPLIT_FORMAT,
            "block": BLOCK,
            "meshes": [{"shape": [2], "start": 1, "strides": [-1]}],
            "tensors": {},
        }
    ).encode()
    monkeypatch.setattr(si, "global_bytes", lambda flat: bad)
    md: dict[str, Any] = {"meta": None, "global": None, "strided": False}
    with pytest.raises(CommitError, match="strides must hold integers") as e:
        save_plan._describe(md, {}, True)
    assert "nothing was committed" in str(e.value)
    assert md["meta"] is None  # not described: the writes that wait for it fail the save

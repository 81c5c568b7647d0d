"""The save side of ckptstore.sharded.plan: shard file layout, parts, and the memoized DCP plan.

Multi-rank behaviour (plans over several ranks, restores on other world sizes) is in
``tests/multirank/test_dtensor.py``; here one process, real files, and a one-rank gloo
group where DTensors are needed.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckptstore import StateMismatchError
from ckptstore.codec import safetensors as st
from ckptstore.integrity import crc32c_of
from ckptstore.sharded import plan as sharding
from ckptstore.sharded.chunks import BLOCK, block_crcs
from ckptstore.storage import open_storage

pytestmark = pytest.mark.timeout(60)

MB = 1 << 20


def _misaligned(nbytes: int, shift: int) -> torch.Tensor:
    """A float32 tensor of ``nbytes`` whose data starts ``shift`` bytes past a 4 KiB page."""
    base = torch.empty(nbytes + 8192, dtype=torch.uint8)
    skip = (shift - base.data_ptr()) % 4096
    t = base[skip : skip + nbytes].view(torch.float32)
    t.copy_(torch.arange(t.numel(), dtype=torch.float32) * (shift + 1))
    assert t.data_ptr() % 4096 == shift
    return t


def test_large_tensors_line_up_with_their_memory_and_the_file_stays_standard(
    tmp_path: Path,
) -> None:
    tensors = {
        "a@0": _misaligned(2 * MB, 64),
        "b@0": _misaligned(3 * MB, 1344),
        "c@0,0": _misaligned(MB + 4096, 0),
        "small@0": torch.arange(10, dtype=torch.float64),  # packed, no alignment needed
        "step@": torch.tensor(3.0),
    }
    head, order, starts = sharding.shard_layout(tensors)
    # Every tensor of at least ZERO_COPY_MIN bytes starts where its memory does, modulo the
    # O_DIRECT block: the writer sends it to the disk without copying it.
    for k in ("a@0", "b@0", "c@0,0"):
        assert (starts[k] - tensors[k].data_ptr()) % 4096 == 0, k
    pads = [k for k, _ in order if k.startswith("_pad.")]
    assert pads, "misaligned tensors need padding"
    assert all("@" not in k for k in pads)  # never a chunk key
    assert sum(t.numel() for k, t in order if k in pads) < 4096 * len(pads)
    path = tmp_path / "shard.safetensors"
    with open(path, "wb") as f:
        st.write_laid_out(f, head, order)
    # A standard file: the safetensors library reads it, padding included.
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors) | set(pads)
    for k, t in tensors.items():
        assert torch.equal(loaded[k], t), k
    data = path.read_bytes()
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        assert data[starts[k] : starts[k] + n] == st.tensor_bytes(t).tobytes(), k


def test_small_files_are_laid_out_as_build_header_does() -> None:
    tensors = {"w@0,0": torch.ones(3, 5), "b@0": torch.zeros(7, dtype=torch.bfloat16)}
    head, order, starts = sharding.shard_layout(tensors)
    want_head, want_order = st.build_header(tensors)
    assert head == want_head
    assert [k for k, _ in order] == [k for k, _ in want_order]
    assert starts == sharding.box_file_offsets(tensors)


def test_tensors_already_lined_up_get_no_padding() -> None:
    # What async staging hands the writer: memory congruent to the standard layout.
    plain = {"a@0": torch.empty(2 * MB // 4), "b@0": torch.empty(3 * MB // 4)}
    offsets = sharding.box_file_offsets(plain)
    staged = {k: _misaligned(t.numel() * 4, offsets[k] % 4096) for k, t in plain.items()}
    head, order, _ = sharding.shard_layout(staged)
    assert [k for k, _ in order] == [k for k, _ in st.build_header(staged)[1]]
    assert head == st.build_header(staged)[0]


def test_split_parts_balances_bytes_and_keeps_small_ranks_in_one_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    small = {f"t{i}@0": torch.empty(10) for i in range(5)}
    assert sharding.split_parts(small) == [small]
    monkeypatch.setattr(sharding, "PART_BYTES", 1000)
    sizes = [4000, 3000, 2000, 1000, 1000, 500, 500]
    many = {f"t{i}@0": torch.empty(n // 4) for i, n in enumerate(sizes)}
    parts = sharding.split_parts(many)
    assert len(parts) == sharding.MAX_PARTS
    assert sorted(k for p in parts for k in p) == sorted(many)
    loads = [sum(t.numel() * 4 for t in p.values()) for p in parts]
    assert sorted(loads, reverse=True) == [4000, 3000, 2500, 2500]  # largest first, lightest part
    assert sum(loads) == sum(sizes)


def test_write_shards_spreads_a_large_rank_over_files_with_correct_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sharding, "PART_BYTES", 2 * MB)
    storage = open_storage(tmp_path / "store")
    storage.check_root()
    pending = storage.begin(5)
    boxes = {
        f"w{i}@{i * 8},0": (f"w{i}", (i * 8, 0), _misaligned((i + 1) * MB, 64 * i))
        for i in range(4)
    }
    wrote: list[str] = []
    table = sharding.write_shards(pending, 3, boxes, {}, also=lambda: wrote.append("plain"))
    assert wrote == ["plain"]  # rank 0's plain part ran alongside
    files = sorted(pending.files)
    assert files == [
        "_shards.rank00003.1.safetensors",
        "_shards.rank00003.2.safetensors",
        "_shards.rank00003.3.safetensors",
        "_shards.rank00003.safetensors",
    ]
    assert all(pending.files[f].rank == 3 for f in files)
    root = tmp_path / "store" / pending.dirname
    for f in files:  # every file durable on disk, with the size and CRC32C recorded
        data = (root / f).read_bytes()
        assert (len(data), crc32c_of(data)) == (pending.files[f].bytes, pending.files[f].crc32c)
    assert len(table["chunks"]) == 4
    for name, offsets, chunk in table["chunks"]:
        t = boxes[f"{name}@{offsets[0]},0"][2]
        data = (root / chunk.file).read_bytes()[chunk.start : chunk.start + chunk.nbytes]
        assert data == st.tensor_bytes(t).tobytes()
        assert list(chunk.crcs) == block_crcs(data, BLOCK)
        assert chunk.sizes == tuple(t.shape)
    storage.abort(pending)


# ---- the memoized save plan (DTensors on a one-rank mesh) ------------------------------------


def test_save_plans_equal_dcps_item_for_item(mesh: object) -> None:
    from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
    from torch.distributed.tensor import DTensor, Replicate, Shard

    flat: dict[str, object] = {}
    for layer in range(3):  # repeated layouts, as a model's layers and AdamW's moments
        for moment in ("w", "exp_avg", "exp_avg_sq"):
            t = DTensor.from_local(torch.randn(4, 6), mesh, [Shard(0)])  # type: ignore[arg-type]
            if moment == "w":
                t = torch.nn.Parameter(t)
            flat[f"h.{layer}.{moment}"] = t
    flat["bias"] = DTensor.from_local(torch.randn(6), mesh, [Replicate()])  # type: ignore[arg-type]
    flat["half"] = DTensor.from_local(
        torch.randn(4, 6).bfloat16(),
        mesh,  # type: ignore[arg-type]
        [Shard(1)],
    )
    for leader in (True, False):
        ours = sharding.save_plans(flat, leader)
        theirs = create_default_local_save_plan(dict(flat), leader)
        assert len(ours.items) == len(theirs.items) == len(flat)
        for a, b in zip(ours.items, theirs.items, strict=True):
            assert a.index == b.index
            assert a.type == b.type
            assert dataclasses.asdict(a.tensor_data) == dataclasses.asdict(b.tensor_data)


def test_split_padded_shards_save_verify_load_and_restore(
    mesh: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parts and padding end to end: the manager writes them, verify and restore read them."""
    from torch.distributed.tensor import DTensor, Shard

    from ckptstore import CheckpointManager

    monkeypatch.setattr(sharding, "PART_BYTES", 100 << 10)
    monkeypatch.setattr(sharding, "ZERO_COPY_MIN", 64 << 10)
    gen = torch.Generator().manual_seed(3)

    def dt(*shape: int) -> object:
        return DTensor.from_local(torch.randn(*shape, generator=gen), mesh, [Shard(0)])  # type: ignore[arg-type]

    state = {"model": {f"w{i}": dt(64 + i, 300 + 7 * i) for i in range(6)}, "step": 4}
    with CheckpointManager(tmp_path / "store") as mgr:
        mgr.save(4, state)
        m = mgr.manifest(4)
        shards = sorted(n for n in m.files if n.startswith("_shards."))
        assert len(shards) > 1  # split over parts
        assert mgr.verify(4, deep=True).ok
        step_dir = tmp_path / "store" / "step-000000000004"
        pads = [k for n in shards for k in load_file(str(step_dir / n)) if k.startswith("_pad.")]
        assert pads  # and padded
        loaded = mgr.load(4)
        for k, v in state["model"].items():
            assert torch.equal(loaded["model"][k], v.full_tensor()), k  # type: ignore[attr-defined]
        target = {"model": {k: dt(*v.shape) for k, v in state["model"].items()}, "step": 0}  # type: ignore[attr-defined]
        assert mgr.restore(target) == 4
        for k, v in state["model"].items():
            assert torch.equal(target["model"][k].to_local(), v.to_local()), k  # type: ignore[attr-defined]


def test_index_from_packed_tables_is_byte_identical_and_refuses_a_missing_chunk(
    mesh: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What rank 0 writes from the ranks' packed tables is the index build_index makes."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from ckptstore.errors import CommitError

    monkeypatch.setattr(sharding, "PART_BYTES", 32 << 10)
    flat: dict[str, object] = {
        "model/w": torch.nn.Parameter(
            DTensor.from_local(torch.randn(64, 300), mesh, [Shard(0)])  # type: ignore[arg-type]
        ),
        "model/b": DTensor.from_local(torch.randn(300), mesh, [Replicate()]),  # type: ignore[arg-type]
        "state/model.w/exp_avg": DTensor.from_local(
            torch.randn(64, 300).bfloat16(),
            mesh,  # type: ignore[arg-type]
            [Shard(1)],
        ),
    }
    plan = sharding.dedup_local(sharding.save_plans(flat, True), flat)
    meta = sharding.tensor_meta(flat)
    assert meta["state/model.w/exp_avg"] == ("bfloat16", (64, 300))
    boxes = sharding.local_boxes(plan, flat)
    storage = open_storage(tmp_path / "store")
    storage.check_root()
    pending = storage.begin(1)
    table = sharding.write_shards(pending, 0, boxes, sharding.layouts(flat))
    assert len({c.file for _, _, c in table["chunks"]}) > 1  # split over part files
    packed = sharding.pack_table(table)
    assert isinstance(packed, bytes)
    got = sharding.index_bytes(meta, [packed])
    assert got == sharding.build_index(meta, [table]).to_bytes()
    index = sharding.check_cover(got, pending.files, "test")
    assert index.tensors["state/model.w/exp_avg"].placements == ("S(1)",)
    # A box no rank reported: the index has a gap, and rank 0 must not commit.
    doc = json.loads(packed)
    doc["chunks"] = [c for c in doc["chunks"] if c[0] != "model/b"]
    holed = sharding.index_bytes(meta, [json.dumps(doc).encode()])
    with pytest.raises(CommitError, match=r"do not make a whole checkpoint.*'model/b'"):
        sharding.check_cover(holed, pending.files, "test")
    storage.abort(pending)


def test_layout_key_sees_every_input_of_the_plan(mesh: object) -> None:
    """A cached plan is reused only for an equal key: any change of what the plan depends on
    (shape, dtype, placement, grad, the mesh's ranks) gives another key, while a new object
    of the same layout (the next step's tensors) gives the same one."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def key(t: torch.Tensor, m: object = mesh, placement: object = None) -> tuple[object, ...]:
        d = DTensor.from_local(t, m, [placement or Shard(0)])  # type: ignore[arg-type]
        return sharding.layout_key({"w": d})

    base = key(torch.zeros(4, 6))
    assert key(torch.ones(4, 6)) == base  # other values, other objects: the same plan
    assert key(torch.zeros(4, 7)) != base
    assert key(torch.zeros(4, 6, dtype=torch.float64)) != base
    assert key(torch.zeros(4, 6).requires_grad_()) != base
    assert key(torch.zeros(4, 6), placement=Replicate()) != base
    named = DeviceMesh("cpu", [0], mesh_dim_names=("dp",))
    assert key(torch.zeros(4, 6), m=named) != base  # not the mesh object's id: its ranks
    assert key(torch.zeros(4, 6), m=DeviceMesh("cpu", [0], mesh_dim_names=("dp",))) == key(
        torch.zeros(4, 6), m=named
    )


def test_a_sharded_save_reports_where_its_time_went(mesh: object, tmp_path: Path) -> None:
    """last_save_phases / last_save_cpu: every phase of a DTensor save, adding up to no more
    than the save's own time."""
    import time

    from torch.distributed.tensor import DTensor, Shard

    from ckptstore import CheckpointManager

    w = DTensor.from_local(torch.randn(64, 32), mesh, [Shard(0)])  # type: ignore[arg-type]
    with CheckpointManager(tmp_path / "store") as mgr:
        assert mgr.last_save_phases == {}
        t0 = time.perf_counter()
        mgr.save(1, {"model": {"w": w}, "step": 1})
        took = time.perf_counter() - t0
        phases, cpu = mgr.last_save_phases, mgr.last_save_cpu
        assert {"encode", "plan", "x:plan", "write", "index", "commit"} <= set(phases)
        assert set(cpu) == set(phases)
        assert all(v >= 0 for v in (*phases.values(), *cpu.values()))
        assert sum(phases.values()) <= took


def test_a_restore_reports_where_its_time_went(mesh: object, tmp_path: Path) -> None:
    """last_restore_phases / last_restore_cpu: a DTensor restore's planning and reading
    apart, a plain one's decode; each adding up to no more than the restore's own time."""
    import time

    from torch.distributed.tensor import DTensor, Shard

    from ckptstore import CheckpointManager

    w = DTensor.from_local(torch.randn(64, 32), mesh, [Shard(0)])  # type: ignore[arg-type]
    with CheckpointManager(tmp_path / "store") as mgr:
        mgr.save(1, {"model": {"w": w}, "step": 1})
        assert mgr.last_restore_phases == {}
        target = {"model": {"w": DTensor.from_local(torch.zeros(64, 32), mesh, [Shard(0)])}}
        t0 = time.perf_counter()
        assert mgr.restore(target, step=1) == 1
        took = time.perf_counter() - t0
        assert torch.equal(target["model"]["w"].to_local(), w.to_local())
        phases, cpu = mgr.last_restore_phases, mgr.last_restore_cpu
        want = {"x:enter", "x:choose", "state", "x:check", "plan", "read", "decode", "x:load"}
        assert want | {"apply", "x:applied"} <= set(phases), phases
        assert "fetch" not in phases  # no replica, no broadcast
        assert set(cpu) == set(phases)
        assert all(v >= 0 for v in (*phases.values(), *cpu.values()))
        assert sum(phases.values()) <= took
    plain = tmp_path / "plain"
    with CheckpointManager(plain) as mgr:
        mgr.save(1, {"x": torch.arange(4.0)})
        got = {"x": torch.zeros(4)}
        assert mgr.resume(got) == 2
        assert torch.equal(got["x"], torch.arange(4.0))
        assert {"state", "decode", "apply"} <= set(mgr.last_restore_phases)
        assert "plan" not in mgr.last_restore_phases  # no DTensor leaf
        assert {"x:resume", "x:list"} <= set(mgr.last_restore_phases)  # the resume's own
        # A restore that fails keeps the last one's phases: they describe a restore that ran.
        before = dict(mgr.last_restore_phases)
        with pytest.raises(StateMismatchError):
            mgr.restore({"y": torch.zeros(1)})
        assert mgr.last_restore_phases == before
        # A step that fails its checks: its work is "failed", not a wait in an exchange.
        mgr.save(2, {"x": torch.arange(4.0) + 1})
        step2 = plain / "step-000000000002"
        payload = next(p for p in step2.iterdir() if p.name.endswith(".safetensors"))
        data = bytearray(payload.read_bytes())
        data[-1] ^= 0xFF
        payload.write_bytes(bytes(data))
        assert mgr.restore(got) == 1
        assert {"failed", "state", "decode", "apply"} <= set(mgr.last_restore_phases)
    with CheckpointManager(tmp_path / "empty") as mgr:
        assert mgr.resume({"x": torch.zeros(4)}) == 0
        assert set(mgr.last_restore_phases) == {"x:resume", "x:list"}
    # With a replica, bringing the step into the local store is "fetch".
    with CheckpointManager(tmp_path / "local", replica=str(tmp_path / "replica")) as mgr:
        mgr.save(1, {"x": torch.arange(4.0)})
        mgr.wait()
        got = {"x": torch.zeros(4)}
        assert mgr.restore(got) == 1
        assert torch.equal(got["x"], torch.arange(4.0))
        assert "fetch" in mgr.last_restore_phases


class _Mesh:
    """The two things writes_here asks of a device mesh: its shape and this rank's place."""

    def __init__(self, shape: tuple[int, ...], coordinate: list[int] | None) -> None:
        self.shape = shape
        self._coordinate = coordinate

    def get_coordinate(self) -> list[int] | None:
        return self._coordinate


class _Box:
    def __init__(self, mesh: _Mesh, placements: tuple[object, ...]) -> None:
        self.device_mesh = mesh
        self.placements = placements


@pytest.mark.parametrize(
    ("shape", "kinds"),
    [
        ((8,), "R"),  # a replicated DTensor over 8 ranks (TP's norm weights)
        ((4, 2), "RS"),  # HSDP: 4 replicas of a 2-way shard
        ((2, 3, 2), "RSR"),  # replicas on two mesh dims
        ((6,), "S"),  # FSDP: every rank writes its own box
    ],
)
def test_every_box_is_written_by_exactly_one_of_its_holders(
    shape: tuple[int, ...], kinds: str
) -> None:
    """The local rule writes each box once, and spreads a model's boxes over the replicas."""
    import itertools

    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(Replicate() if k == "R" else Shard(0) for k in kinds)
    writers: dict[tuple[str, tuple[int, ...]], list[tuple[int, ...]]] = {}
    names = [f"layers.{i}.w" for i in range(64)]
    for coord in itertools.product(*(range(n) for n in shape)):
        box = tuple(c for c, k in zip(coord, kinds, strict=True) if k == "S")
        for name in names:
            t = _Box(_Mesh(shape, list(coord)), placements)
            if sharding.writes_here(t, name):
                writers.setdefault((name, box), []).append(coord)
    boxes = {
        (n, b)
        for n in names
        for b in itertools.product(
            *(range(s) for s, k in zip(shape, kinds, strict=True) if k == "S")
        )
    }
    assert set(writers) == boxes  # every box has a writer
    assert all(len(w) == 1 for w in writers.values())  # and only one
    per_rank: dict[tuple[int, ...], int] = {}
    for (w,) in writers.values():
        per_rank[w] = per_rank.get(w, 0) + 1
    replicas = 1
    for n, k in zip(shape, kinds, strict=True):
        replicas *= n if k == "R" else 1
    fair = len(names) / replicas
    # Spread: no holder writes more than twice its share, none is left idle.
    assert len(per_rank) == math.prod(shape), per_rank
    assert max(per_rank.values()) <= 2 * fair + 1, per_rank
    assert sharding.writes_here(_Box(_Mesh(shape, None), placements), "w") is ("R" not in kinds)


class _Mesh:
    """What shard_is_box asks of a device mesh: its shape and this rank's coordinate."""

    def __init__(self, shape: tuple[int, ...], coord: tuple[int, ...] | None) -> None:
        self.shape, self.coord = shape, coord

    def size(self, dim: int) -> int:
        return self.shape[dim]

    def get_coordinate(self) -> tuple[int, ...] | None:
        return self.coord


@pytest.mark.parametrize(
    ("order", "rows", "boxes"),
    [
        # FSDP2 over TP: (_StridedShard(0, 2), Shard(0)): every part one block of rows.
        ("fsdp_tp", 8, [True, True, True, True]),
        ("fsdp_tp", 7, [True, True, True, True]),  # uneven: still boxes
        # (Shard(0), _StridedShard(0, 2)): rank (0, 0) holds rows 0 and 2 of 8.
        ("strided_last", 8, [False, False, False, False]),
        ("plain", 7, [True, True, True, True]),
    ],
)
def test_shard_is_box_knows_a_strided_part_from_a_box(
    order: str, rows: int, boxes: list[bool]
) -> None:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from ckptstore.state.redistribute import shard_is_box

    placements = {
        "fsdp_tp": [_StridedShard(0, split_factor=2), Shard(0)],
        "strided_last": [Shard(0), _StridedShard(0, split_factor=2)],
        "plain": [Shard(0), Shard(1)],
    }[order]
    got = [
        shard_is_box((rows, 3), _Mesh((2, 2), (i, j)), placements) for i in (0, 1) for j in (0, 1)
    ]
    assert got == boxes
    assert shard_is_box((rows, 3), _Mesh((2, 2), None), placements)  # outside: holds nothing


def test_fsdp2_over_tp_is_known_a_box_without_walking_its_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``_nested`` answers FSDP2 over TP in O(1) where the TP size divides the rows; on
    random layouts it never calls a part a box that walking DTensor's rows does not."""
    import itertools
    import random

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from ckptstore.state import redistribute

    rnd = random.Random(5)
    known = 0
    for _ in range(400):
        nd = rnd.randint(1, 2)
        shape = tuple(rnd.randint(0, 17) for _ in range(nd))
        mesh = tuple(rnd.randint(1, 4) for _ in range(rnd.randint(2, 3)))
        objs: list[Any] = [
            Replicate() if rnd.random() < 0.4 else Shard(rnd.randrange(nd)) for _ in mesh
        ]
        a, b = sorted(rnd.sample(range(len(mesh)), 2))
        d = rnd.randrange(nd)
        if rnd.random() < 0.8:  # FSDP2 over TP's order; else the strided shard last
            objs[a] = _StridedShard(d, split_factor=mesh[b] if rnd.random() < 0.9 else 2)
            objs[b] = Shard(d)
        else:
            objs[a], objs[b] = Shard(d), _StridedShard(d, split_factor=mesh[a])
        fast = redistribute._nested(shape, _Mesh(mesh, None), objs, _StridedShard)
        with monkeypatch.context() as m:
            m.setattr(redistribute, "_nested", lambda *_: False)
            walked = [
                redistribute.shard_is_box(shape, _Mesh(mesh, c), objs)
                for c in itertools.product(*(range(n) for n in mesh))
            ]
        if fast:
            known += 1
            assert all(walked), (shape, mesh, [str(p) for p in objs])
    assert known > 100

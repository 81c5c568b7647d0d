"""The golden DTensor checkpoints: they load exactly, and today's bytes are format 4's and 5's.

``tests/golden/v2-dtensor`` (format 2: every chunk in ``dtensors.json``),
``tests/golden/v3-dtensor`` (format 3: the split index, each rank's chunks in its
``_index.rankNNNNN.json``) and ``tests/golden/v4-dtensor`` (format 4: each rank's files listed
in ``_ranks.jsonl``, not in the manifest) and ``tests/golden/v4-dtensor-b256k`` (format 4 with
the chunk CRC blocks of 256 KiB that saves write since; before, 4 MiB) were each written once by
the ``dtensor_scenarios:golden_save`` scenario on 2 ranks
(``launch("dtensor_scenarios:golden_save", 2, dir)``, then its step directory copied). The
expected values are written out by hand, and all must keep loading; saving the same state
again must reproduce the newest one's shard files, ``state.json``, index, parts and rank table
byte for byte, so the format of sharded checkpoints cannot drift by accident.
``tests/golden/v5-dtensor`` (format 5: FSDP2 over TP's ``_StridedShard`` spelled in the
split index) is checked the same way, on 4 ranks of a 2x2 mesh.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptstore import CheckpointManager
from tests.multirank.launch import describe, launch

GOLDENS = Path(__file__).parent.parent / "golden"
GOLDEN = GOLDENS / "v4-dtensor-b256k"
STEP = "step-000000000007"
PAYLOADS = [
    "_shards.rank00000.safetensors",
    "_shards.rank00001.safetensors",
    "dtensors.json",
    "model.safetensors",
    "state.json",
]
PARTS = ["_index.rank00000.json", "_index.rank00001.json"]
TABLE = "_ranks.jsonl"


@pytest.fixture(
    params=["v2-dtensor", "v3-dtensor", "v4-dtensor", "v4-dtensor-b256k"],
    ids=["v2", "v3", "v4", "v4-b256k"],
)
def golden(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    shutil.copytree(GOLDENS / request.param, tmp_path / request.param)
    return tmp_path / request.param


def _version(golden: Path) -> int:
    return int(json.loads((golden / STEP / "manifest.json").read_text())["format_version"])


def test_manifest_and_deep_verify(golden: Path) -> None:
    mgr = CheckpointManager(golden)
    m = mgr.manifest()
    v = _version(golden)
    assert (m.step, m.format_version, m.world_size) == (7, v, 2)
    assert m.sharding_kind == "dtensor"
    extra = {2: [], 3: PARTS, 4: [*PARTS, TABLE]}[v]
    assert sorted(m.files) == sorted(PAYLOADS + extra)
    assert m.files["_shards.rank00001.safetensors"].rank == 1
    assert m.files["state.json"].rank is None
    if v >= 3:
        assert m.files["_index.rank00001.json"].rank == 1
    if v == 4:  # the manifest itself lists the files of no rank; the table lists the others
        on_disk = json.loads((golden / STEP / "manifest.json").read_text())
        assert sorted(on_disk["files"]) == sorted([*PAYLOADS[2:], TABLE])
        assert on_disk["rank_table"] == {"count": 2, "width": 258}
    assert dict(m.metadata) == {"note": f"golden v{v}"}
    # Both chunk CRC block sizes load: 4 MiB (older stores) and 256 KiB (saved today).
    block = json.loads((golden / STEP / "dtensors.json").read_text())["block"]
    assert block == (256 << 10 if golden.name == "v4-dtensor-b256k" else 4 << 20)
    report = mgr.verify(deep=True)
    assert report.ok, report.problems
    assert report.files == len(m.files)


def test_loads_every_value_exactly(golden: Path) -> None:
    state = CheckpointManager(golden).load()
    assert list(state) == ["model", "step"]
    assert state["step"] == 7
    model = state["model"]
    assert list(model) == ["w", "b", "cols", "scale"]
    assert model["w"].dtype == torch.float32
    assert model["w"].tolist() == [[(3 * r + c) / 4 for c in range(3)] for r in range(7)]
    assert model["b"].dtype == torch.bfloat16
    assert model["b"].tolist() == [1.5, -2.0, 0.25]
    assert model["cols"].dtype == torch.int64
    assert model["cols"].tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert model["scale"].item() == 0.5


def test_restores_into_plain_targets_and_payloads_are_standard(golden: Path) -> None:
    target = {"model": {"w": torch.zeros(7, 3)}, "step": 0}
    CheckpointManager(golden).restore(target, strict=False)
    assert target["model"]["cols"][1, 4].item() == 9
    part = load_file(str(golden / STEP / "_shards.rank00001.safetensors"))
    # rank 1 holds rows 4..6 of w, columns 3..4 of cols, and (deduplicated) all of b.
    assert sorted(part) == ["model/b@0", "model/cols@0,3", "model/w@4,0"]
    assert part["model/w@4,0"].tolist() == [[(3 * r + c) / 4 for c in range(3)] for r in (4, 5, 6)]


@pytest.mark.timeout(180)
def test_saving_today_reproduces_the_golden_bytes(tmp_path: Path) -> None:
    results = launch("dtensor_scenarios:golden_save", 2, tmp_path, timeout=150)
    assert all(r.ok for r in results), describe(results)
    for name in [*PAYLOADS, *PARTS, TABLE]:
        got = (tmp_path / "store" / STEP / name).read_bytes()
        assert got == (GOLDEN / STEP / name).read_bytes(), name
    new = json.loads((tmp_path / "store" / STEP / "manifest.json").read_text())
    old = json.loads((GOLDEN / STEP / "manifest.json").read_text())
    keys = (
        "files",
        "sharding",
        "format_version",
        "world_size",
        "metrics",
        "metadata",
        "rank_table",
    )
    for key in keys:
        assert new[key] == old[key], key


def test_a_load_reads_dim0_shards_straight_into_its_tensors(
    golden: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A Shard(0) chunk is one byte range of its file and one of the full tensor: it is read
    # into the tensor's memory and checked there; a Shard(1) one goes through a buffer.
    from ckptstore.storage.ranges import RangeReader

    paths: list[tuple[str, int]] = []
    real_read, real_into = RangeReader.read, RangeReader.read_into

    def read(self: RangeReader, name: str, offset: int, length: int) -> bytearray:
        paths.append(("buffer", length))
        return real_read(self, name, offset, length)

    def read_into(self: RangeReader, name: str, offset: int, bufs: list[memoryview]) -> None:
        paths.append(("in place", sum(len(b) for b in bufs)))
        real_into(self, name, offset, bufs)

    monkeypatch.setattr(RangeReader, "read", read)
    monkeypatch.setattr(RangeReader, "read_into", read_into)
    state = CheckpointManager(golden).load()
    assert state["model"]["w"].tolist() == [[(3 * r + c) / 4 for c in range(3)] for r in range(7)]
    kinds = {k for k, _ in paths}
    assert kinds == {"in place", "buffer"}, paths
    # w (7 x 3 float32, Shard(0) over 2 ranks): its two chunks, 4 and 3 rows, land in place.
    assert ("in place", 4 * 3 * 4) in paths
    assert ("in place", 3 * 3 * 4) in paths


# ---- format 5: FSDP2 over TP's _StridedShard in the split index -----------------------------

#: ``tests/golden/v5-dtensor``: written once by ``dtensor_scenarios:golden_save_strided`` on 4
#: ranks of a 2x2 ``("dp", "tp")`` mesh (``launch(..., 4, dir)``, its step directory copied).
GOLDEN5 = GOLDENS / "v5-dtensor"
UP = [[(3 * r + c) / 4 for c in range(3)] for r in range(10)]


def test_v5_strided_golden_loads_verifies_and_says_where_each_box_is(tmp_path: Path) -> None:
    store = tmp_path / "v5"
    shutil.copytree(GOLDEN5, store)
    mgr = CheckpointManager(store)
    m = mgr.manifest()
    assert (m.step, m.format_version, m.world_size) == (7, 5, 4)
    layout = json.loads((store / STEP / "dtensors.json").read_text())
    assert layout["tensors"]["model/up"]["placements"] == ["_S(0, 2)", "S(0)"]
    report = mgr.verify(deep=True)
    assert report.ok, report.problems
    state = mgr.load()
    assert state["model"]["up"].tolist() == UP
    assert state["model"]["down"].tolist() == [list(range(5 * r, 5 * r + 5)) for r in range(4)]
    assert state["model"]["bias"].tolist() == [1.5, -2.0, 0.25, 8.0]
    assert state["model"]["scale"].item() == 0.5
    # Rank (i, j) of the 2x2 mesh wrote part i of TP half j of up's 10 rows: the TP split
    # first (rows 0-4, 5-9), then "dp" (3 + 2 rows), as FSDP2 over TP lays it out.
    up = {}
    for rank in range(4):
        part = load_file(str(store / STEP / f"_shards.rank{rank:05d}.safetensors"))
        up.update({k: v for k, v in part.items() if k.startswith("model/up@")})
    assert sorted(up) == ["model/up@0,0", "model/up@3,0", "model/up@5,0", "model/up@8,0"]
    for key, rows in up.items():
        first = int(key.split("@")[1].split(",")[0])
        assert rows.tolist() == UP[first : first + len(rows)], key
    target = {"model": {"up": torch.zeros(10, 3)}, "step": 0}
    mgr.restore(target, strict=False)
    assert target["model"]["up"].tolist() == UP


@pytest.mark.timeout(180)
def test_saving_strided_state_today_reproduces_the_v5_golden_bytes(tmp_path: Path) -> None:
    results = launch("dtensor_scenarios:golden_save_strided", 4, tmp_path, timeout=150)
    assert all(r.ok for r in results), describe(results)
    names = sorted(p.name for p in (GOLDEN5 / STEP).iterdir())
    assert names == sorted(p.name for p in (tmp_path / "store" / STEP).iterdir())
    for name in names:
        if name == "manifest.json":
            continue
        got = (tmp_path / "store" / STEP / name).read_bytes()
        assert got == (GOLDEN5 / STEP / name).read_bytes(), name
    new = json.loads((tmp_path / "store" / STEP / "manifest.json").read_text())
    old = json.loads((GOLDEN5 / STEP / "manifest.json").read_text())
    for key in ("files", "sharding", "format_version", "world_size", "metrics", "metadata"):
        assert new[key] == old[key], key
    assert new["rank_table"] == old["rank_table"] == {"count": 4, "width": 258}

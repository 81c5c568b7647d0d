"""A hostile chunk index whose chunks share bytes, end to end (issue 24 #7).

A real DTensor checkpoint is saved by one process (a one-rank gloo group), then its index
is rewritten so that the 64 rows of a tensor all point at the bytes of its first row, and
the manifest forged to match: every bound, box size, exact cover and block CRC still holds,
so before the fix ``restore`` and ``load`` returned the first row 64 times (a 42 KB index
over a 1 MiB shard so loaded as a 300 MiB tensor). Both index formats: format 2 lists the
chunks in ``dtensors.json``; format 3 (the split index) in rank 0's part, its layout made
hostile too (a mesh of 64 coordinates whose stride 0 makes rank 0 the writer of all).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import (
    MANIFEST,
    edit_entry,
    index_chunks,
    replace_payload,
    step_dir,
    two_dtensor_steps,
)

from ckptstore import CheckpointManager, IntegrityError
from ckptstore import cli as cli_mod
from ckptstore.integrity import crc32c_of, format_crc
from ckptstore.sharded import split_index

pytestmark = pytest.mark.timeout(120)

NAME = "model/w"
ROWS, COLS = 64, 300


def _rewrite(step: Path, name: str, data: bytes) -> None:
    """Replace an index file and forge its entry to match (in the manifest, or in format 4
    its rank's line of the rank table), as an attacker would."""
    replace_payload(step, name, data)


def _alias_rows(step: Path) -> int:
    """Point every row of ``NAME`` at its first row's bytes; returns the index's format."""
    (chunk,) = index_chunks(step, NAME)
    assert chunk["sizes"] == [ROWS, COLS]
    row_bytes = COLS * 4
    shard = (step / chunk["file"]).read_bytes()
    first = shard[chunk["start"] : chunk["start"] + row_bytes]
    rows = [
        dict(
            chunk,
            offsets=[i, 0],
            sizes=[1, COLS],
            bytes=row_bytes,
            crc32c=[format_crc(crc32c_of(first))],
        )
        for i in range(ROWS)
    ]
    index = json.loads((step / "dtensors.json").read_text())
    if "chunks" in index["tensors"][NAME]:  # format 2: the chunks are in dtensors.json
        index["tensors"][NAME]["chunks"] = rows
        _rewrite(step, "dtensors.json", json.dumps(index).encode())
        return 2
    # Formats 3 and 4: the layout says 64 boxes of one row, all written by rank 0 (stride 0), and
    # rank 0's part lists them.
    mesh_id = index["tensors"][NAME]["mesh_id"]
    index["meshes"].append({"shape": [ROWS], "start": 0, "strides": [0]})
    index["tensors"][NAME].update(mesh=[ROWS], mesh_id=len(index["meshes"]) - 1)
    assert index["meshes"][mesh_id]["shape"] == [1]
    _rewrite(step, "dtensors.json", json.dumps(index).encode())
    part = json.loads((step / split_index.part_file(0)).read_text())
    part["chunks"][NAME] = rows
    _rewrite(step, split_index.part_file(0), json.dumps(part).encode())
    return int(json.loads((step / MANIFEST).read_text())["format_version"])


@pytest.mark.parametrize("fmt", [2, 4])
def test_an_index_whose_chunks_share_bytes_is_refused_and_the_good_step_restores(
    mesh: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: int
) -> None:
    if fmt == 2:  # what a save on sub-meshes writes: every chunk listed in dtensors.json
        monkeypatch.setattr(split_index, "splittable", lambda *_: False)
    root = tmp_path / "store"
    values, state = two_dtensor_steps(mesh, root, 7)
    step2 = root / step_dir(2)
    assert json.loads((step2 / MANIFEST).read_text())["format_version"] == fmt
    assert _alias_rows(step2) == fmt

    expected = [
        f"overlap in {index_chunks(step2, NAME)[0]['file']}: bytes",
        "the chunk index is corrupt or hostile",
    ]
    with CheckpointManager(root) as mgr:
        # An explicit step raises (no replica to fall back on), naming the byte ranges.
        for call in (
            lambda: mgr.load(2),
            lambda: mgr.restore(state(0), step=2),
        ):
            with pytest.raises(IntegrityError) as ei:
                call()
            for e in expected:
                assert e in str(ei.value), str(ei.value)
        report = mgr.verify(2, deep=True)
        assert not report.ok
        assert any(all(e in p for e in expected) for p in report.problems), report.problems
        # The newest step is corrupt: restore() and load() fall back to step 1, whole.
        target = state(0)
        assert mgr.restore(target) == 1
        assert torch.equal(target["model"]["w"].to_local(), values[1])
        assert target["step"] == 1
        loaded = mgr.load()
        assert loaded["step"] == 1
        assert torch.equal(loaded["model"]["w"], values[1])


def _set_shapes(node: Any, name: str, shape: list[int]) -> int:
    """Set the shape of the sharded tensor ``name`` wherever ``state.json`` refers to it."""
    if isinstance(node, list):
        return sum(_set_shapes(x, name, shape) for x in node)
    if not isinstance(node, dict):
        return 0
    if node.get("t") == "dtensor" and node.get("name") == name:
        node["shape"] = shape
        return 1
    return sum(_set_shapes(v, name, shape) for v in node.values())


def _claim_huge(
    mesh: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: int, rows: int = 1 << 40
) -> tuple[Path, torch.Tensor, Path]:
    """Two steps of ``{"model": {"w": w}}``; step 2's index and state.json then say ``w`` is
    ``rows`` rows (2**40: 1.3 PB), its one chunk claiming that box. Returns the store, ``w``
    and step 2's directory."""
    from torch.distributed.tensor import DTensor, Shard

    if fmt == 2:
        monkeypatch.setattr(split_index, "splittable", lambda *_: False)
    w = torch.randn(ROWS, COLS)
    root = tmp_path / "store"
    with CheckpointManager(root) as mgr:
        for s in (1, 2):
            mgr.save(s, {"model": {"w": DTensor.from_local(w, mesh, [Shard(0)])}})  # type: ignore[arg-type]
    step = root / step_dir(2)
    huge = [rows, COLS]
    state = json.loads((step / "state.json").read_text())
    assert _set_shapes(state, NAME, huge) == 1
    _rewrite(step, "state.json", json.dumps(state).encode())
    index = json.loads((step / "dtensors.json").read_text())
    index["tensors"][NAME]["shape"] = huge
    (chunk,) = index_chunks(step, NAME)
    chunk.update(sizes=huge, bytes=4 * huge[0] * huge[1])
    if rows < 1 << 40:  # CRC blocks of 1 GiB: a CRC a block, the index stays small
        index["block"] = 1 << 30
        chunk["crc32c"] = ["00000000"] * -(-chunk["bytes"] // index["block"])
    if fmt == 2:
        index["tensors"][NAME]["chunks"] = [chunk]
    else:
        part = json.loads((step / split_index.part_file(0)).read_text())
        part["chunks"][NAME] = [chunk]
        part["block"] = index["block"]
        _rewrite(step, split_index.part_file(0), json.dumps(part).encode())
    _rewrite(step, "dtensors.json", json.dumps(index).encode())
    return root, w, step


@pytest.mark.parametrize("fmt", [2, 4])
def test_a_hostile_shape_is_refused_before_it_is_allocated(
    mesh: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: int
) -> None:
    """Format 3 made the 2**40-row tensor before reading the part that lists its chunk: the
    allocator's RuntimeError left load() (before: no fallback to step 1). What a load
    allocates comes after its chunks are found within the payload's bytes."""
    root, w, _ = _claim_huge(mesh, tmp_path, monkeypatch, fmt)
    with CheckpointManager(root) as mgr:
        with pytest.raises(IntegrityError, match="do not fit its box of float32 or its file"):
            mgr.load(2)
        assert torch.equal(mgr.load()["model"]["w"], w)  # step 1


@pytest.mark.parametrize("fmt", [2, 4])
def test_a_shard_file_claimed_huge_is_measured_before_its_tensor_is_allocated(
    mesh: object,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fmt: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """As above (2**33 rows: 10 TB), and the shard file's entry (the manifest's, or in format
    4 its rank's line of the rank table) claims the bytes the chunk needs, so the chunk
    fits "its file". The file's real size was checked only when the reads opened it, after
    the tensor was allocated: load, restore and export raised the allocator's RuntimeError
    (found by review), and restore never fell back to step 1."""
    root, w, step = _claim_huge(mesh, tmp_path, monkeypatch, fmt, rows=1 << 33)
    (chunk,) = index_chunks(step, NAME)
    shard = step / chunk["file"]
    real = shard.stat().st_size
    claimed = chunk["start"] + chunk["bytes"]
    edit_entry(step, chunk["file"], lambda row: row.update(bytes=claimed))
    said = f"{shard}: file has {real} bytes, manifest says {claimed}"
    with CheckpointManager(root) as mgr:
        with pytest.raises(IntegrityError, match=said):
            mgr.load(2)
        target = {"model": {"w": torch.zeros(ROWS, COLS)}}
        assert mgr.restore(target) == 1
        assert torch.equal(target["model"]["w"], w)
    assert cli_mod.main(["export", str(root), "--step", "2", str(tmp_path / "w.pt")]) == 1
    err = capsys.readouterr().err
    assert said in err
    assert "Traceback" not in err
    assert not (tmp_path / "w.pt").exists()


@pytest.mark.parametrize("placement", ["S(\u00b2)", "_StridedShard(0)"])
def test_a_placement_the_index_cannot_spell_is_refused_and_the_good_step_restores(
    mesh: object, tmp_path: Path, placement: str
) -> None:
    """A split index whose layout names a placement other than ``R`` or ``S(dim)`` (a digit
    ``isdigit`` takes and ``int`` refuses raised ``ValueError`` before, not an
    ``IntegrityError``), the manifest forged to match: the step is refused by name and the
    step before it restores."""
    root = tmp_path / "store"
    values, state = two_dtensor_steps(mesh, root, 9)
    step2 = root / step_dir(2)
    index = json.loads((step2 / "dtensors.json").read_text())
    assert index["tensors"][NAME]["placements"] == ["S(0)"]  # the split index's layout
    index["tensors"][NAME]["placements"] = [placement]
    _rewrite(step2, "dtensors.json", json.dumps(index).encode())
    expected = f"placements {[placement]!r} are not R or S(dim)"
    with CheckpointManager(root) as mgr:
        with pytest.raises(IntegrityError) as ei:
            mgr.load(2)
        assert expected in str(ei.value), str(ei.value)
        target = state(0)
        assert mgr.restore(target) == 1
        assert torch.equal(target["model"]["w"].to_local(), values[1])
        assert target["step"] == 1

"""Forged DTensor steps: what a restore refuses, verify fails, and retention keeps the step before.

A step of a 2-rank FSDP2 save (real gloo ranks, ``dtensor_scenarios:fsdp_save``) is forged
file by file, each file re-signed in the manifest or rank table as an attacker or a buggy
tool would, leaving the step before it good. Review s39 found two ways a restore and verify
disagreed:

- the layout (``dtensors.json``) forged while every part still holds the boxes the save
  wrote: a placement of ``S(1)`` over ``S(0)`` boxes, a mesh of ranks ``[0, 7]`` or
  ``[0, 0]``, a mesh of 4 ranks on a 2-rank job. Every restore refused those, verify said
  OK, and ``prune --keep-last 1`` deleted the only step that restored;
- a chunk row pointed at bytes that are not the shard file's own entry for it (the header,
  or another tensor's bytes of the same size, CRCs recomputed), or a layout and
  ``state.json`` both saying ``int32`` over ``F32`` entries: load() returned those bytes as
  the tensor, and verify and export passed.

For each: verify fails the step, ``load(step=2)`` raises ``IntegrityError``, ``load()`` and
``restore()`` fall back to step 1 with its values, and ``prune --keep-last 1`` keeps step 1.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import edit_entry, run_cli, step_dir

from ckptstore import CheckpointManager, IntegrityError
from ckptstore.integrity import crc32c_of, format_crc
from ckptstore.sharded.chunks import BLOCK
from tests.multirank.dtensor_scenarios import _sha, digests, make_net
from tests.multirank.launch import describe, launch

pytestmark = pytest.mark.timeout(300)

SHARDS1 = "_shards.rank00001.safetensors"
PART1 = "_index.rank00001.json"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """Steps 1 and 2 of one FSDP2 state, saved by 2 gloo ranks; the full tensors' digests."""
    work = tmp_path_factory.mktemp("forgery")
    res = launch("dtensor_scenarios:fsdp_save", 2, work, timeout=180, args={"steps": [1, 2]})
    assert all(r.ok for r in res), describe(res)
    return work / "store", res[0].value["digests"]


def _json(path: Path) -> Any:
    return json.loads(path.read_bytes())


def _put(step: Path, name: str, doc: Any) -> None:
    """Write ``doc`` as file ``name`` of the committed ``step`` and re-sign its entry."""
    data = json.dumps(doc, separators=(",", ":")).encode()
    (step / name).write_bytes(data)
    edit_entry(
        step, name, lambda row: row.update(bytes=len(data), crc32c=format_crc(crc32c_of(data)))
    )


def _crcs(data: bytes) -> list[str]:
    return [format_crc(crc32c_of(data[i : i + BLOCK])) for i in range(0, len(data), BLOCK)]


# ---- the forgeries: each edits step 2 in place ---------------------------------------------


def _layout(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def forge(step: Path) -> None:
        doc = _json(step / "dtensors.json")
        edit(doc)
        _put(step, "dtensors.json", doc)

    return forge


def _placement_s1(doc: dict[str, Any]) -> None:
    # The parts hold rows 0-3 and 4-6 of the 7 x 6 weight; S(1) lays out columns 0-2, 3-5.
    doc["tensors"]["model/inp.weight"]["placements"] = ["S(1)"]


def _mesh_of_4(doc: dict[str, Any]) -> None:
    doc["meshes"][0] = {"shape": [4], "start": 0, "strides": [1]}
    for row in doc["tensors"].values():
        row["mesh"] = [4]


def _int32(step: Path) -> None:
    """The layout and ``state.json`` both say int32; the shard files' entries are F32."""
    _layout(lambda d: d["tensors"]["model/inp.weight"].update(dtype="int32"))(step)
    state = _json(step / "state.json")

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("t") == "dtensor" and node.get("name") == "model/inp.weight":
                node["dtype"] = "int32"
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(state)
    _put(step, "state.json", state)


def _into_header(step: Path) -> None:
    """Rank 1's chunk of ``model/out.bias`` points at byte 0 of its file: the header."""
    part = _json(step / PART1)
    chunk = part["chunks"]["model/out.bias"][0]
    data = (step / SHARDS1).read_bytes()
    chunk.update(start=0, crc32c=_crcs(data[: chunk["bytes"]]))
    _put(step, PART1, part)


def _swapped(step: Path) -> None:
    """Rank 1's chunks of a weight and of its optimizer state (one shape) trade places and
    CRCs: each points at the other's entry, inside the data, sharing no byte."""
    part = _json(step / PART1)
    a = part["chunks"]["model/inp.weight"][0]
    b = part["chunks"]["optimizer/state/inp.weight/exp_avg"][0]
    assert a["bytes"] == b["bytes"]
    for k in ("start", "crc32c"):
        a[k], b[k] = b[k], a[k]
    _put(step, PART1, part)


FORGERIES: dict[str, tuple[Callable[[Path], None], str]] = {
    # Defect A: the layout, against the boxes the parts hold.
    "placement-S1": (
        _layout(_placement_s1),
        "no chunk of 'model/inp.weight' at [0, 0], which rank 0 wrote",
    ),
    "mesh-ranks-0-7": (
        _layout(lambda d: d["meshes"].__setitem__(0, {"shape": [2], "ranks": [0, 7]})),
        "the manifest lists no _index.rank00007.json",
    ),
    "mesh-ranks-0-0": (
        _layout(lambda d: d["meshes"].__setitem__(0, {"shape": [2], "ranks": [0, 0]})),
        "which rank 0 wrote; the index part is not this save's",
    ),
    "mesh-of-4-on-2": (_layout(_mesh_of_4), "which rank 0 wrote; the index part is not"),
    # Defect B: a chunk against its shard file's own safetensors entry.
    "dtype-int32": (
        _int32,
        "tensor 'model/inp.weight': the chunk at [0, 0] is int32 [4, 6] at bytes",
    ),
    "chunk-into-header": (
        _into_header,
        f"tensor 'model/out.bias': the chunk at [2] starts at byte 0 of {SHARDS1}, inside its "
        "safetensors header",
    ),
    "chunks-swapped": (
        _swapped,
        "tensor 'model/inp.weight': the chunk at [4, 0] is float32 [3, 6] at bytes",
    ),
}
#: The forgeries of a chunk's bytes (defect B): ``export`` read them as the tensor.
BYTES = ("dtype-int32", "chunk-into-header", "chunks-swapped")


def _model_digests(model: dict[str, torch.Tensor]) -> dict[str, str]:
    return {f"model/{k}": _sha(v) for k, v in model.items()}


@pytest.mark.parametrize("case", list(FORGERIES))
def test_a_forged_step_fails_verify_and_retention_keeps_the_step_before(
    saved: tuple[Path, dict[str, str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
) -> None:
    master, saved_digests = saved
    want = {k: v for k, v in saved_digests.items() if k.startswith("model/")}
    root = tmp_path / "store"
    shutil.copytree(master, root)
    forge, expected = FORGERIES[case]
    forge(root / step_dir(2))

    with CheckpointManager(root, create=False) as mgr:
        with pytest.raises(IntegrityError) as ei:
            mgr.load(step=2)
        assert expected in str(ei.value)
        assert step_dir(2) in str(ei.value)
        if case != "dtype-int32":  # there state.json no longer fits a float32 model
            with pytest.raises(IntegrityError, match=re.escape(expected)):
                mgr.restore({"model": make_net(seed=99)}, step=2, strict=False)
        report = mgr.verify(2)
        assert not report.ok, f"{case}: verify passed a step every restore refuses"
        assert any(expected in p for p in report.problems), report.problems
        assert mgr.verify(1).ok
        got = mgr.load()  # the newest that verifies: step 1, its own values
        assert got["step"] == 1
        assert _model_digests(got["model"]) == want
        if case != "dtype-int32":
            model = make_net(seed=99)
            assert mgr.restore({"model": model}, strict=False) == 1
            assert digests(model, None) == want

    if case in BYTES:
        out = tmp_path / "hf"
        rc, _, err = run_cli(capsys, "export", root, "--step", 2, "--hf", out)
        assert rc != 0, f"{case}: export wrote the forged bytes as the tensor"
        assert expected in err, err
        assert not out.exists()

    rc, out_text, err = run_cli(capsys, "verify", root, "--all")
    assert rc == 1, out_text + err
    rc, out_text, err = run_cli(capsys, "prune", root, "--keep-last", "1")
    assert rc == 0, out_text + err
    assert (root / step_dir(1)).is_dir(), f"{case}: prune deleted the only step that restores"
    with CheckpointManager(root, create=False) as mgr:
        assert mgr.load()["step"] == 1


def test_the_saved_steps_verify_restore_and_export(
    saved: tuple[Path, dict[str, str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The store the forgeries start from: both steps good, step 2 the newest."""
    master, saved_digests = saved
    want = {k: v for k, v in saved_digests.items() if k.startswith("model/")}
    root = tmp_path / "store"
    shutil.copytree(master, root)
    with CheckpointManager(root, create=False) as mgr:
        assert mgr.verify(1).ok
        assert mgr.verify(2).ok
        got = mgr.load()
        assert got["step"] == 2
        assert _model_digests(got["model"]) == want
        model = make_net(seed=99)
        assert mgr.restore({"model": model}, strict=False) == 2
        assert digests(model, None) == want
    rc, _, err = run_cli(capsys, "export", root, "--step", 2, "--hf", tmp_path / "hf")
    assert rc == 0, err

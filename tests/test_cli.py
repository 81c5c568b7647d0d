"""Tests of the ``ckptstore`` command line (``ckptstore.cli``), mostly in-process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import index_chunks, run_cli, step_dir, step_path
from safetensors.torch import load_file
from torch import nn

from ckptstore import CheckpointManager
from ckptstore.cli import human_bytes, parse_storage_options
from ckptstore.storage import wait_for_deletions

REPO = Path(__file__).resolve().parents[1]


def make_model(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(4, 3)


def flip_last_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A store with steps 9, 10, 100 (model + optimizer + step), step 9 pinned."""
    root = tmp_path / "ckpt"
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with CheckpointManager(root, keep=None) as mgr:
        for s in (9, 10, 100):
            mgr.save(s, {"model": model, "optimizer": opt, "step": s}, metrics={"val_loss": 1 / s})
        mgr.pin(9)
    return root


# ---- ls -----------------------------------------------------------------------------------


def test_ls_table_orders_steps_numerically(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "ls", store)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].split() == [
        "step",
        "created",
        "(UTC)",
        "size",
        "files",
        "world",
        "sharding",
        "metrics",
        "pinned",
    ]
    rows = [ln.split() for ln in lines[1:4]]
    assert [r[0] for r in rows] == ["9", "10", "100"]
    # step, date, time, size value, size unit, files, world, sharding, metrics[, pinned]
    assert rows[0][5] == "3"
    assert rows[0][6:8] == ["1", "replicated"]
    assert rows[0][8] == "val_loss=0.111111"
    assert rows[0][-1] == "yes"
    assert rows[1][-1] == "val_loss=0.1"  # no pinned column text
    assert rows[0][4] in ("B", "kB")
    assert len(rows[0][1]) == 10
    assert len(rows[0][2]) == 8
    assert lines[4].startswith("3 checkpoints")
    assert err == ""


def test_ls_json(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "ls", store, "--json")
    assert rc == 0
    data = json.loads(out)
    assert [d["step"] for d in data] == [9, 10, 100]
    first = data[0]
    fields = ("step", "created", "bytes", "files", "metrics", "pinned", "format", "world_size")
    for field in (*fields, "sharded", "sharding"):
        assert field in first
    assert first["pinned"] is True
    assert data[1]["pinned"] is False
    assert first["files"] == 3
    assert first["format"] == "safetensors"
    assert first["world_size"] == 1
    assert first["sharded"] is False
    assert first["sharding"] == "replicated"
    assert first["metrics"] == {"val_loss": pytest.approx(1 / 9)}
    payloads = [
        f for f in step_path(store, 9).iterdir() if f.name not in {"manifest.json", "pinned"}
    ]
    sizes = sum(f.stat().st_size for f in payloads)
    assert first["bytes"] == sizes
    assert first["created"].endswith("Z")
    assert len(first["created"]) == 20
    # --json is also accepted before the command
    rc2, out2, _ = run_cli(capsys, "--json", "ls", store)
    assert rc2 == 0
    assert json.loads(out2) == data


def test_ls_empty_and_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out, _ = run_cli(capsys, "ls", empty)
    assert rc == 0
    assert "no checkpoints" in out
    rc, out, _ = run_cli(capsys, "ls", empty, "--json")
    assert rc == 0
    assert json.loads(out) == []
    rc, out, err = run_cli(capsys, "ls", tmp_path / "nope")
    assert rc == 1
    assert out == ""
    assert err == f"ckptstore: error: {tmp_path / 'nope'}: no such directory\n"


def test_ls_lists_a_broken_manifest(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = step_path(store, 10) / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"world_size": 1', '"world_size": 2'))
    rc, out, err = run_cli(capsys, "ls", store)
    assert rc == 1
    row = next(ln for ln in out.splitlines() if ln.split()[0] == "10")
    assert "BROKEN:" in row
    assert "self-checksum mismatch" in row
    assert [ln.split()[0] for ln in out.splitlines()[1:4]] == ["9", "10", "100"]
    assert "Traceback" not in err
    data = json.loads(run_cli(capsys, "ls", store, "--json")[1])
    assert data[1]["error"]
    assert data[1]["bytes"] is None
    assert data[0]["error"] is None


# ---- verify -------------------------------------------------------------------------------


def test_verify_newest_ok(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "verify", store)
    assert rc == 0
    assert out.startswith("step 100: OK (3 files, ")
    assert "checked" in out
    assert err == ""  # no progress bar off a terminal


def test_verify_detects_flipped_byte(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flip_last_byte(step_path(store, 100) / "model.safetensors")
    rc, out, _ = run_cli(capsys, "verify", store)
    assert rc == 1
    lines = out.splitlines()
    assert lines[0] == "step 100: FAILED"
    assert lines[1].startswith("    ")
    assert "model.safetensors" in lines[1]
    assert "crc32c" in lines[1]
    assert "corrupt" in lines[1]
    # --quick checks sizes and headers only, so a flipped data byte goes unnoticed
    rc, out, _ = run_cli(capsys, "verify", store, "--quick")
    assert rc == 0
    assert "quick" in out
    rc, out, _ = run_cli(capsys, "verify", store, "--json")
    assert rc == 1
    (report,) = json.loads(out)
    assert report["ok"] is False
    assert report["step"] == 100
    assert any("model.safetensors" in p for p in report["problems"])


def test_verify_all_and_step(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "verify", store, "--all")
    assert rc == 0, out
    assert [ln.split(":")[0] for ln in out.splitlines()[:3]] == ["step 9", "step 10", "step 100"]
    assert out.splitlines()[-1] == "3 checkpoints verified, 0 failed"
    assert err == ""
    (step_path(store, 10) / "optimizer.safetensors").write_bytes(b"short")
    rc, out, _ = run_cli(capsys, "verify", store, "--all")
    assert rc == 1
    assert "step 9: OK" in out
    assert "step 10: FAILED" in out
    assert "step 100: OK" in out
    assert "truncated or replaced" in out
    assert run_cli(capsys, "verify", store, "--step", "9")[0] == 0
    rc, out, _ = run_cli(capsys, "verify", store, "--step", "10", "--json")
    assert rc == 1
    assert json.loads(out)[0]["step"] == 10
    # a step directory given directly
    rc, out, _ = run_cli(capsys, "verify", step_path(store, 9))
    assert rc == 0
    assert out.startswith("step 9: OK")


def test_progress_bar_only_on_a_terminal(store: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    rc, out, err = run_cli(capsys, "verify", store, "--all", "--quick")
    assert rc == 0
    assert "verify" in err  # tqdm's bar, on stderr
    assert out.splitlines()[0].startswith("step 9: OK")  # stdout stays clean


def test_verify_missing_step_and_empty(tmp_path: Path, store: Path, capsys) -> None:
    rc, out, err = run_cli(capsys, "verify", store, "--step", "5")
    assert rc == 1
    assert out == ""
    assert err.startswith("ckptstore: error: ")
    assert "no committed checkpoint" in err
    assert err.count("\n") == 1
    assert "Traceback" not in err
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = run_cli(capsys, "verify", empty, "--all")
    assert rc == 1
    assert "no committed checkpoint" in err


def test_verify_lone_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pt = tmp_path / "plain.pt"
    torch.save({"model": make_model().state_dict(), "epoch": 3}, pt)
    rc, out, _ = run_cli(capsys, "verify", pt)
    assert rc == 0
    assert out == f"{pt}: OK (1 file, {human_bytes(pt.stat().st_size)} checked)\n"
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(pt.read_bytes()[:-100])
    rc, out, _ = run_cli(capsys, "verify", truncated)
    assert rc == 1
    assert out.splitlines()[0] == f"{truncated}: FAILED"
    assert "central directory" in out
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.zeros(2)}, legacy, _use_new_zipfile_serialization=False)
    rc, out, _ = run_cli(capsys, "verify", legacy)
    assert rc == 1
    assert "legacy (non-zip) torch.save format" in out
    # --step makes no sense for a file
    rc, _, err = run_cli(capsys, "verify", pt, "--step", "1")
    assert rc == 2
    assert "apply to stores only" in err


# ---- prune / gc ---------------------------------------------------------------------------


def test_prune_dry_run_deletes_nothing(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "prune", store, "--keep-last", "1", "--dry-run")
    assert rc == 0
    assert "would delete 1 step: 10" in out  # 9 is pinned, 100 is newest
    assert "would keep 2 steps: 9, 100" in out
    wait_for_deletions()
    assert step_path(store, 10).is_dir()
    rc, out, _ = run_cli(capsys, "prune", store, "--keep-last", "1", "--dry-run", "--json")
    assert json.loads(out) == {
        "root": str(store),
        "dry_run": True,
        "deleted": [10],
        "kept": [9, 100],
    }


def test_prune_deletes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpt"
    model = make_model()
    with CheckpointManager(root, keep=None) as mgr:
        for s in range(1, 7):
            mgr.save(s, {"model": model}, metrics={"loss": [5, 1, 4, 3, 6, 7][s - 1]})
    argv = ["--keep-last", "2", "--keep-best", "1", "--metric", "loss", "--keep-every", "4"]
    rc, out, _ = run_cli(capsys, "prune", root, *argv, "--json")
    assert rc == 0
    res = json.loads(out)
    assert res["deleted"] == [1, 3]
    assert res["kept"] == [2, 4, 5, 6]  # best (2) | every 4 (4) | last two (5, 6)
    wait_for_deletions()
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        step_path(root, s).name for s in (2, 4, 5, 6)
    ]
    assert not any(p.name.startswith(".trash-") for p in root.iterdir())
    rc, out, _ = run_cli(capsys, "prune", root, "--keep-last", "1")
    assert rc == 0
    assert "deleted 3 steps: 2, 4, 5" in out
    assert "kept 1 step: 6" in out
    wait_for_deletions()
    assert not step_path(root, 2).exists()
    assert step_path(root, 6).is_dir()


def test_prune_spares_a_step_pinned_while_it_verified(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pin` takes no lock: a step pinned during prune's deep verify (minutes on a large
    store) is kept. The pins were read before the verify, and step 1 was deleted."""
    from ckptstore.ops import steps as ops_steps

    root = tmp_path / "ckpt"
    with CheckpointManager(root, keep=None) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, {"w": torch.full((64,), float(s))})
    real = ops_steps.verify_checkpoint
    pinned: list[int] = []

    def verify_meanwhile_pinned(*args: object, **kw: object) -> object:
        if not pinned:  # another shell: `ckptstore pin ROOT --step 1`, a real pin
            rc, _, _ = run_cli(capsys, "pin", root, "--step", "1")
            assert rc == 0
            pinned.append(1)
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(ops_steps, "verify_checkpoint", verify_meanwhile_pinned)
    rc, out, _ = run_cli(capsys, "prune", root, "--keep-last", "1", "--json")
    assert rc == 0
    assert pinned == [1]
    assert json.loads(out)["deleted"] == [2]
    wait_for_deletions()
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        step_path(root, s).name for s in (1, 3)
    ]


def test_prune_refused_while_locked(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with CheckpointManager(store, keep=None) as writer:
        writer.save(101, {"x": torch.zeros(1)})  # takes and holds the writer lock
        rc, out, err = run_cli(capsys, "prune", store, "--keep-last", "1")
    assert rc == 1
    assert out == ""
    assert err.startswith("ckptstore: error: ")
    assert "locked by another writer" in err
    assert step_path(store, 10).is_dir()


@pytest.mark.parametrize(
    "argv",
    [
        ["prune", "{root}"],
        ["prune", "{root}", "--keep-best", "2"],
        ["prune", "{root}", "--keep-last", "1", "--metric", "loss"],
        ["prune", "{root}", "--keep-last", "0"],
        ["prune", "{root}", "--keep-last", "1", "--mode", "avg"],
    ],
)
def test_prune_usage_errors(store: Path, argv: list[str], capsys) -> None:
    rc, out, err = run_cli(capsys, *[a.format(root=store) for a in argv])
    assert rc == 2
    assert out == ""
    assert "usage: ckptstore prune" in err
    assert "error:" in err


def test_gc_removes_stale_tmp(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = store / (".tmp-step-000000000005-" + "ab" * 16)
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    rc, out, _ = run_cli(capsys, "ls", store)
    assert "1 stale entry (interrupted saves or deletions)" in out
    assert stale.name in out
    rc, out, _ = run_cli(capsys, "gc", store)
    assert rc == 0
    assert out == f"removed {stale.name}\n"
    assert not stale.exists()
    assert step_path(store, 9).is_dir()
    rc, out, _ = run_cli(capsys, "gc", store, "--json")
    assert rc == 0
    assert json.loads(out) == {"removed": []}
    rc, out, _ = run_cli(capsys, "gc", store)
    assert out == "nothing to remove\n"


# ---- inspect ------------------------------------------------------------------------------


def test_inspect_text(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "inspect", store, "--step", "10")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("step      10")
    assert "metrics   val_loss=0.1" in out
    assert "state.json" in out
    assert "model.safetensors" in out
    assert "  model: module (2 tensors, 60 B)" in out
    assert "  optimizer: stateful (2 tensors, 60 B)" in out
    assert "  step: data (int 10)" in out
    table = {ln.split()[0]: ln.split()[1:] for ln in lines if ln.startswith("    ")}
    assert table["weight"][:3] == ["float32", "[3,", "4]"]
    assert table["bias"][:2] == ["float32", "[3]"]
    assert table["state.0.momentum_buffer"][:3] == ["float32", "[3,", "4]"]


def test_inspect_json_reads_only_state_json(store: Path, capsys) -> None:
    # Payloads are never read: inspect works with them gone.
    (step_path(store, 100) / "model.safetensors").unlink()
    rc, out, _ = run_cli(capsys, "inspect", store, "--json")
    assert rc == 0
    info = json.loads(out)
    assert info["step"] == 100
    assert info["pinned"] is False
    assert set(info["files"]) == {"model.safetensors", "optimizer.safetensors", "state.json"}
    entries = {e["key"]: e for e in info["entries"]}
    assert entries["model"]["kind"] == "module"
    assert entries["model"]["tensors"] == [
        {"name": "weight", "dtype": "float32", "shape": [3, 4], "bytes": 48, "note": ""},
        {"name": "bias", "dtype": "float32", "shape": [3], "bytes": 12, "note": ""},
    ]
    assert entries["step"] == {
        "key": "step",
        "kind": "data",
        "summary": "int 100",
        "tensor_bytes": 0,
        "tensors": [],
    }


def test_inspect_checks_state_json(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flip_last_byte(step_path(store, 100) / "state.json")
    rc, out, err = run_cli(capsys, "inspect", store)
    assert rc == 1
    assert out == ""
    assert "state.json" in err
    assert "crc32c" in err
    assert err.count("\n") == 1


def test_inspect_shared_tensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    w = torch.arange(6.0).reshape(2, 3)
    with CheckpointManager(tmp_path, keep=None) as mgr:
        mgr.save(
            0, {"data": {"a": w, "b": w, "row": w[1], "half": torch.ones(2, dtype=torch.half)}}
        )
    info = json.loads(run_cli(capsys, "inspect", tmp_path, "--json")[1])
    tensors = {t["name"]: t for t in info["entries"][0]["tensors"]}
    assert tensors["b"]["note"] == "shares a"
    assert tensors["row"]["note"].startswith("view of")
    assert tensors["half"]["dtype"] == "float16"
    assert tensors["half"]["bytes"] == 4
    assert info["entries"][0]["tensor_bytes"] == 24 + 4


def test_inspect_names_each_tensor_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The key "x.y" beside x -> y, and the key "1" beside 1, printed as one name each."""
    state = {"x.y": torch.ones(2), "x": {"y": torch.zeros(3)}, 1: torch.ones(1), "1": torch.ones(4)}
    with CheckpointManager(tmp_path, keep=None) as mgr:
        mgr.save(0, {"m": state, "opt": {"layer.weight": torch.ones(5)}})
    info = json.loads(run_cli(capsys, "inspect", tmp_path, "--json")[1])
    shapes = {e["key"]: {t["name"]: t["shape"] for t in e["tensors"]} for e in info["entries"]}
    assert shapes["m"] == {"'x.y'": [2], "x.y": [3], "1": [1], "'1'": [4]}
    assert shapes["opt"] == {"layer.weight": [5]}  # quoted only where two names collide
    rc, out, _ = run_cli(capsys, "inspect", tmp_path)
    assert rc == 0
    assert "'x.y'  float32  [2]" in out


# ---- import / export ----------------------------------------------------------------------


def test_import_ddp_prefixed_then_restore(tmp_path: Path, capsys) -> None:
    src = make_model(1)
    ddp_sd = {f"module.{k}": v.clone() for k, v in src.state_dict().items()}
    pt = tmp_path / "old.pt"
    torch.save({"model": ddp_sd, "epoch": 7, "lr": 0.1}, pt)
    root = tmp_path / "store"
    rc, out, err = run_cli(capsys, "import", pt, root, "--step", "70")
    assert rc == 0, err
    assert "stripped 'module.' from the keys of 'model'" in out
    assert f"imported {pt} as step 70 (model, epoch, lr;" in out
    target = make_model(2)
    assert not torch.equal(target.weight, src.weight)
    state: dict[str, object] = {"model": target, "epoch": 0}
    with CheckpointManager(root) as mgr:
        assert mgr.restore(state) == 70
        assert mgr.manifest(70).metadata["imported_from"] == str(pt)
    assert state["epoch"] == 7
    for k, v in src.state_dict().items():
        assert torch.equal(target.state_dict()[k], v)
    assert run_cli(capsys, "verify", root)[0] == 0


def test_import_bare_state_dict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_model(3)
    pt = tmp_path / "bare.pt"
    torch.save({f"_orig_mod.{k}": v for k, v in src.state_dict().items()}, pt)
    root = tmp_path / "store"
    argv = ["--step", "1", "--format", "torch", "--compression", "zstd", "--json"]
    rc, out, _ = run_cli(capsys, "import", pt, root, *argv)
    assert rc == 0
    res = json.loads(out)
    assert res["keys"] == ["model"]
    assert res["step"] == 1
    assert any("bare state dict" in n for n in res["notes"])
    with CheckpointManager(root) as mgr:
        assert set(mgr.manifest(1).files) == {"model.pt.zst", "state.json"}
        loaded = mgr.load(1)["model"]
    assert set(loaded) == {"weight", "bias"}
    assert torch.equal(loaded["weight"], src.weight.detach())
    # the step exists now: steps are write-once
    rc, _, err = run_cli(capsys, "import", pt, root, "--step", "1")
    assert rc == 1
    assert "already committed" in err


class NotPlainData:
    """An object that a weights_only load refuses."""

    def __init__(self) -> None:
        self.value = 1


def test_import_refuses_code_and_bad_files(tmp_path: Path, capsys) -> None:
    root = tmp_path / "store"
    evil = tmp_path / "evil.pt"
    torch.save({"model": make_model().state_dict(), "extra": NotPlainData()}, evil)
    rc, out, err = run_cli(capsys, "import", evil, root, "--step", "1")
    assert rc == 1
    assert out == ""
    assert err.startswith("ckptstore: error: ")
    assert err.count("\n") == 1
    assert "needs code to load" in err
    assert "weights_only=True" in err
    assert "Traceback" not in err
    assert not root.exists() or not any(root.glob("step-*"))

    good = tmp_path / "good.pt"
    torch.save({"model": make_model().state_dict()}, good)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[:-64])
    rc, _, err = run_cli(capsys, "import", cut, root, "--step", "1")
    assert rc == 1
    assert "central directory" in err
    assert err.count("\n") == 1

    lst = tmp_path / "list.pt"
    torch.save([torch.zeros(2)], lst)
    rc, _, err = run_cli(capsys, "import", lst, root, "--step", "1")
    assert rc == 1
    assert "not a dict" in err

    rc, _, err = run_cli(capsys, "import", tmp_path / "missing.pt", root, "--step", "1")
    assert rc == 1
    assert err == f"ckptstore: error: {tmp_path / 'missing.pt'}: no such file\n"

    rc, _, err = run_cli(capsys, "import", good, root)  # --step is required
    assert rc == 2
    assert "--step" in err


def test_export_safetensors(store: Path, tmp_path: Path, capsys) -> None:
    out_file = tmp_path / "model.safetensors"
    rc, out, err = run_cli(capsys, "export", store, "--step", "10", out_file)
    assert rc == 0, err
    assert "exported step 10 (entry 'model', 2 tensors)" in out
    tensors = load_file(str(out_file))
    with CheckpointManager(store) as mgr:
        expected = mgr.load(10)["model"]
    assert set(tensors) == {"weight", "bias"}
    for k, v in expected.items():
        assert torch.equal(tensors[k], v)
    assert not list(tmp_path.glob(".model.safetensors.tmp-*"))

    # refuses to overwrite without --force, and leaves the file alone
    before = out_file.read_bytes()
    rc, out, err = run_cli(capsys, "export", store, "--step", "100", out_file)
    assert rc == 1
    assert out == ""
    assert err == f"ckptstore: error: {out_file}: already exists; pass --force to overwrite it\n"
    assert out_file.read_bytes() == before
    rc, _, _ = run_cli(capsys, "export", store, "--step", "100", out_file, "--force")
    assert rc == 0
    # --force onto a directory: said so (it named a temporary file: "Is a directory").
    folder = tmp_path / "folder.safetensors"
    folder.mkdir()
    rc, _, err = run_cli(capsys, "export", store, "--step", "100", folder, "--force")
    assert rc == 1
    assert err.startswith(f"ckptstore: error: {folder}: a directory; export writes one file")
    assert list(folder.iterdir()) == []

    other = tmp_path / "x.safetensors"
    rc, _, err = run_cli(capsys, "export", store, "--step", "100", other, "--key", "nope")
    assert rc == 1
    assert "no entry 'nope'" in err
    rc, _, err = run_cli(capsys, "export", store, "--step", "100", other, "--key", "optimizer")
    assert rc == 1
    assert "not a tensor" in err
    assert not other.exists()


def test_export_tied_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight

    model = Tied()
    with CheckpointManager(tmp_path / "s", keep=None) as mgr:
        mgr.save(1, {"net": model})  # no "model" entry: the one module entry is chosen
    out_file = tmp_path / "tied.safetensors"
    rc, out, err = run_cli(capsys, "export", tmp_path / "s", "--step", "1", out_file)
    assert rc == 0, err
    assert "entry 'net'" in out
    tensors = load_file(str(out_file))
    assert torch.equal(tensors["emb.weight"], model.emb.weight.detach())
    assert torch.equal(tensors["head.weight"], model.emb.weight.detach())


def test_export_pt(store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "full.pt"
    rc, out, _ = run_cli(capsys, "export", store, "--step", "100", out_file, "--json")
    assert rc == 0
    res = json.loads(out)
    assert res["format"] == "torch"
    assert res["tensors"] == 4
    assert res["key"] is None
    data = torch.load(out_file, weights_only=True)
    with CheckpointManager(store) as mgr:
        stored = mgr.load(100)
    assert data["step"] == 100
    assert torch.equal(data["model"]["weight"], stored["model"]["weight"])
    assert torch.equal(
        data["optimizer"]["state"][0]["momentum_buffer"],
        stored["optimizer"]["state"][0]["momentum_buffer"],
    )
    assert run_cli(capsys, "verify", out_file)[0] == 0


def test_export_pt_of_one_entry(store: Path, tmp_path: Path, capsys) -> None:
    """--key was ignored for a .pt file: the whole state was written, exit 0, even for an
    entry the step does not hold (found by review)."""
    out_file = tmp_path / "opt.pt"
    rc, out, _ = run_cli(
        capsys, "--json", "export", store, "--step", "100", out_file, "--key", "optimizer"
    )
    assert rc == 0
    assert json.loads(out)["key"] == "optimizer"
    data = torch.load(out_file, weights_only=True)
    with CheckpointManager(store) as mgr:
        stored = mgr.load(100)["optimizer"]
    assert sorted(data) == sorted(stored) == ["param_groups", "state"]
    assert torch.equal(data["state"][0]["momentum_buffer"], stored["state"][0]["momentum_buffer"])
    bad = tmp_path / "bad.pt"
    rc, out, err = run_cli(capsys, "export", store, "--step", "100", bad, "--key", "nope")
    assert (rc, out) == (1, "")
    assert "has no entry 'nope'" in err
    assert not bad.exists()


# ---- usage errors, helpers, entry points --------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["bogus"],
        ["ls"],
        ["verify", "{root}", "--step", "abc"],
        ["verify", "{root}", "--step", "-1"],
        ["verify", "{root}", "--step", "1", "--all"],
        ["inspect", "{root}", "--nope"],
        ["ls", "{root}", "--storage-option", "a=b"],  # local paths take no storage options
        ["ls", "{root}", "--storage-option", "novalue"],
        ["import", "x.pt", "{root}", "--step", "1", "--format", "pickle"],
    ],
)
def test_usage_errors_exit_2(store: Path, argv: list[str], capsys) -> None:
    rc, out, err = run_cli(capsys, *[a.format(root=store) for a in argv])
    assert rc == 2
    assert out == ""
    assert "usage: ckptstore" in err
    assert "Traceback" not in err


def test_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "--help")
    assert rc == 0
    assert "verify" in out
    assert "export" in out
    rc, out, _ = run_cli(capsys, "--version")
    assert rc == 0
    assert out.startswith("ckptstore ")


def test_helpers() -> None:
    assert human_bytes(0) == "0 B"
    assert human_bytes(999) == "999 B"
    assert human_bytes(1234) == "1.2 kB"
    assert human_bytes(1_200_000) == "1.2 MB"
    assert human_bytes(999_999) == "1.0 MB"
    assert human_bytes(3 * 10**12) == "3.0 TB"
    items = ["anon=true", "n=3", "endpoint_url=http://h:9000", "k=", "x=-.5", "y=1.", "z=null"]
    assert parse_storage_options(items) == {
        "anon": True,
        "n": 3,
        "endpoint_url": "http://h:9000",
        "k": "",
        "x": -0.5,
        "y": 1.0,
        "z": None,
    }


def test_memory_url_store(capsys: pytest.CaptureFixture[str]) -> None:
    url = "memory://ckptstore-cli-test"
    with CheckpointManager(url, keep=None) as mgr:
        mgr.save(3, {"model": make_model()})
    rc, out, _ = run_cli(capsys, "ls", url)
    assert rc == 0
    assert out.splitlines()[1].split()[0] == "3"
    assert run_cli(capsys, "verify", url)[0] == 0


def test_python_dash_m_entry_point(store: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ckptstore", "ls", str(store)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert [ln.split()[0] for ln in proc.stdout.splitlines()[1:4]] == ["9", "10", "100"]
    bad = subprocess.run(
        [sys.executable, "-m", "ckptstore", "verify", str(store), "--step", "5"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 1
    assert bad.stderr.startswith("ckptstore: error: ")
    assert "Traceback" not in bad.stderr


def test_console_script(store: Path) -> None:
    script = Path(sys.executable).parent / "ckptstore"
    if not script.exists():
        pytest.skip("the ckptstore console script is not installed (pip install -e .)")
    proc = subprocess.run(
        [str(script), "ls", str(store), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert [d["step"] for d in json.loads(proc.stdout)] == [9, 10, 100]


# ---- diff --------------------------------------------------------------------------------


def test_diff_text_json_and_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "s"
    m = make_model(0)
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": m, "step": 1, "old": "x", "same": (1, 2)})
        with torch.no_grad():
            m.weight[0, 0] += 0.5
        mgr.save(2, {"model": m, "step": 2, "new": torch.zeros(3), "same": (1, 2)})

    code, out, _ = run_cli(capsys, "diff", str(root), "1", "2")
    assert code == 1  # like diff(1): they differ
    lines = out.splitlines()
    assert lines[0] == f"diff step 1 -> step 2 ({root})"
    weight = next(line for line in lines if "model/weight" in line)
    assert weight.split()[0] == "~"
    assert "max |a-b| 0.5" in weight
    assert any(line.split()[:2] == ["+", "new"] and "float32[3]" in line for line in lines)
    assert any(line.split()[:2] == ["-", "old"] and "'x'" in line for line in lines)
    assert any(line.split()[:2] == ["~", "step"] and "1 -> 2" in line for line in lines)
    assert lines[-1] == "2 same, 2 changed, 1 added, 1 removed"  # model/bias, same

    code, out, _ = run_cli(capsys, "--json", "diff", str(root), "1", "2")
    assert code == 1
    doc = json.loads(out)
    assert (doc["a"], doc["b"], doc["same"]) == (1, 2, 2)
    by_path = {d["path"]: d for d in doc["differences"]}
    assert by_path["model/weight"]["change"] == "changed"
    assert by_path["model/weight"]["max_abs_diff"] == pytest.approx(0.5)
    assert by_path["new"]["change"] == "added"
    assert by_path["old"]["change"] == "removed"

    code, out, _ = run_cli(capsys, "diff", str(root), "2", "2")
    assert code == 0
    assert out.splitlines()[-1].endswith("0 changed, 0 added, 0 removed")

    code, _, err = run_cli(capsys, "diff", str(root), "1", "7")
    assert code == 1
    assert "no committed checkpoint" in err
    assert "Traceback" not in err


def test_diff_tells_apart_what_an_approximate_comparison_took_for_equal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # nan_to_num (for NaN-tolerance) turned +-inf into the largest finite floats, and numpy
    # arrays were compared by their repr, which elides arrays of over 1,000 elements and
    # rounds to 8 digits: `diff` said "same" and exited 0 for each of these.
    import math

    import numpy as np

    big = torch.finfo(torch.float32).max
    wide = np.zeros(2000)
    a = {
        "inf": torch.tensor([math.inf, 1.0, -math.inf]),
        "wide": wide,
        "close": np.array([1.0, 1.000000001]),
        "c": torch.tensor([1 + 1j, complex("nan+nanj")], dtype=torch.complex64),
        "f8": torch.tensor([1.0, math.nan]).to(torch.float8_e4m3fn),
        # A NaN in a list or tuple made two identical steps differ (list == list).
        "losses": [math.nan, 2.0],
        "betas": (0.9, math.nan),
        # Integers went through float64: 2**62 + 1 and 2**62 differed by 0.
        "ids": torch.tensor([2**62], dtype=torch.int64),
        # uint64 too, which took the float64 path: 2**63 and 2**63 + 1 differed by 0.
        "uids": torch.tensor([2**63, 5], dtype=torch.uint64),
    }
    b = dict(a)
    b["ids"] = torch.tensor([2**62 + 1], dtype=torch.int64)
    b["uids"] = torch.tensor([2**63 + 1, 2**64 - 1], dtype=torch.uint64)
    b["inf"] = torch.tensor([big, 1.0, -big])
    b["wide"] = wide.copy()
    b["wide"][1000] = 5.0
    b["close"] = np.array([1.0, 1.000000002])
    root = tmp_path / "s"
    with CheckpointManager(root) as mgr:
        mgr.save(1, a)
        mgr.save(2, b)
    code, out, _ = run_cli(capsys, "--json", "diff", str(root), "1", "2")
    assert code == 1
    doc = json.loads(out)
    paths = ["close", "ids", "inf", "uids", "wide"]
    assert sorted(d["path"] for d in doc["differences"]) == paths
    ids = next(d for d in doc["differences"] if d["path"] == "ids")
    assert ids["max_abs_diff"] == 1.0
    uids = next(d for d in doc["differences"] if d["path"] == "uids")
    assert uids["max_abs_diff"] == float(2**64 - 6)
    one = {"u": torch.tensor([2**63], dtype=torch.uint64)}
    with CheckpointManager(root) as mgr:
        mgr.save(3, one)
        mgr.save(4, {"u": torch.tensor([2**63 + 1], dtype=torch.uint64)})
    code, out, _ = run_cli(capsys, "--json", "diff", str(root), "3", "4")
    assert [d["max_abs_diff"] for d in json.loads(out)["differences"]] == [1.0]
    # The complex and float8 tensors, the list and the tuple: NaNs in the same places.
    assert doc["same"] == 4
    code, out, _ = run_cli(capsys, "diff", str(root), "1", "1")
    assert code == 0


def test_diff_never_takes_two_leaves_for_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Leaves were keyed by "/".join(str(key)): the int key 1 and the string "1" of one dict,
    # or {"a/b": x} and {"a": {"b": y}}, were one path, the second hid the first, and diff
    # said "2 same, 0 changed" (exit 0) for two changed tensors.
    def state(step: int) -> dict[str, object]:
        return {
            "m": {1: torch.full((3,), float(step)), "1": torch.zeros(3)},
            "n": {"a/b": torch.full((2,), float(step)), "a": {"b": torch.zeros(2)}},
            "k": {"x'y": step, "'x'y'": 0, "-2": step, -2: 0, "": step},
        }

    root = tmp_path / "s"
    with CheckpointManager(root) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
        loaded = mgr.load(2)
    assert set(loaded["k"]) == {"x'y", "'x'y'", "-2", -2, ""}
    code, out, _ = run_cli(capsys, "--json", "diff", str(root), "1", "2")
    assert code == 1
    doc = json.loads(out)
    changed = {d["path"]: d for d in doc["differences"]}
    assert sorted(changed) == sorted(["k/''", "k/'-2'", 'k/"x\'y"', "m/1", "n/'a/b'"])
    assert changed["m/1"]["max_abs_diff"] == 1.0
    assert changed["n/'a/b'"]["max_abs_diff"] == 1.0
    assert doc["same"] == 4  # m/'1', n/a/b, k/-2 and k/'\'x\'y\


def test_completion_script_completes_commands_and_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(capsys, "completion", "bash")
    assert code == 0
    assert "complete -o filenames -F _ckptstore ckptstore" in out
    script = tmp_path / "comp.sh"
    script.write_text(out)
    probe = (
        f"source {script}; "
        'COMP_WORDS=(ckptstore ve); COMP_CWORD=1; _ckptstore; echo "${COMPREPLY[@]}"; '
        "COMP_WORDS=(ckptstore prune r --keep-l); COMP_CWORD=3; _ckptstore; "
        'echo "${COMPREPLY[@]}"'
    )
    res = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True)
    assert res.stdout.splitlines() == ["verify", "--keep-last"]


def test_storage_options_nest_and_keep_quoted_strings() -> None:
    opts = parse_storage_options(
        [
            "client_kwargs.region_name=eu-west-1",
            "client_kwargs.endpoint_url=http://127.0.0.1:9000",
            'secret="0123"',
            'config_kwargs={"retries": {"max_attempts": 2}}',
        ]
    )
    assert opts == {
        "client_kwargs": {"region_name": "eu-west-1", "endpoint_url": "http://127.0.0.1:9000"},
        "secret": "0123",
        "config_kwargs": {"retries": {"max_attempts": 2}},
    }
    with pytest.raises(Exception, match="already has a value"):
        parse_storage_options(["a=1", "a.b=2"])
    with pytest.raises(Exception, match="expects KEY=VALUE"):
        parse_storage_options(["a..b=1"])


# ---- DTensor checkpoints ------------------------------------------------------------------
# The mixed store (conftest.py): step 3 DTensor by 2 ranks, 4 DTensor by 1 rank, 5 the same
# values replicated, 6 per-rank sharded=True state of 2 ranks.


def sha(t: torch.Tensor) -> str:
    from tests.multirank.dtensor_scenarios import _sha

    return _sha(t)


def test_ls_shows_sharding_and_world_size(mixed_store, capsys) -> None:
    root, _ = mixed_store
    rc, out, err = run_cli(capsys, "ls", root)
    assert rc == 0, err
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines()[1:5]}
    assert {k: v[6:8] for k, v in rows.items()} == {
        "3": ["2", "dtensor"],
        "4": ["1", "dtensor"],
        "5": ["2", "replicated"],
        "6": ["2", "sharded"],
    }
    data = {d["step"]: d for d in json.loads(run_cli(capsys, "ls", root, "--json")[1])}
    assert (data[3]["sharding"], data[3]["world_size"], data[3]["sharded"]) == ("dtensor", 2, True)
    assert (data[4]["sharding"], data[4]["world_size"]) == ("dtensor", 1)
    assert (data[6]["sharding"], data[6]["world_size"]) == ("sharded", 2)


def test_inspect_dtensor_text_and_json(mixed_store, capsys) -> None:
    root, _ = mixed_store
    rc, out, err = run_cli(capsys, "inspect", root, "--step", "3")
    assert rc == 0, err
    assert "world size 2, dtensor" in out
    section = out[out.index("\nsharded tensors") :].splitlines()
    assert section[1].startswith(
        "sharded tensors (19 in dtensors.json, 38 chunks, saved by 2 ranks)"
    )
    assert section[2].split() == ["name", "dtype", "shape", "bytes", "mesh", "placements", "chunks"]
    rows = {ln.split()[0]: ln.split() for ln in section[3:]}
    emb = rows["table/emb"]
    assert emb[1:4] == ["float32", "[2560,", "1024]"]
    assert emb[-3:] == ["shard=2", "S(0)", "2"]
    assert rows["model/inp.weight"][-3:] == ["shard=2", "S(0)", "2"]
    # the state section names the sharded tensors where they are
    assert any(
        ln.split()[:2] == ["inp.weight", "float32"] and "sharded" in ln for ln in out.splitlines()
    )

    info = json.loads(run_cli(capsys, "inspect", root, "--step", "4", "--json")[1])
    assert (info["world_size"], info["sharding"], info["format_version"]) == (1, "dtensor", 4)
    by_name = {t["name"]: t for t in info["sharded_tensors"]}
    assert by_name["table/emb"] == {
        "name": "table/emb",
        "dtype": "float32",
        "shape": [2560, 1024],
        "bytes": 2560 * 1024 * 4,
        "mesh": [1],
        "mesh_dims": ["shard"],
        "placements": ["S(0)"],
        "chunks": 1,
    }
    model = next(e for e in info["entries"] if e["key"] == "model")
    notes = {t["name"]: t["note"] for t in model["tensors"]}
    assert notes["inp.weight"] == "sharded"
    assert notes["scale"] == ""

    info = json.loads(run_cli(capsys, "inspect", root, "--step", "5", "--json")[1])
    assert (info["sharding"], info["sharded_tensors"]) == ("replicated", [])
    rc, out, err = run_cli(capsys, "inspect", root, "--step", "6")
    assert rc == 0, err
    assert "state (rank 0's part of per-rank state)" in out


def test_verify_dtensor_steps(mixed_store, capsys) -> None:
    root, _ = mixed_store
    rc, out, err = run_cli(capsys, "verify", root, "--all")
    assert rc == 0, out + err
    assert "4 checkpoints verified, 0 failed" in out
    chunk = index_chunks(step_path(root, 3), "table/emb")[1]
    assert chunk["file"] == "_shards.rank00001.safetensors"
    shard = step_path(root, 3) / chunk["file"]
    raw = bytearray(shard.read_bytes())
    raw[chunk["start"] + chunk["bytes"] - 100] ^= 0x10  # in the chunk's last block
    shard.write_bytes(bytes(raw))
    rc, out, _ = run_cli(capsys, "verify", root, "--step", "3")
    assert rc == 1
    last = len(chunk["crc32c"]) - 1
    assert last > 0  # the chunk spans several blocks
    assert f"block {last} of the chunk of tensor 'table/emb' at offsets [1280, 0]" in out
    assert "_shards.rank00001.safetensors" in out


def test_diff_dtensor_steps_across_world_sizes(mixed_store, capsys, monkeypatch) -> None:
    root, _ = mixed_store

    def no_whole_load(*a, **k):
        raise AssertionError("diff must not load whole checkpoints")

    monkeypatch.setattr(CheckpointManager, "load", no_whole_load)
    rc, out, err = run_cli(capsys, "diff", root, "3", "3")
    assert rc == 0, err
    rc, out, err = run_cli(capsys, "--json", "diff", root, "3", "4")  # 2 ranks vs 1 rank
    doc = json.loads(out)
    # Same model, optimizer and table; only the unseeded NumPy/Python generators differ.
    changed = {d["path"] for d in doc["differences"]}
    assert changed <= {"rng/numpy/1", "rng/python/1"}, doc["differences"]
    assert doc["same"] >= 40
    assert doc["notes"] == []


def test_diff_dtensor_and_replicated_steps(mixed_store, capsys) -> None:
    root, _ = mixed_store
    for a, b in (("3", "5"), ("5", "3")):
        rc, out, err = run_cli(capsys, "diff", root, a, b)
        assert rc == 0, out + err
        lines = out.splitlines()
        assert lines[1] == (
            "  note: optimizer: step 5 numbers the optimizer's parameters, step 3 names them "
            "(a DTensor save); matched by position in the parameter groups"
        )
        assert lines[-1].endswith(" same, 0 changed, 0 added, 0 removed")
    doc = json.loads(run_cli(capsys, "--json", "diff", root, "5", "4")[1])
    paths = {d["path"] for d in doc["differences"]}
    assert not {p for p in paths if p.startswith(("model/", "optimizer/", "table/"))}


def test_export_consolidates_dtensor_steps(mixed_store, tmp_path, capsys) -> None:
    root, digests = mixed_store
    for step, ranks in (("3", "2 ranks"), ("4", "1 rank")):
        out_file = tmp_path / f"model{step}.safetensors"
        rc, out, err = run_cli(capsys, "export", root, "--step", step, out_file)
        assert rc == 0, err
        assert f"(entry 'model', 7 tensors; consolidated from the DTensor shards of {ranks})" in out
        tensors = load_file(str(out_file))
        assert {f"model/{k}": sha(v) for k, v in tensors.items()} == {
            k: v for k, v in digests.items() if k.startswith("model/")
        }
    rc, out, err = run_cli(capsys, "export", root, "--step", "5", tmp_path / "rep.safetensors")
    assert rc == 0, err
    assert "consolidated" not in out
    rep = load_file(str(tmp_path / "rep.safetensors"))
    assert rep.keys() == tensors.keys()
    assert all(torch.equal(rep[k], tensors[k]) for k in rep)

    rc, out, err = run_cli(capsys, "export", root, "--step", "3", tmp_path / "all.pt", "--json")
    assert rc == 0, err
    res = json.loads(out)
    assert res["consolidated_from"] == 2
    # The whole state: NumPy's RNG state needs weights_only=False (our own file).
    data = torch.load(tmp_path / "all.pt", weights_only=False)
    assert sha(data["table"]["emb"]) == digests["table/emb"]
    assert set(data["optimizer"]["state"]) == {n for n in tensors if n != "scale"}


def test_export_refuses_per_rank_state(mixed_store, tmp_path, capsys) -> None:
    root, _ = mixed_store
    for argv in (
        [tmp_path / "x.pt"],
        [tmp_path / "x.safetensors"],
        ["--hf", tmp_path / "hf"],
    ):
        rc, out, err = run_cli(capsys, "export", root, "--step", "6", *argv)
        assert rc == 1
        assert out == ""
        assert "per-rank state saved with sharded=True by 2 ranks" in err
        assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == [root]


def test_export_hf_cli(mixed_store, tmp_path, capsys) -> None:
    root, digests = mixed_store
    out_dir = tmp_path / "hf"
    rc, out, err = run_cli(capsys, "export", root, "--step", "3", "--hf", out_dir, "--key", "table")
    assert rc == 0, err
    assert "consolidated from the DTensor shards of 2 ranks" in out
    assert sorted(p.name for p in out_dir.iterdir()) == ["model.safetensors"]
    assert sha(load_file(str(out_dir / "model.safetensors"))["emb"]) == digests["table/emb"]

    rc, out, err = run_cli(
        capsys, "export", root, "--step", "3", "--hf", tmp_path / "hf2", "--max-shard-size", "100B"
    )
    assert rc == 0, err
    # The shards counted, the index named after them (it said "4 files:" and named five).
    shards = sorted(p.name for p in (tmp_path / "hf2").glob("*.safetensors"))
    assert f"{len(shards)} shards: {', '.join(shards)}; and model.safetensors.index.json" in out
    index = json.loads((tmp_path / "hf2" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {k.removeprefix("model/") for k in digests if "model/" in k}
    doc = json.loads(
        run_cli(capsys, "--json", "export", root, "--step", "4", tmp_path / "hf3", "--hf")[1]
    )
    assert (doc["files"], doc["sharding"], doc["world_size"]) == (
        ["model.safetensors"],
        "dtensor",
        1,
    )

    # an existing, non-empty directory is never touched
    rc, out, err = run_cli(capsys, "export", root, "--step", "3", "--hf", out_dir)
    assert rc == 1
    assert f"{out_dir}: exists and is not empty" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--hf", "{tmp}/a", "--force"],
        ["{tmp}/a.safetensors", "--max-shard-size", "1GB"],
        ["--hf", "{tmp}/a", "--max-shard-size", "lots"],
        ["--hf", "{tmp}/a", "--max-shard-size", "0"],
    ],
)
def test_export_hf_usage_errors(store: Path, tmp_path: Path, argv: list[str], capsys) -> None:
    rc, out, err = run_cli(
        capsys, "export", store, "--step", "10", *[a.format(tmp=tmp_path) for a in argv]
    )
    assert rc == 2, err
    assert out == ""
    assert "usage: ckptstore export" in err
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_export_never_replaces_a_file_made_while_it_ran(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The "does OUT exist" check ran once, before the step was read; the final rename then
    replaced a file made meanwhile (another export, the user's). Published with link(2)
    now: that file is kept, PathExistsError says so; --force still replaces."""
    from ckptstore.errors import PathExistsError
    from ckptstore.ops.export import export_step

    for name in ("a.pt", "a.safetensors"):
        out = tmp_path / name

        def meanwhile(done: int, total: int | None, what: str, out: Path = out) -> None:
            if done == 1:  # the step is read, the file not written yet
                out.write_bytes(b"the user's file")

        with pytest.raises(PathExistsError, match="made while the export ran") as e:
            export_step(store, 10, out, progress=meanwhile)
        assert e.value.path == str(out)
        assert out.read_bytes() == b"the user's file"
        assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
        export_step(store, 10, out, force=True, progress=meanwhile)
        assert out.read_bytes() != b"the user's file"


def test_export_of_a_step_deleted_meanwhile_says_deleted_not_corrupt(
    store: Path, tmp_path: Path
) -> None:
    from ckptstore.errors import NoCheckpointError
    from ckptstore.ops.export import export_step

    gone = 10

    def retention(done: int, total: int | None, what: str) -> None:
        if done == 0:  # the manifest is read: a running job's retention deletes the step
            shutil.rmtree(store / step_dir(gone))

    with pytest.raises(NoCheckpointError, match="was deleted while it was exported"):
        export_step(store, gone, tmp_path / "a.safetensors", progress=retention)
    assert not (tmp_path / "a.safetensors").exists()


@pytest.mark.parametrize("kind", ["fifo", "device", "huge"])
def test_export_hf_config_that_is_no_regular_file_is_refused_without_blocking(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    # A FIFO hung the export for ever, a device was read as a file.
    config = tmp_path / "config.json"
    if kind == "fifo":
        os.mkfifo(config)
    elif kind == "huge":
        config.write_bytes(b'{"a": "' + b"x" * (16 << 20) + b'"}')
    else:
        config = Path("/dev/null")  # a device: /dev/zero was read without end
    rc, out, err = run_cli(
        capsys, "export", store, "--step", "10", "--hf", tmp_path / "hf", "--config", config
    )
    assert rc == 1
    assert "Traceback" not in out + err
    why = "larger than 16777216 bytes" if kind == "huge" else "not a regular file"
    assert f"{config}: cannot read the model config" in err
    assert why in err
    assert not (tmp_path / "hf").exists()


def test_ls_ranks_text_collapses_runs() -> None:
    from ckptstore.cli.ls import ranks_text

    assert ranks_text([1, 0], 4) == "ranks 0-1 of 4"
    assert ranks_text([0, 2, 3, 5], 8) == "ranks 0,2-3,5 of 8"
    assert ranks_text([3], 4) == "ranks 3 of 4"
    assert ranks_text([], 2) == "ranks none of 2"

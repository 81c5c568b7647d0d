"""Guardrails of the command line (issue 12): a file of a step is checked against its
manifest, random bytes are "not a checkpoint format ckptstore knows", the README's own
quick-start state survives ``export`` then ``import``, and with ``--json`` every error is a
JSON object on stdout as well.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from _helpers import run_cli, step_path
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ckptstore import EMA, CheckpointManager, RNGState, export_step, import_file, verify_path


def flip(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    torch.manual_seed(0)
    with CheckpointManager(root) as mgr:
        mgr.save(7, {"model": nn.Linear(4, 3), "step": 7})
    return root


# ---- verify a file of a step against its manifest -------------------------------------------


def test_verify_a_file_of_a_step_checks_it_against_the_manifest(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = step_path(store, 7) / "model.safetensors"
    rc, out, err = run_cli(capsys, "verify", f)
    assert (rc, err) == (0, "")
    assert out.startswith(f"{f}: OK (1 file, ")
    flip(f)  # a data byte: the header is still fine, so only the CRC32C can tell
    rc, out, _ = run_cli(capsys, "verify", f)
    assert rc == 1
    lines = out.splitlines()
    assert lines[0] == f"{f}: FAILED"
    assert "crc32c" in lines[1]
    assert "does not match the manifest's" in lines[1]
    rc, out, _ = run_cli(capsys, "verify", f, "--json")
    (report,) = json.loads(out)
    assert (report["ok"], report["target"]) == (False, str(f))
    # --quick checks the size against the manifest
    with open(f, "ab") as fh:
        fh.write(b"\0")
    rc, out, _ = run_cli(capsys, "verify", f, "--quick")
    assert rc == 1
    assert "manifest says" in out
    # a lone copy of the file is checked on its own (no manifest beside it): header only
    lone = store.parent / "lone.safetensors"
    lone.write_bytes(f.read_bytes()[:-1])
    (r,) = verify_path(lone)
    assert r.target == str(lone)


def test_verify_manifest_and_unlisted_files_of_a_step(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = step_path(store, 7)
    assert run_cli(capsys, "verify", d / "manifest.json")[0] == 0
    assert run_cli(capsys, "verify", d / "state.json")[0] == 0
    (d / "notes.txt").write_text("mine")
    rc, out, _ = run_cli(capsys, "verify", d / "notes.txt")
    assert rc == 1
    assert "not a file of the checkpoint (its manifest does not list it)" in out
    flip(d / "state.json", 5)
    rc, out, _ = run_cli(capsys, "verify", d / "state.json")
    assert rc == 1
    assert "crc32c" in out


# ---- random bytes -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["random.bin", "random.pt", "random.ckpt"])
def test_random_bytes_are_not_a_known_format(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / name
    f.write_bytes(np.random.default_rng(0).bytes(4096))
    rc, out, _ = run_cli(capsys, "verify", f)
    assert rc == 1
    assert out.splitlines() == [
        f"{f}: FAILED",
        f"    {f}: not a checkpoint format ckptstore knows (neither a torch.save zip archive "
        "nor a safetensors file)",
    ]
    root = tmp_path / "store"
    rc, out, err = run_cli(capsys, "import", f, root, "--step", "1")
    assert (rc, out) == (1, "")
    assert err.startswith(f"ckptstore: error: {f}: not a checkpoint format ckptstore knows; ")
    assert "pickle" not in err
    assert "header" not in err
    assert not root.exists()


def test_a_zip_behind_other_bytes_is_not_called_ok(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """zipfile finds a torch.save archive behind a prefix; torch.load does not. verify took
    it for a zip, checked nothing and said OK, with a flipped byte too (found by review)."""
    good = tmp_path / "good.pt"
    torch.save({"w": torch.arange(64.0)}, good)
    f = tmp_path / "prefixed.pt"
    f.write_bytes(b"\0" * 64 + good.read_bytes())
    rc, out, _ = run_cli(capsys, "verify", f)
    assert rc == 1
    assert out.splitlines() == [
        f"{f}: FAILED",
        f"    {f}: a zip archive with other data before its first record: not a torch.save "
        "archive (torch.load cannot read it)",
    ]


def test_an_import_of_a_dtype_no_format_stores_says_only_that(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The import's rewording of a pickle refusal was applied to a dtype refusal too, and
    advised .to(torch.float32), which drops a complex tensor's imaginary parts."""
    f = tmp_path / "c.pt"
    torch.save({"w": torch.zeros(2, dtype=torch.complex128)}, f)
    rc, out, err = run_cli(capsys, "import", f, tmp_path / "store", "--step", "1")
    assert (rc, out) == (1, "")
    assert err.startswith(
        f"ckptstore: error: {f}: state['model']['w']: tensors of dtype torch.complex128 "
        "cannot be stored"
    )
    assert "torch.view_as_real(t)" in err
    assert "pickle" not in err
    assert "float32" not in err.split("convert it")[1]


def test_a_sharded_import_of_a_file_or_nothing_says_which(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both were "a directory without .metadata is not a torch.distributed.checkpoint"."""
    f = tmp_path / "a.pt"
    torch.save({"w": torch.zeros(2)}, f)
    root = tmp_path / "store"
    rc, _, err = run_cli(capsys, "import", f, root, "--step", "1", "--sharded")
    assert rc == 1
    assert f"{f}: not a directory; --sharded imports a torch.distributed.checkpoint" in err
    rc, _, err = run_cli(capsys, "import", tmp_path / "nope", root, "--step", "1", "--sharded")
    assert rc == 1
    assert f"{tmp_path / 'nope'}: no such file or directory" in err
    assert not root.exists() or not any(root.glob("step-*"))


def test_a_zip_with_two_members_of_one_name_fails_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both CRCs right, the two data/0 members differ: verify said OK, where the loader
    refuses the archive and a zip reader takes either one (found by review)."""
    import io
    import warnings
    import zipfile

    buf = io.BytesIO()
    torch.save({"w": torch.ones(4)}, buf)
    f = tmp_path / "dup.pt"
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(f, "w") as out:
        warnings.simplefilter("ignore")  # zipfile's "Duplicate name"
        for info in src.infolist():
            out.writestr(info.filename, src.read(info.filename))
            if info.filename.endswith("/data/0"):
                dup = info.filename
                out.writestr(dup, torch.full((4,), 7.0).numpy().tobytes())
    rc, out_text, _ = run_cli(capsys, "verify", f)
    assert rc == 1
    assert f"{f}: zip archive has two members named {dup!r}" in out_text
    rc, _, err = run_cli(capsys, "import", f, tmp_path / "store", "--step", "1")
    assert rc == 1
    assert "two members" in err


def test_import_a_safetensors_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import save_file

    sd = {"module.w": torch.arange(6.0).reshape(2, 3), "module.b": torch.ones(3)}
    f = tmp_path / "weights.safetensors"
    save_file(sd, f)
    root = tmp_path / "store"
    rc, out, err = run_cli(capsys, "import", f, root, "--step", "3")
    assert (rc, err) == (0, "")
    assert "note: a safetensors file" in out
    assert "stripped 'module.'" in out
    with CheckpointManager(root) as mgr:
        got = mgr.load(3)
    assert torch.equal(got["model"]["w"], sd["module.w"])


# ---- export then import: the README's quick-start state -----------------------------------------


def _readme_state(seed: int) -> dict[str, object]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10_000)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "ema": EMA(ema, source=model),
        "rng": RNGState(),
        "step": 0,
    }


def test_export_then_import_round_trips_the_readme_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = _readme_state(0)
    model = state["model"]
    assert isinstance(model, nn.Module)
    opt = state["optimizer"]
    assert isinstance(opt, torch.optim.Optimizer)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        state["scheduler"].step()  # type: ignore[attr-defined]
        state["ema"].ema.update_parameters(model)  # type: ignore[attr-defined]
    np.random.seed(1234)
    state["step"] = 499
    src = tmp_path / "runs" / "ckpt"
    with CheckpointManager(src, keep=3) as mgr:
        mgr.save(499, state, metrics={"val_loss": 0.31})
        saved = mgr.load(499)

    out = tmp_path / "state.pt"
    rc, text, err = run_cli(capsys, "export", src, "--step", "499", out)
    assert (rc, err) == (0, "")
    assert "the whole state" in text
    dst = tmp_path / "imported"
    rc, text, err = run_cli(capsys, "import", out, dst, "--step", "499")
    assert (rc, err) == (0, ""), err
    assert text.splitlines()[-1].startswith(f"imported {out} as step 499 (")

    with CheckpointManager(dst) as mgr:
        back = mgr.load(499)
    assert set(back) == set(saved)
    np_state = back["rng"]["numpy"]
    assert isinstance(np_state[1], np.ndarray)
    assert np_state[1].dtype == np.uint32
    assert np.array_equal(np_state[1], saved["rng"]["numpy"][1])
    for key in ("model", "optimizer"):
        assert json.dumps(back[key], default=repr, sort_keys=True) == json.dumps(
            saved[key], default=repr, sort_keys=True
        )
    # and it restores into the README's state: the model, the EMA and the generators
    fresh = _readme_state(1)
    with CheckpointManager(dst) as mgr:
        assert mgr.restore(fresh) == 499
    fresh_model = fresh["model"]
    assert isinstance(fresh_model, nn.Module)
    for a, b in zip(fresh_model.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert np.random.get_state()[1].tolist() == saved["rng"]["numpy"][1].tolist()

    # the library functions are the same operations
    again = tmp_path / "again.pt"
    assert export_step(src, 499, again).format == "torch"
    assert import_file(again, tmp_path / "again", 1).keys == [str(k) for k in saved]


def test_import_still_refuses_code_next_to_numpy(tmp_path: Path) -> None:
    import argparse

    from ckptstore import CkptStoreError

    f = tmp_path / "mixed.pt"
    torch.save({"rng": np.arange(3, dtype=np.uint32), "args": argparse.Namespace(lr=1)}, f)
    with pytest.raises(CkptStoreError, match=r"needs code to load.*argparse\.Namespace"):
        import_file(f, tmp_path / "s", 1)
    res = import_file(f, tmp_path / "s", 1, skip_unsafe=True)
    assert res.keys == ["rng"]
    assert any("['args']" in n for n in res.notes)


# ---- --json errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        (["ls", "{missing}"], 1, "NoCheckpointError", "no such directory"),
        (["verify", "{root}", "--step", "3"], 1, "NoCheckpointError", "no committed checkpoint"),
        (["inspect", "{root}", "--step", "3"], 1, "NoCheckpointError", "no committed checkpoint"),
        (["export", "{root}", "--step", "7", "{root}"], 1, "PathExistsError", "already exists"),
        (["import", "{missing}", "{root}", "--step", "1"], 1, "PathNotFoundError", "no such file"),
        (["ls", "{root}", "--storage-option", "a=b"], 2, "UsageError", "fsspec URLs"),
        (["verify", "{root}", "--step", "x"], 2, "UsageError", "not an integer step"),
        (["prune", "{root}"], 2, "UsageError", "say what to keep"),
        (["bogus"], 2, "UsageError", "invalid choice"),
    ],
)
def test_json_errors_are_json_on_stdout(
    store: Path,
    tmp_path: Path,
    case: tuple[list[str], int, str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv, code, kind, says = case
    args = [a.format(root=store, missing=tmp_path / "missing") for a in argv]
    rc, out, err = run_cli(capsys, *args, "--json")
    assert rc == code
    doc = json.loads(out)
    assert set(doc) == {"error", "message"}
    assert doc["error"] == kind
    assert says in doc["message"]
    assert "\n" not in doc["message"]
    assert "Traceback" not in err
    assert says in err  # the line on stderr is still there
    # without --json, stdout stays empty
    rc, out, _ = run_cli(capsys, *args)
    assert (rc, out) == (code, "")


def test_no_traceback_for_an_unreadable_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads everything")
    root = tmp_path / "locked"
    root.mkdir(mode=0)
    try:
        rc, out, err = run_cli(capsys, "ls", root)
    finally:
        root.chmod(0o755)
    assert (rc, out) == (1, "")
    assert "Permission denied" in err
    assert "Traceback" not in err

"""Tests of finding and opening existing stores (``ckptstore.ops.stores``) and of listing them
(``ckptstore.ops.listing``): "no store there" for every wrong root, the stores of a Lightning
checkpoint directory, and one-line errors for an object store that cannot be reached (a real
S3 endpoint: moto's server, stopped, with wrong credentials, without the bucket).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from _helpers import run_cli

from ckptstore import CheckpointManager, NoCheckpointError, list_store, list_stores
from ckptstore.ops.stores import find_stores, open_store


def make_store(root: Path, steps: tuple[int, ...] = (1,), **metrics: float) -> Path:
    with CheckpointManager(root, keep=None) as mgr:
        for s in steps:
            mgr.save(s, {"x": torch.full((2,), float(s))}, metrics=metrics or None)
    return root


# ---- wrong roots ------------------------------------------------------------------------------


def test_ls_etc_says_there_is_no_store(capsys: pytest.CaptureFixture[str]) -> None:
    if not os.path.isdir("/etc"):
        pytest.skip("no /etc")
    rc, out, err = run_cli(capsys, "ls", "/etc")
    assert (rc, out) == (1, "")
    assert err.startswith("ckptstore: error: /etc: no store there")
    assert err.count("\n") == 1


def test_a_file_and_a_step_directory_are_not_stores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_store(tmp_path / "ckpt", (1, 2))
    f = tmp_path / "file.txt"
    f.write_text("x")
    rc, _, err = run_cli(capsys, "ls", f)
    assert rc == 1
    assert f"{f}: not a directory" in err
    step = root / "step-000000000002"
    rc, out, err = run_cli(capsys, "ls", step)
    assert (rc, out) == (1, "")
    assert err == (
        f"ckptstore: error: {step} is the checkpoint of step 2, not a store; the store is {root}\n"
    )
    with pytest.raises(NoCheckpointError, match="not a store; the store is"):
        open_store(step)


def test_an_empty_directory_is_an_empty_store(tmp_path: Path) -> None:
    storage, stores = find_stores(tmp_path)
    assert stores == [storage]
    assert list_store(tmp_path).steps == []
    assert os.listdir(tmp_path) == []


# ---- a directory of stores (Lightning's dirpath) ----------------------------------------------


@pytest.fixture
def lightning_dir(tmp_path: Path) -> Path:
    """What ``ModelCheckpoint(dirpath=d)`` with ``CkptStoreIO`` leaves: one store per name."""
    lightning = pytest.importorskip("lightning")
    del lightning
    from ckptstore.integrations.lightning import CkptStoreIO

    d = tmp_path / "checkpoints"
    io = CkptStoreIO(keep=2)
    for step, name in ((10, "epoch=0-step=10.ckpt"), (20, "epoch=1-step=20.ckpt")):
        ckpt = {"state_dict": {"w": torch.full((3,), float(step))}, "global_step": step}
        io.save_checkpoint(ckpt, d / name)
        io.save_checkpoint(ckpt, d / "last.ckpt")
    (d / "hparams.yaml").write_text("lr: 0.1\n")  # not a store: not listed
    (d / ".last.ckpt.tmp-0123").mkdir()  # hidden: never listed
    return d


def test_ls_lists_each_store_of_a_lightning_directory(
    lightning_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = lightning_dir
    rc, out, err = run_cli(capsys, "ls", d)
    assert (rc, err) == (0, "")
    blocks = out.split("\n\n")
    names = ["epoch=0-step=10.ckpt", "epoch=1-step=20.ckpt", "last.ckpt"]
    assert [b.splitlines()[0] for b in blocks[:3]] == [f"{d / n}:" for n in names]
    assert [ln.split()[0] for ln in blocks[2].splitlines()[2:4]] == ["10", "20"]  # two versions
    assert blocks[0].splitlines()[1].split()[:2] == ["step", "created"]
    assert blocks[-1] == f"3 stores in {d}\n"
    rc, out, _ = run_cli(capsys, "ls", d, "--json")
    doc = json.loads(out)
    assert doc["root"] == str(d)
    assert [s["root"] for s in doc["stores"]] == [str(d / n) for n in names]
    assert [[st["step"] for st in s["steps"]] for s in doc["stores"]] == [[10], [20], [10, 20]]
    res = list_stores(d)
    assert res.nested
    assert [len(s.steps) for s in res.stores] == [1, 1, 2]
    # a command for one store says which stores the directory holds
    rc, _, err = run_cli(capsys, "verify", d)
    assert rc == 1
    assert f"{d}: no store there, but it holds 3 stores (epoch=0-step=10.ckpt, " in err
    assert not (d / ".ckptstore.lock").exists()
    # one of them, as any store
    rc, out, _ = run_cli(capsys, "ls", d / "last.ckpt")
    assert rc == 0
    assert out.splitlines()[-1] == "2 checkpoints, " + out.splitlines()[-1].split(", ")[1]


def test_list_stores_of_a_plain_store_is_not_nested(tmp_path: Path) -> None:
    root = make_store(tmp_path / "s", (3, 4))
    res = list_stores(root)
    assert not res.nested
    assert [s.step for s in res.stores[0].steps] == [3, 4]


# ---- object stores: errors without tracebacks ------------------------------------------------


#: Fail fast against an endpoint that does not answer: one attempt, a short timeout.
FAST = [
    "--storage-option=config_kwargs.retries.max_attempts=1",
    "--storage-option=config_kwargs.connect_timeout=2",
]


@pytest.mark.timeout(60)
def test_s3_missing_bucket_is_no_store(s3: object, capsys: pytest.CaptureFixture[str]) -> None:
    opts = s3.cli_options  # type: ignore[attr-defined]
    for argv in (["ls"], ["verify"], ["gc"], ["prune", "--keep-last", "1"]):
        rc, out, err = run_cli(capsys, argv[0], "s3://nosuchbucket/x", *argv[1:], *opts)
        assert (rc, out) == (1, ""), err
        assert err == (
            "ckptstore: error: s3://nosuchbucket/x: no store there: the bucket 'nosuchbucket' "
            "does not exist; check the bucket name (and the endpoint_url and region storage "
            "options)\n"
        )
    rc, out, _ = run_cli(capsys, "ls", "s3://nosuchbucket/x", "--json", *opts)
    assert rc == 1
    assert json.loads(out)["error"] == "NoCheckpointError"
    # issue 22 #6: a prefix with nothing under it in an existing bucket (a typo) is no store
    # either, as the README promises: on an object store a store exists once it holds a step.
    typo = s3.url("nothing-here")  # type: ignore[attr-defined]
    for argv in (["ls"], ["verify"], ["gc"], ["prune", "--keep-last", "1"]):
        rc, out, err = run_cli(capsys, argv[0], typo, *argv[1:], *opts)
        assert (rc, out) == (1, ""), err
        assert err == (
            f"ckptstore: error: {typo}: no store there: nothing is stored under this prefix; "
            "check the path (on an object store a store exists once its first step is saved)\n"
        )


@pytest.mark.timeout(60)
def test_s3_missing_credentials(
    s3: object, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    url = s3.url("creds")  # type: ignore[attr-defined]
    endpoint = f"--storage-option=endpoint_url={s3.endpoint}"  # type: ignore[attr-defined]
    args = [endpoint, "--storage-option=skip_instance_cache=true", *FAST]
    rc, out, err = run_cli(capsys, "ls", url, *args)
    assert (rc, out) == (1, ""), err
    assert err.startswith(f"ckptstore: error: {url}: no credentials found (")
    assert "AWS_ACCESS_KEY_ID" in err
    assert err.count("\n") == 1
    assert "Traceback" not in err
    rc, out, _ = run_cli(capsys, "verify", url, "--json", *args)
    assert rc == 1
    doc = json.loads(out)
    assert doc["error"] == "StoreUnreachableError"  # a CkptStoreError (OSError)
    assert "no credentials found" in doc["message"]


@pytest.mark.timeout(120)
def test_s3_wrong_credentials(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from s3server import s3_server

    # moto checks credentials once its first N requests are done (here: creating the bucket).
    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "1")
    with s3_server() as ep:
        monkeypatch.delenv("INITIAL_NO_AUTH_ACTION_COUNT")
        url = ep.url("run")
        opts = [
            "--storage-option=key=wrong",
            "--storage-option=secret=wrong",
            f"--storage-option=endpoint_url={ep.endpoint}",
            "--storage-option=skip_instance_cache=true",
        ]
        for argv in (["ls"], ["verify", "--quick"], ["prune", "--keep-last", "1", "--dry-run"]):
            rc, out, err = run_cli(capsys, argv[0], url, *argv[1:], *opts)
            assert (rc, out) == (1, ""), err
            assert err.startswith(f"ckptstore: error: {url}: access denied (")
            assert "check the credentials" in err
            assert err.count("\n") == 1


@pytest.mark.timeout(120)
def test_s3_endpoint_that_does_not_answer(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from s3server import KEY, SECRET, s3_server

    with s3_server() as ep:
        endpoint = ep.endpoint
    # stopped: nothing listens on its port any more
    opts = [
        f"--storage-option=key={KEY}",
        f"--storage-option=secret={SECRET}",
        f"--storage-option=endpoint_url={endpoint}",
        "--storage-option=skip_instance_cache=true",
        *FAST,
    ]
    url = "s3://ckptstore-test/run"
    for argv in (["ls"], ["verify"], ["inspect"], ["rm", "--step", "1"]):
        rc, out, err = run_cli(capsys, argv[0], url, *argv[1:], *opts)
        assert (rc, out) == (1, ""), err
        assert err.startswith(f"ckptstore: error: {url}: cannot reach the storage endpoint (")
        assert "check the endpoint_url storage option" in err
        assert err.count("\n") == 1
    rc, out, _ = run_cli(capsys, "ls", url, "--json", *opts)
    assert json.loads(out)["message"].startswith(f"{url}: cannot reach the storage endpoint")

"""A short run of the crash campaign (tools/crashtest.py), and its checker catching damage.

``make crashtest`` runs the long campaign (300 kills per store, 20 distributed jobs); here it
runs 16 kills on a local store with 2 distributed jobs and 4 kills on S3 (moto on loopback)
in one campaign, and 4 kills of the replica tier's uploader mid-upload to S3 in another.

Each campaign is the tool's ``main`` run in this process, which imported torch already (the
campaign's checker needs it; a fresh interpreter spent 3.5 s of CPU on the import, 2026-11-30);
its fork server, writers, ranks, uploaders and moto's server are still processes of their own.
A hang is caught by the campaign's own waits (each bounded) and by the test's timeout.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from _helpers import REPO, fork_tool_servers

from ckptstore import CheckpointManager
from tests.timing import FACTOR, healthy


def campaign(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
    *args: str,
) -> dict[str, Any]:
    """Run tools/crashtest.py's ``main`` with ``args`` here; its JSON, once it reported no
    violation and exited 0."""
    out = tmp_path / f"{name}.json"
    monkeypatch.syspath_prepend(str(REPO / "tools"))  # as crashtest.py has it; undone after
    # The campaign's slack for a survivor's exit is scaled like the tests' waits: in the fork
    # server's children (read from the environment) and here (read when crashkit.common was
    # first imported, maybe by another test without it).
    monkeypatch.setenv("CKPTSTORE_TEST_SLOWDOWN", str(FACTOR))
    for mod in ("crashkit.common", "crashkit.dist", "crashkit.campaign"):
        monkeypatch.setattr(importlib.import_module(mod), "DIST_SLACK", 5.0 * FACTOR)
    main = importlib.import_module("crashkit.campaign").main
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):  # its checker seeds torch's generator
            rc = main([*args, "--json", str(out)])
    finally:
        torch.set_num_threads(threads)  # the campaign runs on one, as its own process did
    text = capsys.readouterr().out
    assert rc == 0, text[-4000:]
    assert "violations: 0" in text
    return dict(json.loads(out.read_text()))


@pytest.mark.timeout(healthy(150))  # campaigns: minutes on a busy host
def test_short_campaigns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The local and S3 campaigns in one run, one after the other: both keep the CPU busy
    # (the S3 one in moto and s3fs), and one campaign and one fork server, each importing
    # torch, cost less than two of each.
    with_s3 = bool(importlib.util.find_spec("moto") and importlib.util.find_spec("s3fs"))
    fork_tool_servers(monkeypatch)  # its fork server (torch imported), before campaign()
    doc = campaign(
        tmp_path,
        monkeypatch,
        capsys,
        "campaigns",
        *("--store", "both" if with_s3 else "local", "--trials", "16", "--s3-trials", "4"),
        *("--dist-trials", "2", "--upload-trials", "0"),
    )
    assert doc["violations"] == []
    stats = doc["stores"][0]
    assert stats["store"] == "local"
    assert stats["kills"] == stats["trials"] == 16
    assert len(stats["configs"]) == 8  # sync/async x safetensors/torch x keep 1/2
    # The second round of the 8 configurations kills each writer only after a save
    # returned (on any host), the first at any moment from its start.
    assert stats["saves_returned"] >= 8
    dist = doc["dist"]
    assert dist["trials"] == dist["kills"] == dist["survivor_timeouts"] == 2
    assert dist["max_exit_after_kill"] < 3.0 + healthy(5.0)
    if not with_s3:  # pragma: no cover
        pytest.skip("moto or s3fs missing: no S3 campaign")
    (s3,) = doc["stores"][1:]
    assert s3["store"] == "s3"
    assert s3["kills"] == s3["trials"] == 4


@pytest.mark.timeout(300)
def test_short_upload_campaign(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The replica tier's uploader SIGKILLed mid-upload to S3 (its own test: the suite's two
    workers run it beside the campaigns above instead of after them)."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    # Not scaled: on a busy host its time is the uploads', which run at nice 19 (IO_NICE)
    # and yield to every busy process. Under 4 busy loops at nice 0, one whole upload
    # of the 2 steps took 31 s against 0.9 s idle (2026-11-28), and each trial's
    # recovery uploads again: the campaign did not finish in 500 s there (2026-11-23).
    doc = campaign(
        tmp_path,
        monkeypatch,
        capsys,
        "upload",
        *("--store", "local", "--trials", "0", "--dist-trials", "0", "--upload-trials", "4"),
    )
    assert doc["violations"] == []
    ups = doc["uploads"]
    assert ups["trials"] == 4
    assert ups["kills"] >= 2  # a few uploads may finish before their kill
    assert ups["killed_mid_upload"] + ups["complete_at_kill"] > 0


# ---- the checker has teeth --------------------------------------------------------------------


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ct() -> ModuleType:
    """tools/crashkit/writers.py: the writer trials' Store, StoreStats and Checker."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        return importlib.import_module("crashkit.writers")
    finally:
        sys.path.remove(str(REPO / "tools"))


def _store(ct: ModuleType, root: Path, steps: range) -> object:
    cw = _load("crash_writer", REPO / "tools" / "crash_writer.py")
    state = cw.make_state()
    with CheckpointManager(root, keep=2) as mgr:
        for s in steps:
            cw.fill(state, s)
            mgr.save(s, state)
    store = ct.Store(str(root), "safetensors", False, 2, None)
    store.newest = steps[0] - 1
    return store


def test_checker_catches_a_lost_save(ct: ModuleType, tmp_path: Path) -> None:
    store = _store(ct, tmp_path / "s", range(3))
    stats = ct.StoreStats("local")
    # The writer said step 3 was saved, but the store's newest is 2.
    bad = ct.Checker().check(store, ["start 0", "returned 3", "saved 3"], stats)
    assert any("step 3 was saved" in b for b in bad), bad


def test_checker_catches_a_corrupt_newest(ct: ModuleType, tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = _store(ct, root, range(3))
    p = root / "step-000000000002" / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF
    p.write_bytes(bytes(data))
    bad = ct.Checker().check(store, ["start 0", "returned 2", "saved 2"], ct.StoreStats("x"))
    assert any("does not verify" in b for b in bad), bad


def test_checker_catches_a_step_retention_should_have_kept(ct: ModuleType, tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = _store(ct, root, range(3))  # keep=2: steps 1 and 2
    (root / "step-000000000001" / "manifest.json").unlink()
    bad = ct.Checker().check(store, ["start 0", "returned 2", "saved 2"], ct.StoreStats("x"))
    assert any("[1] lost" in b for b in bad), bad

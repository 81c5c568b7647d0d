"""A short sharded crash campaign (tools/crash_sharded.py), and its checker catching damage.

``make crashtest-sharded`` runs the long campaign; here a few trials of FSDP2 jobs on 2 and 3
ranks (gloo, real processes) are killed, and the checker is shown to report a flipped byte and
a step that holds another step's values.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from _helpers import REPO, fork_tool_servers

from ckptstore import CheckpointManager
from tests.timing import FACTOR, healthy

TOOL = REPO / "tools" / "crash_sharded.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("crash_sharded", TOOL)
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(healthy(150))
def test_short_sharded_campaign(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sharded.json"
    fork_tool_servers(monkeypatch)  # its fork server, before the environment changes
    # The campaign's slack for a survivor's report is scaled like the tests' waits (read when
    # the tool is loaded, and by its fork server from the environment).
    monkeypatch.setenv("CKPTSTORE_TEST_SLOWDOWN", str(FACTOR))
    # Its main, in this process: torch is imported here already (the campaign's own
    # interpreter spent 5 s of CPU on torch and torch._dynamo for its checks, 2026-11-30).
    # The fork server and the ranks are processes of their own; every wait of the campaign
    # is bounded, and the test's timeout catches the rest.
    # Seed 31's three trials draw each fault once: 2 ranks on a shared root, async, all
    # killed (then the 3-rank restore of what it left); 2 ranks on node-local roots with a
    # replica, async, one frozen; 3 ranks on a shared root, sync, one killed at a wait.
    args = ["--trials", "3", "--seed", "31", "--wide-every", "3", "--json", str(out)]
    with torch.random.fork_rng(devices=[]):  # its checks seed torch's generator
        rc = _tool().main(args)
    stdout = capsys.readouterr().out
    assert rc == 0, stdout[-4000:]
    report = json.loads(out.read_text())
    assert report["violations"] == []
    assert report["trials"] == {
        "2 ranks, shared, async, kill-all": 1,
        "2 ranks, node-local+replica, async, stop-one": 1,
        "3 ranks, shared, sync, kill-one": 1,
    }
    assert "3 sharded trials" in stdout


def _store(tmp_path: Path, values_of: int) -> tuple[Any, dict[str, Any]]:
    """A one-process store whose step 3 holds the campaign's values of step ``values_of``."""
    tool = _tool()
    root = tmp_path / "node0"
    model, opt = tool.build(1)
    tool.set_values(model, opt, values_of)
    with CheckpointManager(str(root)) as mgr:
        mgr.save(3, {"model": model, "optimizer": opt, "step": 3})
    job = {"roots": [str(root)], "nodes": False, "replica": None}
    return tool, job


def test_checker_accepts_a_good_step(tmp_path: Path) -> None:
    tool, job = _store(tmp_path, 3)
    assert tool.check_restores(job) == []


def test_checker_reports_a_flipped_byte(tmp_path: Path) -> None:
    tool, job = _store(tmp_path, 3)
    step_dir = Path(job["roots"][0]) / "step-000000000003"
    payload = next(p for p in sorted(step_dir.iterdir()) if p.name.startswith("model"))
    data = bytearray(payload.read_bytes())
    data[-3] ^= 0x10
    payload.write_bytes(bytes(data))
    os.sync()
    problems = tool.check_restores(job)
    assert len(problems) == 1
    assert "fails deep verify" in problems[0]
    assert payload.name in problems[0]


def test_checker_reports_wrong_values(tmp_path: Path) -> None:
    tool, job = _store(tmp_path, 4)  # step 3 holding step 4's values
    problems = tool.check_restores(job)
    assert len(problems) == 1
    assert "step 3 restored in one process differs" in problems[0]

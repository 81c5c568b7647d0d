"""A short sharded crash campaign (tools/crash_sharded.py), and its checker catching damage.

``make crashtest-sharded`` runs the long campaign; here a few trials of FSDP2 jobs on 2 and 3
ranks (gloo, real processes) are killed, and the checker is shown to report a flipped byte and
a step that holds another step's values.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from _helpers import REPO, subprocess_env

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
def test_short_sharded_campaign(tmp_path: Path) -> None:
    out = tmp_path / "sharded.json"
    # Seed 31's three trials draw each fault once: 2 ranks on a shared root, async, all
    # killed (then the 3-rank restore of what it left); 2 ranks on node-local roots with a
    # replica, async, one frozen; 3 ranks on a shared root, sync, one killed at a wait.
    cmd = [sys.executable, str(TOOL), "--trials", "3", "--seed", "31", "--wide-every", "3"]
    proc = subprocess.run(
        [*cmd, "--json", str(out)],
        env={**subprocess_env(), "CKPTSTORE_TEST_SLOWDOWN": str(FACTOR)},
        capture_output=True,
        text=True,
        timeout=healthy(140),
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["violations"] == []
    assert report["trials"] == {
        "2 ranks, shared, async, kill-all": 1,
        "2 ranks, node-local+replica, async, stop-one": 1,
        "3 ranks, shared, sync, kill-one": 1,
    }
    assert "3 sharded trials" in proc.stdout


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

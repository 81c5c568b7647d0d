"""``_once.made_once``: a module's costly job runs once a pytest run, not once a worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import REPO, subprocess_env
from _once import made_once

# Two processes as two xdist workers (popen-gw0, popen-gw1 under one run's directory) ask
# for the same job at once; it sleeps so that the second asks while the first makes it.
WORKER = """
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from _once import made_once

class Factory:
    def getbasetemp(self):
        return Path(sys.argv[1])

def make(out):
    with open(out.parent / "calls", "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
    time.sleep(1.0)
    (out / "result").write_text("made")
    if sys.argv[2] == "fail":
        raise RuntimeError("the job broke")
    return {{"by": os.environ["PYTEST_XDIST_WORKER"]}}

try:
    out, value = made_once(Factory(), "job", make)
except BaseException as e:
    print(json.dumps({{"error": type(e).__name__, "message": str(e)}}))
else:
    print(json.dumps({{"out": str(out), "value": value, "result": (out / "result").read_text()}}))
"""


def _workers(run: Path, mode: str) -> list[dict[str, object]]:
    code = WORKER.format(tests=str(REPO / "tests"))
    procs = []
    for i in range(2):
        (run / f"popen-gw{i}").mkdir(exist_ok=True)
        env = dict(subprocess_env(), PYTEST_XDIST_WORKER=f"gw{i}")
        argv = [sys.executable, "-c", code, str(run / f"popen-gw{i}"), mode]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    return [json.loads(o) for o in outs]


@pytest.mark.timeout(90)
def test_two_workers_share_one_making_of_the_job(tmp_path: Path) -> None:
    a, b = _workers(tmp_path, "ok")
    assert (tmp_path / "calls").read_text().count("\n") == 1  # made once, by one of them
    maker = (tmp_path / "calls").read_text().strip()
    made = {"out": str(tmp_path / "once-job"), "value": {"by": maker}, "result": "made"}
    assert a == b == made
    # A later caller (a worker whose module fixture was set up again) reuses it too.
    again = _workers(tmp_path, "ok")
    assert again == [a, b]
    assert (tmp_path / "calls").read_text().count("\n") == 1


@pytest.mark.timeout(90)
def test_a_job_that_failed_fails_every_caller_with_its_message(tmp_path: Path) -> None:
    got = _workers(tmp_path, "fail")
    assert (tmp_path / "calls").read_text().count("\n") == 1  # not made again by the other
    first, later = sorted(got, key=lambda r: r["error"] != "RuntimeError")
    assert first == {"error": "RuntimeError", "message": "the job broke"}
    assert later["error"] == "Failed"
    assert later["message"] == "job, made once for the run, failed:\nRuntimeError: the job broke"


def test_without_xdist_the_run_directory_is_the_base_itself(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Factory:
        def getbasetemp(self) -> Path:
            return base

    base = tmp_path_factory.mktemp("run")
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    calls: list[Path] = []

    def make(out: Path) -> list[int]:
        calls.append(out)
        return [1, 2]

    assert made_once(Factory(), "x", make) == (base / "once-x", [1, 2])
    assert made_once(Factory(), "x", make) == (base / "once-x", [1, 2])
    assert calls == [base / "once-x"]
    assert os.path.isdir(base / "once-x")

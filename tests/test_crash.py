"""Crash safety: SIGKILL a writer (tools/crash_writer.py) anywhere, the store stays whole.

Two ways to pick the moment: timed kills at random delays while the writer saves in a loop,
and a deterministic sweep where the writer kills itself at every ``os.fsync``/``os.rename``
of one save, before or after the call. After every kill the store is checked from this
process: the newest step verifies deeply, loads and holds exactly its own data; no save
that returned is lost; retention kept what it must; ``gc`` leaves no ``.tmp-``/``.trash-``;
a new manager saves the next step.

The writers are forked by one fork server (``crash_writer.py --serve``) so that torch is
imported once, not once per kill; the server itself is forked from the test fork server
(``tests/multirank/launch.py``, ``spawn_piped``) where there is one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from _helpers import REPO, LineReader, subprocess_env

from ckptstore import CheckpointManager
from ckptstore.storage import wait_for_deletions
from tests.timing import healthy

WRITER = REPO / "tools" / "crash_writer.py"
CONFIGS = [("safetensors", False), ("torch", False), ("safetensors", True), ("torch", True)]
IDS = [f"{f}-{'async' if a else 'sync'}" for f, a in CONFIGS]
KILLS = 5  # timed kills per configuration


def _load_writer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("crash_writer", WRITER)
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


cw = _load_writer()


class Server:
    """The fork server and the output of the writers it forks."""

    def __init__(self) -> None:
        from tests.multirank.launch import piped_spawner

        cmd = [sys.executable, str(WRITER), "--serve"]
        # Forked from the test fork server where there is one (torch and ckptstore imported
        # there once: 4 s of CPU a fresh interpreter), else a fresh interpreter.
        spawn = piped_spawner()
        self.proc: Any = (spawn and spawn(cmd, subprocess_env(), True)) or subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=subprocess_env(),
        )
        self.out = LineReader(self.proc.stdout)
        self.child: int | None = None

    def start(self, **opts: Any) -> int:
        """Fork a writer; returns its pid once it runs."""
        self._mark = len(self.out.lines)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(opts) + "\n")
        self.proc.stdin.flush()
        self.child = int(self.out.until("pid ", timeout=healthy(30)).split()[1])
        return self.child

    def finish(self, timeout: float = 30) -> tuple[str, list[str]]:
        """Wait for the writer to end: ``("signal 9" | "code 0" | ..., its output)``; ``timeout``
        is an idle host's figure, scaled (tests/timing.py)."""
        line = self.out.until("exit ", timeout=healthy(timeout))
        self.child = None
        return " ".join(line.split()[2:]), self.out.lines[self._mark : -1]

    def close(self) -> None:
        if self.child is not None:  # a test failed while a writer ran: never leave it behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child, signal.SIGKILL)
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


def numbers(lines: list[str], word: str) -> list[int]:
    return [int(line.split()[1]) for line in lines if line.startswith(word + " ")]


_STATE: dict[str, Any] = {}


def check_store(root: Path, fmt: str) -> list[int]:
    """What every kill must leave: whole checkpoints only, and a store that works on."""
    with CheckpointManager(root, keep=2, format=fmt) as mgr:
        steps = mgr.steps()
        if steps:
            newest = steps[-1]
            report = mgr.verify(newest, deep=True)
            assert report.ok, report.problems
            cw.check_loaded(mgr.load(newest), newest)
            for s in steps[:-1]:
                report = mgr.verify(s, deep=False)
                assert report.ok, report.problems
        mgr.gc()
        wait_for_deletions()
        leftovers = [n for n in os.listdir(root) if n.startswith((".tmp-", ".trash-"))]
        assert leftovers == []
        assert mgr.steps() == steps
        nxt = steps[-1] + 1 if steps else 0
        if not _STATE:
            _STATE.update(cw.make_state())
        cw.fill(_STATE, nxt)
        mgr.save(nxt, _STATE)
    return steps


@pytest.mark.timeout(healthy(60))  # a whole sweep: minutes on a busy host
@pytest.mark.parametrize(("fmt", "async_save"), CONFIGS, ids=IDS)
def test_random_kills(server: Server, tmp_path: Path, fmt: str, async_save: bool) -> None:
    rng = random.Random(f"{fmt}-{async_save}")
    root = tmp_path / "store"
    newest_known: int | None = None
    kills = 0
    for _ in range(KILLS):
        pid = server.start(root=str(root), format=fmt, async_save=async_save, keep=2)
        server.out.until("start ", timeout=healthy(30))
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(pid, signal.SIGKILL)
        status, lines = server.finish()
        assert status == f"signal {signal.SIGKILL}", lines[-20:]
        kills += 1
        saved = numbers(lines, "saved")
        returned = numbers(lines, "returned")
        start = numbers(lines, "start")[0]
        assert start == (newest_known + 1 if newest_known is not None else 0)

        steps = check_store(root, fmt)
        newest = steps[-1] if steps else None
        last_saved = saved[-1] if saved else newest_known
        if last_saved is None:
            assert newest is None or newest == 0
        else:
            assert newest is not None
            assert newest >= last_saved, f"step {last_saved} returned from save but is gone"
            assert newest <= last_saved + 1
            if returned:
                assert newest <= returned[-1] + (0 if async_save else 1)
            # Retention (keep=2) never removed one of the two newest.
            expected = {s for s in (newest - 1, newest) if s >= 0}
            assert expected <= set(steps) <= expected | {newest - 2}
        # check_store saved the step after the newest one.
        newest_known = newest + 1 if newest is not None else 0
    assert kills == KILLS


def trace_of(server: Server, root: Path, fmt: str, async_save: bool) -> list[str]:
    """The os.fsync/os.rename calls of one save (with retention), in order."""
    server.start(root=str(root), format=fmt, async_save=async_save, steps=2, crash_at=0)
    status, lines = server.finish()
    assert status == "code 0", lines
    calls = [line.split(" ", 2)[2] for line in lines if line.startswith("call ")]
    assert calls
    return calls


@pytest.mark.timeout(healthy(60))  # a whole sweep: minutes on a busy host
@pytest.mark.parametrize(("fmt", "async_save"), CONFIGS, ids=IDS)
def test_kill_at_every_protocol_point(
    server: Server, tmp_path: Path, fmt: str, async_save: bool
) -> None:
    root = tmp_path / "store"
    with CheckpointManager(root, keep=2, format=fmt) as mgr:  # two steps already there
        for s in (0, 1):
            state = cw.make_state()
            cw.fill(state, s)
            mgr.save(s, state)
    calls = trace_of(server, root, fmt, async_save)  # saves 2 and 3 (armed), leaves {2, 3}
    # The commit is the rename of the tmp directory; retention's rename comes after it.
    commit = next(i for i, c in enumerate(calls, 1) if c.startswith("rename .tmp-step-"))
    trash = next(i for i, c in enumerate(calls, 1) if c.startswith("rename step-"))
    assert calls[commit - 2].startswith("fsync .tmp-step-"), "tmp dir fsynced before the rename"
    assert calls[commit - 3] == "fsync manifest.json", "the manifest is the last file written"
    assert calls[commit] == f"fsync {root.name}", "the root is fsynced after the rename"
    assert commit < trash, "retention runs only after the commit"
    assert len(calls) == trash + 1

    newest = max(check_store(root, fmt)) + 1  # check_store saves one more step
    swept = 0
    # Before every call; "after" only for the last one (after call n, the disk is as it is
    # before call n + 1); and one round past the end, where the writer is not killed.
    points = [(n, "before") for n in range(1, len(calls) + 1)]
    points += [(len(calls), "after"), (len(calls) + 1, "before")]
    for n, when in points:
        first, armed = newest + 1, newest + 2  # the writer saves these two
        server.start(
            root=str(root),
            format=fmt,
            async_save=async_save,
            steps=2,
            crash_at=n,
            crash_when=when,
            resume=False,  # the checker loads every step; the writer only needs its number
        )
        status, lines = server.finish()
        assert numbers(lines, "saved")[:1] == [first], lines
        if n > len(calls):
            assert status == "code 0", lines
            assert numbers(lines, "saved") == [first, armed]
        else:
            assert status == f"signal {signal.SIGKILL}", lines
            swept += 1
        past = n > len(calls)
        committed = past or n > commit or (n == commit and when == "after")
        deleted = past or n > trash or (n == trash and when == "after")
        if not committed:  # the previous checkpoint is the newest
            expected = {newest, first}
        elif not deleted:  # committed; retention has not removed the oldest yet
            expected = {newest, first, armed}
        else:
            expected = {first, armed}
        steps = check_store(root, fmt)
        assert set(steps) == expected, (n, when, calls[n - 1 : n])
        newest = max(steps) + 1
    assert swept == len(calls) + 1

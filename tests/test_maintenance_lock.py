"""A job's first save waits for a maintenance command at work; another job is refused at once.

A job (re)started while a cron ``ckptstore prune`` held the store's writer lock (its deep
verify takes minutes on a large store) failed its first save with ``StoreLockedError``.
Maintenance commands now also hold a ``flock`` on the store's root directory, and a save
that finds the writer lock taken waits for such a command, up to half its
``barrier_timeout``.
The command runs for real (``prune_store``) in a thread: ``flock`` locks open file
descriptions, so its lock excludes the job's manager in this process as in another one.
Only the length of its deep verify is stretched (an event it waits for), the one fault
this cannot cause otherwise.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointManager, StoreLockedError
from ckptstore.ops import steps as ops_steps
from ckptstore.storage import LocalStorage, wait_for_deletions

pytestmark = pytest.mark.timeout(60)


def _store(root: Path) -> None:
    with CheckpointManager(root, keep=None) as mgr:
        mgr.save(1, {"x": torch.tensor([1.0])})
        mgr.save(2, {"x": torch.tensor([2.0])})


class _SlowPrune:
    """``prune_store`` in a thread, held inside its writer lock until :meth:`go`."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.inside = threading.Event()
        self._go = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        real = ops_steps._last_good

        def slow_last_good(*args: Any, **kwargs: Any) -> Any:
            self.inside.set()
            assert self._go.wait(30), "the test never let the prune go on"
            return real(*args, **kwargs)

        monkeypatch.setattr(ops_steps, "_last_good", slow_last_good)
        self._thread = threading.Thread(target=self._run, args=(root,), daemon=True)
        self._thread.start()
        assert self.inside.wait(30), "the prune never took the lock"

    def _run(self, root: Path) -> None:
        try:
            self.result = ops_steps.prune_store(root, 1)
        except BaseException as e:
            self.error = e

    def go(self) -> None:
        self._go.set()
        self._thread.join(30)
        assert not self._thread.is_alive()
        assert self.error is None, self.error


def _save_in_thread(mgr: CheckpointManager, step: int) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            mgr.save(step, {"x": torch.tensor([float(step)])})
            out.append("saved")
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_first_save_waits_for_a_prune_at_work_then_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "s"
    _store(root)
    prune = _SlowPrune(root, monkeypatch)
    mgr = CheckpointManager(root, keep=None, barrier_timeout=60)
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        t, out = _save_in_thread(mgr, 3)
        # The save waits while the prune holds the lock (it was refused at once before).
        t.join(1.0)
        assert t.is_alive()
        assert out == [], out
        assert any("maintenance command" in r.getMessage() for r in caplog.records)
        prune.go()
        t.join(30)
    assert out == ["saved"], out
    assert prune.result.deleted == [1]
    wait_for_deletions()
    assert mgr.steps() == [2, 3]
    assert mgr.load()["x"].tolist() == [3.0]
    mgr.close()


def test_a_prune_outlasting_the_wait_refuses_the_save_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "s"
    _store(root)
    prune = _SlowPrune(root, monkeypatch)
    mgr = CheckpointManager(root, keep=None, barrier_timeout=1.0)  # waits 0.5 s at most
    with pytest.raises(StoreLockedError) as ei:
        mgr.save(3, {"x": torch.tensor([3.0])})
    msg = str(ei.value)
    assert "maintenance command" in msg, msg
    assert "over 0.5s" in msg, msg
    assert "nothing was written" in msg
    prune.go()
    wait_for_deletions()
    assert mgr.steps() == [2]
    assert mgr.load()["x"].tolist() == [2.0]
    mgr.save(3, {"x": torch.tensor([3.0])})  # the command ended: the lock is free
    assert mgr.steps() == [2, 3]
    mgr.close()


def test_another_job_is_still_refused_at_once(tmp_path: Path) -> None:
    """A job holds no marker: the second one does not wait (60 s of test timeout against
    a wait of 300 s) and is told about the other job."""
    root = tmp_path / "s"
    _store(root)
    with CheckpointManager(root, keep=None) as job:
        job.save(3, {"x": torch.tensor([3.0])})
        other = CheckpointManager(root, keep=None, barrier_timeout=600)
        with pytest.raises(StoreLockedError) as ei:
            other.save(4, {"x": torch.tensor([4.0])})
        assert "locked by another writer" in str(ei.value)
        other.close()
    assert CheckpointManager(root).steps() == [1, 2, 3]


def test_a_job_holding_the_lock_refuses_the_command_which_leaves_no_marker_held(
    tmp_path: Path,
) -> None:
    root = tmp_path / "s"
    _store(root)
    with CheckpointManager(root, keep=None) as job:
        job.save(3, {"x": torch.tensor([3.0])})
        with pytest.raises(StoreLockedError, match="nothing was deleted"):
            ops_steps.prune_store(root, 1)
        # The refused command gave its marker back: no job waits for it.
        probe = LocalStorage(root).writer_lock()
        assert not probe._maintenance_at_work()  # type: ignore[attr-defined]
    assert CheckpointManager(root).steps() == [1, 2, 3]

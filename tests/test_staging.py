"""Async save: one memory copy on the caller's path, one writer in the background."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import (
    STORE_FILES,
    assert_same,
    make_state,
    module_bytes,
    run_python,
    step_dir,
    step_path,
)

from ckptstore import CheckpointManager, CommitError, SaveHandle, StepExistsError
from ckptstore.integrity import CRCWriter
from ckptstore.save.staging import StagingPool
from ckptstore.storage import Storage, wait_for_deletions
from ckptstore.storage.directio import DirectWriter


class Gate:
    """Holds the background writer at the start of a save until opened."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def open(self) -> None:
        self.opened.set()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real = Storage.begin

        def begin(storage: Storage, step: int, **kwargs: Any) -> Any:
            self.entered.set()
            assert self.opened.wait(20), "the test never opened the gate"
            return real(storage, step, **kwargs)

        monkeypatch.setattr(Storage, "begin", begin)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate()
    g.install(monkeypatch)
    yield g
    g.open()


def entries(root: Path) -> list[str]:
    wait_for_deletions()
    return sorted(n for n in os.listdir(root) if n not in STORE_FILES)


@pytest.mark.timeout(60)
def test_mutating_after_save_returns_does_not_change_what_is_saved(
    tmp_path: Path, gate: Gate
) -> None:
    state = make_state(1)
    model, opt = state["model"], state["optimizer"]
    expected_model = module_bytes(model)
    expected_opt = opt.state_dict()
    expected_opt = {
        "state": {k: {n: v.clone() for n, v in s.items()} for k, s in expected_opt["state"].items()}
    }
    with CheckpointManager(tmp_path / "s", async_save=True) as mgr:
        handle = mgr.save(1, state)
        assert isinstance(handle, SaveHandle)
        assert not handle.done(), "the write waits at the gate"
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1)
            for s in opt.state.values():
                s["exp_avg"].mul_(-3)
        model.calls.fill_(99)
        assert gate.entered.wait(10)
        gate.open()
        manifest = handle.wait(timeout=20)
        assert handle.done()
        assert manifest.step == 1
        loaded = mgr.load(1)
    assert_same(dict(loaded["model"]), expected_model)
    for k, s in expected_opt["state"].items():
        assert_same(loaded["optimizer"]["state"][k]["exp_avg"], s["exp_avg"])


@pytest.mark.timeout(60)
def test_at_most_one_save_in_flight(tmp_path: Path, gate: Gate) -> None:
    with CheckpointManager(tmp_path / "s", async_save=True) as mgr:
        h1 = mgr.save(1, {"x": torch.ones(4)})
        assert gate.entered.wait(10)
        threading.Timer(0.3, gate.open).start()
        t0 = time.monotonic()
        h2 = mgr.save(2, {"x": torch.ones(4) * 2})
        assert time.monotonic() - t0 >= 0.25, "the second save waited for the first"
        assert h1.done()
        assert h1.wait().step == 1
        assert h2.wait(timeout=20).step == 2
        assert mgr.steps() == [1, 2]


def test_staging_buffers_are_reused(tmp_path: Path) -> None:
    state = make_state(1)
    with CheckpointManager(tmp_path / "s", async_save=True) as mgr:
        pool: StagingPool = mgr._staging
        mgr.save(1, state)
        mgr.wait()
        ptrs = {k: b.data_ptr() for k, b in pool._bufs.items()}
        allocated = pool.allocated_bytes
        assert ptrs
        assert allocated > 0
        for step in (2, 3):
            with torch.no_grad():
                state["model"].fc1.weight.add_(1)
            mgr.save(step, state)
            mgr.wait()
            assert {k: b.data_ptr() for k, b in pool._bufs.items()} == ptrs
            assert pool.allocated_bytes == allocated
        assert_same(mgr.load(3)["model"]["fc1.weight"], state["model"].fc1.weight.detach())
        # A state that changed shape drops the buffers it no longer uses.
        mgr.save(4, {"other": torch.zeros(3)})
        mgr.wait()
        assert len(pool._bufs) == 1
        assert next(iter(pool._bufs)).startswith("other/")


def _enospc(*args: Any, **kwargs: Any) -> Any:
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reported_by", ["save", "wait", "close", "restore"])
def test_background_failure_is_raised_again(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    gate: Gate,
    reported_by: str,
) -> None:
    root = tmp_path / "s"
    good = {"x": torch.arange(4.0)}
    mgr = CheckpointManager(root, async_save=True)
    try:
        gate.open()
        mgr.save(1, good).wait()
        gate.opened.clear()
        gate.entered.clear()
        monkeypatch.setattr(CRCWriter, "write", _enospc)
        monkeypatch.setattr(DirectWriter, "write", _enospc)
        handle = mgr.save(2, {"x": torch.zeros(4)})  # returns before the failure
        assert gate.entered.wait(10)
        calls = {
            "save": lambda: mgr.save(3, {"x": torch.zeros(4)}),
            "wait": mgr.wait,
            "restore": lambda: mgr.restore({"x": None}),
            "close": mgr.close,
        }
        # The failure happens while the next call is already waiting for the save.
        threading.Timer(0.2, gate.open).start()
        with pytest.raises(CommitError) as ei:
            calls[reported_by]()
        msg = str(ei.value)
        assert "the disk is full" in msg
        assert "step 1 is still the newest checkpoint" in msg
        with pytest.raises(CommitError):
            handle.wait()
        # ... and it was logged when it happened, not only when raised again.
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert any("step 2" in e and "disk is full" in e for e in errors), errors
        monkeypatch.undo()
        assert entries(root) == [step_dir(1)], "no tmp directory remains"
        if reported_by != "close":
            mgr.wait()  # reported once: the manager works again
            assert mgr.restore(target := {"x": None}) == 1
            assert torch.equal(target["x"], good["x"])
            mgr.save(3, {"x": torch.ones(4)}).wait()
            assert mgr.steps() == [1, 3]
    finally:
        gate.open()
        mgr.close()


@pytest.mark.timeout(60)
def test_retention_runs_only_after_commit(tmp_path: Path, gate: Gate) -> None:
    root = tmp_path / "s"
    with CheckpointManager(root, keep=1, async_save=True) as mgr:
        gate.open()
        mgr.save(1, {"x": torch.ones(2)}).wait()
        gate.opened.clear()
        gate.entered.clear()
        handle = mgr.save(2, {"x": torch.ones(2) * 2})
        assert gate.entered.wait(10)
        time.sleep(0.05)
        assert mgr.steps() == [1], "step 1 stays until step 2 is committed"
        assert entries(root) == [step_dir(1)]
        gate.open()
        handle.wait(timeout=20)
        mgr.wait()
        assert mgr.steps() == [2]
    assert entries(root) == [step_dir(2)]


@pytest.mark.timeout(60)
def test_gc_spares_the_save_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entered, opened = threading.Event(), threading.Event()
    real_commit = Storage.commit

    def held_commit(storage: Storage, pending: Any, manifest: Any) -> None:
        entered.set()  # payloads are written into the .tmp- directory by now
        assert opened.wait(20)
        real_commit(storage, pending, manifest)

    monkeypatch.setattr(Storage, "commit", held_commit)
    root = tmp_path / "s"
    try:
        with CheckpointManager(root, async_save=True) as mgr:
            handle = mgr.save(1, {"x": torch.ones(3)})
            assert entered.wait(10)
            assert [n for n in os.listdir(root) if n.startswith(".tmp-step-")]
            threading.Timer(0.3, opened.set).start()
            assert mgr.gc() == [], "the save in flight is not garbage"
            assert handle.wait(timeout=20).step == 1
            assert mgr.steps() == [1]
            assert mgr.verify(1).ok
    finally:
        opened.set()
    assert entries(root) == [step_dir(1)]


def test_step_exists_is_raised_by_save_itself(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "s", async_save=True) as mgr:
        mgr.save(1, {"x": torch.ones(2)}).wait()
        with pytest.raises(StepExistsError):
            mgr.save(1, {"x": torch.zeros(2)})
        mgr.wait()  # nothing failed in the background
        assert torch.equal(mgr.load(1)["x"], torch.ones(2))


def test_async_matches_sync_bytes(tmp_path: Path) -> None:
    state = make_state(3)
    for fmt in ("safetensors", "torch"):
        with CheckpointManager(tmp_path / f"sync-{fmt}", format=fmt) as a:
            a.save(1, state)
            sync = a.load()
        with CheckpointManager(tmp_path / f"async-{fmt}", format=fmt, async_save=True) as b:
            b.save(1, state)
            b.wait()
            assert b.verify(1).ok
            asynced = b.load()
        assert_same(asynced, sync)


EXIT_RIGHT_AFTER = r"""
import sys, time
import torch
from ckptstore import CheckpointManager
from ckptstore.storage import Storage

real_commit = Storage.commit

def slow_commit(self, pending, manifest):
    time.sleep(0.5)  # still in flight when the main thread falls off the end
    real_commit(self, pending, manifest)

Storage.commit = slow_commit
compression = None if sys.argv[2] == "None" else sys.argv[2]
mgr = CheckpointManager(sys.argv[1], async_save=True, keep=1, compression=compression)
x = torch.arange(1 << 21, dtype=torch.float32)  # 8 MiB: two zstd frames in one write
mgr.save(1, {"x": x}).wait()
h = mgr.save(2, {"x": x * 2})
print("returned", h.done(), flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_exit_right_after_async_save_still_commits(tmp_path: Path, compression: str | None) -> None:
    # zstd: its frames went to a concurrent.futures pool, which takes no new work once the
    # interpreter exits: the save left to finish at exit failed and was lost (exit code 0).
    root = tmp_path / "s"
    proc = run_python(EXIT_RIGHT_AFTER, str(root), str(compression), timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "returned False"
    assert "failed" not in proc.stderr
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [2]
        assert mgr.verify(2).ok
        assert torch.equal(mgr.load()["x"], torch.arange(1 << 21, dtype=torch.float32) * 2)
        if compression:
            assert mgr.manifest(2).files["x.safetensors.zst"].compression == "zstd"
        mgr.gc()
    assert entries(root) == [step_dir(2)]


# ---- an async save is in flight until it is over (session 29) -----------------------------


def _slow_commits(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    from ckptstore.save import commit

    real = commit.commit_job

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)  # a slow disk: the writer reads the staging buffers meanwhile
        return real(*args, **kwargs)

    monkeypatch.setattr(commit, "commit_job", slow)


def _values(root: Path) -> dict[int, list[float]]:
    with CheckpointManager(root) as mgr:
        assert all(mgr.verify(s).ok for s in mgr.steps())
        return {s: mgr.load(s)["w"].unique().tolist() for s in mgr.steps()}


@pytest.mark.timeout(60)
def test_a_save_after_an_interrupted_wait_still_waits_for_the_one_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl-C while save(2) waited for step 1, and the usual emergency save in the handler:
    # the wait had forgotten step 1, so the new save copied into the staging buffers the
    # writer was still writing out, and step 1 committed step 2's values (its CRCs theirs).
    from ckptstore.save.staging import SaveHandle as Handle

    _slow_commits(monkeypatch, 1.0)
    real = Handle._settle
    interrupted: list[int] = []

    def settle(self: Handle) -> None:
        if not interrupted:
            interrupted.append(self.step)
            raise KeyboardInterrupt  # the signal lands while save(2) waits
        real(self)

    monkeypatch.setattr(Handle, "_settle", settle)
    w = torch.zeros(1 << 18)
    with CheckpointManager(tmp_path / "s", async_save=True) as mgr:
        mgr.save(1, {"w": w})
        w.fill_(2.0)  # training goes on
        with pytest.raises(KeyboardInterrupt):
            mgr.save(2, {"w": w})
        mgr.save(2, {"w": w})  # the emergency save
    assert interrupted == [1]
    assert _values(tmp_path / "s") == {1: [0.0], 2: [2.0]}


@pytest.mark.timeout(60)
def test_another_thread_waiting_does_not_let_the_next_save_overwrite_the_one_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A monitoring thread calls gc() (which waits for the save in flight) while step 1 is
    # written: the training thread's save(2) then no longer waited for step 1.
    _slow_commits(monkeypatch, 1.0)
    w = torch.zeros(1 << 18)
    with CheckpointManager(tmp_path / "s", async_save=True) as mgr:
        mgr.save(1, {"w": w})
        other = threading.Thread(target=mgr.gc)
        other.start()
        deadline = time.monotonic() + 20
        while (
            not any("wait_save" in str(f) for f in _frames_of(other))
            and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        w.fill_(2.0)
        mgr.save(2, {"w": w})
        other.join()
    assert _values(tmp_path / "s") == {1: [0.0], 2: [2.0]}


def _frames_of(thread: threading.Thread) -> list[str]:
    """The function names on ``thread``'s stack now."""
    import sys

    frame = sys._current_frames().get(thread.ident or -1)
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names


@pytest.mark.timeout(60)
def test_an_interrupt_during_an_async_copy_is_raised_as_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It came out as CommitError(''): an `except KeyboardInterrupt` never ran, and an
    # error of the state's own (a state_dict() that raises) changed type with async_save.
    real = StagingPool.stage
    raised: list[BaseException] = [KeyboardInterrupt(), ValueError("state_dict broke")]

    def stage(self: StagingPool, *args: Any, **kwargs: Any) -> Any:
        if raised:
            raise raised.pop(0)  # the signal (then the error) arrives during the copy
        return real(self, *args, **kwargs)

    monkeypatch.setattr(StagingPool, "stage", stage)
    with CheckpointManager(tmp_path / "s", async_save=True) as mgr:
        with pytest.raises(KeyboardInterrupt):
            mgr.save(1, {"w": torch.ones(10)})
        with pytest.raises(ValueError, match="state_dict broke"):
            mgr.save(1, {"w": torch.ones(10)})
        mgr.save(1, {"w": torch.ones(10)})  # nothing of the failed ones is left in the way
    assert _values(tmp_path / "s") == {1: [1.0]}


@pytest.mark.timeout(60)
def test_the_blocks_own_error_is_not_replaced_by_the_saves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The with-block raised while an async save failed (disk full): __exit__'s close()
    # raised the save's CommitError, and the user's own error showed only as its context.
    from ckptstore.save import commit

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(commit, "commit_job", full)
    with (  # noqa: PT012 - the block's own error, raised inside the manager's with
        pytest.raises(ValueError, match="loss is NaN") as info,
        CheckpointManager(tmp_path / "s", async_save=True) as mgr,
    ):
        mgr.save(1, {"w": torch.ones(10)})
        raise ValueError("loss is NaN at step 2")
    (note,) = info.value.__notes__
    assert note.startswith(f"ckptstore: closing {tmp_path / 's'} also failed: ")
    assert "No space left on device" in note
    assert "No space left on device" in caplog.text
    # Without an error of the block's own, close() raises the save's.
    with (
        pytest.raises(CommitError, match="No space left"),
        CheckpointManager(tmp_path / "t", async_save=True) as mgr,
    ):
        mgr.save(1, {"w": torch.ones(10)})


# ---- issue 10: frozen metadata, errors raised once, every device synchronized -------------


@pytest.mark.timeout(60)
def test_metadata_changed_after_save_returns_is_not_in_the_manifest(
    tmp_path: Path, gate: Gate
) -> None:
    meta: dict[str, Any] = {"run": {"tags": ["a"], "cfg": {"lr": 0.1}}}
    with CheckpointManager(tmp_path / "s", async_save=True) as mgr:
        handle = mgr.save(1, {"x": torch.ones(2)}, metadata=meta)
        meta["run"]["tags"].append("changed later")  # the writer has not run yet
        meta["run"]["cfg"]["lr"] = 9.0
        gate.open()
        assert handle.wait().metadata == {"run": {"tags": ["a"], "cfg": {"lr": 0.1}}}
        assert mgr.manifest(1).metadata == {"run": {"tags": ["a"], "cfg": {"lr": 0.1}}}


@pytest.mark.timeout(60)
def test_an_error_received_from_wait_is_not_raised_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "s"
    with CheckpointManager(root, async_save=True) as mgr:
        mgr.save(1, {"x": torch.arange(4.0)}).wait()
        with monkeypatch.context() as m:
            m.setattr(CRCWriter, "write", _enospc)
            m.setattr(DirectWriter, "write", _enospc)
            handle = mgr.save(2, {"x": torch.zeros(4)})
            with pytest.raises(CommitError, match="disk is full"):
                handle.wait()  # the caller has the error now ...
        mgr.save(3, {"x": torch.ones(4)}).wait()  # ... so the next save saves
        mgr.wait()
        assert mgr.steps() == [1, 3]


class _OnDevice(torch.Tensor):
    """A CPU tensor that says it lives on a GPU: to see which devices staging waits for."""

    fake: torch.device = torch.device("cuda", 1)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.fake


def _on(t: torch.Tensor, index: int) -> torch.Tensor:
    out = t.as_subclass(_OnDevice)
    out.fake = torch.device("cuda", index)  # type: ignore[attr-defined]
    return out


def test_staging_waits_for_the_copies_of_every_source_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    synced: list[Any] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    pool = StagingPool()
    pool.begin()
    tensors = {"a": _on(torch.ones(4), 1), "b": _on(torch.ones(2), 3), "c": torch.ones(3)}
    tensors["d"] = _on(torch.zeros(5), 1)
    staged = {k: pool.stage(k, t) for k, t in tensors.items()}
    assert synced == [], "copies are waited for once, at the end"
    pool.end()
    # Each GPU a copy came from, not only the current one (torch.cuda.synchronize() alone).
    assert synced == [torch.device("cuda", 1), torch.device("cuda", 3)]
    assert all(torch.equal(staged[k], torch.Tensor(tensors[k])) for k in tensors)
    synced.clear()
    pool.begin()
    pool.stage("c", torch.ones(3))
    pool.end()
    assert synced == []  # nothing came from a GPU: nothing to wait for


def test_a_synchronous_sharded_save_of_gpu_state_goes_through_the_staging_buffers(
    mesh: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPU boxes of a synchronous DTensor save are copied out into the reused (pinned)
    staging buffers, as an async save's are, not ``.cpu()`` per box; CPU boxes are written
    from where they lie. The GPU is played (``_on_gpu``) where there is none: what is
    checked here is that the staged way writes the same step."""
    from torch.distributed.fsdp import fully_shard

    from ckptstore.save import plan as save_plan

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 8))
    fully_shard(model, mesh=mesh)  # type: ignore[arg-type]
    want = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": model})
        assert mgr._staging.allocated_bytes == 0  # CPU state: nothing staged, nothing held
        monkeypatch.setattr(save_plan, "_on_gpu", lambda boxes, groups: True)
        mgr.save(2, {"model": model})
        pool: StagingPool = mgr._staging
        ptrs = {k: b.data_ptr() for k, b in pool._bufs.items()}
        # One buffer a box ("name@offsets"): every box of the model.
        assert sorted(k.split("@")[0] for k in ptrs) == sorted(f"_shards/model/{k}" for k in want)
        mgr.save(3, {"model": model})
        assert {k: b.data_ptr() for k, b in pool._bufs.items()} == ptrs  # reused
        # The shard files staged and not staged: the same bytes.
        shards = sorted(p.name for p in step_path(tmp_path / "s", 1).glob("_shards*"))
        assert shards
        for name in shards:
            one = (step_path(tmp_path / "s", 1) / name).read_bytes()
            assert one == (step_path(tmp_path / "s", 3) / name).read_bytes()
        for step in (2, 3):
            got = mgr.load(step)["model"]
            assert sorted(got) == sorted(want)
            assert all(torch.equal(got[k], want[k]) for k in want)  # full tensors


@pytest.mark.timeout(60)
def test_an_interrupt_at_the_end_of_an_async_save_never_lets_the_next_one_restage(
    tmp_path: Path, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by review, with real SIGINTs: Ctrl-C between the job's submit and the record
    # of the save in flight left it untracked; the next save staged into the buffers it
    # was still writing, and step 1 committed (and verified) holding step 2's values.
    real = SaveHandle.__init__
    calls = [0]

    def init(self: SaveHandle, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt  # as a signal handler raises it, right there

    monkeypatch.setattr(SaveHandle, "__init__", init)
    w = torch.ones(1 << 16)
    with CheckpointManager(tmp_path / "s", async_save=True) as mgr:
        with pytest.raises(KeyboardInterrupt):
            mgr.save(1, {"w": w})
        w.fill_(2.0)  # what the job does next
        threading.Timer(0.3, gate.open).start()
        mgr.save(2, {"w": w}).wait(timeout=20)
        for s in mgr.steps():
            assert mgr.verify(s).ok
            assert torch.equal(mgr.load(s)["w"], torch.full((1 << 16,), float(s))), s
        assert 2 in mgr.steps()


def test_the_writer_thread_outlives_a_future_that_fails_to_complete() -> None:
    # A KeyboardInterrupt inside the training thread's condition wait left the future's
    # lock released under the writer: its set_result raised "release unlocked lock", the
    # ThreadPoolExecutor's worker died of it, and every later save queued to no thread
    # (waits hung; saves were dropped at exit without a word; found by review).
    import concurrent.futures

    from ckptstore.save.staging import BackgroundWriter

    class Broken(concurrent.futures.Future[Any]):
        def set_result(self, result: Any) -> None:
            raise RuntimeError("release unlocked lock")

    writer = BackgroundWriter()

    def run(fn: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        writer.submit_to(future, fn)
        return future

    try:
        writer.submit_to(Broken(), lambda: 1)
        assert run(lambda: 2).result(timeout=10) == 2
        stop = run(lambda: (_ for _ in ()).throw(SystemExit(3)))
        assert isinstance(stop.exception(timeout=10), SystemExit)
        assert run(lambda: 4).result(timeout=10) == 4
    finally:
        writer.shutdown()
    with pytest.raises(CommitError, match="the background writer is stopped"):
        run(lambda: 5)

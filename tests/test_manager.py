"""CheckpointManager: arguments, failures while writing, the writer lock, and resume."""

from __future__ import annotations

import errno
import logging
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _helpers import (
    STORE_FILES,
    LineReader,
    TinyNet,
    assert_same,
    fresh_like,
    make_state,
    step_dir,
    subprocess_env,
)

from ckptstore import (
    CheckpointManager,
    CkptStoreError,
    CommitError,
    KeepLast,
    NoCheckpointError,
    RNGState,
    StepExistsError,
    StoreLockedError,
    UnsafeCheckpointError,
)
from ckptstore.integrity import CRCWriter
from ckptstore.storage import LocalStorage, wait_for_deletions
from ckptstore.storage.directio import DirectWriter


def entries(root: Path) -> list[str]:
    wait_for_deletions()
    return sorted(n for n in os.listdir(root) if n not in STORE_FILES)


def model_sd(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return dict(state["model"].state_dict())


# ---- arguments --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"format": "pickle"}, "format"),
        ({"compression": "gzip"}, "compression"),
        ({"barrier_timeout": 0}, "barrier_timeout"),
        ({"barrier_timeout": float("nan")}, "barrier_timeout"),
        ({"barrier_timeout": True}, "barrier_timeout"),
        ({"keep": 0}, "KeepLast"),
        ({"keep": True}, "keep"),
        ({"keep": "3"}, "keep"),
    ],
)
def test_invalid_arguments_name_themselves(tmp_path: Path, kwargs: dict[str, Any], names: str):
    with pytest.raises(ValueError, match=names):
        CheckpointManager(tmp_path / "s", **kwargs)


def test_invalid_save_arguments(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "s") as mgr:
        for bad in (-1, True, 1.0, "3"):
            with pytest.raises(ValueError, match="step"):
                mgr.save(bad, {})  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="mapping"):
            mgr.save(1, [1, 2])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="metrics"):
            mgr.save(1, {}, metrics={"loss": "low"})  # type: ignore[dict-item]
        with pytest.raises(ValueError, match="metadata"):
            mgr.save(1, {}, metadata={"x": object()})
        assert mgr.steps() == []
    assert not (tmp_path / "s").exists() or entries(tmp_path / "s") == []


def test_unsafe_object_is_refused_with_its_path(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with CheckpointManager(root) as mgr:
        with pytest.raises(UnsafeCheckpointError, match=r"state\['extra'\]\['fn'\]"):
            mgr.save(1, {"extra": {"fn": object()}})
        assert mgr.steps() == []
        mgr.save(1, {"extra": {"fn": 1}})
    assert entries(root) == [step_dir(1)]


def test_closed_manager_refuses_work(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "s")
    mgr.close()
    mgr.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        mgr.save(1, {})
    with pytest.raises(RuntimeError, match="closed"):
        mgr.restore({})


def test_metrics_accept_tensors_and_numpy(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {}, metrics={"a": torch.tensor(0.5), "b": np.float32(2.0), "c": 3})
        assert dict(mgr.manifest().metrics) == {"a": 0.5, "b": 2.0, "c": 3.0}


# ---- disk full, permissions ---------------------------------------------------------------


def _enospc(*args: Any, **kwargs: Any) -> Any:
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["write", "open", "fsync"])
def test_disk_full_raises_commit_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    root = tmp_path / "s"
    good = make_state(1)
    with CheckpointManager(root) as mgr:
        mgr.save(1, good)
        if where == "write":
            monkeypatch.setattr(CRCWriter, "write", _enospc)
            monkeypatch.setattr(DirectWriter, "write", _enospc)
        elif where == "open":
            monkeypatch.setattr(LocalStorage, "_open_write", _enospc)
        else:
            monkeypatch.setattr(os, "fsync", _enospc)
        with pytest.raises(CommitError) as ei:
            mgr.save(2, make_state(2))
        msg = str(ei.value)
        assert "the disk is full" in msg
        assert "step 1 is still the newest checkpoint" in msg
        assert str(root) in msg
        assert isinstance(ei.value.__cause__, OSError)
        assert ei.value.__cause__.errno == errno.ENOSPC
        monkeypatch.undo()
        assert entries(root) == [step_dir(1)], "no .tmp- directory remains"
        assert mgr.steps() == [1]
        fresh = fresh_like(good)
        assert mgr.restore(fresh) == 1
        assert_same(model_sd(fresh), model_sd(good))
        mgr.save(2, make_state(2))  # space is back: saving works again
        assert mgr.steps() == [1, 2]


def test_disk_full_on_an_empty_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CRCWriter, "write", _enospc)
    monkeypatch.setattr(DirectWriter, "write", _enospc)
    with CheckpointManager(tmp_path / "s") as mgr:
        with pytest.raises(CommitError, match="nothing was committed"):
            mgr.save(1, make_state(1))
        assert mgr.steps() == []
    assert entries(tmp_path / "s") == []


def test_read_only_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "s"
    good = make_state(1)
    with CheckpointManager(root) as mgr:
        mgr.save(1, good)
    simulated = os.geteuid() == 0  # root ignores permission bits: simulate EACCES instead
    if simulated:

        def mkdir(self: LocalStorage, rel: str) -> None:
            raise PermissionError(errno.EACCES, "Permission denied", os.path.join(self.root, rel))

        monkeypatch.setattr(LocalStorage, "_mkdir", mkdir)
    else:  # pragma: no cover - CI runs as root
        root.chmod(0o555)
    try:
        with CheckpointManager(root) as mgr:
            with pytest.raises(CommitError, match="permission denied") as ei:
                mgr.save(2, make_state(2))
            assert "step 1 is still the newest checkpoint" in str(ei.value)
            fresh = fresh_like(good)
            assert mgr.restore(fresh) == 1
            assert_same(model_sd(fresh), model_sd(good))
            assert mgr.verify().ok
    finally:
        root.chmod(0o755)
    assert entries(root) == [step_dir(1)]


def test_errors_are_one_tree() -> None:
    assert issubclass(CommitError, CkptStoreError)
    assert issubclass(CommitError, OSError)
    assert issubclass(StoreLockedError, CkptStoreError)
    assert issubclass(NoCheckpointError, FileNotFoundError)


# ---- the writer lock --------------------------------------------------------------------

HOLDER = r"""
import sys
import torch
from ckptstore import CheckpointManager

mgr = CheckpointManager(sys.argv[1])
mgr.save(1, {"x": torch.tensor([1.0])})
print("saved", flush=True)
sys.stdin.readline()
mgr.close()
print("closed", flush=True)
sys.stdin.readline()
"""


@pytest.mark.timeout(60)
def test_second_writer_process_is_locked_out(tmp_path: Path) -> None:
    root = tmp_path / "s"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env(),
    )
    assert proc.stdin is not None
    try:
        out = LineReader(proc.stdout)
        out.until("saved", timeout=45)
        with CheckpointManager(root) as mgr:
            assert mgr.steps() == [1], "readers take no lock"
            assert mgr.load()["x"].tolist() == [1.0]
            with pytest.raises(StoreLockedError) as ei:
                mgr.save(2, {"x": torch.tensor([2.0])})
            msg = str(ei.value)
            assert "locked by another writer" in msg
            assert str(root) in msg
            assert "own directory" in msg  # what to do about it
            with pytest.raises(StoreLockedError):
                mgr.prune()
            assert mgr.steps() == [1]
            proc.stdin.write("\n")
            proc.stdin.flush()
            out.until("closed", timeout=15)
            mgr.save(2, {"x": torch.tensor([2.0])})
            assert mgr.steps() == [1, 2]
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert entries(root) == [step_dir(1), step_dir(2)]


def test_second_writer_in_one_process_is_locked_out(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with CheckpointManager(root) as a:
        a.save(1, {"x": torch.tensor(1)})
        b = CheckpointManager(root)
        with pytest.raises(StoreLockedError):
            b.save(2, {"x": torch.tensor(2)})
        b.close()
    with CheckpointManager(root) as c:
        c.save(2, {"x": torch.tensor(2)})
        assert c.steps() == [1, 2]


# ---- resume -------------------------------------------------------------------------------


class GeneratorState:
    """A Stateful wrapping the torch.Generator that orders the data."""

    def __init__(self, gen: torch.Generator) -> None:
        self.gen = gen

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"state": self.gen.get_state()}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.gen.set_state(sd["state"])


DATA = torch.linspace(-2, 2, 64 * 4).reshape(64, 4)


def build(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    model = TinyNet(16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)
    gen = torch.Generator().manual_seed(seed + 1)
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "data": GeneratorState(gen),
        "rng": RNGState(),
        "step": -1,
    }


def train(state: dict[str, Any], start: int, stop: int, mgr: Any = None, save_at: int = -1):
    model, opt, sched = state["model"], state["optimizer"], state["scheduler"]
    for s in range(start, stop):
        idx = torch.randperm(64, generator=state["data"].gen)[:8]
        x = DATA[idx] + 0.01 * torch.randn(8, 4)  # the global generator, and dropout
        scale = 1.0 + 0.1 * float(np.random.rand()) + 0.1 * random.random()
        opt.zero_grad()
        (model(x).square().mean() * scale).backward()
        opt.step()
        sched.step()
        state["step"] = s
        if s == save_at:
            mgr.save(s, state)


def test_resume_is_bit_identical(tmp_path: Path) -> None:
    total, crash_after = 12, 5
    straight = build(0)
    train(straight, 0, total)
    straight_rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())

    with CheckpointManager(tmp_path / "s", keep=2) as mgr:
        first = build(0)
        assert mgr.resume(first) == 0
        train(first, 0, crash_after + 3, mgr, save_at=crash_after - 1)
    del first  # the process "crashed" after training on past the save

    resumed = build(999)  # fresh objects, different initial weights and generators
    with CheckpointManager(tmp_path / "s", keep=2) as mgr:
        start = mgr.resume(resumed)
        assert start == crash_after
        assert resumed["step"] == crash_after - 1
        train(resumed, start, total)

    assert_same(model_sd(resumed), model_sd(straight))
    assert_same(resumed["optimizer"].state_dict(), straight["optimizer"].state_dict())
    assert_same(resumed["scheduler"].state_dict(), straight["scheduler"].state_dict())
    assert torch.equal(resumed["data"].gen.get_state(), straight["data"].gen.get_state())
    # The process-wide generators end where the uninterrupted run left them.
    assert random.getstate() == straight_rng[0]
    assert_same(list(np.random.get_state()), list(straight_rng[1]))
    assert torch.equal(torch.get_rng_state(), straight_rng[2])


def test_restore_explicit_step_and_policy_objects(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "s", keep=KeepLast(3)) as mgr:
        states = {s: make_state(s) for s in (1, 2, 3)}
        for s, st in states.items():
            mgr.save(s, st)
        fresh = fresh_like(states[2])
        assert mgr.restore(fresh, step=2) == 2
        assert_same(model_sd(fresh), model_sd(states[2]))
        assert fresh["step"] == 2
        with pytest.raises(NoCheckpointError, match=r"have 1\.\.3"):
            mgr.restore(fresh, step=7)
        assert "KeepLast(n=3)" in repr(mgr)


def test_a_corrupt_step_is_replaced_when_training_reaches_it_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "s"
    with CheckpointManager(root) as mgr:
        mgr.save(1, make_state(1))
        mgr.save(2, make_state(2))
        payload = root / step_dir(2) / "model.safetensors"
        data = bytearray(payload.read_bytes())
        data[-1] ^= 0xFF
        payload.write_bytes(bytes(data))
        # Resume skips the corrupt step 2 and lands on 1 ...
        assert mgr.restore(fresh_like(make_state(1))) == 1
        # ... and when training reaches step 2 again, its save replaces the corrupt one.
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            mgr.save(2, make_state(20))
        assert any("does not verify" in r.getMessage() for r in caplog.records)
        assert mgr.steps() == [1, 2]
        assert mgr.verify(2).ok
        fresh = fresh_like(make_state(20))
        assert mgr.restore(fresh) == 2
        assert_same(model_sd(fresh), model_sd(make_state(20)))
        # A step that verifies is never overwritten.
        with pytest.raises(StepExistsError, match="already committed"):
            mgr.save(2, make_state(21))


def test_a_quick_verify_does_not_make_retention_trust_a_step(tmp_path: Path) -> None:
    # A quick verify passes a flipped data byte; retention must still find step 2 bad and
    # keep step 1, the newest that loads, instead of deleting it as superseded.
    root = tmp_path / "s"
    states = {s: make_state(s) for s in (1, 2)}
    with CheckpointManager(root) as mgr:
        for s, state in states.items():
            mgr.save(s, state)
    path = root / step_dir(2) / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    with CheckpointManager(root, keep=1) as mgr:
        assert mgr.verify(2, deep=False).ok
        assert mgr.prune() == []
        assert mgr.steps() == [1, 2]
        fresh = fresh_like(states[1])
        assert mgr.restore(fresh) == 1
        assert_same(dict(fresh["model"].state_dict()), dict(states[1]["model"].state_dict()))

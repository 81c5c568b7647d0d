"""CkptStoreIO with a real Lightning Trainer on CPU, and with 2 DDP processes on gloo.

One small LightningModule (a Linear layer, Adam, StepLR, hyper-parameters with a Namespace,
a set and a path) trains for a few epochs on random data; every checkpoint Lightning writes
goes through the plugin. The tests check what lies on disk, that what loads is exactly what
Lightning saved, resuming with ``ckpt_path="last"``, falling back from a corrupt last
checkpoint, a crash in the middle of a save, and a 2-rank DDP job.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import importlib
import json
import logging
import math
import os
import pathlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import REPO, run_job_ranks

from ckptstore import CheckpointManager, IntegrityError, UnsafeCheckpointError, atomic_save
from ckptstore.errors import ConfigError, StateMismatchError
from ckptstore.storage import wait_for_deletions
from ckptstore.storage.base import Storage

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:.*Checkpoint directory .* exists and is not empty.*"),
    pytest.mark.filterwarnings("ignore:.*number of training batches.*"),
]

WORKER = REPO / "tests" / "lightning_ddp_worker.py"

# Lightning, its job (Model, trainer(), fit(), ...) and CkptStoreIO come from
# tests/lightning_parts.py, imported by each test as it runs, not here: every xdist worker
# collects this module, and importing Lightning (with transformers, tests/test_hf.py) cost
# each one 7 s of CPU before its first test.


# ---- a small job ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """3 epochs, top-2 by step plus last: epoch=1-step=8, epoch=2-step=12, last (12)."""
    from lightning_parts import Recorder, fit, trainer

    root = tmp_path_factory.mktemp("run")
    plugin = Recorder()
    model = fit(trainer(root / "ckpt", 3, plugin))
    wait_for_deletions()  # retention frees trash in the background; copy a settled tree
    shutil.copytree(root / "ckpt", root / "pristine", symlinks=True)
    return {"dir": root / "ckpt", "pristine": root / "pristine", "plugin": plugin, "model": model}


@pytest.fixture
def ckdir(run: dict[str, Any]) -> Path:
    """The module run's checkpoint directory as the run left it, free to corrupt.

    Restored in place rather than copied elsewhere: ModelCheckpoint reloads its state only
    when its dirpath is the one it saved.
    """
    # The test before may have left trash that retention frees in the background: the
    # deleter would race this rmtree (FileNotFoundError on a .trash-step directory).
    wait_for_deletions()
    shutil.rmtree(run["dir"])
    shutil.copytree(run["pristine"], run["dir"], symlinks=True)
    return Path(run["dir"])


# ---- helpers --------------------------------------------------------------------------


def assert_same(a: Any, b: Any, where: str = "checkpoint") -> None:
    """``a`` and ``b`` are equal with the same types, tensors bit for bit."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, where
        assert a.shape == b.shape, where
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), where
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, argparse.Namespace):
        assert_same(vars(a), vars(b), f"{where}.__dict__")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def steps_of(path: Path) -> list[int]:
    with CheckpointManager(path, distributed=False) as mgr:
        return mgr.steps()


def corrupt(path: Path) -> None:
    """Flip one byte of the model weights in the newest version of the store ``path``."""
    step = sorted(path.glob("step-*"))[-1]
    payload = step / "state_dict.safetensors"
    data = bytearray(payload.read_bytes())
    data[-2] ^= 0x40
    payload.write_bytes(bytes(data))


# ---- a Trainer on CPU -----------------------------------------------------------------


def test_fit_commits_every_checkpoint_as_a_verified_store(tmp_path: Path) -> None:
    from lightning_parts import AttributeDict, ModelCheckpoint, Recorder, fit, trainer

    plugin = Recorder()
    tr = trainer(tmp_path, 3, plugin, monitor="val_loss", mode="min")
    model = fit(tr)
    cb = tr.checkpoint_callback
    assert isinstance(cb, ModelCheckpoint)

    # On disk: the top 2 by val_loss and last, each a store directory; nothing else.
    best = {Path(p).name for p in cb.best_k_models}
    assert len(best) == 2
    assert {e.name for e in tmp_path.iterdir()} == best | {"last.ckpt"}
    saved_topk = {Path(p).name for p, _ in plugin.saved} - {"last.ckpt"}
    assert len(saved_topk) == 3
    evicted = saved_topk - best
    assert {Path(p).name for p in plugin.removed} == evicted
    assert not (tmp_path / evicted.pop()).exists()

    for path in tmp_path.iterdir():
        assert path.is_dir()
        assert not path.is_symlink()
        with CheckpointManager(path, distributed=False) as mgr:
            step = mgr.steps()
            saved = plugin.last_saved(path)
            # One version each, named by the global step; the older lasts were pruned.
            assert step == [saved["global_step"]]
            assert mgr.verify().ok, mgr.verify().problems
            meta = mgr.manifest().metadata["lightning"]
            assert meta == {
                "global_step": saved["global_step"],
                "epoch": saved["epoch"],
                "rank": 0,
                "weights_only": False,
            }
            if path.name in best:  # the value ModelCheckpoint ranked it by
                value = float(cb.best_k_models[str(path)])
                assert mgr.manifest().metrics == {"val_loss": pytest.approx(value)}
        # What loads is exactly what Lightning saved, types included.
        assert_same(plugin.load_checkpoint(path), saved)
    assert [s for p, s in plugin.saved if p.endswith("last.ckpt")][-1]["global_step"] == 12

    last = plugin.load_checkpoint(tmp_path / "last.ckpt")
    assert_same(dict(last["state_dict"]), {k: v for k, v in model.state_dict().items()})
    hp = last["hyper_parameters"]
    assert type(hp["args"]) is argparse.Namespace
    assert type(hp["args"].nested) is AttributeDict
    assert hp["tags"] == frozenset({"cpu", "test"})
    assert hp["root"] == pathlib.Path("/data/x")
    assert type(last["state_dict"]) is collections.OrderedDict
    assert isinstance(last["optimizer_states"][0]["state"][0]["exp_avg"], torch.Tensor)


@pytest.mark.parametrize("mode", ["max", "min"])
def test_monitored_metric_goes_into_the_manifest(tmp_path: Path, mode: str) -> None:
    # Monitoring the global step itself makes the values known in advance (steps 4, 8, 12),
    # so every store's metric must be the step it was saved at.
    from lightning_parts import fit, trainer

    fit(trainer(tmp_path, 3, monitor="step", mode=mode, save_top_k=2))
    got = {}
    for path in sorted(tmp_path.iterdir()):
        with CheckpointManager(path, distributed=False) as mgr:
            m = mgr.manifest()
        got[path.name] = (m.metadata["lightning"]["global_step"], m.metrics)
    top = (
        ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]
        if mode == "max"
        else [
            "epoch=0-step=4.ckpt",
            "epoch=1-step=8.ckpt",
        ]
    )
    assert sorted(got) == [*top, "last.ckpt"]
    for name in top:
        step, metrics = got[name]
        assert metrics == {"step": float(step)}, name
    # last.ckpt: its own step's value (Lightning saves it right after a top-k save), never
    # another step's; with "min" the newest top-k save, and so last.ckpt, is step 8.
    step, metrics = got["last.ckpt"]
    assert step == (12 if mode == "max" else 8)
    assert metrics == {"step": float(step)}


def test_a_stale_monitored_value_is_left_out(tmp_path: Path) -> None:
    # A save that is no top-k save of its step (last.ckpt after a deferred or failed step,
    # and on every epoch in older Lightning) carries the callback's current_score of an
    # earlier step: that value would be wrong for this checkpoint, so none is stored.
    from lightning_parts import CkptStoreIO

    plugin = CkptStoreIO()
    top = str(tmp_path / "epoch=0-step=4.ckpt")
    last = str(tmp_path / "last.ckpt")

    def checkpoint(step: int) -> dict[str, Any]:
        state = {
            "monitor": "val_loss",
            "current_score": torch.tensor(0.5),
            "best_k_models": {top: torch.tensor(0.5)},
            "last_model_path": last,
        }
        return {"global_step": step, "epoch": 0, "callbacks": {"ModelCheckpoint{}": state}}

    plugin.save_checkpoint(checkpoint(4), top)
    plugin.save_checkpoint(checkpoint(4), last)  # right after the top-k save of step 4
    plugin.save_checkpoint(checkpoint(9), last)  # step 9: current_score is step 4's
    metrics = {}
    for path in (top, last):
        with CheckpointManager(path, distributed=False) as mgr:
            metrics[Path(path).name] = [mgr.manifest(s).metrics for s in mgr.steps()]
    assert metrics == {"epoch=0-step=4.ckpt": [{"val_loss": 0.5}], "last.ckpt": [{}]}
    with CheckpointManager(last, distributed=False) as mgr:
        assert mgr.steps() == [9], "keep=1: the version of step 4 was pruned"


def test_fit_resumes_from_last(run: dict[str, Any], ckdir: Path) -> None:
    from lightning_parts import BATCHES, AtStart, fit, trainer

    saved = run["plugin"].last_saved(run["dir"] / "last.ckpt")
    start = AtStart()
    tr = trainer(ckdir, 4, extra=[start])
    fit(tr, ckpt_path="last")
    assert start.global_step == saved["global_step"] == 3 * BATCHES
    assert start.epoch == saved["epoch"] + 1
    assert_same(start.weights, dict(saved["state_dict"]))
    assert_same(start.optimizer["state"], saved["optimizer_states"][0]["state"])
    assert tr.global_step == 4 * BATCHES
    assert steps_of(ckdir / "last.ckpt") == [4 * BATCHES]
    assert {e.name for e in ckdir.iterdir()} == {
        "epoch=2-step=12.ckpt",
        "epoch=3-step=16.ckpt",
        "last.ckpt",
    }


def test_corrupt_last_falls_back_to_the_newest_good_checkpoint(
    run: dict[str, Any], ckdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning_parts import AtStart, fit, trainer

    corrupt(ckdir / "last.ckpt")
    start = AtStart()
    tr = trainer(ckdir, 4, extra=[start])
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        fit(tr, ckpt_path="last")
    # last (step 12) is corrupt: epoch=2-step=12.ckpt holds the same state and verifies.
    assert start.global_step == 12
    good = run["plugin"].last_saved(run["dir"] / "epoch=2-step=12.ckpt")
    assert_same(start.weights, dict(good["state_dict"]))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("last.ckpt does not verify" in m and "epoch=2-step=12.ckpt" in m for m in warned)
    # Training went on, and the next save replaced the corrupt version.
    assert tr.global_step == 16
    assert steps_of(ckdir / "last.ckpt") == [16]
    with CheckpointManager(ckdir / "last.ckpt", distributed=False) as mgr:
        assert mgr.verify().ok


def test_fallback_skips_every_corrupt_checkpoint(
    run: dict[str, Any], ckdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning_parts import CkptStoreIO

    corrupt(ckdir / "last.ckpt")
    corrupt(ckdir / "epoch=2-step=12.ckpt")
    plugin = CkptStoreIO()
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        loaded = plugin.load_checkpoint(ckdir / "last.ckpt")
    assert loaded["global_step"] == 8
    assert_same(loaded, run["plugin"].last_saved(run["dir"] / "epoch=1-step=8.ckpt"))
    corrupt(ckdir / "epoch=1-step=8.ckpt")
    with pytest.raises(IntegrityError, match=r"no other checkpoint in .* does either"):
        plugin.load_checkpoint(ckdir / "last.ckpt")


def test_fallback_prefers_a_full_checkpoint_to_a_newer_weights_only_one(tmp_path: Path) -> None:
    """A ModelCheckpoint(save_weights_only=True) beside the full ones: a corrupt last.ckpt
    fell back to its newer weights-only step, and fit(ckpt_path="last") then failed inside
    Lightning ("contains only the model") though a full checkpoint verified (found by
    review)."""
    from lightning_parts import CkptStoreIO

    plugin = CkptStoreIO()

    def checkpoint(step: int, *, full: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"global_step": step, "epoch": 0}
        out["state_dict"] = {"w": torch.full((4,), float(step))}
        if full:
            out["optimizer_states"] = [{"state": {}, "param_groups": []}]
            out["loops"] = {"fit_loop": {"step": step}}
        return out

    plugin.save_checkpoint(checkpoint(4, full=True), tmp_path / "full-step=4.ckpt")
    plugin.save_checkpoint(checkpoint(6, full=True), tmp_path / "last.ckpt")
    plugin.save_checkpoint(checkpoint(6, full=False), tmp_path / "w-step=6.ckpt")
    corrupt(tmp_path / "last.ckpt")
    loaded = plugin.load_checkpoint(tmp_path / "last.ckpt")
    assert loaded["global_step"] == 4
    assert "optimizer_states" in loaded
    # With no full checkpoint left that verifies, the weights-only one is still loaded.
    corrupt(tmp_path / "full-step=4.ckpt")
    assert plugin.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 6


def test_explicit_corrupt_checkpoint_raises(ckdir: Path) -> None:
    from lightning_parts import CkptStoreIO, fit, trainer

    path = ckdir / "epoch=1-step=8.ckpt"
    corrupt(path)
    with pytest.raises(IntegrityError) as info:
        fit(trainer(ckdir, 4), ckpt_path=str(path))
    msg = str(info.value)
    assert f"Lightning checkpoint {path} does not verify" in msg
    assert "state_dict.safetensors: crc32c" in msg
    assert "the file is corrupt" in msg
    # With fallback off, a corrupt last raises too.
    corrupt(ckdir / "last.ckpt")
    with pytest.raises(IntegrityError, match=r"last\.ckpt does not verify"):
        CkptStoreIO(fallback=False).load_checkpoint(ckdir / "last.ckpt")


class Killed(Exception):
    """The process was killed during a save: nothing after the kill ran."""


@contextlib.contextmanager
def killed_at_commit(monkeypatch: pytest.MonkeyPatch, why: str) -> Iterator[None]:
    """Saves in the block die before their commit, and nothing cleans up after them."""

    def die(self: Storage, *args: Any) -> None:
        raise Killed(why)

    with monkeypatch.context() as m:
        m.setattr(Storage, "commit", die)
        m.setattr(Storage, "abort", lambda self, pending: None)
        m.setattr(shutil, "rmtree", lambda *a, **k: None)
        yield


def test_crash_during_save_keeps_the_previous_checkpoint(
    run: dict[str, Any], ckdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_parts import AtStart, CkptStoreIO, fit, trainer

    last = ckdir / "last.ckpt"
    before = run["plugin"].last_saved(run["dir"] / "last.ckpt")
    newer = copy.deepcopy(before)
    newer["global_step"] = 16
    newer["state_dict"]["layer.weight"] += 1

    # A kill: the commit never happens and nothing cleans up after it.
    with killed_at_commit(monkeypatch, "killed after writing the payloads, before the manifest"):
        with pytest.raises(Killed):
            CkptStoreIO().save_checkpoint(newer, last)
        with pytest.raises(Killed):
            CkptStoreIO().save_checkpoint(newer, ckdir / "epoch=3-step=16.ckpt")
    # The half-written save is invisible: last still holds step 12, whole.
    assert steps_of(last) == [12]
    assert any(e.name.startswith(".tmp-step-") for e in last.iterdir())
    assert_same(CkptStoreIO().load_checkpoint(last), before)
    # The new path never appeared (its store was being built beside it).
    assert not (ckdir / "epoch=3-step=16.ckpt").exists()
    # Resuming works, and the next saves clear the leftovers.
    start = AtStart()
    fit(trainer(ckdir, 4, extra=[start]), ckpt_path="last")
    assert start.global_step == 12
    assert steps_of(last) == [16]
    assert sorted(e.name for e in ckdir.iterdir()) == [
        "epoch=2-step=12.ckpt",
        "epoch=3-step=16.ckpt",
        "last.ckpt",
    ]
    assert not any(e.name.startswith(".tmp-") for e in last.iterdir())


def test_a_killed_hpc_save_leaves_slurm_requeue_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lightning's SLURM auto-requeue resumes from hpc_ckpt_<N>.ckpt, N the digits of every
    # entry of default_root_dir holding "hpc_ckpt_" run together. A save of hpc_ckpt_2.ckpt
    # killed mid-way left .hpc_ckpt_2.ckpt.tmp-<uuid>: every requeued job then looked for
    # hpc_ckpt_2<the uuid's digits>.ckpt, which does not exist, and failed to start.
    from lightning_parts import CkptStoreIO, pl

    state = {"global_step": 10, "epoch": 0, "state_dict": {"w": torch.ones(2)}}
    CkptStoreIO().save_checkpoint(state, tmp_path / "hpc_ckpt_1.ckpt")

    with killed_at_commit(monkeypatch, "SIGKILL by SLURM during the save"), pytest.raises(Killed):
        CkptStoreIO().save_checkpoint({**state, "global_step": 20}, tmp_path / "hpc_ckpt_2.ckpt")
    (left,) = [e.name for e in tmp_path.iterdir() if e.name.startswith(".")]
    assert "ckpt_" not in left
    requeued = pl.Trainer(default_root_dir=tmp_path, logger=False, plugins=[CkptStoreIO()])
    path = requeued._checkpoint_connector._hpc_resume_path
    assert path == str(tmp_path / "hpc_ckpt_1.ckpt")
    assert CkptStoreIO().load_checkpoint(path)["global_step"] == 10
    # The next save of that name clears what the killed one left.
    CkptStoreIO().save_checkpoint({**state, "global_step": 20}, tmp_path / "hpc_ckpt_2.ckpt")
    assert sorted(e.name for e in tmp_path.iterdir()) == ["hpc_ckpt_1.ckpt", "hpc_ckpt_2.ckpt"]


def test_save_last_link(tmp_path: Path) -> None:
    from lightning_parts import AtStart, CkptStoreIO, Recorder, fit, trainer

    plugin = Recorder()
    fit(trainer(tmp_path, 3, plugin, save_last="link"))
    last = tmp_path / "last.ckpt"
    assert last.is_symlink()
    assert os.readlink(last) == "epoch=2-step=12.ckpt"
    assert sorted(e.name for e in tmp_path.iterdir()) == [
        "epoch=1-step=8.ckpt",
        "epoch=2-step=12.ckpt",
        "last.ckpt",
    ]
    start = AtStart()
    fit(trainer(tmp_path, 4, extra=[start], save_last="link"), ckpt_path="last")
    assert start.global_step == 12
    assert os.readlink(last) == "epoch=3-step=16.ckpt"
    # The link was replaced, never written through: its old target holds its own step.
    assert steps_of(tmp_path / "epoch=2-step=12.ckpt") == [12]
    # Saving over a link replaces the link, not what it points to.
    CkptStoreIO().save_checkpoint(plugin.saved[0][1], last)
    assert not last.is_symlink()
    assert steps_of(tmp_path / "epoch=3-step=16.ckpt") == [16]
    assert CkptStoreIO().load_checkpoint(last)["global_step"] == 4


# ---- the plugin on its own ------------------------------------------------------------


def test_round_trip_of_converted_types(tmp_path: Path) -> None:
    from lightning_parts import AttributeDict, CkptStoreIO

    od: collections.OrderedDict[str, Any] = collections.OrderedDict(w=torch.arange(6.0))
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    ckpt = {
        "state_dict": od,
        "global_step": 3,
        "hyper_parameters": {
            "ns": argparse.Namespace(a=1, b=[1, 2], c=argparse.Namespace(d=None)),
            "attr": AttributeDict(x=1.5, y="z"),
            "s": {3, 1, 2},
            "fs": frozenset({"a"}),
            "p": pathlib.PurePosixPath("a/b"),
            "lookalike": {"__ckptstore_lightning__": "namespace", "v": 1},
            "ns_lookalike": argparse.Namespace(__ckptstore_lightning__="path", items=[1]),
            "ns_items": argparse.Namespace(items=[[1, 2]], v=AttributeDict({1: "int key"})),
            "od": collections.OrderedDict(b=1, a=2),
            "nums": (float("inf"), float("nan"), -0.0, 2**70),
            "intkeys": {1: "a", 2: "b"},
            "bytes": b"\x00\xff",
            "dtype": torch.bfloat16,
        },
    }
    io = CkptStoreIO()
    io.save_checkpoint(ckpt, tmp_path / "x.ckpt")
    loaded = io.load_checkpoint(tmp_path / "x.ckpt", weights_only=True)
    assert_same(loaded, ckpt)
    assert loaded["hyper_parameters"]["s"] == {1, 2, 3}
    assert type(loaded["hyper_parameters"]["fs"]) is frozenset
    assert type(loaded["hyper_parameters"]["p"]) is pathlib.PurePosixPath
    # The store is plain ckptstore: the weights load with safetensors under their names.
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "x.ckpt" / "step-000000000003" / "state_dict.safetensors")
    assert torch.equal(weights["w"], torch.arange(6.0))


class Opaque:
    def __init__(self, v: int) -> None:
        self.v = v

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.v == self.v

    __hash__ = None  # type: ignore[assignment]


def test_objects_need_allow_pickle(tmp_path: Path) -> None:
    from lightning_parts import CkptStoreIO

    ckpt = {"global_step": 1, "hyper_parameters": {"obj": Opaque(3)}}
    path = tmp_path / "x.ckpt"
    with pytest.raises(UnsafeCheckpointError) as info:
        CkptStoreIO().save_checkpoint(ckpt, path)
    msg = str(info.value)
    assert str(path) in msg
    assert "checkpoint['hyper_parameters']['obj']" in msg
    assert "Opaque" in msg
    assert "allow_pickle=True" in msg
    assert not path.exists()
    inner = {"hyper_parameters": {"args": argparse.Namespace(lr=0.1, obj=Opaque(1))}}
    with pytest.raises(UnsafeCheckpointError, match=r"\['args'\]\['obj'\]: objects of type"):
        CkptStoreIO().save_checkpoint(inner, path)
    CkptStoreIO(allow_pickle=True).save_checkpoint(ckpt, path)
    assert CkptStoreIO(allow_pickle=True).load_checkpoint(path) == ckpt
    with pytest.raises(UnsafeCheckpointError, match="pickle"):
        CkptStoreIO().load_checkpoint(path)
    with pytest.raises(UnsafeCheckpointError, match="pickle"):
        CkptStoreIO(allow_pickle=True).load_checkpoint(path, weights_only=True)


def test_keep_versions_and_fall_back_within_last(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning_parts import CkptStoreIO

    io = CkptStoreIO(keep=2)
    last = tmp_path / "last.ckpt"
    for step in (5, 10, 15):
        io.save_checkpoint({"global_step": step, "state_dict": {"w": torch.full((3,), step)}}, last)
    assert steps_of(last) == [10, 15]
    # A run restarted from scratch: the newest save still becomes the newest version.
    io.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.zeros(3)}}, last)
    assert steps_of(last) == [15, 16]
    assert io.load_checkpoint(last)["global_step"] == 2
    corrupt(last)
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        assert io.load_checkpoint(last)["global_step"] == 15
    assert any("newest older version" in r.getMessage() for r in caplog.records)


def test_remove_checkpoint(tmp_path: Path) -> None:
    from lightning_parts import CkptStoreIO

    io = CkptStoreIO()
    target = tmp_path / "epoch=0-step=1.ckpt"
    io.save_checkpoint({"global_step": 1}, target)
    link = tmp_path / "last.ckpt"
    link.symlink_to(target.name)
    assert io.load_checkpoint(link)["global_step"] == 1
    io.remove_checkpoint(link)  # the link goes, its target stays
    assert not link.exists()
    assert steps_of(target) == [1]
    io.remove_checkpoint(target)
    assert list(tmp_path.iterdir()) == []
    io.remove_checkpoint(target)  # missing: nothing to do
    with pytest.raises(FileNotFoundError, match="not found"):
        io.load_checkpoint(target)


def test_torch_save_file_is_replaced_and_loads_verified(tmp_path: Path) -> None:
    from lightning_parts import CkptStoreIO

    path = tmp_path / "last.ckpt"
    atomic_save({"global_step": 7, "state_dict": {"w": torch.ones(2)}}, path)
    io = CkptStoreIO()
    old = io.load_checkpoint(path)  # an earlier run's torch.save file, verified first
    assert old["global_step"] == 7
    data = bytearray(path.read_bytes())
    data[data.find(b"\x00\x00\x80\x3f")] ^= 1  # a byte of the tensor data
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="does not verify"):
        io.load_checkpoint(path)
    io.save_checkpoint({"global_step": 9}, path)
    assert path.is_dir()
    assert io.load_checkpoint(path) == {"global_step": 9}
    assert [e.name for e in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_store_another_writer_committed_is_named(tmp_path: Path) -> None:
    """Lightning failed on it with a bare KeyError ('pytorch-lightning_version')."""
    from lightning_parts import CkptStoreIO

    path = tmp_path / "acc.ckpt"
    with CheckpointManager(path) as mgr:  # an AcceleratorCheckpointer's store, in small
        mgr.save(3, {"model": {"w": torch.ones(2)}, "rng": {"seed": 1}})
    with pytest.raises(StateMismatchError) as e:
        CkptStoreIO().load_checkpoint(path)
    assert str(e.value).startswith(
        f"{path}/step-000000000003 was not committed by CkptStoreIO (its manifest holds no "
        "Lightning metadata)"
    ), e.value
    CkptStoreIO().save_checkpoint({"global_step": 1}, tmp_path / "own.ckpt")
    assert CkptStoreIO().load_checkpoint(tmp_path / "own.ckpt") == {"global_step": 1}
    # Beside a corrupt last.ckpt, the fall-back passes over the other writer's store.
    CkptStoreIO().save_checkpoint({"global_step": 2}, tmp_path / "last.ckpt")
    (payload,) = (tmp_path / "last.ckpt").glob("step-*/state.json")
    payload.write_bytes(payload.read_bytes().replace(b"2", b"3"))  # a digit rots
    assert CkptStoreIO().load_checkpoint(tmp_path / "last.ckpt") == {"global_step": 1}


def test_fsspec_url(tmp_path: Path) -> None:
    from lightning_parts import CkptStoreIO

    io = CkptStoreIO()
    url = f"memory://ckptstore-lightning-{os.getpid()}/epoch=0-step=3.ckpt"
    io.save_checkpoint({"global_step": 3, "w": torch.ones(2)}, url)
    io.save_checkpoint({"global_step": 4, "w": torch.zeros(2)}, url)
    loaded = io.load_checkpoint(url)
    assert loaded["global_step"] == 4
    assert torch.equal(loaded["w"], torch.zeros(2))
    io.remove_checkpoint(url)
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(url)


def test_arguments_are_checked() -> None:
    from lightning_parts import CkptStoreIO

    with pytest.raises(ValueError, match="keep"):
        CkptStoreIO(keep=0)
    with pytest.raises(ValueError, match="format"):
        CkptStoreIO(format="pickle")
    with pytest.raises(ValueError, match="compression"):
        CkptStoreIO(compression="gzip")
    with pytest.raises(TypeError, match="storage_options"):
        CkptStoreIO().save_checkpoint({}, "/nonexistent/x.ckpt", storage_options={"a": 1})


def test_standalone_lightning_package_accepts_the_plugin() -> None:
    from lightning_parts import CkptStoreIO

    fabric_io = pytest.importorskip("lightning_fabric.plugins.io.checkpoint_io")
    assert isinstance(CkptStoreIO(), fabric_io.CheckpointIO)


# ---- strategies that never call a CheckpointIO (issue 23) -------------------------------


def test_model_parallel_strategy_is_served_or_refused_at_construction(tmp_path: Path) -> None:
    # Lightning accepted plugins=[CkptStoreIO()] here, then saved last.ckpt/ as DCP's
    # .metadata and __0_0.distcp itself: nothing checksummed, `ckptstore ls` found no store.
    # Its sharded save is now CkptStoreIO's (tests/test_lightning_sharded.py); the full one
    # (save_distributed_checkpoint=False) is refused before anything runs.
    from lightning.pytorch.strategies import ModelParallelStrategy
    from lightning_parts import CkptStoreIO, pl

    def build(strategy: ModelParallelStrategy, plugin: CkptStoreIO) -> pl.Trainer:
        return pl.Trainer(
            strategy=strategy,
            plugins=[plugin],
            accelerator="cpu",
            devices=2,
            logger=False,
            default_root_dir=tmp_path,
        )

    plugin = CkptStoreIO()
    assert build(ModelParallelStrategy(), plugin).strategy.checkpoint_io is plugin
    with pytest.raises(ConfigError) as info:
        build(ModelParallelStrategy(save_distributed_checkpoint=False), CkptStoreIO())
    msg = str(info.value)
    assert msg.startswith("CkptStoreIO cannot serve ModelParallelStrategy: with ")
    assert "save_distributed_checkpoint=True" in msg
    assert list(tmp_path.iterdir()) == []  # nothing was written anywhere


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_strategies_refuse_the_plugin_where_it_cannot_serve(package: str) -> None:
    # Their Trainer wants a GPU (FSDP) or deepspeed; the setter the Trainer hands the plugin
    # through is what refuses, in either Lightning package.
    from lightning_parts import CkptStoreIO

    strategies = pytest.importorskip(f"{package}.strategies")
    CkptStoreIO()  # guards the package's Strategy (imported now)
    # FSDPStrategy: served with sharded state dicts (saved and loaded through the plugin),
    # refused with full ones (its default), and with compression.
    fsdp_cls = strategies.FSDPStrategy
    assert fsdp_cls.save_checkpoint._ckptstore_route
    assert fsdp_cls.load_checkpoint.__wrapped__.__qualname__ == "FSDPStrategy.load_checkpoint"
    for fsdp in (fsdp_cls(), fsdp_cls(state_dict_type="full")):
        with pytest.raises(ConfigError) as info:
            fsdp.checkpoint_io = CkptStoreIO()
        assert str(info.value).startswith(
            "CkptStoreIO cannot serve FSDPStrategy: with state_dict_type='full' (its default)"
        )
        assert "FSDPStrategy(state_dict_type='sharded')" in str(info.value)
    with pytest.raises(ConfigError, match="FSDPStrategy: compression='zstd' cannot hold"):
        fsdp_cls(state_dict_type="sharded").checkpoint_io = CkptStoreIO(compression="zstd")
    fsdp = fsdp_cls(state_dict_type="sharded")
    fsdp.checkpoint_io = plugin_fsdp = CkptStoreIO()
    assert fsdp.checkpoint_io is plugin_fsdp
    deepspeed = object.__new__(strategies.DeepSpeedStrategy)  # its constructor needs deepspeed
    with pytest.raises(ConfigError, match="DeepSpeedStrategy: it saves and loads through"):
        deepspeed.checkpoint_io = CkptStoreIO()
    # ModelParallelStrategy: served (its save and load routed through the plugin) in either
    # package, except the full save it cannot serve.
    model_parallel = strategies.ModelParallelStrategy
    assert model_parallel.save_checkpoint._ckptstore_route
    with pytest.raises(ConfigError, match="ModelParallelStrategy: with save_distributed"):
        model_parallel(save_distributed_checkpoint=False).checkpoint_io = CkptStoreIO()
    sharded = model_parallel()
    sharded.checkpoint_io = plugin_mp = CkptStoreIO()
    assert sharded.checkpoint_io is plugin_mp
    # A strategy that calls the plugin keeps it; any other CheckpointIO is left alone.
    ddp = strategies.DDPStrategy()
    plugin = CkptStoreIO()
    ddp.checkpoint_io = plugin
    assert ddp.checkpoint_io is plugin
    other = strategies.FSDPStrategy()
    io_module = importlib.import_module(
        "lightning.fabric.plugins.io.torch_io"
        if package == "lightning.pytorch"
        else "lightning_fabric.plugins.io.torch_io"
    )
    other.checkpoint_io = io_module.TorchCheckpointIO()
    assert isinstance(other.checkpoint_io, io_module.TorchCheckpointIO)


# ---- DDP: 2 processes on gloo ---------------------------------------------------------


def launch(out: Path, mode: str, epochs: int, timeout: float, *, torchrun: bool = False) -> None:
    """The DDP job: rank 0 alone, Lightning's launcher starting rank 1 as users run
    ``python train.py``, or (``torchrun``) both ranks started here as torchrun starts them.
    The ranks started here are forked from the test fork server, which imported Lightning
    once (10 s of CPU a fresh interpreter: torchmetrics imports transformers); Lightning's
    launcher starts its rank 1 as a fresh interpreter, as it does for users. Every rank
    dies on timeout."""
    argv = [str(WORKER), str(out), mode, str(epochs)]
    run_job_ranks(argv, 2 if torchrun else 1, out / f"{mode}.log", timeout, f"DDP {mode}")


def calls(out: Path, rank: int) -> list[dict[str, Any]]:
    path = out / f"calls.rank{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(240)
def test_ddp_two_ranks_rank0_writes_every_rank_resumes(tmp_path: Path) -> None:
    from lightning_parts import CkptStoreIO

    launch(tmp_path, "fit", 2, timeout=110)
    ckpt = tmp_path / "ckpt"
    first = [json.loads((tmp_path / f"fit.rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in first] == [2, 2]
    # Rank 0 alone saved, each top-k path once and last once per epoch; rank 1 never did.
    assert calls(tmp_path, 1) == []
    saves = [(Path(c["path"]).name, c["global_step"]) for c in calls(tmp_path, 0)]
    assert saves == [
        ("epoch=0-step=4.ckpt", 4),
        ("last.ckpt", 4),
        ("epoch=1-step=8.ckpt", 8),
        ("last.ckpt", 8),
    ]
    assert {c["rank"] for c in calls(tmp_path, 0)} == {0}
    assert sorted(e.name for e in ckpt.iterdir()) == [
        "epoch=0-step=4.ckpt",
        "epoch=1-step=8.ckpt",
        "last.ckpt",
    ]
    for store in ckpt.iterdir():
        with CheckpointManager(store, distributed=False) as mgr:
            assert len(mgr.steps()) == 1
            assert mgr.verify().ok, mgr.verify().problems
            assert mgr.manifest().world_size == 1
            assert mgr.manifest().metadata["lightning"]["rank"] == 0
    last = CkptStoreIO().load_checkpoint(ckpt / "last.ckpt")
    assert last["global_step"] == 8

    # A second job, started as torchrun starts one, resumes from last on both ranks, with the
    # weights rank 0 saved.
    launch(tmp_path, "resume", 3, timeout=110, torchrun=True)
    second = [json.loads((tmp_path / f"resume.rank{r}.json").read_text()) for r in (0, 1)]
    for row in second:
        assert row["start_step"] == 8
        assert row["start_epoch"] == 2
        assert row["start_digest"] == first[0]["end_digest"]
        assert row["end_step"] == 12
    assert second[0]["end_digest"] == second[1]["end_digest"]
    assert calls(tmp_path, 1) == []
    assert sorted(e.name for e in ckpt.iterdir()) == [
        "epoch=1-step=8.ckpt",
        "epoch=2-step=12.ckpt",
        "last.ckpt",
    ]
    assert steps_of(ckpt / "last.ckpt") == [12]

"""Scenarios of the power-cut test of sharded saves (``tests/multirank/test_power_sharded.py``).

Run by ``tests/multirank/worker.py`` as ``power_scenarios:<name>``. ``args``: ``roots`` (one
directory name per rank under ``workdir/disks``: the same name on every rank is one shared
store, different names are node-local roots), ``keep`` and ``async``.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckptstore import CheckpointManager
from ckptstore.storage import wait_for_deletions
from tests.multirank.dtensor_scenarios import digests, make_net, shard, train
from tests.multirank.scenarios import Ctx
from tests.power import PowerModel, snapshot_of

#: Steps saved before the one whose system calls are recorded.
BEFORE = (1, 2)
#: The step saved while every rank records its calls.
NEW = 3


def disks(workdir: Path) -> Path:
    """The directory that holds every store root of the job: the machine's disk."""
    return workdir / "disks"


def _fsdp(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_net(seed)
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 1)
    return model, opt


def _mgr(ctx: Ctx, **kw: Any) -> CheckpointManager:
    root = disks(ctx.workdir) / ctx.args["roots"][ctx.rank]
    return CheckpointManager(root, barrier_timeout=30, **kw)


def power_record(ctx: Ctx) -> dict[str, Any]:
    """FSDP2 steps 1 and 2 saved, then step 3 with every rank's store calls recorded.

    Rank 0 writes the disk as it is before step 3 (``start.pkl``); every rank then records
    the system calls of its local backend (``tests/power.py``) through the save of step 3,
    its commit (``mgr.wait_save()`` for an async save), ``close()`` and retention's deletions, and
    writes them to ``events.rankN.pkl``. An ``acked`` mark is logged when the rank saw its
    save committed. Returns the digests of every full tensor at each step.
    """
    model, opt = _fsdp()
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
    mgr = _mgr(ctx, keep=ctx.args.get("keep"), async_save=bool(ctx.args.get("async")))
    out: dict[str, Any] = {}
    for step in BEFORE:
        state["step"] = step
        mgr.save(step, state)
        out[str(step)] = digests(model, opt)
        mgr.wait()  # the next training step may not overlap the copy-out
        train(model, opt, 1, seed=step + 10)
    state["step"] = NEW
    out[str(NEW)] = digests(model, opt)
    mgr.wait()
    wait_for_deletions()
    dist.barrier()
    if ctx.rank == 0:
        (ctx.workdir / "start.pkl").write_bytes(pickle.dumps(snapshot_of(str(disks(ctx.workdir)))))
    dist.barrier()
    rec = PowerModel(str(disks(ctx.workdir)), snapshots=False, log=True)
    with rec.installed():
        mgr.save(NEW, state)
        mgr.wait_save()  # an async save: until its commit returned
        rec.mark("acked")
        mgr.close()
        wait_for_deletions()
    assert rec.events is not None
    (ctx.workdir / f"events.rank{ctx.rank}.pkl").write_bytes(pickle.dumps(rec.events))
    return out


def power_resume(ctx: Ctx) -> list[dict[str, Any]]:
    """What the job finds after each cut: ``resume`` into a fresh FSDP2 model, then a new save.

    ``args["cuts"]``: directories under the workdir, each a disk a cut left (its store roots
    under ``disks/``). For each: ``gc`` (a cut leaves tmp directories behind), ``resume``,
    the digests of what was restored, and whether the save of the next step (the one after
    the step resumed) committed and verifies.
    """
    outs = []
    for cut in ctx.args["cuts"]:
        model, opt = _fsdp(seed=99)
        state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
        root = disks(ctx.workdir / cut) / ctx.args["roots"][ctx.rank]
        mgr = CheckpointManager(root, barrier_timeout=30)
        mgr.gc()
        nxt = mgr.resume(state)
        out: dict[str, Any] = {"next": nxt, "step": state["step"], "steps": mgr.steps()}
        out["digests"] = digests(model, opt)
        # The step after the one resumed, as training does: step 3 again where a cut left it
        # whole on some node only (that copy is replaced).
        nxt = state["step"] + 1
        state["step"] = nxt
        mgr.save(nxt, state)
        rep = mgr.verify(nxt, deep=True)
        out["saved"] = {"step": nxt, "ok": rep.ok, "problems": rep.problems, "steps": mgr.steps()}
        mgr.close()
        outs.append(out)
    return outs

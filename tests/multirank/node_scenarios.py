"""Scenarios for node-local roots: each rank its own ``local_root`` (a directory per "node").

Run by ``tests/multirank/worker.py`` as ``node_scenarios:<name>``. ``args``: ``roots`` (one
directory name per rank, under the workdir: the same name on every rank is a shared
filesystem), and optionally ``url``/``options`` of a replica on moto's S3 server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckptstore import CheckpointManager, RNGState
from tests.multirank.dtensor_scenarios import digests, make_net, shard, train
from tests.multirank.scenarios import Ctx, outcome


def _root(ctx: Ctx) -> Path:
    return ctx.workdir / ctx.args["roots"][ctx.rank]


def _mgr(ctx: Ctx, **kw: Any) -> CheckpointManager:
    if ctx.args.get("url"):
        kw.update(replica=ctx.args["url"], replica_options=ctx.args["options"])
    return CheckpointManager(
        _root(ctx), keep=None, barrier_timeout=ctx.args.get("timeout", 30), **kw
    )


def _fsdp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_net()
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 2)
    return model, opt


def _step_files(root: Path, step: int) -> list[str]:
    d = root / f"step-{step:012d}"
    return sorted(os.listdir(d)) if d.is_dir() else []


def nodes_save(ctx: Ctx) -> dict[str, Any]:
    """A plain save (step 1) and FSDP2 saves (2, 3) on node-local roots.

    With a replica and ``"abandon"``: rank 1's uploader is paused before step 3 and stopped
    in the middle of that upload, once rank 0's part is on the replica.
    """
    model, opt = _fsdp()
    state: dict[str, Any] = {"model": model, "optimizer": opt, "rng": RNGState(), "step": 2}
    mgr = _mgr(ctx)
    out: dict[str, Any] = {"split": mgr._split, "peers": mgr._peers}
    mgr.save(1, {"w": torch.arange(4.0), "step": 1})
    mgr.save(2, state)
    out["digests2"] = digests(model, opt)
    if mgr.replica is not None:
        mgr.wait()
        dist.barrier()  # every rank's part of step 2 is in
    train(model, opt, 1, seed=5)
    state["step"] = 3
    abandon = ctx.args.get("abandon") and mgr.replica is not None
    if abandon and ctx.rank == 1:
        assert mgr.replica is not None
        mgr.replica.pause()  # the upload of step 3 stops at its first bytes
    mgr.save(3, state)
    out["digests3"] = digests(model, opt)
    if abandon:
        assert mgr.replica is not None
        if ctx.rank == 0:
            mgr.wait()  # rank 0's part of step 3 is on the replica
        dist.barrier()
        if ctx.rank == 1:
            mgr.replica.close(wait=False)  # the uploader dies mid-upload
    out["close"] = outcome(mgr.close)
    out["local_steps"] = mgr.steps()
    out["files3"] = _step_files(_root(ctx), 3)
    out["files1"] = _step_files(_root(ctx), 1)
    rep = mgr.verify(3)
    out["verify3"] = {"ok": rep.ok, "problems": rep.problems, "elsewhere": rep.elsewhere}
    out["parts"] = {str(k): v for k, v in (mgr.replica.parts if mgr.replica else {}).items()}
    return out


def nodes_recover(ctx: Ctx) -> dict[str, Any]:
    """New managers on the same roots: each rank's uploader finishes what is missing.

    Meanwhile the ranks resume from their own roots (as :func:`nodes_resume`).
    """
    mgr = _mgr(ctx)
    out = _resume(ctx, mgr)
    mgr.wait()
    dist.barrier()
    out["parts"] = {str(k): v for k, v in (mgr.replica.parts if mgr.replica else {}).items()}
    mgr.close()
    return out


def nodes_resume(ctx: Ctx) -> dict[str, Any]:
    """Resume a fresh FSDP2 model and optimizer on these roots (local, else the replica)."""
    mgr = _mgr(ctx)
    out = _resume(ctx, mgr)
    mgr.close()
    return out


def _resume(ctx: Ctx, mgr: CheckpointManager) -> dict[str, Any]:
    """Resume into a fresh FSDP2 model; with ``plain_step``, then restore that step too."""
    model = make_net(seed=99)
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "rng": RNGState(), "step": 0}
    nxt = mgr.resume(state)
    out = {
        "next": nxt,
        "step": state["step"],
        "digests": digests(model, opt),
        "local_steps": mgr.steps(),
        "split": mgr._split,
    }
    if ctx.args.get("plain_step"):
        # A replicated save is on rank 0's node alone: rank 0 reads it, sends it.
        plain: dict[str, Any] = {"w": torch.zeros(4), "step": 0}
        out["plain_restored"] = mgr.restore(plain, step=ctx.args["plain_step"])
        out["plain"] = [plain["w"].tolist(), plain["step"]]
    return out


def nodes_fault(ctx: Ctx) -> dict[str, Any]:
    """Node 1's store fails in the commit of node-local FSDP2 saves; nothing may stay anywhere.

    Step 1 commits. Step 2: rank 1's copy of rank 0's ``state.json`` hits a full disk while
    its node prepares. Step 3: rank 1's rename into place fails, after node 0 renamed. Step
    4 commits again. After each: the steps of this node, the tmp directories left, what a
    fresh model restores; with a replica, what it holds once the uploads are done.
    """
    from tests.faults import Injector, injected

    model, opt = _fsdp()
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 1}
    mgr = _mgr(ctx)
    mgr.save(1, state)
    out: dict[str, Any] = {"digests1": digests(model, opt)}
    faults = {2: Injector(1, "ENOSPC", target="state.json"), 3: Injector(1, "EIO", op="_rename")}
    for step, inj in faults.items():
        train(model, opt, 1, seed=step)
        state["step"] = step
        with contextlib.ExitStack() as stack:
            if ctx.rank == 1:
                stack.enter_context(injected(inj))
            res = outcome(lambda s=step: mgr.save(s, state) and None)
        res["fired"] = str(inj.fired) if inj.fired else None
        res["steps"] = mgr.steps()
        res["tmp"] = sorted(n for n in os.listdir(_root(ctx)) if n.startswith(".tmp-"))
        out[str(step)] = res
    dist.barrier()
    out["restored"] = _restore_fresh(mgr)
    state["step"] = 4
    mgr.save(4, state)
    out["digests4"] = digests(model, opt)
    out["steps4"] = mgr.steps()
    if mgr.replica is not None:
        mgr.wait()
        dist.barrier()
        assert mgr.replica_storage is not None
        out["replica_steps"] = mgr.replica_storage.list_steps()
    mgr.close()
    return out


def _restore_fresh(mgr: CheckpointManager, mesh: list[int] | None = None) -> list[Any]:
    """Restore the newest step into a fresh FSDP2 model: ``[step, digests]``."""
    model = make_net(seed=99)
    shard(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
    step = mgr.restore(state)
    return [step, state["step"], digests(model, opt)]


def nodes_shared(ctx: Ctx) -> dict[str, Any]:
    """Several ranks per node: an FSDP2 save, what each node holds, verify, a restore.

    ``roots`` names a directory per rank; ranks giving the same name share that "node".
    """
    model, opt = _fsdp()
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 1}
    mgr = _mgr(ctx)
    out: dict[str, Any] = {"split": mgr._split, "peers": mgr._peers}
    mgr.coord.stats.clear()
    mgr.save(1, state)
    out["prepared"] = [list(r) for r in mgr.coord.stats.records if r[0] == "save:prepared"]
    out["digests"] = digests(model, opt)
    dist.barrier()  # every node committed before any lists its files
    out["files"] = _step_files(_root(ctx), 1)
    out["table"] = (_root(ctx) / "step-000000000001" / "_ranks.jsonl").stat().st_size
    rep = mgr.verify(1)
    out["verify"] = {"ok": rep.ok, "problems": rep.problems, "elsewhere": rep.elsewhere}
    out["restored"] = _restore_fresh(mgr)
    if mgr.replica is not None:
        mgr.wait()
        out["parts"] = {str(k): v for k, v in mgr.replica.parts.items()}
    mgr.close()
    return out


def nodes_async(ctx: Ctx) -> dict[str, Any]:
    """Async FSDP2 saves on node-local roots: two that commit, one whose node 1 runs out of
    disk while preparing its copy (in the background), one after it."""
    from tests.faults import Injector, injected

    model, opt = _fsdp()
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 1}
    mgr = _mgr(ctx, async_save=True)
    out: dict[str, Any] = {}
    mgr.save(1, state).wait()
    train(model, opt, 1, seed=2)
    state["step"] = 2
    handle = mgr.save(2, state)
    out["digests2"] = digests(model, opt)
    train(model, opt, 1, seed=3)  # while step 2 is written: the staged copy is saved
    handle.wait()
    out["steps2"] = mgr.steps()
    out["files2"] = _step_files(_root(ctx), 2)
    inj = Injector(1, "ENOSPC", target="state.json")
    with contextlib.ExitStack() as stack:
        if ctx.rank == 1:
            stack.enter_context(injected(inj))
        state["step"] = 3
        handle = mgr.save(3, state)
        out["failed3"] = outcome(lambda: handle.wait() and None)
    out["steps3"] = mgr.steps()
    out["tmp3"] = sorted(n for n in os.listdir(_root(ctx)) if n.startswith(".tmp-"))
    state["step"] = 4
    mgr.save(4, state).wait()
    out["digests4"] = digests(model, opt)
    mgr.wait()
    out["steps4"] = mgr.steps()
    dist.barrier()
    out["restored"] = _restore_fresh(mgr)
    restore2 = make_net(seed=7)
    shard(restore2)
    opt2 = torch.optim.AdamW(restore2.parameters(), lr=1e-2)
    mgr.restore({"model": restore2, "optimizer": opt2, "step": 0}, step=2)
    out["restored2"] = digests(restore2, opt2)
    if mgr.replica is not None:
        assert mgr.replica_storage is not None
        dist.barrier()
        out["replica_steps"] = mgr.replica_storage.list_steps()
    mgr.close()
    return out


def nodes_commits(ctx: Ctx) -> dict[str, Any]:
    """:func:`nodes_fault`, then :func:`nodes_async` on other roots and another replica
    prefix (``async_roots``, ``async_url``): one launch for both."""
    sync = nodes_fault(ctx)
    args = {**ctx.args, "roots": ctx.args["async_roots"], "url": ctx.args["async_url"]}
    return {"sync": sync, "async": nodes_async(dataclasses.replace(ctx, args=args))}


def peers_probe(ctx: Ctx) -> dict[str, Any]:
    """Construct a manager on this rank's root: which ranks share it, what init exchanged."""
    with _mgr(ctx) as mgr:
        init = [r for r in mgr.coord.stats.records if r[0].startswith("init:")]
        dist.barrier()  # every rank's constructor returned: every probe is gone
        return {
            "peers": mgr._peers,
            "split": mgr._split,
            "links": mgr._session.links,
            "phases": sorted({r[0] for r in init}),
            "sent": sum(r[2] for r in init),
            "received": sum(r[3] for r in init),
            "left": sorted(n for n in os.listdir(_root(ctx)) if n.startswith(".ckptstore.probe")),
        }


def nodes_damaged(ctx: Ctx) -> dict[str, Any]:
    """FSDP2 steps 1 and 2 on node-local roots, then step 2 damaged on some nodes; prune.

    Each rank damages its own node's copy of step 2 as ``damage[rank]`` says: ``marker``
    truncates its ``local-ranks`` marker, ``shard`` flips a byte of its rank's shard. Then
    new managers with ``keep=1`` prune on every rank. Returns what ``verify_checkpoint`` says
    of step 2 on this node (before the prune), what the prune deleted, the steps this node
    kept and where a restore of a fresh model lands. With ``more``: a second prune, then a
    save of step 3 (the collectives it made), and the steps kept and restored after it.
    With ``absent``: that rank does not call ``prune`` (the others must name it).
    """
    from ckptstore.ops.verify import verify_checkpoint

    model, opt = _fsdp()
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 1}
    out: dict[str, Any] = {}
    with _mgr(ctx) as mgr:
        mgr.save(1, state)
        out["digests1"] = digests(model, opt)
        train(model, opt, 1, seed=2)
        state["step"] = 2
        mgr.save(2, state)
    dist.barrier()  # every node committed both steps
    step2 = _root(ctx) / "step-000000000002"
    damage = ctx.args["damage"][ctx.rank]
    if "marker" in damage:
        marker = step2 / "local-ranks"
        marker.write_bytes(marker.read_bytes()[:9])  # torn: not JSON any more
    if "shard" in damage:
        path = step2 / f"_shards.rank{ctx.rank:05d}.safetensors"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF  # the last byte of the last box
        path.write_bytes(bytes(data))
    dist.barrier()
    absent = ctx.args.get("absent")
    mgr = CheckpointManager(_root(ctx), keep=1, barrier_timeout=5 if absent is not None else 30)
    rep = verify_checkpoint(mgr.storage, 2)
    out["verify2"] = {"ok": rep.ok, "problems": rep.problems}
    if absent == ctx.rank:
        # With ``saves``: that rank saves instead (both raised a bare ValueError).
        out["pruned"] = (
            outcome(lambda: mgr.save(3, state) and None) if ctx.args.get("saves") else None
        )
    else:
        out["pruned"] = outcome(mgr.prune)
    dist.barrier()  # every node pruned before any lists or restores
    out["steps"] = mgr.steps()
    if absent is not None:
        mgr.close()
        return out
    out["restored"] = outcome(lambda: _restore_fresh(mgr))
    if ctx.args.get("more"):
        out["pruned_again"] = outcome(mgr.prune)
        out["steps_again"] = mgr.steps()
        train(model, opt, 1, seed=3)
        state["step"] = 3
        n = len(mgr.coord.stats.records)
        mgr.save(3, state)
        out["phases3"] = [r[0] for r in mgr.coord.stats.records[n:]]
        out["digests3"] = digests(model, opt)
        mgr.wait()
        dist.barrier()
        out["steps3"] = mgr.steps()
        out["restored3"] = outcome(lambda: _restore_fresh(mgr))
    mgr.close()
    return out


def nodes_die_in_commit(ctx: Ctx) -> dict[str, Any]:
    """Step 1 commits; in step 2's publish round rank 1 dies after its node renamed its copy.

    Rank 1 is SIGKILLed as it enters the ``save:commit`` exchange, so every node has
    published step 2 and no survivor learns the outcome. The survivors raise
    ``BarrierTimeout`` naming rank 1 and keep their copies: whether rank 0 had told some
    rank "committed" is not known to them (the verdict may be on its way when a rank dies).
    """
    import signal

    from ckptstore.dist import Coordinator

    model, opt = _fsdp()
    state: dict[str, Any] = {"model": model, "optimizer": opt, "rng": RNGState(), "step": 1}
    mgr = _mgr(ctx)
    mgr.save(1, state)
    train(model, opt, 1, seed=2)
    state["step"] = 2
    out: dict[str, Any] = {"digests2": digests(model, opt)}
    if ctx.rank == 1:
        real = Coordinator.reduce

        def reduce(self: Coordinator, obj: Any, fn: Any, phase: str, step: Any = None) -> Any:
            if phase == "save:commit":
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, obj, fn, phase, step)

        Coordinator.reduce = reduce  # type: ignore[method-assign]
    out["save2"] = outcome(lambda: mgr.save(2, state) and None)
    out["steps"] = sorted(int(n[5:]) for n in os.listdir(_root(ctx)) if n.startswith("step-"))
    return out


def nodes_hsdp(ctx: Ctx) -> dict[str, Any]:
    """HSDP (2 x 2: replicate x shard) on node-local roots, 4 ranks, no replica.

    ``roots`` put each box's two replicas on two nodes (ranks 0, 1 | 2, 3): the save is
    refused before anything is written, and the step saved before it still restores.
    ``shared_roots`` put them on one node (0, 2 | 1, 3): the save commits and the ranks
    restore it from their own node's disk.
    """
    model = make_net()
    shard(model, [2, 2])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 2)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 1}
    out: dict[str, Any] = {"digests": digests(model, opt)}
    mgr = _mgr(ctx)
    # A good step before the refused one: it must still restore, on every rank.
    mgr.save(0, {"step": 0, "w": torch.arange(6.0)})
    out["refused"] = outcome(lambda: mgr.save(1, state) and None)
    before: dict[str, Any] = {"step": None, "w": torch.zeros(6)}
    out["previous"] = outcome(lambda: mgr.restore(before))
    out["previous_values"] = [before["step"], before["w"].tolist()]
    mgr.close()
    dist.barrier()
    out["left"] = sorted(os.listdir(_root(ctx)))
    ctx.args["roots"] = ctx.args["shared_roots"]
    mgr = _mgr(ctx)
    mgr.save(1, state)
    dist.barrier()
    out["files"] = _step_files(_root(ctx), 1)
    out["restored"] = _restore_fresh(mgr, [2, 2])
    mgr.close()
    return out

"""Scenarios run on every rank by ``tests/multirank/worker.py`` (one function per scenario).

Each function gets a :class:`Ctx` and returns JSON-serializable data, or raises; the worker
records either. Failures that a scenario expects are caught with :func:`outcome` so the
rank can report how long the error took and what it said.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ckptstore import EMA, CheckpointManager, KeepBest, KeepLast, RNGState
from ckptstore.storage.local import LocalStorage
from tests.timing import healthy

#: barrier_timeout of the waits in which every rank is healthy (a busy host only slows them).
HEALTHY = healthy(15.0)


@dataclass
class Ctx:
    rank: int
    world: int
    workdir: Path
    args: dict[str, Any]

    @property
    def root(self) -> Path:
        return self.workdir / "store"


def make_model(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 4))


def digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(module.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def train_steps(
    model: nn.Module, opt: torch.optim.Optimizer, n: int, seed: int, batch: tuple[int, int] = (4, 8)
) -> None:
    """``n`` optimizer steps on random inputs of shape ``batch`` drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(*batch, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def failure(e: BaseException) -> dict[str, Any]:
    """An exception as JSON: its type and message, and ``BarrierTimeout``'s attributes."""
    return {
        "ok": False,
        "error_type": type(e).__name__,
        "message": str(e),
        "missing_ranks": list(getattr(e, "missing_ranks", []) or []),
        "phase": getattr(e, "phase", None),
        "step": getattr(e, "step", None),
        "missing": list(getattr(e, "missing", []) or []),
        "notes": list(getattr(e, "__notes__", [])),
    }


def outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    """``fn()``'s value or its exception (:func:`failure`), and how long it took."""
    t0 = time.monotonic()
    try:
        value = fn()
        return {"ok": True, "value": value, "seconds": time.monotonic() - t0}
    except Exception as e:
        return {**failure(e), "seconds": time.monotonic() - t0}


def step1_then_manager(ctx: Ctx, state: dict[str, Any], **kw: Any) -> CheckpointManager:
    """``state`` saved as step 1 by every rank with :data:`HEALTHY` waits, then the manager
    under test (``kw``: its other arguments).

    The returned manager's ``barrier_timeout`` is the scenario's short ``timeout``: the wait
    that must run out when a rank is missing. The healthy save before it must not fail only
    because a busy host made one rank slower than that.
    """
    with CheckpointManager(ctx.root, barrier_timeout=HEALTHY) as setup:
        setup.save(1, state)
    # Constructing the manager waits for every rank, with the short timeout: start together.
    dist.barrier()
    return CheckpointManager(ctx.root, barrier_timeout=float(ctx.args["timeout"]), **kw)


def wait_for_outcomes(ctx: Ctx, ranks: list[int]) -> None:
    """Block until ``ranks`` have written their outcome (``rank{r}.json``, by the worker).

    For a rank that must stay alive, absent from the waits, until the survivors are done:
    a fixed sleep is too short on a busy host and too long on an idle one.
    """
    deadline = time.monotonic() + healthy(30.0)
    paths = [ctx.workdir / f"rank{r}.json" for r in ranks]
    while not all(p.exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.05)


def files_of(root: Path, step: int) -> list[str]:
    d = root / f"step-{step:012d}"
    return sorted(os.listdir(d)) if d.exists() else []


# ---- replicated ------------------------------------------------------------------------


def replicated(ctx: Ctx) -> dict[str, Any]:
    model = DDP(make_model())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train_steps(model, opt, 3, seed=ctx.rank)  # different data per rank, grads all-reduced
    mgr = CheckpointManager(ctx.root, keep=3)
    m1 = mgr.save(1, {"model": model, "optimizer": opt}).manifest
    train_steps(model, opt, 2, seed=10 + ctx.rank)
    saved = digest(model.module)
    m2 = mgr.save(2, {"model": model, "optimizer": opt}).manifest
    files_after_save = files_of(ctx.root, 2)
    fresh = DDP(make_model(seed=123))
    opt2 = torch.optim.Adam(fresh.parameters(), lr=0.01)
    step = mgr.restore({"model": fresh, "optimizer": opt2})
    mgr.close()
    return {
        "saved": saved,
        "restored": digest(fresh.module),
        "step": step,
        "manifest_steps": [m1.step, m2.step],
        "world_size": m2.world_size,
        "files": files_after_save,
        "exp_avg": opt2.state_dict()["state"][0]["exp_avg"].sum().item(),
        "exp_avg_saved": opt.state_dict()["state"][0]["exp_avg"].sum().item(),
    }


def save_on_rank0_only(ctx: Ctx) -> dict[str, Any]:
    model = make_model()
    mgr = step1_then_manager(ctx, {"model": model})
    if ctx.rank == 0:
        return outcome(lambda: mgr.save(2, {"model": model}))  # the `if rank == 0` bug
    wait_for_outcomes(ctx, [0])  # alive, but never at the wait
    return {"ok": True, "value": "idle"}


def guardrails(ctx: Ctx) -> dict[str, Any]:
    """Saves that rank 0 refuses (it holds the listing): every rank raises the same error."""
    model = make_model()
    out: dict[str, Any] = {}
    with CheckpointManager(ctx.root, barrier_timeout=HEALTHY) as mgr:
        mgr.save(10, {"model": model}, metrics={"val_loss": 1.0})
        # Training restarted without resume(): older steps, replicated and per-rank.
        out["older"] = outcome(lambda: mgr.save(5, {"model": model}))
        out["older_sharded"] = outcome(lambda: mgr.save(6, {"model": model}, sharded=True))
    keep = [KeepBest(1, "val_loss"), KeepLast(1)]
    with CheckpointManager(ctx.root, keep=keep, async_save=True, barrier_timeout=HEALTHY) as mgr:
        # The metrics stored are rank 0's: rank 0's decide, whatever the other ranks pass.
        lacking = {"loss": 0.5} if ctx.rank == 0 else {"val_loss": 0.5}
        out["rank0_lacks_metric"] = outcome(lambda: mgr.save(11, {"model": model}, metrics=lacking))
        only0 = {"val_loss": 0.5} if ctx.rank == 0 else None
        out["only_rank0_has_it"] = outcome(
            lambda: mgr.save(12, {"model": model}, metrics=only0).wait() and None
        )
        out["older_async"] = outcome(lambda: mgr.save(7, {"model": model}))
        out["steps"] = mgr.steps()
    return out


def calls_differ(ctx: Ctx) -> dict[str, Any]:
    """Ranks whose calls differ: every rank refuses at once, and nothing is saved or read.

    Batches counted per rank (seed 000: 62 on rank 0, 61 on rank 1) save different steps; a
    best step tracked per rank is restored by number; a save under ``if rank == 0`` meets
    the next save of every rank; a restore on one rank meets a save on the other.
    """
    model = make_model()
    out: dict[str, Any] = {}
    with CheckpointManager(ctx.root, barrier_timeout=HEALTHY) as mgr:
        mgr.save(2, {"model": model})
        mgr.save(4, {"model": make_model(seed=4)})
        step = 62 if ctx.rank == 0 else 61
        out["steps_differ"] = outcome(lambda: mgr.save(step, {"model": model}, sharded=True))
        out["sharded_differs"] = outcome(
            lambda: mgr.save(6, {"model": model}, sharded=ctx.rank == 1)
        )
        best = 2 if ctx.rank == 0 else 4
        out["restore_differs"] = outcome(lambda: mgr.restore({"model": make_model(9)}, step=best))
        out["after"] = mgr.steps()
        if ctx.rank == 0:  # `if rank == 0: save(best)`, then every rank's periodic save
            out["solo"] = outcome(lambda: mgr.save(102, {"model": model}) and None)
        else:
            out["solo"] = outcome(lambda: mgr.save(8, {"model": model}) and None)
        if ctx.rank == 0:
            out["mixed"] = outcome(lambda: mgr.restore({"model": make_model(9)}, step=2))
        else:
            out["mixed"] = outcome(lambda: mgr.save(10, {"model": model}) and None)
        if ctx.rank == 0:  # a resume met a save: both timed out, naming no one
            out["resume_mixed"] = outcome(lambda: mgr.resume({"model": make_model(9)}) and None)
        else:
            out["resume_mixed"] = outcome(lambda: mgr.save(10, {"model": model}) and None)
        # Arguments refused on one rank alone (its loss gone NaN): that rank skipped the
        # first exchange, and every later call met another rank's next one.
        bad = {"loss": float("nan")} if ctx.rank == 1 else None
        out["bad_args"] = outcome(lambda: mgr.save(14, {"model": model}, metadata=bad) and None)
        out["end"] = mgr.steps()
        target = make_model(9)
        out["restored"] = [mgr.restore({"model": target}), digest(target)]
    # async_save on one rank only: the async rank's staging broadcast met the other's write
    # broadcast, and a step was committed while both raised (found by review).
    with CheckpointManager(ctx.root, barrier_timeout=HEALTHY, async_save=ctx.rank == 1) as mgr:
        out["async_differs"] = outcome(lambda: mgr.save(12, {"model": model}) and None)
        out["after_async"] = mgr.steps()
    return out


def replicated_state_differs(ctx: Ctx) -> dict[str, Any]:
    """A replicated save writes rank 0's state alone: rank 1's own list or entry was dropped
    without a word (found by review). Rank 0 now warns, once a manager, naming the ranks and
    the entries; a rank holding less than rank 0 (torch's full state dict, empty on every
    rank but 0) or other values in the same shapes is not named."""
    seen = ckptstore_warnings()
    model = make_model()
    out: dict[str, Any] = {}
    with CheckpointManager(ctx.root, barrier_timeout=HEALTHY) as mgr:
        mgr.save(1, {"model": model, "seen": [0, 1]})
        mine = list(range(3 + ctx.rank))  # a rank's own sample ids
        mgr.save(2, {"model": model, "seen": mine})
        out["after_list"] = list(seen)
        extra: dict[str, Any] = {"model": model, "seen": [0, 1]}
        if ctx.rank == 1:
            extra["loader"] = {"pos": 3}
        mgr.save(3, extra)
        mgr.save(4, {"model": model, "seen": mine})  # said once already
        out["after_repeat"] = list(seen)
        full = {"model": model.state_dict(), "seen": [0, 1]}
        if ctx.rank == 1:  # get_state_dict(full_state_dict=True, cpu_offload=True) there
            full = {"model": {}, "seen": None}
        mgr.save(5, full)
        mgr.save(6, {"model": model, "seen": [ctx.rank, 7], "loss": torch.tensor(ctx.rank * 1.0)})
        out["warnings"] = list(seen)
        out["steps"] = mgr.steps()
        out["saved_seen"] = mgr.load(2)["seen"]
    return out


def other_ranks_maintain(ctx: Ctx) -> dict[str, Any]:
    """``prune()`` and ``gc()`` on every rank of a job writing one store, whose rank 1 was
    built with another ``keep``: only rank 0, the store's writer, may act (rank 1 deleted
    steps rank 0 keeps, and removed the ``.tmp-`` of rank 0's save in flight)."""
    model = make_model()
    out: dict[str, Any] = {}
    with CheckpointManager(
        ctx.root, barrier_timeout=HEALTHY, keep=None if ctx.rank == 0 else 1
    ) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, {"model": model})
        in_flight = ctx.root / (".tmp-step-000000000004-" + "a" * 32)
        if ctx.rank == 0:  # rank 0's next save, under way
            in_flight.mkdir()
        dist.barrier()
        out["pruned"] = mgr.prune()
        out["gc"] = mgr.gc() if ctx.rank == 1 else []
        dist.barrier()
        out["in_flight_left"] = in_flight.is_dir()
        out["steps"] = mgr.steps()
    return out


def restore_refused_on_one_rank(ctx: Ctx) -> dict[str, Any]:
    """Rank 1 restores into a model of another shape: every rank raises, and rank 0's model,
    whose targets passed their checks, must hold what it held (found by review: it was
    read in place from the step while both ranks raised)."""
    out: dict[str, Any] = {}
    with CheckpointManager(ctx.root, barrier_timeout=HEALTHY) as mgr:
        for sharded in (False, True):
            step = 1 if not sharded else 2
            mgr.save(step, {"model": make_model(seed=step)}, sharded=sharded)
            # rank 1: a model of another shape
            target = nn.Sequential(nn.Linear(8, 3)) if ctx.rank == 1 else make_model(seed=50)
            before = digest(target)
            res = outcome(lambda t=target, s=step: mgr.restore({"model": t}, step=s))
            out[str(step)] = {"res": res, "kept": digest(target) == before}
        # A state whose load_state_dict raises on rank 1 alone: rank 0 went on training.
        mgr.save(3, {"model": make_model(seed=3), "extra": _Picky(False)})
        picky = {"model": make_model(seed=50), "extra": _Picky(ctx.rank == 1)}
        out["applied"] = outcome(lambda: mgr.restore(picky, step=3))
        # The job goes on: a restore every rank can take works.
        target = make_model(seed=50)
        out["then"] = [
            mgr.restore({"model": target}, step=2),
            digest(target) == digest(make_model(2)),
        ]
    return out


class _Picky:
    """A stateful object whose ``load_state_dict`` raises where ``fail`` (one rank)."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.v = 7

    def state_dict(self) -> dict[str, Any]:
        return {"v": self.v}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if self.fail:
            raise RuntimeError("cannot take it (injected)")
        self.v = sd["v"]


def rank0_saves_alone(ctx: Ctx) -> dict[str, Any]:
    """``if rank == 0: save(2)``, then every rank's ``save(3)`` once rank 0 gave up on 2.

    Rank 0 names rank 1 at 'save:enter' of step 2; rank 1, alive and on time for its own
    call, must not read that verdict as "rank 1 did not arrive" of itself.
    """
    model = make_model()
    mgr = step1_then_manager(ctx, {"model": model})
    timeout = float(ctx.args["timeout"])
    out: dict[str, Any] = {}
    if ctx.rank == 0:
        out["solo"] = outcome(lambda: mgr.save(2, {"model": model}) and None)
    else:
        time.sleep(timeout + 3.0)  # until rank 0 gave up on its save of step 2
    out["next"] = outcome(lambda: mgr.save(3, {"model": model}) and None)
    if ctx.rank == 0:
        time.sleep(timeout + 3.0)  # alive while rank 1 waits for it
    return out


def rank_exits_before_save(ctx: Ctx) -> dict[str, Any]:
    model = make_model()
    mgr = step1_then_manager(ctx, {"model": model})
    if ctx.rank == 1:
        os._exit(3)
    return outcome(lambda: mgr.save(2, {"model": model}))


def rank_exits_mid_commit(ctx: Ctx) -> dict[str, Any]:
    writing = ctx.workdir / "rank0-writing"
    pid_file = ctx.workdir / "rank1.pid"
    if ctx.rank == 1:  # read by rank 0 after step 1, a collective
        pid_file.with_suffix(".tmp").write_text(str(os.getpid()))
        os.replace(pid_file.with_suffix(".tmp"), pid_file)
    model = make_model()
    mgr = step1_then_manager(ctx, {"model": model})
    if ctx.rank == 0:
        # Rank 0 starts writing step 2, then waits until the other rank is dead: it dies while
        # step 2 is being written, however slow the host.
        from ckptstore.codec import payload
        from ckptstore.dist import _alive

        real = payload.write_group
        other = int(pid_file.read_text())

        def slow(*a: Any, **k: Any) -> None:
            writing.touch()
            deadline = time.monotonic() + healthy(30.0)
            while _alive(other) and time.monotonic() < deadline:
                time.sleep(0.02)
            real(*a, **k)

        payload.write_group = slow  # type: ignore[assignment]
    else:

        def die_once_rank0_writes() -> None:
            deadline = time.monotonic() + healthy(30.0)
            while not writing.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            os._exit(3)

        threading.Thread(target=die_once_rank0_writes, daemon=True).start()
    return outcome(lambda: mgr.save(2, {"model": model}))


def rank0_raises_in_serialization(ctx: Ctx) -> dict[str, Any]:
    model = make_model()
    mgr = CheckpointManager(ctx.root, barrier_timeout=HEALTHY)
    mgr.save(1, {"model": model})
    # Not storable without pickle: only rank 0, the writer, serializes it and finds out.
    state: dict[str, Any] = {"model": model, "extra": {"obj": object()}}
    first = outcome(lambda: mgr.save(2, state))
    # The group is still healthy: a later save works on every rank.
    second = outcome(lambda: mgr.save(3, {"model": model}).manifest.step)
    return {"first": first, "second": second, "steps": mgr.steps()}


# ---- sharded ---------------------------------------------------------------------------


def _shard_state(rank: int) -> dict[str, Any]:
    return {
        "shard": torch.arange(6, dtype=torch.float32) + 100 * rank,
        "model": make_model(seed=rank),  # different weights per rank, as FSDP shards are
        "meta": {"rank": rank},
    }


def sharded_roundtrip(ctx: Ctx) -> dict[str, Any]:
    mgr = CheckpointManager(ctx.root, barrier_timeout=HEALTHY)
    state = _shard_state(ctx.rank)
    m = mgr.save(1, state, sharded=True).manifest
    fresh = {"shard": torch.zeros(6), "model": make_model(seed=99), "meta": None}
    step = mgr.restore(fresh)
    return {
        "step": step,
        "sharded": m.sharded,
        "world_size": m.world_size,
        "files": sorted(m.files),
        "shard": fresh["shard"].tolist(),
        "meta": fresh["meta"],
        "model_ok": digest(fresh["model"]) == digest(state["model"]),
    }


def sharded_restore_other_world(ctx: Ctx) -> dict[str, Any]:
    mgr = CheckpointManager(ctx.root, barrier_timeout=HEALTHY)
    fresh = {"shard": torch.zeros(6), "model": make_model(seed=99), "meta": None}
    return outcome(lambda: mgr.restore(fresh))


def sharded_disk_full(ctx: Ctx) -> dict[str, Any]:
    mgr = CheckpointManager(ctx.root, barrier_timeout=HEALTHY)
    state = _shard_state(ctx.rank)
    mgr.save(1, state, sharded=True)
    if ctx.rank == 1:
        real = LocalStorage._open_write

        def full(self: LocalStorage, rel: str) -> Any:
            if "step-000000000002" in rel or ".tmp-step-000000000002" in rel:
                raise OSError(errno.ENOSPC, "No space left on device", rel)
            return real(self, rel)

        LocalStorage._open_write = full  # type: ignore[method-assign]
    failed = outcome(lambda: mgr.save(2, state, sharded=True))
    leftovers = sorted(n for n in os.listdir(ctx.root) if n.startswith("."))
    dist.barrier()
    fresh = {"shard": torch.zeros(6), "model": make_model(seed=99), "meta": None}
    step = mgr.restore(fresh)
    return {
        "failed": failed,
        "steps": mgr.steps(),
        "leftovers": [n for n in leftovers if n.startswith(".tmp")],
        "restored_step": step,
        "shard": fresh["shard"].tolist(),
    }


# ---- restore ---------------------------------------------------------------------------


def corrupt_newest(ctx: Ctx) -> dict[str, Any]:
    model = make_model()
    mgr = CheckpointManager(ctx.root, barrier_timeout=HEALTHY)
    mgr.save(1, {"model": model})
    with torch.no_grad():
        model[0].weight.add_(1.0)
    mgr.save(2, {"model": model})
    if ctx.rank == 0:
        p = ctx.root / "step-000000000002" / "model.safetensors"
        data = bytearray(p.read_bytes())
        data[-5] ^= 0xFF
        p.write_bytes(bytes(data))
    dist.barrier()
    fresh = make_model(seed=7)
    step = mgr.restore({"model": fresh})
    return {"step": step, "digest": digest(fresh), "verify2": mgr.verify(2).ok}


def corrupt_step_rank0_cannot_list(ctx: Ctx) -> dict[str, Any]:
    """Step 2 is corrupt on every rank; rank 0's look at the store (was it deleted while it
    was read?) fails: its listing raises a foreign error, then (``look``) the look itself.
    Every rank's outcome of ``restore(step=2)`` and ``restore()`` in each case, with its
    seconds."""
    from ckptstore.restore import reader

    model = make_model()
    mgr = CheckpointManager(ctx.root, barrier_timeout=float(ctx.args["timeout"]))
    mgr.save(1, {"model": model})
    mgr.save(2, {"model": model})
    calls = [0]
    if ctx.rank == 0:
        p = ctx.root / "step-000000000002" / "model.safetensors"
        data = bytearray(p.read_bytes())
        data[-5] ^= 0xFF
        p.write_bytes(bytes(data))
        real = mgr.storage.list_steps

        def flaky() -> list[int]:  # the choice of step lists; the look after it fails
            calls[0] += 1
            if calls[0] > 1:
                raise RuntimeError("the listing broke")
            return real()

        mgr.storage.list_steps = flaky  # type: ignore[method-assign]
    dist.barrier()

    def restore(**kw: Any) -> Any:
        calls[0] = 0
        return mgr.restore({"model": make_model(seed=7)}, **kw)

    out = {"explicit": outcome(lambda: restore(step=2)), "newest": outcome(restore)}
    if ctx.rank == 0:

        def broken(session: Any, step: int, *, fetched: bool = False) -> bool:
            raise RuntimeError("the look broke")

        reader.vanished = broken  # a fault in the look itself
    out["look_explicit"] = outcome(lambda: restore(step=2))
    out["look_newest"] = outcome(restore)
    return out


def broadcast_restore(ctx: Ctx) -> dict[str, Any]:
    # Node-local disks: each rank has its own directory; only rank 0's holds checkpoints.
    root = ctx.workdir / f"node{ctx.rank}"
    model = make_model(seed=5)
    mgr = CheckpointManager(root, barrier_timeout=HEALTHY)
    mgr.save(1, {"model": model, "step": 1})
    fresh: dict[str, Any] = {"model": make_model(seed=6), "step": 0}
    step = mgr.restore(fresh, broadcast=True)
    # The same launch, compressed torch-format payloads: the broadcast copies inflate into
    # the model's tensors as they stream (payload.decode_bytes).
    zroot = ctx.workdir / f"znode{ctx.rank}"
    zmgr = CheckpointManager(zroot, barrier_timeout=HEALTHY, format="torch", compression="zstd")
    zmgr.save(2, {"model": model, "step": 2})
    zfresh: dict[str, Any] = {"model": make_model(seed=8), "step": 0}
    zstep = zmgr.restore(zfresh, broadcast=True)
    return {
        "step": step,
        "digest": digest(fresh["model"]),
        "saved": digest(model),
        "value": fresh["step"],
        "local_files": sorted(os.listdir(root)) if root.exists() else [],
        "zstd": [zstep, digest(zfresh["model"]), zfresh["step"]],
    }


def ddp_ema(ctx: Ctx) -> dict[str, Any]:
    model = DDP(make_model())
    ema = AveragedModel(model.module, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(3):
        train_steps(model, opt, 1, seed=i)
        ema.update_parameters(model.module)
    mgr = CheckpointManager(ctx.root, barrier_timeout=HEALTHY)
    mgr.save(1, {"model": model, "optimizer": opt})  # a checkpoint without EMA
    mgr.save(2, {"model": model, "optimizer": opt, "ema": EMA(ema, source=model)})
    ema_saved = digest(ema.module)
    n_saved = int(ema.n_averaged)

    # 1) No EMA stored: rebuilt from the de-parallelized, restored model.
    m2 = DDP(make_model(seed=42))
    ema2 = AveragedModel(m2.module, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    s1 = mgr.restore({"model": m2, "optimizer": opt2, "ema": EMA(ema2, source=m2)}, step=1)
    rebuilt_equals_model = digest(ema2.module) == digest(m2.module)
    # 2) EMA stored: the EMA weights come back, not the model's.
    m3 = DDP(make_model(seed=43))
    ema3 = AveragedModel(m3.module, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    opt3 = torch.optim.SGD(m3.parameters(), lr=0.1)
    s2 = mgr.restore({"model": m3, "optimizer": opt3, "ema": EMA(ema3, source=m3)})
    # Training continues in lockstep after the restore (DDP collectives still match).
    train_steps(m3, opt3, 1, seed=ctx.rank)
    return {
        "s1": s1,
        "s2": s2,
        "rebuilt_equals_model": rebuilt_equals_model,
        "ema_restored": digest(ema3.module) == ema_saved,
        "ema_differs_from_model": ema_saved != digest(model.module),
        "n_averaged": int(ema3.n_averaged),
        "n_saved": n_saved,
        "after": digest(m3.module),
    }


# ---- failures that must reach every rank at once (issue 10) ------------------------------


def async_failure_then_restore(ctx: Ctx) -> dict[str, Any]:
    """Rank 0's async save fails in the background; then every rank restores (or resumes)."""
    from ckptstore.codec import payload

    timeout = float(ctx.args["timeout"])
    via = ctx.args["via"]
    model = make_model()
    mgr = CheckpointManager(ctx.root, barrier_timeout=timeout, async_save=True)
    mgr.save(1, {"model": model}).wait()
    if ctx.rank == 0:

        def full(*a: Any, **k: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        payload.write_group = full  # type: ignore[assignment]
    mgr.save(2, {"model": model})  # returns at once; rank 0's writer fails behind it
    fresh = make_model(seed=9)
    call = {
        "restore": lambda: mgr.restore({"model": fresh}),
        "resume": lambda: mgr.resume({"model": fresh}),
    }[via]
    first = outcome(call)
    second = outcome(call)  # reported once: the group is healthy and the step is there
    return {"first": first, "second": second, "digest_ok": digest(fresh) == digest(model)}


def async_failure_waited_on_rank0(ctx: Ctx) -> dict[str, Any]:
    """Rank 0's async save fails; rank 0 alone sees it (``wait()``, not collective); the
    next save is where every rank is told, rank 0 again, and nothing of it is committed."""
    from ckptstore.codec import payload

    model = make_model()
    mgr = CheckpointManager(ctx.root, barrier_timeout=float(ctx.args["timeout"]), async_save=True)
    mgr.save(1, {"model": model}).wait()
    real = payload.write_group
    if ctx.rank == 0:

        def full(*a: Any, **k: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        payload.write_group = full  # type: ignore[assignment]
    mgr.save(2, {"model": model})
    waited = outcome(mgr.wait)
    payload.write_group = real  # type: ignore[assignment]
    out = {"waited": waited, "next": outcome(lambda: mgr.save(3, {"model": model}) and None)}
    out["then"] = outcome(lambda: mgr.save(3, {"model": model}).wait() and None)
    mgr.close()  # rank 1's handle is done at once (rank 0 writes): close waits for rank 0
    dist.barrier()
    with CheckpointManager(ctx.root, barrier_timeout=float(ctx.args["timeout"])) as again:
        out["steps"] = again.steps()
    return out


class LockedError(Exception):
    """An exception that cannot be pickled: it holds a lock."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


class Refuses:
    """A Stateful whose state_dict() raises an unpicklable exception (on chosen ranks)."""

    def __init__(self, raises: bool) -> None:
        self.raises = raises

    def state_dict(self) -> dict[str, Any]:
        if self.raises:
            raise LockedError("the loader is mid-epoch and holds its lock")
        return {"pos": 1}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def unpicklable_error_in_state_dict(ctx: Ctx) -> dict[str, Any]:
    timeout = float(ctx.args["timeout"])
    model = make_model()
    out: dict[str, Any] = {}
    for mode in ("sync", "async", "sharded"):
        root = ctx.workdir / f"store-{mode}"
        mgr = CheckpointManager(root, barrier_timeout=timeout, async_save=mode == "async")
        sharded = mode == "sharded"
        state = {"model": model, "loader": Refuses(raises=ctx.rank == 0)}

        def first(m: Any = mgr, st: Any = state, sh: bool = sharded) -> Any:
            return m.save(1, st, sharded=sh).wait()

        def second(m: Any = mgr, sh: bool = sharded) -> Any:
            handle = m.save(2, {"model": model}, sharded=sh)
            handle.wait()
            return handle.step

        out[mode] = outcome(first)
        out[mode + "_next"] = outcome(second)  # the group is intact: the next save works
        mgr.close()
    return out


def manager_on_some_ranks(ctx: Ctx) -> dict[str, Any]:
    timeout = float(ctx.args["timeout"])
    if ctx.rank == ctx.world - 1:
        # Never constructs it (the bug under test), but stays alive until the others are done.
        wait_for_outcomes(ctx, list(range(ctx.world - 1)))
        return {"ok": True, "value": "absent"}
    return outcome(lambda: CheckpointManager(ctx.root, barrier_timeout=timeout))


def rank_dies_in_group_creation(ctx: Ctx) -> dict[str, Any]:
    """The last rank dies inside ``new_group`` while the manager's coordinator is built: it
    had announced itself (its host key is set), so only the others' group waits for it."""
    timeout = float(ctx.args["timeout"])
    if ctx.rank == ctx.world - 1:
        from ckptstore import dist as cdist

        def die(*a: Any, **k: Any) -> Any:
            os._exit(3)

        cdist.dist.new_group = die  # type: ignore[assignment]
    return outcome(lambda: CheckpointManager(ctx.root, barrier_timeout=timeout))


def rank_dies_inside_group_creation(ctx: Ctx) -> dict[str, Any]:
    """The last rank dies inside the real ``new_group`` (``after`` seconds into it), waiting
    there for the others, who come ``late`` seconds after it died (every rank has announced
    itself: its part of the group's rendezvous is in the store already).

    The others wait for the file the dying rank writes just before it exits (at most 30 s),
    not for a fixed time: on a loaded machine the dying rank reached ``new_group`` after the
    others' fixed 0.4 s, the group was made whole, and it died only after it (the test saw
    no rank missing).
    """
    timeout = float(ctx.args["timeout"])
    from ckptstore import dist as cdist

    died = ctx.workdir / "last-rank-died"
    real = cdist.dist.new_group
    if ctx.rank == ctx.world - 1:

        def die() -> None:
            died.touch()
            os._exit(3)

        def die_inside(*a: Any, **k: Any) -> Any:
            threading.Timer(float(ctx.args["after"]), die).start()
            return real(*a, **k)

        cdist.dist.new_group = die_inside  # type: ignore[assignment]
    else:
        waited = cdist.Coordinator._await_ranks

        def late(self: Any, store: Any) -> None:  # every key is set: then a while elsewhere
            waited(self, store)
            deadline = time.monotonic() + 30
            while not died.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(float(ctx.args["late"]))

        cdist.Coordinator._await_ranks = late  # type: ignore[method-assign]
    return outcome(lambda: CheckpointManager(ctx.root, barrier_timeout=timeout).close())


def rank0_elsewhere_when_a_rank_dies(ctx: Ctx) -> dict[str, Any]:
    """Rank 2 dies before a save, and rank 0 comes to it only after rank 1 gave up (rank 0
    was at another wait: still finishing an async save's commit, say): no verdict of rank 0
    reaches rank 1, which must still name the rank whose process exited."""
    model = make_model()
    mgr = step1_then_manager(ctx, {"model": model})
    if ctx.rank == 2:
        os._exit(3)
    if ctx.rank == 0:
        wait_for_outcomes(ctx, [1])
    return outcome(lambda: mgr.save(2, {"model": model}))


def exporter_then_rank_dies(ctx: Ctx) -> dict[str, Any]:
    """Rank 0 alone builds a manager with distributed=False first (an exporter, Lightning's
    CheckpointIO); then a rank dies in a save, and every survivor must name that rank."""
    model = make_model()
    if ctx.rank == 0:
        with CheckpointManager(ctx.workdir / "export", distributed=False) as exporter:
            exporter.save(1, {"model": model})
    mgr = step1_then_manager(ctx, {"model": model})
    if ctx.rank == 1:
        os._exit(3)
    return outcome(lambda: mgr.save(2, {"model": model}))


def _draws() -> list[float]:
    import random

    import numpy as np

    return [*torch.rand(2).tolist(), random.random(), float(np.random.rand())]


def _seed_all(seed: int) -> None:
    import random

    import numpy as np

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def rng_save(ctx: Ctx) -> dict[str, Any]:
    """Save each rank's generators (world 1: a single-process checkpoint)."""
    _seed_all(100 + ctx.rank)
    with CheckpointManager(ctx.root, barrier_timeout=HEALTHY) as mgr:
        mgr.save(1, {"rng": RNGState()})
    return {"draws": _draws()}


def ckptstore_warnings() -> list[str]:
    """A list that receives the message of every warning (or worse) ckptstore logs from now."""
    import logging

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                seen.append(record.getMessage())

    logging.getLogger("ckptstore").addHandler(Keep())
    return seen


def rng_sharded(ctx: Ctx) -> dict[str, Any]:
    """A sharded save keeps each rank's stream in its own file: each gets its own back."""
    seen = ckptstore_warnings()
    _seed_all(100 + ctx.rank)
    with CheckpointManager(ctx.root, barrier_timeout=HEALTHY) as mgr:
        mgr.save(1, {"rng": RNGState()}, sharded=True)
        saved = _draws()
        _seed_all(7)
        mgr.restore({"rng": RNGState(derive_missing=True)})
    return {"saved": saved, "restored": _draws(), "warnings": seen}


def rng_restore(ctx: Ctx) -> dict[str, Any]:
    """Restore on more ranks than saved: plain, then with derive_missing (twice)."""
    seen = ckptstore_warnings()
    out: dict[str, Any] = {}
    with CheckpointManager(ctx.root, barrier_timeout=HEALTHY) as mgr:
        for name, derive in (("plain", False), ("derived", True), ("again", True)):
            _seed_all(7)  # the same scrambled state on every rank before each restore
            seen.clear()
            mgr.restore({"rng": RNGState(derive_missing=derive)})
            out[name] = {"draws": _draws(), "warnings": list(seen)}
    return out


# ---- exact resume ----------------------------------------------------------------------


def train_run(ctx: Ctx) -> dict[str, Any]:
    """Train to ``total`` steps, checkpointing every 2; stop abruptly after ``stop_at``."""
    total = int(ctx.args["total"])
    stop_at = ctx.args.get("stop_at")
    torch.manual_seed(1000 + ctx.rank)  # per-rank streams: data and dropout differ by rank
    model = DDP(make_model(seed=0, dropout=0.2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    ema = AveragedModel(model.module, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    mgr = CheckpointManager(ctx.root, keep=2, barrier_timeout=HEALTHY)
    state: dict[str, Any] = {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "ema": EMA(ema, source=model),
        "rng": RNGState(),
        "step": 0,
    }
    start = mgr.resume(state)
    for step in range(start, total):
        x = torch.randn(4, 8)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        ema.update_parameters(model.module)
        state["step"] = step
        if step % 2 == 1:
            mgr.save(step, state)
        if stop_at is not None and step == int(stop_at):
            os._exit(0)  # a crash: no close, no cleanup
    mgr.close()
    return {
        "start": start,
        "model": digest(model.module),
        "ema": digest(ema.module),
        "opt": hashlib.sha256(
            b"".join(
                t.numpy().tobytes()
                for s in opt.state_dict()["state"].values()
                for t in s.values()
                if isinstance(t, torch.Tensor)
            )
        ).hexdigest(),
        "lr": opt.param_groups[0]["lr"],
    }


# ---- a rank that hangs (alive, sockets open) ----------------------------------------------


def rank_freezes_mid_exchange(ctx: Ctx) -> dict[str, Any]:
    """The last rank passes the 'save:write' wait, then freezes (SIGSTOP) before the data
    exchange: only the timeout can tell, and the survivors must still name it. With
    ``args["in_barrier"] = k`` it freezes inside its k-th barrier of the save, once it has
    arrived there (its arrival key set)."""
    import signal

    from ckptstore.dist import Coordinator

    model = make_model()
    mgr = step1_then_manager(ctx, {"model": model})
    if ctx.rank == ctx.world - 1:
        real = Coordinator.barrier
        real_arrive = Coordinator._arrive
        me = os.getpid()

        def freeze() -> None:
            if os.fork() == 0:  # the undertaker: the frozen rank cannot end itself
                wait_for_outcomes(ctx, list(range(ctx.world - 1)))  # the survivors'
                os.kill(me, signal.SIGKILL)
                os._exit(0)
            os.kill(me, signal.SIGSTOP)

        def barrier(self: Coordinator, phase: str, step: int | None = None) -> None:
            real(self, phase, step)
            if phase == "save:write":
                freeze()

        arrivals = [0]  # counted from the save under test on

        def arrive(self: Coordinator) -> None:  # arrived (its key is set), then frozen
            arrivals[0] += 1
            there = arrivals[0] == ctx.args["in_barrier"]
            if there and ctx.args.get("late_rank") == ctx.rank:
                time.sleep(ctx.args["late"])  # it arrives late, then freezes
            real_arrive(self)
            if there:
                freeze()

        if ctx.args.get("in_barrier"):
            Coordinator._arrive = arrive  # type: ignore[method-assign]
        else:
            Coordinator.barrier = barrier  # type: ignore[method-assign]
    elif ctx.rank == ctx.args.get("late_rank", -1):
        # A survivor that arrives ``late`` seconds after the others at that barrier (and so
        # times out that much later than they do).
        real_arrive = Coordinator._arrive
        seen = [0]

        def late_arrive(self: Coordinator) -> None:
            seen[0] += 1
            if seen[0] == ctx.args["in_barrier"]:
                time.sleep(ctx.args["late"])
            real_arrive(self)

        Coordinator._arrive = late_arrive  # type: ignore[method-assign]
    return outcome(lambda: mgr.save(2, {"model": model}))


# ---- two tiers: a replica on S3 (moto, started by the test) ------------------------------------


def _tiered(ctx: Ctx, root: Path) -> CheckpointManager:
    return CheckpointManager(
        root,
        keep=None,
        barrier_timeout=HEALTHY,
        replica=ctx.args["url"],
        replica_options=ctx.args["options"],
    )


def replica_save(ctx: Ctx) -> dict[str, Any]:
    """A replicated and a per-rank sharded save on a shared local root with a replica."""
    mgr = _tiered(ctx, ctx.root)
    uploader = mgr.replica is not None
    mgr.save(1, {"model": make_model(seed=7), "step": 1})
    state = _shard_state(ctx.rank)
    m = mgr.save(2, state, sharded=True).manifest
    mgr.close()  # waits for the uploads (every rank's own files of the sharded step)
    parts = {str(k): v for k, v in (mgr.replica.parts if mgr.replica else {}).items()}
    return {
        "uploader": uploader,
        "files": sorted(m.files),
        "model": digest(state["model"]),
        "parts": parts,
    }


def replica_restore(ctx: Ctx) -> dict[str, Any]:
    """Both ranks on a new, empty shared root: the newest step comes from the replica."""
    mgr = _tiered(ctx, ctx.workdir / "new-node")
    fresh = {"shard": torch.zeros(6), "model": make_model(seed=99), "meta": None}
    nxt = mgr.resume(fresh)
    steps = mgr.steps()
    mgr.close()
    return {
        "next": nxt,
        "shard": fresh["shard"].tolist(),
        "meta": fresh["meta"],
        "model": digest(fresh["model"]),
        "local_steps": steps,
    }


def rank_dies_mid_reduce(ctx: Ctx) -> dict[str, Any]:
    """The last rank passes a reduce's barrier, then dies (SIGKILL) before its slot is sent
    (``args["where"] == "barrier"``: it dies before it arrives at the barrier).

    Rank 0 learns at once (the dead rank's connection closes), while the other survivors
    wait on rank 0's verdict, which never comes, until their own timeout: every survivor
    must still name the dead rank, not rank 0.
    """
    import signal

    from ckptstore.dist import Coordinator

    coord = Coordinator(ctx.args["timeout"])
    assert coord.reduce(ctx.rank, sum, "warm-up") == sum(range(ctx.world))
    if ctx.rank == ctx.world - 1:

        def die(*a: Any, **k: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)

        if ctx.args.get("where") == "barrier":  # before it arrives at the reduce's barrier
            Coordinator._barrier = die  # type: ignore[method-assign]
        else:
            Coordinator._gather_bytes = die  # type: ignore[method-assign]
    if ctx.args.get("where") == "gather":
        # A gather, then a broadcast: rank 0 fails in the gather, while the others have sent
        # their slots and wait at the broadcast, one collective further on.
        def gather_then_broadcast() -> Any:
            coord.gather(ctx.rank, "save:gather", 7)
            return coord.broadcast("manifest", "save:prepared", 7)

        return outcome(gather_then_broadcast)
    return outcome(lambda: coord.reduce(ctx.rank, sum, "save:ready", 7))


def manager_on_readonly_store(ctx: Ctx) -> dict[str, Any]:
    """Every rank builds a manager on a store whose root cannot be written (the test makes it
    immutable, as a read-only mount is); rank 0, having failed, goes on for a while, as a
    job that catches the error does. Each rank's outcome."""
    out = outcome(
        lambda: CheckpointManager(
            ctx.workdir / "ro", barrier_timeout=ctx.args["timeout"], create=False
        ).close()
    )
    if not out["ok"] and ctx.rank == 0:
        time.sleep(ctx.args["linger"])
    return out


def leader_value_fails(ctx: Ctx) -> dict[str, Any]:
    """``Coordinator.leader_value``: rank 0's value everywhere, then rank 0's error everywhere
    (the store it lists is unreachable), then the coordinator still works: each rank's
    outcome of each, with its seconds."""
    import threading

    from ckptstore.dist import Coordinator
    from ckptstore.errors import StateMismatchError, StoreUnreachableError

    coord = Coordinator(ctx.args["timeout"])

    def listing() -> list[int]:
        if ctx.rank != 0:
            raise AssertionError("only rank 0 computes the value")
        return [1, 2, 3]

    def unreachable() -> int:
        if ctx.rank != 0:
            raise AssertionError("only rank 0 computes the value")
        raise StoreUnreachableError("s3://bucket/run: the endpoint does not answer")

    def mismatch() -> int:
        raise StateMismatchError("the checkpoint lacks 'w'", missing=["w"])

    def denied() -> int:
        raise PermissionError(13, "Permission denied", "/ckpt/run")

    return {
        "value": outcome(lambda: coord.leader_value(listing, "t:list")),
        "error": outcome(lambda: coord.leader_value(unreachable, "t:newest", 4)),
        # A ckptstore error keeps its attributes on every rank; any other, a note of its rank.
        "attrs": outcome(lambda: coord.leader_value(mismatch, "t:keys")),
        "foreign": outcome(lambda: coord.leader_value(denied, "t:perm")),
        "after": outcome(lambda: coord.reduce(ctx.rank, sum, "t:after")),
        # A value that cannot travel is an error on every rank, not a stand-in as a value.
        "unpicklable": outcome(lambda: coord.leader_value(threading.Lock, "t:lock")),
    }


def leader_value_peer_away(ctx: Ctx) -> dict[str, Any]:
    """Rank 0's value fails while rank 1 stays out of the broadcast: what rank 0 raises
    (its ``BarrierTimeout``, and under it as its cause rank 0's own error)."""
    from ckptstore.dist import Coordinator

    coord = Coordinator(float(ctx.args["timeout"]))
    if ctx.rank == 1:
        wait_for_outcomes(ctx, [0])
        return {"away": True}

    def fn() -> int:
        raise RuntimeError("rank 0's own failure: the store is unreachable")

    try:
        coord.leader_value(fn, "t:away")
    except Exception as e:
        return {**failure(e), "cause": repr(e.__cause__)}
    return {"ok": True}


def tree_exchange(ctx: Ctx) -> dict[str, Any]:
    """``Coordinator.scatter`` and ``broadcast_tree`` on 4 ranks, then a member dies in one.

    Trees: every rank a member (rank 2 forwards to rank 3), then ranks 0, 2 and 3 only.
    Last, rank 2 is SIGKILLed after it received the payload, before it forwards it: every
    survivor must raise ``BarrierTimeout`` naming it (rank 3 there, the others at the next
    exchange).
    """
    import random
    import signal

    from ckptstore.dist import Coordinator
    from ckptstore.tiers.nodes import leader_links

    coord = Coordinator(ctx.args["timeout"])
    out: dict[str, Any] = {}
    mine = [("slot", r, "x" * r) for r in range(ctx.world)] if ctx.rank == 0 else None
    out["scatter"] = coord.scatter(mine, "t:scatter")
    big = random.Random(7).randbytes(300_000)
    for name, members in (("all", [0, 1, 2, 3]), ("some", [0, 2, 3])):
        links = leader_links(members).get(ctx.rank)
        small, got = coord.broadcast_tree(
            {"small": name}, big if ctx.rank == 0 else None, links, f"t:{name}"
        )
        out[name] = {
            "links": links,
            "small": small,
            "big": got == big if got is not None else None,
            "record": list(coord.stats.records[-1]),
        }
    links = leader_links([0, 1, 2, 3]).get(ctx.rank)
    if ctx.rank == 2:
        real = dist.recv

        def die(*a: Any, **k: Any) -> Any:
            real(*a, **k)  # the payload arrives; the process dies before sending it on
            os.kill(os.getpid(), signal.SIGKILL)

        dist.recv = die  # type: ignore[assignment]

    def dead() -> None:
        # As in a save: the ranks that got the payload go on to the next exchange, where
        # they find rank 2 missing; rank 3 waits for it here.
        coord.broadcast_tree("s", big if ctx.rank == 0 else None, links, "t:dead", 9)
        coord.reduce(0, sum, "t:after", 9)

    out["dead"] = outcome(dead)
    return out


def lightning_agree(ctx: Ctx) -> dict[str, Any]:
    """``lightning_sharded._agree`` on every rank: nobody fails, rank 1 fails, ranks 1 and 2.

    The strategy's ``broadcast`` is Lightning's own (``broadcast_object_list`` on the
    default group), without a Trainer around it.
    """
    from ckptstore.integrations.lightning_sharded import _agree

    class Strategy:
        root_device = torch.device("cpu")

        def broadcast(self, obj: Any, src: int = 0) -> Any:
            box = [obj]
            dist.broadcast_object_list(box, src=src)
            return box[0]

    out: dict[str, Any] = {}
    for case, failing in (("none", ()), ("one", (1,)), ("two", (2, 1))):
        err = ValueError(f"boom on {ctx.rank}") if ctx.rank in failing else None
        out[case] = outcome(lambda err=err: _agree(Strategy(), err, "saving X"))  # type: ignore[misc]
    return out


def lightning_fall_back_unlisted(ctx: Ctx) -> dict[str, Any]:
    """``lightning_sharded._fall_back`` after a checkpoint failed to verify, where rank 0
    cannot list the directory beside it (it is gone): each rank's outcome, with its
    seconds. The strategy's ``broadcast`` is Lightning's own, without a Trainer."""
    from ckptstore.errors import IntegrityError
    from ckptstore.integrations.lightning import CkptStoreIO
    from ckptstore.integrations.lightning_sharded import _fall_back

    class Strategy:
        root_device = torch.device("cpu")
        is_global_zero = ctx.rank == 0

        def broadcast(self, obj: Any, src: int = 0) -> Any:
            box = [obj]
            dist.broadcast_object_list(box, src=src)
            return box[0]

    path = str(ctx.workdir / "gone" / "epoch=1.ckpt")
    error = IntegrityError(f"{path}: model.safetensors does not match its crc32c")
    return outcome(lambda: _fall_back(Strategy(), CkptStoreIO(), path, error, allow_pickle=False))


def hard_error_on_rank1(ctx: Ctx) -> dict[str, Any]:
    """Rank 1's read of the step fails with an error that has a cause (the fault: its decode
    raises): what each rank raises, its cause, notes and seconds."""
    from ckptstore.restore import reader

    mgr = CheckpointManager(ctx.root, barrier_timeout=float(ctx.args["timeout"]))
    mgr.save(1, {"model": make_model()})
    if ctx.rank == 1:

        def decode(*a: Any, **k: Any) -> Any:
            try:
                raise ValueError("the root cause")
            except ValueError as e:
                raise OSError(5, "I/O error reading the shard") from e

        reader.decode = decode
    dist.barrier()
    t0 = time.monotonic()
    try:
        mgr.restore({"model": make_model(seed=7)})
        return {"ok": True}
    except Exception as e:
        return {
            **failure(e),
            "cause": repr(e.__cause__),
            "seconds": time.monotonic() - t0,
        }

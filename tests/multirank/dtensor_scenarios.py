"""Scenarios for sharded DTensor state: FSDP2, HSDP and tensor-parallel placements.

Run by ``tests/multirank/worker.py`` as ``dtensor_scenarios:<name>``. Every scenario builds
the same model on every rank from a seed, so a checkpoint saved on one world size and the
full tensors seen on another can be compared digest by digest.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ckptstore import CheckpointManager, RNGState
from ckptstore.sharded.plan import is_dtensor, named_optimizer_state
from tests.multirank.scenarios import Ctx, outcome, step1_then_manager, train_steps


class Net(nn.Module):
    """Uneven on purpose: 7 and 5 rows do not split evenly over 2, 3 or 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 7)
        self.mid = nn.Linear(7, 5)
        self.out = nn.Linear(5, 3)
        self.register_buffer("scale", torch.tensor([0.5, 2.0, 1.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x))))) * self.scale


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def shard(model: nn.Module, mesh_shape: list[int] | None = None) -> Any:
    """``fully_shard`` every layer and the root: FSDP2 (1-D mesh) or HSDP (2-D mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    shape = tuple(mesh_shape or [dist.get_world_size()])
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for layer in (model.inp, model.mid, model.out):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    train_steps(model, opt, steps, seed, batch=(8, 6))  # Net's 6 inputs


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if is_dtensor(t) else t  # type: ignore[attr-defined,no-any-return]


def _sha(t: torch.Tensor) -> str:
    t = _full(t).detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return f"{hashlib.sha256(raw).hexdigest()[:16]}:{list(t.shape)}:{t.dtype}"


def digests(model: nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, str]:
    """Digest of every full tensor of the model and the optimizer (collective under FSDP)."""
    out = {f"model/{k}": _sha(v) for k, v in sorted(model.state_dict().items())}
    if opt is not None:
        named = named_optimizer_state(opt, model)
        for p, st in sorted(named["state"].items()):
            for k, v in sorted(st.items()):
                out[f"optim/{p}/{k}"] = _sha(v) if isinstance(v, torch.Tensor) else repr(v)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in named["param_groups"]]
        out["optim/groups"] = repr(groups)
    return out


def _mgr(ctx: Ctx, **kw: Any) -> CheckpointManager:
    return CheckpointManager(ctx.root, barrier_timeout=ctx.args.get("timeout", 60.0), **kw)


def fsdp_save(ctx: Ctx) -> dict[str, Any]:
    """Train an FSDP2 (or HSDP) model a few steps and save it; return the full digests."""
    model = make_net()
    shard(model, ctx.args.get("mesh"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 3)
    torch.manual_seed(1000 + ctx.rank)
    state = {"model": model, "optimizer": opt, "rng": RNGState(), "step": 3}
    handles = []
    with _mgr(ctx, keep=ctx.args.get("keep"), async_save=ctx.args.get("async", False)) as mgr:
        for step in ctx.args.get("steps", [3]):
            state["step"] = step
            handles.append(mgr.save(step, state, metrics={"loss": 1.0}))
            if ctx.args.get("async"):
                # Training changes its tensors as soon as save returns: the save must not
                # see it (it was staged). Then the values are put back exactly.
                params = list(model.parameters())
                with torch.no_grad():
                    kept = [p.detach().clone() for p in params]
                    for p in params:
                        p.mul_(-3.0).add_(1000.0)
                    for p, k in zip(params, kept, strict=True):
                        p.copy_(k)
        mgr.wait()
        assert all(h.done() for h in handles)
        files = sorted(os.listdir(ctx.root / f"step-{ctx.args.get('steps', [3])[-1]:012d}"))
        manifest = mgr.manifest()
    return {
        "digests": digests(model, opt),
        "files": files,
        "world": manifest.world_size,
        "kind": manifest.sharding_kind,
        "rand": torch.rand(1).item(),
    }


def fsdp_async_failure(ctx: Ctx) -> dict[str, Any]:
    """An async DTensor save whose background write fails on one rank."""
    model = make_net()
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 1)
    state = {"model": model, "optimizer": opt}
    mgr = _mgr(ctx, async_save=True)
    mgr.save(1, state).wait()
    if ctx.rank == 1:
        import ckptstore.sharded.plan as sh

        real = sh.write_shards

        def fail_once(*a: Any, **k: Any) -> Any:
            sh.write_shards = real  # type: ignore[assignment]
            raise OSError(28, "No space left on device (injected)")

        sh.write_shards = fail_once  # type: ignore[assignment]
    handle = mgr.save(2, state)
    waited = outcome(lambda: handle.wait() and None)
    after = outcome(lambda: mgr.save(3, state).wait() and None)
    mgr.wait()
    steps = mgr.steps()
    mgr.close()
    return {"waited": waited, "after": after, "steps": steps}


def fsdp_async_stage_failure(ctx: Ctx) -> dict[str, Any]:
    """An async DTensor save whose boxes fail to build (or to stage) on rank 1 only.

    ``args["where"]``: ``"boxes"`` (``local_boxes`` raises) or ``"stage"`` (the staging
    copy raises). Every rank must learn of it at once, not after ``barrier_timeout``.
    """
    model = make_net()
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 1)
    state = {"model": model, "optimizer": opt}
    mgr = step1_then_manager(ctx, state, async_save=True)
    if ctx.rank == 1:
        import ckptstore.sharded.plan as sh

        if ctx.args["where"] in ("boxes", "interrupt"):
            real_boxes = sh.local_boxes

            def fail_boxes(*a: Any, **k: Any) -> Any:
                sh.local_boxes = real_boxes  # type: ignore[assignment]
                if ctx.args["where"] == "interrupt":  # Ctrl-C while the boxes are made
                    raise KeyboardInterrupt
                raise MemoryError("cannot build the boxes (injected)")

            sh.local_boxes = fail_boxes  # type: ignore[assignment]
        else:
            real_stage = mgr._staging.stage

            def fail_stage(*a: Any, **k: Any) -> Any:
                mgr._staging.stage = real_stage  # type: ignore[method-assign]
                raise OSError(12, "Cannot allocate memory (injected)")

            mgr._staging.stage = fail_stage  # type: ignore[method-assign]
    t0 = time.monotonic()
    try:
        res = outcome(lambda: mgr.save(2, state).wait() and None)
    except KeyboardInterrupt:
        res = {"ok": False, "error_type": "KeyboardInterrupt", "message": ""}
    res["elapsed"] = time.monotonic() - t0
    # The failure was raised where it happened: the next save goes ahead on every rank.
    res["after"] = outcome(lambda: mgr.save(3, state).wait() and None)
    res["steps"] = mgr.steps()
    mgr.close()
    return res


def fsdp_async_then_destroy(ctx: Ctx) -> dict[str, Any]:
    """An async FSDP2 save in flight when the script destroys its process group, then
    ``close()`` (as many scripts end): the step is lost, and the log must say why."""
    model = make_net()
    shard(model)
    mgr = _mgr(ctx, async_save=True)
    mgr.save(1, {"model": model}).wait()
    mgr.save(2, {"model": model})
    dist.destroy_process_group()
    out = outcome(mgr.close)
    out["steps"] = CheckpointManager(ctx.root, distributed=False, create=False).steps()
    return out


def fsdp_restore(ctx: Ctx) -> dict[str, Any]:
    """Restore into a fresh FSDP2 (or HSDP) model and optimizer on this world size."""
    model = make_net(seed=99)
    shard(model, ctx.args.get("mesh"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "rng": RNGState(), "step": 0}
    with _mgr(ctx) as mgr:
        start = mgr.resume(state)
    out: dict[str, Any] = {"start": start, "step": state["step"], "digests": digests(model, opt)}
    out["rand"] = torch.rand(1).item()
    local = {k: list(v.to_local().shape) for k, v in model.state_dict().items() if is_dtensor(v)}
    out["local_shapes"] = local
    # Training goes on from the restored state: the optimizer really holds the moments.
    train(model, opt, 1, seed=7)
    out["after"] = digests(model, opt)
    return out


def live_locals(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """The address of every parameter's and AdamW moment's local data, by name."""

    def loc(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined,no-any-return]

    out = {n: loc(p).data_ptr() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{names[id(p)]}/{k}"] = loc(st[k]).data_ptr()
    return {k: v for k, v in out.items() if v}  # an empty local shard has no memory


def fsdp_restore_live(ctx: Ctx) -> dict[str, Any]:
    """Restore into an FSDP2 model and an AdamW whose moments exist (a job that trained on).

    Returns the digests, whether every parameter's and moment's memory stayed where it was,
    and whether each was read straight into that memory (the addresses the read wrote to).
    """
    from ckptstore.sharded import targets as targets_mod

    model = make_net(seed=99)
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 1, seed=7)
    before = live_locals(model, opt)
    written: set[int] = set()
    real = targets_mod.read_into

    def read_into(index: Any, flat: Any, *a: Any, **k: Any) -> int:
        written.update((t.to_local() if is_dtensor(t) else t).data_ptr() for t in flat.values())
        return real(index, flat, *a, **k)

    targets_mod.read_into = read_into  # type: ignore[assignment]
    state: dict[str, Any] = {"model": model, "optimizer": opt, "rng": RNGState(), "step": 0}
    with _mgr(ctx) as mgr:
        mgr.restore(state)
    after = live_locals(model, opt)
    return {
        "digests": digests(model, opt),
        "kept": after == before,
        "read_in_place": sorted(k for k, v in before.items() if v in written),
        "tensors": sorted(before),
    }


def fsdp_train_on(ctx: Ctx) -> dict[str, Any]:
    """Reference: train 3 steps, then 1 more with seed 7, without any checkpoint."""
    model = make_net()
    shard(model, ctx.args.get("mesh"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 3)
    train(model, opt, 1, seed=7)
    return {"after": digests(model, opt)}


def tp_save(ctx: Ctx) -> dict[str, Any]:
    """Plain DTensors with tensor-parallel placements: Shard(0), Shard(1), Replicate().

    ``args["mesh"]`` (``[dp, tp]``): the DTensors lie on the ``"tp"`` sub-mesh of a
    ``("dp", "tp")`` mesh, as tensor parallelism under DDP: each of the ``dp`` sub-meshes
    holds a copy.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if ctx.args.get("mesh"):
        mesh = init_device_mesh("cpu", tuple(ctx.args["mesh"]), mesh_dim_names=("dp", "tp"))
        mesh = mesh["tp"]
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(5)
    full = {
        "col": torch.randn(9, 6),
        "row": torch.randn(5, 11),
        "rep": torch.randn(4),
        "half": torch.randn(7, 3).to(torch.bfloat16),
    }
    place = {"col": Shard(0), "row": Shard(1), "rep": Replicate(), "half": Shard(1)}
    state = {
        "weights": {k: distribute_tensor(v, mesh, [place[k]]) for k, v in full.items()},
        "plain": torch.arange(6),
        "note": "tp",
    }
    with _mgr(ctx) as mgr:
        mgr.save(1, state)
    return {k: _sha(v) for k, v in full.items()}


def tp_restore(ctx: Ctx) -> dict[str, Any]:
    """Restore the TP state into other placements: Shard(1) <-> Shard(0), Replicate."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    place = {"col": Shard(1), "row": Shard(0), "rep": Shard(0), "half": Replicate()}
    shapes = {"col": (9, 6), "row": (5, 11), "rep": (4,), "half": (7, 3)}
    dtypes = {"half": torch.bfloat16}
    state: dict[str, Any] = {
        "weights": {
            k: distribute_tensor(
                torch.zeros(s, dtype=dtypes.get(k, torch.float32)), mesh, [place[k]]
            )
            for k, s in shapes.items()
        },
        "plain": None,
        "note": None,
    }
    with _mgr(ctx) as mgr:
        mgr.restore(state)
    w = state["weights"]
    return {
        "digests": {k: _sha(v) for k, v in w.items()},
        "placements": {k: str(v.placements) for k, v in w.items()},
        "plain": state["plain"].tolist(),
        "note": state["note"],
    }


def fsdp_corrupt_fallback(ctx: Ctx) -> dict[str, Any]:
    """Restore when the newest step has a flipped byte in one rank's shard."""
    model = make_net(seed=99)
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
    with _mgr(ctx) as mgr:
        restored = mgr.restore(state)
    return {"restored": restored, "digests": digests(model, opt)}


def fsdp_die_in_save(ctx: Ctx) -> dict[str, Any]:
    """A rank dies in one phase of a sharded save; the survivors must agree, bounded."""
    model = make_net()
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 1)
    state = {"model": model, "optimizer": opt}
    victim = ctx.args["victim"]
    phase = ctx.args["phase"]
    mgr = step1_then_manager(ctx, state)
    if ctx.rank == victim:
        import ckptstore.sharded.plan as sh

        if phase == "plan":
            orig_key = sh.layout_key  # runs in every save's planning, cached plan or not

            def die_plan(*a: Any, **k: Any) -> Any:
                os.kill(os.getpid(), signal.SIGKILL)
                return orig_key(*a, **k)

            sh.layout_key = die_plan  # type: ignore[assignment]
        elif phase == "write":
            orig_write = sh.write_shards

            def die_write(*a: Any, **k: Any) -> Any:
                orig_write(*a, **k)
                os.kill(os.getpid(), signal.SIGKILL)

            sh.write_shards = die_write  # type: ignore[assignment]
        elif phase == "commit":
            # Dies after its shard is written and reported, while rank 0 commits.
            threading.Timer(0.0, lambda: None).start()
            orig_gather = mgr.coord.gather

            def die_after_gather(*a: Any, **k: Any) -> Any:
                r = orig_gather(*a, **k)
                os.kill(os.getpid(), signal.SIGKILL)
                return r

            mgr.coord.gather = die_after_gather  # type: ignore[method-assign]
        elif phase == "error":
            orig_write2 = sh.write_shards

            def fail_write(*a: Any, **k: Any) -> Any:
                raise OSError(28, "No space left on device (injected)")

            sh.write_shards = fail_write  # type: ignore[assignment]
            del orig_write2
    t0 = time.monotonic()
    res = outcome(lambda: mgr.save(2, state) and None)
    res["elapsed"] = time.monotonic() - t0
    return res


def fsdp_die_in_restore(ctx: Ctx) -> dict[str, Any]:
    """A rank dies while reading its part of a resharded restore."""
    model = make_net(seed=99)
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state: dict[str, Any] = {"model": model, "optimizer": opt}
    mgr = _mgr(ctx)
    if ctx.rank == ctx.args["victim"]:
        import ckptstore.sharded.targets as sh

        orig = sh.read_into

        def die_read(*a: Any, **k: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)
            return orig(*a, **k)

        sh.read_into = die_read  # type: ignore[assignment]
    t0 = time.monotonic()
    res = outcome(lambda: mgr.restore(state))
    res["elapsed"] = time.monotonic() - t0
    return res


def golden_save(ctx: Ctx) -> None:
    """The state of ``tests/golden/v2-dtensor`` (format 2, written by ckptstore before the split
    index), ``v3-dtensor`` (format 3) and ``v4-dtensor`` (format 4: the rank table), saved by
    2 ranks: fixed values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    w = torch.arange(21, dtype=torch.float32).reshape(7, 3) / 4
    b = torch.tensor([1.5, -2.0, 0.25], dtype=torch.bfloat16)
    cols = torch.arange(10, dtype=torch.int64).reshape(2, 5)
    state = {
        "model": {
            "w": distribute_tensor(w, mesh, [Shard(0)]),
            "b": distribute_tensor(b, mesh, [Replicate()]),
            "cols": distribute_tensor(cols, mesh, [Shard(1)]),
            "scale": torch.tensor(0.5),
        },
        "step": 7,
    }
    with _mgr(ctx) as mgr:
        note = ctx.args.get("note", "golden v4")
        mgr.save(7, state, metrics={"loss": 0.25}, metadata={"note": note})


def golden_save_strided(ctx: Ctx) -> None:
    """The state of ``tests/golden/v5-dtensor`` (format 5: ``_StridedShard`` in the split
    index), saved by 4 ranks on a 2x2 ``("dp", "tp")`` mesh as FSDP2 over TP lays it out:
    fixed values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    up = torch.arange(30, dtype=torch.float32).reshape(10, 3) / 4  # 10 rows: 3 + 2 a TP half
    down = torch.arange(20, dtype=torch.int64).reshape(4, 5)
    bias = torch.tensor([1.5, -2.0, 0.25, 8.0], dtype=torch.bfloat16)
    column = [_StridedShard(0, split_factor=2), Shard(0)]
    state = {
        "model": {
            "up": distribute_tensor(up, mesh, column, src_data_rank=None),
            "down": distribute_tensor(down, mesh, [Shard(0), Shard(1)]),
            "bias": distribute_tensor(bias, mesh, [Shard(0), Replicate()]),
            "scale": torch.tensor(0.5),
        },
        "step": 7,
    }
    with _mgr(ctx) as mgr:
        mgr.save(7, state, metrics={"loss": 0.25}, metadata={"note": "golden v5"})


def fsdp_refused(ctx: Ctx) -> dict[str, Any]:
    """DTensor state that cannot be saved: every rank gets the refusal as such, nothing lands."""
    from torch.distributed.tensor import DTensor, Partial

    model = make_net()
    mesh = shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 1)
    out: dict[str, Any] = {}
    with _mgr(ctx, compression="zstd") as mgr:
        out["zstd"] = outcome(lambda: mgr.save(1, {"model": model, "optimizer": opt}) and None)
    with _mgr(ctx) as mgr:
        partial = DTensor.from_local(torch.ones(2), mesh, [Partial()])
        out["partial"] = outcome(lambda: mgr.save(1, {"model": model, "p": partial}) and None)
        out["orphan"] = outcome(lambda: mgr.save(1, {"optimizer": opt}) and None)
        out["steps"] = mgr.steps()
        mgr.save(2, {"model": model, "optimizer": opt})  # the store is still usable
        out["after"] = mgr.steps()
        saved = digests(model, opt)
        # Pipeline stages: each rank holds other layers, FSDP2 on its own one-rank sub-mesh.
        # Rank 0 indexes only the DTensors it holds: rank 1's used to be written and never
        # indexed, and the step committed without them.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        pp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
        stage = nn.Sequential()
        stage.add_module(f"layer{ctx.rank}", nn.Linear(4, 4))
        fully_shard(stage, mesh=pp["dp"])
        out["stages"] = outcome(lambda: mgr.save(3, {"model": stage}) and None)
        out["after_stages"] = mgr.steps()
        fresh = make_net(seed=9)
        shard(fresh)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        out["restored"] = mgr.restore({"model": fresh, "optimizer": fresh_opt})
        out["exact"] = digests(fresh, fresh_opt) == saved
        # Local shards that are not the split their placements give (from_local with
        # run_check=False checks nothing: rows [2, 3] of 5 where Shard(0) gives [3, 2]).
        # Rank 0's commit check counts elements (4 + 6 = 10): the step committed, rank 1's
        # box past the tensor's end, and no reader took it.
        from torch.distributed.tensor import Shard

        rows = torch.arange(10.0).reshape(5, 2)
        local = rows[:2] if ctx.rank == 0 else rows[2:]
        shape = {"run_check": False, "shape": (5, 2), "stride": (2, 1)}
        bad = DTensor.from_local(local, mesh, [Shard(0)], **shape)
        out["missized"] = outcome(lambda: mgr.save(4, {"model": model, "bad": bad}) and None)
        out["after_missized"] = mgr.steps()
        # The refused save lost nothing: step 2 still restores exactly.
        again = make_net(seed=11)
        shard(again)
        again_opt = torch.optim.AdamW(again.parameters(), lr=1e-2)
        out["restored_after_missized"] = mgr.restore({"model": again, "optimizer": again_opt})
        out["exact_after_missized"] = digests(again, again_opt) == saved
    out["leftovers"] = sorted(n for n in os.listdir(ctx.root) if n.startswith(".tmp"))
    return out


def reversed_mesh(ctx: Ctx) -> dict[str, Any]:
    """A mesh whose ranks run downwards (``DeviceMesh("cpu", [1, 0])``): the save commits a
    step every reader takes, restored exactly on that mesh and on the usual one."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(10.0).reshape(5, 2)
    rev = DeviceMesh("cpu", list(range(ctx.world))[::-1])
    fwd = init_device_mesh("cpu", (ctx.world,))

    # torch's own scatter and gather go wrong on such a mesh under gloo: every rank cuts
    # its shard from the whole tensor (src_data_rank=None), and shards are compared locally.
    def dt(t: torch.Tensor, mesh: Any) -> Any:
        return distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)

    out: dict[str, Any] = {}
    with _mgr(ctx, keep=1) as mgr:
        mgr.save(1, {"t": dt(full, fwd)})
        mgr.save(2, {"t": dt(full * 2, rev)})
        dist.barrier()  # rank 0's retention (keep=1) is done once its save() returned
        out["steps"] = mgr.steps()
        on_rev = {"t": dt(torch.zeros(5, 2), rev)}
        out["resumed"] = mgr.resume(on_rev)
        out["rev_exact"] = torch.equal(on_rev["t"].to_local(), dt(full * 2, rev).to_local())
        on_fwd = {"t": dt(torch.zeros(5, 2), fwd)}
        out["restored_fwd"] = mgr.restore(on_fwd)
        out["fwd_exact"] = torch.equal(on_fwd["t"].to_local(), dt(full * 2, fwd).to_local())
    if ctx.rank == 0:
        from ckptstore import verify_path

        out["verified"] = [(r.step, r.problems) for r in verify_path(ctx.root, all_steps=True)]
    return out


def fsdp_plan_cache(ctx: Ctx) -> dict[str, Any]:
    """Save plans reused while the layout stays (all ranks hit, mixed, all miss)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    model = make_net()
    mesh = shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state: dict[str, Any] = {"model": model, "optimizer": opt}
    out: dict[str, Any] = {"planned": 0, "checked": 0}
    import ckptstore.sharded.plan as sh
    import ckptstore.sharded.split_index as si

    real, real_split = sh.save_plans, si.splittable

    def counted(*a: Any, **k: Any) -> Any:
        out["planned"] += 1
        return real(*a, **k)

    def checked(*a: Any, **k: Any) -> Any:
        out["checked"] += 1
        return real_split(*a, **k)

    sh.save_plans = counted  # type: ignore[assignment]
    si.splittable = checked  # type: ignore[assignment]
    with _mgr(ctx) as mgr:
        for step in (1, 2, 3, 4):
            train(model, opt, 1, seed=step)
            if step == 3 and ctx.rank == 1:
                mgr._save_plan = None  # this rank alone plans again
            if step == 4:
                torch.manual_seed(4)
                state["extra"] = distribute_tensor(torch.randn(5, 2), mesh, [Shard(0)])
            mgr.save(step, state)
            out[str(step)] = digests(model, opt)
        out["extra"] = _sha(state["extra"])
    return out


def plain_into_fsdp(ctx: Ctx) -> dict[str, Any]:
    """Restore a replicated step (saved by one process, no DTensor) into FSDP2 on this world.

    Each rank takes its part of every whole stored tensor, parameters and AdamW moments
    alike; then one more step of training. Returns the full digests after the restore and
    after that step.
    """
    model = make_net(seed=5)
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(ctx.args["root"], barrier_timeout=60.0) as mgr:
        step = mgr.restore({"model": model, "optim": opt})
    restored = digests(model, opt)
    # Each moment is laid out as its parameter: this rank's part, not a whole tensor.
    layouts = sorted(
        {
            f"{v.placements == p.placements}:{v.to_local().shape == p.to_local().shape}"
            for p in model.parameters()
            for v in opt.state[p].values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        }
    )
    train(model, opt, 1, seed=9)
    return {
        "step": step,
        "restored": restored,
        "layouts": layouts,
        "trained": digests(model, opt),
    }


def fsdp_save_into(ctx: Ctx) -> dict[str, Any]:
    """Save step ``step`` of an FSDP2 model and AdamW, as ``{"model", "optim"}``, into ``root``."""
    model = make_net(seed=7)
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 2)
    with CheckpointManager(ctx.args["root"], barrier_timeout=60.0) as mgr:
        mgr.save(ctx.args["step"], {"model": model, "optim": opt})
    return {}


def plain_into_state_dict(ctx: Ctx) -> dict[str, Any]:
    """Restore a replicated step into a plain dict of DTensors (``get_model_state_dict``).

    The stored whole tensors come back as DTensors laid out like the dict's values (this
    rank's parts), which ``set_model_state_dict`` loads; returns, per value, whether it is
    a DTensor of its target's placements and local shape, and the model's digests after.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = make_net(seed=5)
    shard(model)
    sd = get_model_state_dict(model)
    # The buffer ("scale") is a plain tensor under FSDP2, and stays one.
    like = {k: (v.placements, v.to_local().shape) if is_dtensor(v) else None for k, v in sd.items()}
    state: dict[str, Any] = {"model": sd}
    with CheckpointManager(ctx.args["root"], barrier_timeout=60.0) as mgr:
        step = mgr.restore(state)
    got = state["model"]
    layouts = {
        k: (v.placements, v.to_local().shape) == like[k] if is_dtensor(v) else like[k] is None
        for k, v in got.items()
    }
    set_model_state_dict(model, got)
    return {"step": step, "layouts": layouts, "restored": digests(model, None)}


class MLP(nn.Module):
    """Two tensor-parallel pairs (column- then row-wise), uneven over 2 and 3 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 10)
        self.down = nn.Linear(10, 6)
        self.up2 = nn.Linear(6, 14)
        self.down2 = nn.Linear(14, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down2(torch.relu(self.up2(self.down(torch.relu(self.up(x))))))


def make_mlp(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP()


def _tp_plan() -> dict[str, Any]:
    """The MLP's tensor-parallel plan: each pair column- then row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "up": ColwiseParallel(),
        "down": RowwiseParallel(),
        "up2": ColwiseParallel(),
        "down2": RowwiseParallel(),
    }


def fsdp_tp(model: MLP, dp: int, tp: int) -> None:
    """FSDP2 over tensor parallelism on a ``(dp, tp)`` mesh, as torchtitan lays out 2-D
    parallelism: ``parallelize_module`` on ``"tp"``, then ``fully_shard`` on ``"dp"``
    (the weights' placements ``(_StridedShard(0), Shard(0))`` for column-wise layers)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], _tp_plan())
    for layer in (model.up, model.down, model.up2, model.down2):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def fsdp_tp_titan(model: MLP, dims: list[int]) -> None:
    """FSDP2 (or HSDP) over TP on torchtitan's meshes: a ``("dp_replicate", "dp_shard",
    "cp", "tp")`` world mesh of ``dims``, ``("dp_shard", "cp")`` flattened to
    ``"dp_shard_cp"``; TP on ``"tp"``, ``fully_shard`` on ``("dp_replicate",
    "dp_shard_cp")``. The parameters' mesh, ``(dp_replicate, dp_shard_cp, tp)``, is no
    slice of the world mesh by name: it holds a flattened dim."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    names = ("dp_replicate", "dp_shard", "cp", "tp")
    world = init_device_mesh("cpu", tuple(dims), mesh_dim_names=names)
    world[("dp_shard", "cp")]._flatten("dp_shard_cp")
    parallelize_module(model, world["tp"], _tp_plan())
    dp = world[("dp_replicate", "dp_shard_cp")]
    for layer in (model.up, model.down, model.up2, model.down2):
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)


def _parallelize_mlp(model: MLP, args: dict[str, Any]) -> None:
    """``args["titan"]``: torchtitan's meshes; ``args["mesh"]``: ``[dp, tp]``; else FSDP2."""
    if args.get("titan"):
        fsdp_tp_titan(model, args["titan"])
    elif args.get("mesh"):
        fsdp_tp(model, *args["mesh"])
    else:
        _fsdp_only(model)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _mlp_layout(model: MLP) -> dict[str, str]:
    return {k: str(getattr(v, "placements", "plain")) for k, v in model.state_dict().items()}


def _fsdp_only(model: MLP) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in (model.up, model.down, model.up2, model.down2):
        fully_shard(layer)
    fully_shard(model)


def fsdp_tp_save(ctx: Ctx) -> dict[str, Any]:
    """Train FSDP2 over TP (``args["mesh"]`` = ``[dp, tp]``, or torchtitan's meshes of
    ``args["titan"]``; neither: FSDP2 alone) 2 steps; save; digests and the parameters'
    placements."""
    model = make_mlp(seed=3)
    _parallelize_mlp(model, ctx.args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(7)
    for _ in range(2):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
    with _mgr(ctx) as mgr:
        mgr.save(2, {"model": model, "optim": opt})
    return {"digests": digests(model, opt), "layout": _mlp_layout(model)}


def fsdp_tp_restore(ctx: Ctx) -> dict[str, Any]:
    """Restore into FSDP2 over TP (``args["mesh"]`` or ``args["titan"]``) or, without
    them, FSDP2 alone; with ``args["train"]``, one more training step after it (its
    digests: ``trained``)."""
    model = make_mlp(seed=11)
    _parallelize_mlp(model, ctx.args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with _mgr(ctx) as mgr:
        step = mgr.restore({"model": model, "optim": opt})
    out = {"step": step, "digests": digests(model, opt), "layout": _mlp_layout(model)}
    # Each moment laid out as its parameter (its placements, its local shape): what the
    # training step below would trip over otherwise, checked without one.
    out["moments"] = sorted(
        {
            f"{getattr(v, 'placements', None) == getattr(p, 'placements', None)}:"
            f"{_local(v).shape == _local(p).shape}"
            for p in model.parameters()
            for v in opt.state[p].values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        }
    )
    if ctx.args.get("train"):
        # Training goes on: one more step, alike on every rank. DTensor's sharding
        # propagation of a first AdamW step over TP costs seconds of CPU a rank: only the
        # restores that check it take it.
        model(torch.ones(2, 6)).sum().backward()
        opt.step()
        out["trained"] = digests(model, opt)
    return out


def strided_shards(ctx: Ctx) -> dict[str, Any]:
    """A 2x2 mesh, a DTensor laid out as (Shard(0), _StridedShard(0, split_factor=2)): each
    rank holds rows i and i + 2 of a block, not one box. After a good step 1, its save as
    step 2 is refused; so are a restore into it and DCP's load of it through
    ``CkptStoreReader``, with the target unchanged; step 1 then restores whole. Returns the
    errors and what was restored."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2))
    full = torch.arange(24, dtype=torch.float32).reshape(8, 3)
    strided = [Shard(0), _StridedShard(0, split_factor=2)]
    boxes = [Shard(0), Replicate()]
    out: dict[str, Any] = {}
    with _mgr(ctx) as mgr:
        mgr.save(1, {"w": distribute_tensor(full, mesh, boxes)})
        try:
            mgr.save(2, {"w": distribute_tensor(full + 1, mesh, strided)})
        except Exception as e:
            out["save"] = f"{type(e).__name__}: {e}"
        out["steps"] = mgr.steps()
        target = {"w": distribute_tensor(torch.zeros(8, 3), mesh, strided)}
        try:
            mgr.restore(target)
        except Exception as e:
            out["restore"] = f"{type(e).__name__}: {e}"
        out["untouched"] = bool((target["w"].to_local() == 0).all())
        good = {"w": distribute_tensor(torch.zeros(8, 3), mesh, boxes)}
        out["restored_step"] = mgr.restore(good)
        out["restored_whole"] = bool(torch.equal(good["w"].full_tensor(), full))
    # DCP's own load through CkptStoreReader: DCP plans the same wrong box; refused too.
    import torch.distributed.checkpoint as dcp

    from ckptstore.dcp import CkptStoreReader

    target = {"w": distribute_tensor(torch.zeros(8, 3), mesh, strided)}
    try:
        dcp.load(target, storage_reader=CkptStoreReader(ctx.root, step=1))
    except BaseException as e:  # DCP's CheckpointException is not an Exception
        out["dcp"] = f"{type(e).__name__}: {e}"
    out["dcp_untouched"] = bool((target["w"].to_local() == 0).all())
    return out

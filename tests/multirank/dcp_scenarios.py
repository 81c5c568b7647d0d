"""Scenarios of ``dcp.save``/``dcp.async_save``/``dcp.load`` through ckptstore (issue 23).

``dcp_save`` trains an FSDP2 model, saves ``{"model", "optim", "step"}`` (as DCP users build
it, with ``get_state_dict``) through :class:`~ckptstore.dcp.CkptStoreWriter` with
``dcp.save``, trains one step more and saves again with ``dcp.async_save``; it returns the
full tensors' digests of both. ``dcp_restore`` loads a step on this world size, both through
``mgr.restore`` and through ``dcp.load`` with ``CkptStoreReader``. ``dcp_die_in_write`` kills
one rank inside ckptstore's write under ``dcp.save``.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ckptstore import CheckpointManager
from ckptstore.dcp import CkptStoreReader, CkptStoreWriter
from tests.multirank.dtensor_scenarios import _sha, make_net, shard, train
from tests.multirank.scenarios import HEALTHY, Ctx, failure


def _digests(state: dict[str, Any]) -> dict[str, str]:
    """``model/NAME`` and ``optim/NAME/KEY`` digests of the full tensors (collective)."""
    out = {f"model/{k}": _sha(v) for k, v in sorted(state["model"].items())}
    for p, st in sorted(state["optim"]["state"].items()):
        for k, v in sorted(st.items()):
            out[f"optim/{p}/{k}"] = _sha(v)
    return out


def _model_opt(seed: int) -> tuple[Any, Any]:
    model = make_net(seed=seed)
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _state(model: Any, opt: Any, step: int) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": step}


def dcp_save(ctx: Ctx) -> dict[str, Any]:
    """``dcp.save`` at step 3, ``dcp.async_save`` at step 4; the digests of both."""
    model, opt = _model_opt(0)
    train(model, opt, 3)
    out: dict[str, Any] = {}
    with CheckpointManager(ctx.root, keep=ctx.args.get("keep"), barrier_timeout=HEALTHY) as mgr:
        writer = CkptStoreWriter(mgr, metrics={"loss": 0.5})
        state = _state(model, opt, 3)
        meta = dcp.save(
            state,
            checkpoint_id=f"{ctx.root}/step-3",
            storage_writer=writer,
            process_group=writer.process_group,
        )
        out["3"] = _digests(state)
        out["dcp_items"] = len(meta.state_dict_metadata)  # none: the writer drops them
        assert writer.manifest is not None
        assert writer.manifest.step == 3
        train(model, opt, 1, seed=2)
        state = _state(model, opt, 4)
        fut = dcp.async_save(
            state,
            checkpoint_id=f"{ctx.root}/step-4",
            storage_writer=writer,
            process_group=writer.process_group,
        )
        fut.result(timeout=120)
        out["4"] = _digests(state)
        out["steps"] = mgr.steps()
    return out


def dcp_restore(ctx: Ctx) -> dict[str, Any]:
    """Step ``step`` into a fresh FSDP2 model and optimizer on this world size, by
    ``mgr.restore`` and by ``dcp.load`` through ``CkptStoreReader``: both sets of digests."""
    step = ctx.args["step"]
    out: dict[str, Any] = {}
    for how in ("restore", "dcp"):
        model, opt = _model_opt(99)
        train(model, opt, 1, seed=7)  # the optimizer has state to overwrite
        state = _state(model, opt, -1)
        if how == "restore":
            with CheckpointManager(ctx.root, barrier_timeout=HEALTHY) as mgr:
                mgr.restore(state, step=step)
        else:
            dcp.load(state, storage_reader=CkptStoreReader(ctx.root, step=step))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out[how] = {"digests": _digests(_state(model, opt, 0)), "step": state["step"]}
    return out


def dcp_die_in_write(ctx: Ctx) -> dict[str, Any]:
    """Rank ``victim`` is SIGKILLed after writing its shards under ``dcp.save`` of step 2;
    the survivors report what DCP raised and how long it took."""
    import ckptstore.sharded.plan as sh

    model, opt = _model_opt(0)
    train(model, opt, 1)
    with CheckpointManager(ctx.root, barrier_timeout=HEALTHY) as setup:
        w = CkptStoreWriter(setup)
        dcp.save(_state(model, opt, 1), checkpoint_id=f"{ctx.root}/step-1", storage_writer=w)
    torch.distributed.barrier()
    mgr = CheckpointManager(ctx.root, barrier_timeout=float(ctx.args["timeout"]))
    writer = CkptStoreWriter(mgr, step=2)
    if ctx.rank == ctx.args["victim"]:
        orig_write = sh.write_shards

        def die_write(*a: Any, **k: Any) -> Any:
            orig_write(*a, **k)
            os.kill(os.getpid(), signal.SIGKILL)

        sh.write_shards = die_write  # type: ignore[assignment]
    train(model, opt, 1, seed=2)
    state = _state(model, opt, 2)
    t0 = time.monotonic()
    try:
        dcp.save(state, storage_writer=writer, process_group=writer.process_group)
        res: dict[str, Any] = {"ok": True}
    except Exception as e:  # DCP's own error (its gather meets the dead rank)
        res = failure(e)
        res["cause"] = failure(writer.error) if writer.error is not None else None
    res["elapsed"] = time.monotonic() - t0
    res["steps"] = mgr.steps()
    return res


def dcp_fs_save(ctx: Ctx) -> dict[str, Any]:
    """``dcp.save`` with DCP's own ``FileSystemWriter`` into ``workdir/dcp`` (FSDP2 on this
    world size, model, AdamW and a step count); the digests of the full tensors."""
    model, opt = _model_opt(0)
    train(model, opt, 2)
    state = _state(model, opt, 3)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(ctx.workdir / "dcp")))
    return _digests(state)


def dcp_per_rank(ctx: Ctx) -> dict[str, Any]:
    """``dcp.save`` of state some of whose names one rank alone holds (torchtitan's
    dataloader: ``dp_rank_<r>``), then ``dcp.load`` of this rank's names through the reader."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model, opt = _model_opt(0)
    train(model, opt, 1)
    msd, _ = get_state_dict(model, opt)
    state = {
        "model": msd,
        "dataloader": {f"dp_rank_{rank}": f"position of rank {rank}".encode(), "world_size": 2},
        f"rank{rank}": torch.full((3,), float(rank)),
        "shared": {"epoch": 5},
    }
    with CheckpointManager(ctx.root, barrier_timeout=HEALTHY) as mgr:
        writer = CkptStoreWriter(mgr, step=1)
        dcp.save(state, storage_writer=writer, process_group=writer.process_group)
        stored = mgr.load(1)
    back: dict[str, Any] = {
        "dataloader": {f"dp_rank_{rank}": b"", "world_size": 0},
        f"rank{rank}": torch.zeros(3),
        "shared": {"epoch": 0},
    }
    dcp.load(back, storage_reader=CkptStoreReader(ctx.root, step=1))
    return {
        "stored_keys": sorted(str(k) for k in stored),
        "stored_dataloader": sorted(stored["dataloader"]),
        "mine": back["dataloader"][f"dp_rank_{rank}"].decode(),
        "world_size": back["dataloader"]["world_size"],
        "tensor": back[f"rank{rank}"].tolist(),
        "epoch": back["shared"]["epoch"],
    }

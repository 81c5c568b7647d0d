"""CPU ranks reading what a GPU framework run saved (tests/test_gpu_frameworks.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ckptstore import CheckpointManager
from tests.multirank.scenarios import HEALTHY, Ctx


def restore_accelerate(ctx: Ctx) -> dict[str, Any]:
    """Restore the accelerate FSDP2 step (saved on one GPU) into FSDP2 on these CPU ranks.

    Returns the full tensors' digests of the model and the optimizer state, by name.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import tests.gpu_frameworks_worker as w

    model = w.make_net(seed=11)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(ctx.args["root"], barrier_timeout=HEALTHY) as mgr:
        step = mgr.restore({"model": model, "optimizer": opt}, ctx.args["step"])
    return {
        "step": step,
        "model": w.model_digests(model),
        "optim": w.optimizer_digests(model, opt),
    }


def restore_trainer(ctx: Ctx) -> dict[str, Any]:
    """Restore the Trainer's FSDP2 GPT-2 step (saved on one GPU) into FSDP2 on these CPU ranks.

    Returns the full tensors' digests of the model, by name.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import tests.gpu_frameworks_worker as w

    model = w.tiny_gpt2(seed=13)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with CheckpointManager(ctx.args["root"], barrier_timeout=HEALTHY) as mgr:
        step = mgr.restore({"model": model}, ctx.args["step"])
    return {"step": step, "model": w.model_digests(model)}

"""FSDP1's ``ShardedTensor`` state saved and restored through DTensor views (issue 23).

FSDP1 itself needs a GPU, but the ``ShardedTensor``s its sharded state dicts hold do not:
they are built here with FSDP's own ``_create_chunk_sharded_tensor`` on gloo, as FSDP1 builds
them, saved by every rank through :func:`ckptstore.integrations._sharded_tensor.as_dtensors`
and restored on another world size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp._shard_utils import _create_chunk_sharded_tensor

from ckptstore import CheckpointManager
from ckptstore.integrations._sharded_tensor import as_dtensors, back_to_shards
from tests.multirank.scenarios import HEALTHY, Ctx

#: Shapes whose dim-0 chunks are uneven, and one with ranks past the last chunk.
SHAPES = {"a.weight": (5, 3), "a.bias": (5,), "b.weight": (1, 4), "c.table": (7, 2, 2)}


def full_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g) for k, shape in SHAPES.items()}


def _st(full: torch.Tensor) -> Any:
    group = dist.group.WORLD
    return _create_chunk_sharded_tensor(
        full, dist.get_rank(), dist.get_world_size(), 1, group, device=torch.device("cpu")
    )


def state(seed: int, lr: float) -> dict[str, Any]:
    """A Lightning-like checkpoint of FSDP1 sharded state: model and one optimizer."""
    model = {k: _st(v) for k, v in full_tensors(seed).items()}
    moments = {k: _st(v * 2) for k, v in full_tensors(seed).items()}
    optim = {
        "state": {k: {"exp_avg": m, "step": torch.tensor(float(seed))} for k, m in moments.items()},
        "param_groups": [{"lr": lr, "params": sorted(SHAPES)}],
    }
    return {"state_dict": model, "optimizer_states": [optim]}


def _local_rows(full: torch.Tensor) -> torch.Tensor:
    chunks = full.chunk(dist.get_world_size(), dim=0)
    rank = dist.get_rank()
    return chunks[rank] if rank < len(chunks) else full[:0]


def st_save(ctx: Ctx) -> dict[str, Any]:
    """Every rank saves the sharded state of seed 1 as step 1; then the refusal below."""
    with CheckpointManager(ctx.root, barrier_timeout=HEALTHY) as mgr:
        mgr.save(1, as_dtensors(state(1, 0.1), "state"))
    return {"saved": 1, "refused": st_refuse(ctx)}


def st_restore(ctx: Ctx) -> dict[str, Any]:
    """Restore step 1 into ShardedTensors of another seed; compare with seed 1's chunks."""
    own = state(seed=7, lr=0.5)
    targets = as_dtensors(own, "state")
    with CheckpointManager(ctx.root, barrier_timeout=HEALTHY) as mgr:
        step = mgr.restore(targets)
    back = back_to_shards(own, targets)
    want = full_tensors(1)
    bad = []
    for k, full in want.items():
        model_st = back["state_dict"][k]
        shards = model_st.local_shards()
        got = shards[0].tensor if shards else full[:0]
        if model_st is not own["state_dict"][k] or not torch.equal(got, _local_rows(full)):
            bad.append(f"model {k}")
        mom = back["optimizer_states"][0]["state"][k]
        shards = mom["exp_avg"].local_shards()
        got = shards[0].tensor if shards else full[:0]
        if not torch.equal(got, _local_rows(full * 2)) or float(mom["step"]) != 1.0:
            bad.append(f"optim {k}")
    lr = back["optimizer_states"][0]["param_groups"][0]["lr"]
    return {"step": step, "bad": bad, "lr": lr}


def st_refuse(ctx: Ctx) -> dict[str, Any]:
    """A ShardedTensor chunked along dim 1 is refused before anything is written."""
    from torch.distributed._shard.sharded_tensor import init_from_local_shards
    from torch.distributed._shard.sharded_tensor.shard import Shard
    from torch.distributed._shard.sharding_spec import ShardMetadata

    rank = dist.get_rank()
    local = torch.full((4, 2), float(rank))
    md = ShardMetadata([0, 2 * rank], [4, 2], f"rank:{rank}/cpu")
    st = init_from_local_shards([Shard(local, md)], [4, 2 * dist.get_world_size()])
    try:
        as_dtensors({"w": st}, "state_dict")
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}

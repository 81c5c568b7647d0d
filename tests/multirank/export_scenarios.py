"""Scenarios that build stores for the CLI, verify and consolidation tests (run by worker.py).

``mixed_save`` writes, into one store, the same training state as a DTensor step (FSDP2
model and optimizer plus a sharded table large enough for several CRC blocks per chunk),
optionally as a replicated step of a plain model holding the same values, and optionally
per-rank ``sharded=True`` state. ``big_save`` writes a DTensor model of a few large tensors
for the peak-memory test of the streaming export.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ckptstore import CheckpointManager, RNGState
from ckptstore.sharded.plan import indexed_optimizer_state, is_dtensor, named_optimizer_state
from tests.multirank.dtensor_scenarios import _sha, make_net, shard, train
from tests.multirank.scenarios import Ctx

#: Rows of the sharded table: 2560 x 1024 float32 is 10 MiB, so each rank's chunk on 2
#: ranks spans two 4 MiB CRC blocks, and the whole tensor three on 1 rank.
TABLE_ROWS = 2560


def _full(t: Any) -> Any:
    return t.full_tensor() if is_dtensor(t) else t


def mixed_save(ctx: Ctx) -> dict[str, Any]:
    """A DTensor step, then optionally the same values replicated, then per-rank state."""
    from torch.distributed.tensor import Shard, distribute_tensor

    model = make_net()
    mesh = shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 3)
    torch.manual_seed(5)
    big = torch.randn(TABLE_ROWS, 1024)
    table = {"emb": distribute_tensor(big, mesh, [Shard(0)])}
    torch.manual_seed(1000 + ctx.rank)
    state = {"model": model, "optimizer": opt, "table": table, "rng": RNGState(), "step": 3}
    with CheckpointManager(ctx.root, barrier_timeout=60.0) as mgr:
        # The 1-rank DTensor step (4) is saved after the 2-rank launch made steps 3, 5, 6.
        mgr.save(ctx.args["dtensor_step"], state, metrics={"loss": 1.0}, allow_older=True)
        full_sd = {k: _full(v).detach().clone() for k, v in model.state_dict().items()}
        if ctx.args.get("replicated_step") is not None:
            plain = make_net(seed=99)
            plain.load_state_dict(full_sd)
            popt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
            named = named_optimizer_state(opt, model)
            named["state"] = {
                p: {k: _full(v).detach().clone() for k, v in st.items()}
                for p, st in named["state"].items()
            }
            popt.load_state_dict(indexed_optimizer_state(popt, plain, named, "replicated"))
            torch.manual_seed(1000 + ctx.rank)
            replicated = {
                "model": plain,
                "optimizer": popt,
                "table": {"emb": big},
                "rng": RNGState(),
                "step": 3,
            }
            mgr.save(ctx.args["replicated_step"], replicated, metrics={"loss": 1.0})
        if ctx.args.get("per_rank_step") is not None:
            part = {"part": torch.full((4,), float(ctx.rank))}
            mgr.save(ctx.args["per_rank_step"], part, sharded=True)
    digests = {f"model/{k}": _sha(v) for k, v in full_sd.items()}
    digests["table/emb"] = _sha(big)
    return {"digests": digests, "world": dist.get_world_size()}


def big_save(ctx: Ctx) -> dict[str, Any]:
    """A model of ``n`` large DTensors (``rows`` x 1024 float32 each) and a few small ones."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rows, n = ctx.args["rows"], ctx.args["n"]
    weights: dict[str, Any] = {}
    digests = {}
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        full = torch.rand(rows, 1024, generator=g)
        digests[f"layer{i}.weight"] = _sha(full)
        weights[f"layer{i}.weight"] = distribute_tensor(full, mesh, [Shard(i % 2)])
        del full
    bias = torch.arange(7, dtype=torch.float32)
    weights["bias"] = distribute_tensor(bias, mesh, [Replicate()])
    digests["bias"] = _sha(bias)
    with CheckpointManager(ctx.root, barrier_timeout=120.0) as mgr:
        mgr.save(1, {"model": weights})
    return {"digests": digests}


def dcp_load_fsdp(ctx: Ctx) -> dict[str, Any]:
    """``dcp.load`` into a fresh FSDP2 model on this world, twice: from an ``export --dcp``
    directory (``FileSystemReader``), and from the ckptstore step itself (``CkptStoreReader``).

    Every rank loads its own shards (DCP reads the chunks they overlap); returns the digests
    of the full tensors of each load.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from ckptstore.dcp import CkptStoreReader

    readers = {
        "export": FileSystemReader(ctx.args["dcp_dir"]),
        "store": CkptStoreReader(ctx.args["store"], step=ctx.args["step"]),
    }
    out: dict[str, Any] = {}
    for label, reader in readers.items():
        model = make_net(seed=99)
        shard(model)
        sd = model.state_dict()
        dcp.load({"model": sd}, storage_reader=reader)
        model.load_state_dict(sd)
        full = {k: _full(v) for k, v in model.state_dict().items()}
        out[label] = {f"model/{k}": _sha(v) for k, v in full.items()}
    return out

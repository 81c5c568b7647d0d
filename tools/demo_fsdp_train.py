"""One rank of the FSDP2 demo job (or, with ``--single``, a plain process with no group).

Launched by tools/demo_fsdp.py with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the
environment (as torchrun would). The model is ``fully_shard``-ed per layer and at the root
on a 1-D CPU mesh (gloo); its sizes (37, 23, 5, 2 rows) split unevenly over 2 and 3 ranks,
and the 2-row head leaves the third rank an empty shard.

Every rank writes ``RESULT.rankR`` (JSON) after each save: the SHA-256 of every *full*
tensor of the model and of the optimizer's moments at each saved step (``full_tensor()``,
a collective, so every rank holds the same digests), and the loss of every step.

``--kill-at-save N --kill-rank R``: rank R SIGKILLs itself inside ckptstore's sharded save
of step N, right after its shard file is written and fsynced (``ckptstore.sharded.plan.
write_shards`` is wrapped here, in the demo only), so the save is in flight on every rank.

``--single``: no process group; restore ``--check-steps`` one by one into a plain model and
a fresh plain AdamW with ``CheckpointManager(root).restore(state, step=s)``, and digest them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstore import BarrierTimeout, CheckpointManager

BATCH = 12  # global batch: splits evenly over 1, 2, 3, 4 and 6 ranks
D_IN = 10


class Net(nn.Module):
    """Uneven on purpose: 37, 23, 5 and 2 rows do not split evenly over 2 or 3 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, 37)
        self.norm = nn.LayerNorm(37)
        self.hidden = nn.Linear(37, 23)
        self.proj = nn.Linear(23, 5)
        self.head = nn.Linear(5, 2)
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))

    def layers(self) -> list[nn.Module]:
        return [self.embed, self.norm, self.hidden, self.proj, self.head]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.embed(x)))
        h = torch.relu(self.proj(torch.relu(self.hidden(h))))
        y: torch.Tensor = self.head(h) * self.scale
        return y


def make_model(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch of ``step`` (the same data on any world size)."""
    g = torch.Generator().manual_seed(10_000 + step)
    x, y = torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, 2, generator=g)
    per = BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def full(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of a DTensor (a collective), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def sha(t: torch.Tensor) -> str:
    t = full(t).detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{hashlib.sha256(raw).hexdigest()[:16]} {list(t.shape)} {str(t.dtype)[6:]}"


def digests(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    """A digest of every full tensor of the model and of every optimizer state value."""
    out = {f"model/{k}": sha(v) for k, v in sorted(model.state_dict().items())}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            for k, v in sorted(opt.state.get(p, {}).items()):
                key = f"optim/{names[id(p)]}/{k}"
                out[key] = sha(v) if isinstance(v, torch.Tensor) else repr(v)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    out["optim/param_groups"] = repr(hyper)
    return out


def write_result(path: str, result: dict[str, Any]) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)


def kill_inside_save(step: int) -> None:
    """SIGKILL this rank inside the sharded save of ``step``, after its shard is on disk."""
    from ckptstore.sharded import plan as sharding

    real = sharding.write_shards

    def dying(pending: Any, rank: int, plan: Any, flat: Any, **kw: Any) -> Any:
        table = real(pending, rank, plan, flat, **kw)
        if pending.step == step:
            names = sorted({c.file for _, _, c in table["chunks"]})
            print(
                f"  rank {rank}: SIGKILL inside the save of step {step}, after writing "
                f"{', '.join(names)} (manifest not yet written)",
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)
        return table

    sharding.write_shards = dying  # type: ignore[assignment]


def run_distributed(args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.WARNING, format=f"  [rank {rank}] %(message)s")
    result_path = f"{args.result}.rank{rank}"
    # The resumed jobs pass another seed: a restore must overwrite every weight.
    model = make_model(seed=0 if args.fresh_seed is None else args.fresh_seed)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_optimizer(model)

    mgr = CheckpointManager(args.store, keep=args.keep, barrier_timeout=args.timeout)
    result: dict[str, Any] = {"rank": rank, "world": world, "steps_at_start": mgr.steps()}
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": -1}
    start = mgr.resume(state)
    result["start"] = start
    if start:
        result["restored"] = {"step": state["step"], "digests": digests(model, opt)}
        sd = model.state_dict()
        result["local_shapes"] = {
            k: list(v.to_local().shape) for k, v in sd.items() if hasattr(v, "to_local")
        }
    if rank == 0:
        how = f"resumed at step {start}" if start else "fresh start"
        print(f"  {world} rank(s): {how}; committed steps {result['steps_at_start']}", flush=True)
    if args.kill_at_save is not None and rank == args.kill_rank:
        kill_inside_save(args.kill_at_save)

    result.update(losses={}, saved={})
    try:
        for step in range(start, args.steps):
            x, y = batch(step, rank, world)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
            opt.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            result["losses"][str(step)] = total.item() / world
            state["step"] = step
            if (step + 1) % args.every == 0:
                mgr.save(step, state, metrics={"loss": result["losses"][str(step)]})
                result["saved"][str(step)] = digests(model, opt)
                write_result(result_path, result)
    except BarrierTimeout as e:
        print(
            f"  rank {rank}: BarrierTimeout in {e.phase!r} of step {e.step}, missing ranks "
            f"{e.missing_ranks}",
            flush=True,
        )
        result["timeout"] = {"phase": e.phase, "missing": e.missing_ranks, "step": e.step}
        result["steps_after_timeout"] = mgr.steps()  # a listing: no collective
        write_result(result_path, result)
        os._exit(2)  # the group is broken: do not wait on the dead rank at exit
    result["steps_at_end"] = mgr.steps()
    mgr.close()
    write_result(result_path, result)
    dist.destroy_process_group()


def run_single(args: argparse.Namespace) -> None:
    """No process group: restore each step into a plain model and a fresh plain AdamW."""
    result: dict[str, Any] = {"restored": {}}
    with CheckpointManager(args.store) as mgr:
        result["steps"] = mgr.steps()
        for step in args.check_steps:
            model = make_model(seed=99)
            opt = make_optimizer(model)
            state: dict[str, Any] = {"model": model, "optimizer": opt, "step": -1}
            got = mgr.restore(state, step=step)
            result["restored"][str(got)] = {
                "digests": digests(model, opt),
                "state_step": state["step"],
                "plain": all(type(p) is nn.Parameter for p in model.parameters()),
            }
    write_result(args.result + ".single", result)


def main(argv: list[str] | None = None) -> None:
    """One rank (or, with ``--single``, one process) of the demo; ``argv`` as on the command
    line (default: ``sys.argv[1:]``)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--keep", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=60.0, help="barrier_timeout, seconds")
    ap.add_argument("--fresh-seed", type=int, default=None)
    ap.add_argument("--kill-at-save", type=int, default=None)
    ap.add_argument("--kill-rank", type=int, default=0)
    ap.add_argument("--single", action="store_true")
    ap.add_argument("--check-steps", type=lambda s: [int(x) for x in s.split(",")], default=[])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.single:
        run_single(args)
    else:
        run_distributed(args)


if __name__ == "__main__":
    main()

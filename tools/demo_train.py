"""One rank of the demo job: DDP on gloo/CPU, EMA, checkpoints through ckptstore.

Launched by tools/demo.py with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the
environment (as torchrun would). ``--kill-at-save N`` makes rank 0 SIGKILL itself in the
middle of writing checkpoint N, after some of its files are on disk.
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstore import EMA, BarrierTimeout, CheckpointManager, RNGState


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> None:
    """One rank of the demo; ``argv`` as on the command line (default: ``sys.argv[1:]``)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--kill-at-save", type=int, default=None)
    ap.add_argument("--result", required=True)
    args = ap.parse_args(argv)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.WARNING, format=f"  [rank {rank}] %(message)s")
    torch.manual_seed(0)  # same initial weights on every rank (DDP also broadcasts them)
    data = TensorDataset(torch.randn(512, 32), torch.randn(512, 8))
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        data, shuffle=True, seed=17
    )
    # The loader gets its own generator: a DataLoader draws a seed from the *global* RNG each
    # time an iterator is created, and a resumed run creates one mid-epoch, so it would
    # shift every random number after it (dropout masks) and break exact resumption.
    loader = DataLoader(data, batch_size=16, sampler=sampler, generator=torch.Generator())
    per_epoch = len(loader)

    model = DDP(nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 8)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    ema_avg = get_ema_multi_avg_fn(0.95)  # type: ignore[no-untyped-call]  # unannotated in torch
    ema = AveragedModel(model.module, multi_avg_fn=ema_avg)
    torch.manual_seed(1000 + rank)  # per-rank streams (dropout) that RNGState restores

    mgr = CheckpointManager(args.store, keep=3, barrier_timeout=8.0)
    state: dict[str, Any] = {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "ema": EMA(ema, source=model),
        "rng": RNGState(),
        "step": -1,
    }
    start = mgr.resume(state)
    if rank == 0:
        print(f"  rank 0: {'resumed at step ' + str(start) if start else 'fresh start'}")

    if args.kill_at_save is not None and rank == 0:
        from ckptstore.codec import payload

        real = payload.write_group
        written: list[str] = []

        def dying_write(pending: Any, name: str, *a: Any, **k: Any) -> None:
            real(pending, name, *a, **k)
            if pending.step != args.kill_at_save:
                return
            written.append(name)
            if len(written) >= 2:
                print(
                    f"  rank 0: SIGKILL while writing step {pending.step} "
                    f"({', '.join(written)} on disk, manifest not yet)",
                    flush=True,
                )
                os.kill(os.getpid(), signal.SIGKILL)

        payload.write_group = dying_write

    step = start
    try:
        while step < args.steps:
            epoch, pos = divmod(step, per_epoch)
            sampler.set_epoch(epoch)
            for i, (x, y) in enumerate(loader):
                if i < pos:
                    continue  # fast-forward the data order to where the checkpoint was
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
                opt.step()
                sched.step()
                ema.update_parameters(model.module)
                state["step"] = step
                if (step + 1) % args.every == 0:
                    mgr.save(step, state, metrics={"loss": loss.item()})
                step += 1
                if step >= args.steps:
                    break
    except BarrierTimeout as e:
        print(f"  rank {rank}: BarrierTimeout after {e.phase!r}, missing ranks {e.missing_ranks}")
        Path(args.result + f".rank{rank}").write_text(json.dumps({"timeout": str(e)}))
        os._exit(2)
    mgr.close()
    result = {
        "rank": rank,
        "start": start,
        "model": digest(model.module.state_dict()),
        "ema": digest(ema.module.state_dict()),
        "optimizer": digest(
            {f"{i}.{k}": v for i, s in opt.state_dict()["state"].items() for k, v in s.items()}
        ),
        "loss": loss.item(),
    }
    Path(args.result + f".rank{rank}").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

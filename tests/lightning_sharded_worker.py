"""Lightning ModelParallelStrategy (FSDP2) jobs on CPU (gloo) with CkptStoreIO.

For tests/test_lightning_sharded.py. Usage::

    python tests/lightning_sharded_worker.py OUT DEVICES PLAN_JSON

The test starts rank 0; Lightning's subprocess launcher starts the other ranks by running
the same command again. The plan is a list of runs, each a new ``Trainer`` in the same
processes (so the job starts once): ``{"name", "epochs", "ckpt", "dir", "copy", "corrupt",
"unsafe"}``. Before a run, rank 0 copies each ``[src, dst]`` of ``copy`` and flips a byte
of tensor data in each file matching a glob of ``corrupt`` (paths relative to OUT), and
every rank waits for it. ``tp`` (default 1) ranks of the job's form each tensor-parallel
group (the model's ``hidden`` width, default 5, must then split evenly). The run fits
``epochs`` epochs from ``ckpt`` (a path relative to
OUT, ``"last"`` or ``null``), checkpointing into ``OUT/<dir or name>/`` (the two newest
epochs and ``last.ckpt``), with an object only pickle could store if ``unsafe``, with one
more layer if ``extra``. Every rank writes ``OUT/<name>.rank<R>.json``: the global step,
epoch and digests of the full parameters and optimizer state when training starts, at the
end of every epoch and when it ends; or, when ``fit`` raised, the error's type and message
(and, with ``extra``, the digests of the parameters it left).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckptstore.integrations.lightning import CkptStoreIO


def rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    return int(os.environ.get("LOCAL_RANK", "0"))


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)  # a DTensor: gathered (collective)
    return (full() if full is not None else t).detach().cpu().contiguous()


def digests(module: pl.LightningModule, trainer: pl.Trainer) -> dict[str, str]:
    """sha256 prefixes of every full parameter and optimizer tensor, by name (collective)."""
    out: dict[str, str] = {}
    opt = trainer.optimizers[0]
    for name, p in module.named_parameters():
        out[f"param/{name}"] = _sha(_full(p))
        for key, v in sorted(opt.state.get(p, {}).items()):
            if isinstance(v, torch.Tensor):
                out[f"optim/{name}/{key}"] = _sha(_full(v))
            else:
                out[f"optim/{name}/{key}"] = repr(v)
    out["lr"] = repr([g["lr"] for g in opt.param_groups])
    return out


def _sha(t: torch.Tensor) -> str:
    h = hashlib.sha256(str((t.dtype, tuple(t.shape))).encode())
    h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


class Probe(Callback):
    def __init__(self, out: Path, name: str) -> None:
        self.path = out / f"{name}.rank{{}}.json"
        self.row: dict[str, Any] = {"epochs": {}}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.row.update(
            start_step=trainer.global_step,
            start_epoch=trainer.current_epoch,
            start=digests(pl_module, trainer),
            world_size=trainer.world_size,
        )

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.row["epochs"][str(trainer.current_epoch)] = digests(pl_module, trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.row.update(end_step=trainer.global_step, end=digests(pl_module, trainer))
        self.write()

    def write(self) -> None:
        Path(str(self.path).format(rank())).write_text(json.dumps(self.row))


class Opaque:
    """An object only pickle could store."""


class Model(pl.LightningModule):
    def __init__(self, unsafe: bool | str = False, hidden: int = 5, extra: bool = False) -> None:
        super().__init__()
        self.unsafe = unsafe
        # 5 and 3 rows: uneven shards on 2 and on 3 ranks (``hidden=6`` for tensor
        # parallelism, whose column-wise outputs torch splits evenly only). ``extra``: one
        # more layer than the checkpoints of the other runs hold.
        layers: list[nn.Module] = [nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3)]
        self.net = nn.Sequential(*layers, *([nn.Linear(3, 3)] if extra else []))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        tp = self.device_mesh["tensor_parallel"]
        if tp.size() > 1:  # column- then row-wise, then FSDP2 over it: torchtitan's 2-D
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )

            parallelize_module(self.net, tp, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.unsafe is True or (self.unsafe == "rank1" and rank() == 1):
            checkpoint["opaque"] = Opaque()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=0.05)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}


def prepare(out: Path, run: dict[str, Any]) -> None:
    """Rank 0 copies and corrupts what the run asks for; every rank waits for it."""
    if rank() == 0:
        for src, dst in run.get("copy", []):
            shutil.copytree(out / src, out / dst, symlinks=True)
        for pattern in run.get("corrupt", []):
            files = sorted(out.glob(pattern))
            assert files, pattern
            for f in files:
                data = bytearray(f.read_bytes())
                data[-2] ^= 0xFF  # tensor bytes (the safetensors header comes first)
                f.write_bytes(bytes(data))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def fit(out: Path, n: int, run: dict[str, Any]) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 4, generator=g), torch.randn(48, 3, generator=g))
    probe = Probe(out, run["name"])
    tp = run.get("tp", 1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=n,
        strategy=ModelParallelStrategy(data_parallel_size=n // tp, tensor_parallel_size=tp),
        max_epochs=run["epochs"],
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[CkptStoreIO(keep=run.get("keep", 1))],
        callbacks=[
            ModelCheckpoint(
                dirpath=out / run.get("dir", run["name"]),
                save_top_k=2,
                monitor="step",
                mode="max",
                save_last=True,
            ),
            probe,
        ],
    )
    if run.get("weights"):  # weights-only checkpoints beside the full ones, written after them
        trainer.callbacks.append(
            ModelCheckpoint(
                dirpath=out / run.get("dir", run["name"]),
                filename="weights-{epoch}",
                save_weights_only=True,
                monitor="step",
                mode="max",
            )
        )
    ckpt = run.get("ckpt")
    model = Model(
        unsafe=run.get("unsafe", False), hidden=run.get("hidden", 5), extra=run.get("extra", False)
    )
    try:
        trainer.fit(
            model,
            # 2 steps an epoch on any data-parallel size (tensor-parallel ranks share a batch)
            DataLoader(data, batch_size=24 // (n // tp)),
            ckpt_path=None if ckpt is None else ckpt if ckpt == "last" else str(out / ckpt),
        )
    except Exception as e:
        probe.row["error"] = {"type": type(e).__name__, "message": str(e)}
        if run.get("extra"):  # what the failed load left in the model (collective)
            probe.row["after_error"] = {
                f"param/{n}": _sha(_full(p)) for n, p in model.named_parameters()
            }
        probe.write()


def main() -> None:
    out, devices, plan = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    for run in json.loads(plan.read_text()):
        prepare(out, run)
        fit(out, devices, run)


if __name__ == "__main__":
    main()

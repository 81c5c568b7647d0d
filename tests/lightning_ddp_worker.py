"""A 2-rank DDP Lightning job on CPU (gloo) with CkptStoreIO, for tests/test_lightning.py.

Usage: ``python tests/lightning_ddp_worker.py OUT fit|resume MAX_EPOCHS``. The test starts
rank 0 of the fit, and Lightning's subprocess launcher starts rank 1 by running this same
command again; the resume's ranks are both started by the test, as torchrun starts them.
Every rank writes ``OUT/<mode>.rank<R>.json``: the global step, epoch and a digest of the
weights when training starts, and the global step when it ends. Every call of
``save_checkpoint``/``remove_checkpoint`` is appended to ``OUT/calls.rank<R>.jsonl`` by the
rank that made it, so the test can see who wrote what.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckptstore.integrations.lightning import CkptStoreIO


def rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class Recording(CkptStoreIO):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    def _record(self, op: str, path: Any, **extra: Any) -> None:
        row = {"op": op, "rank": rank(), "pid": os.getpid(), "path": os.fspath(path), **extra}
        with open(self.out / f"calls.rank{rank()}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
        self._record("save", path, global_step=checkpoint["global_step"])
        super().save_checkpoint(checkpoint, path, storage_options)

    def remove_checkpoint(self, path: Any) -> None:
        self._record("remove", path)
        super().remove_checkpoint(path)


class Probe(Callback):
    def __init__(self, out: Path, mode: str) -> None:
        self.out = out
        self.mode = mode
        self.row: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.row.update(
            start_step=trainer.global_step,
            start_epoch=trainer.current_epoch,
            start_digest=digest(pl_module.state_dict()),
            world_size=trainer.world_size,
        )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.row.update(end_step=trainer.global_step, end_digest=digest(pl_module.state_dict()))
        (self.out / f"{self.mode}.rank{rank()}.json").write_text(json.dumps(self.row))


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05)


def main() -> None:
    out, mode, max_epochs = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_epochs=max_epochs,
        limit_train_batches=4,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[Recording(out)],
        callbacks=[
            ModelCheckpoint(
                dirpath=out / "ckpt", save_top_k=2, monitor="step", mode="max", save_last=True
            ),
            Probe(out, mode),
        ],
    )
    ckpt_path = "last" if mode == "resume" else None
    trainer.fit(Model(), DataLoader(data, batch_size=8), ckpt_path=ckpt_path)


if __name__ == "__main__":
    main()

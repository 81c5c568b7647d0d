"""The Lightning parts of tests/test_lightning.py: a small LightningModule and Trainer, and
the plugin's names, in a module of their own that the tests import when they run.

Importing Lightning (with transformers, which tests/test_hf.py imports) cost every xdist
worker 7 s of CPU while collecting, where one or two of them run these tests.
"""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckptstore.integrations.lightning import CkptStoreIO

__all__ = [
    "BATCHES",
    "AtStart",
    "AttributeDict",
    "Callback",
    "CkptStoreIO",
    "Model",
    "ModelCheckpoint",
    "Recorder",
    "fit",
    "loaders",
    "new_model",
    "pl",
    "trainer",
]

BATCHES = 4  # training steps per epoch


class Model(pl.LightningModule):
    def __init__(
        self,
        lr: float = 0.05,
        args: argparse.Namespace | None = None,
        tags: frozenset[str] = frozenset(),
        root: pathlib.Path | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}


def new_model() -> Model:
    return Model(
        args=argparse.Namespace(width=4, name="tiny", nested=AttributeDict(a=1)),
        tags=frozenset({"cpu", "test"}),
        root=pathlib.Path("/data/x"),
    )


def loaders() -> tuple[DataLoader[Any], DataLoader[Any]]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    return DataLoader(data, batch_size=8), DataLoader(data, batch_size=8)


class Recorder(CkptStoreIO):
    """The plugin, keeping a deep copy of every checkpoint dict Lightning hands it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.saved: list[tuple[str, dict[str, Any]]] = []
        self.removed: list[str] = []

    def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
        self.saved.append((os.fspath(path), copy.deepcopy(checkpoint)))
        super().save_checkpoint(checkpoint, path, storage_options)

    def remove_checkpoint(self, path: Any) -> None:
        self.removed.append(os.fspath(path))
        super().remove_checkpoint(path)

    def last_saved(self, path: Path) -> dict[str, Any]:
        return next(c for p, c in reversed(self.saved) if p == str(path))


class AtStart(Callback):
    """What the trainer holds when training (re)starts."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.global_step = trainer.global_step
        self.epoch = trainer.current_epoch
        self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        self.optimizer = copy.deepcopy(trainer.optimizers[0].state_dict())


def trainer(
    dirpath: Path,
    epochs: int,
    plugin: CkptStoreIO | None = None,
    *,
    extra: list[Callback] | None = None,
    **ckpt: Any,
) -> pl.Trainer:
    options: dict[str, Any] = {"save_top_k": 2, "monitor": "step", "mode": "max", "save_last": True}
    options.update(ckpt)
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        limit_train_batches=BATCHES,
        limit_val_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        plugins=[plugin or CkptStoreIO()],
        callbacks=[ModelCheckpoint(dirpath=dirpath, **options), *(extra or [])],
    )


def fit(tr: pl.Trainer, model: Model | None = None, ckpt_path: str | None = None) -> Model:
    model = model or new_model()
    train, val = loaders()
    tr.fit(model, train, val, ckpt_path=ckpt_path)
    return model

"""One process of the GPU framework tests (tests/test_gpu_frameworks.py): issue 23.

    python tests/gpu_frameworks_worker.py MODE OUT_DIR [--plain]

MODE is one of ``accelerate``, ``accelerate_resume``, ``lightning``, ``lightning_resume``,
``trainer`` and ``trainer_resume``. Each runs a real framework on one CUDA device in a
one-process NCCL group (the launcher sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``): accelerate with an FSDP2 plugin, Lightning's
``FSDPStrategy`` with sharded state dicts, the transformers ``Trainer`` with FSDP2. It
writes ``OUT_DIR/MODE.json``: digests of the full parameters (and optimizer state) at the
points the test compares. ``--plain`` runs the same flow without FSDP on the CPU, which
only checks the harness itself where no GPU is.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]

MODE, OUT, PLAIN = "", Path(), False  # set by main() from the command line
STEPS = 6  # every run trains 6 steps; the first run saves along the way
SAVE_AT = (1, 3)  # accelerate: the steps saved (the resume starts after step 3)


def sha(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return f"{hashlib.sha256(raw).hexdigest()[:16]}:{list(t.shape)}:{t.dtype}"


def full(t: Any) -> Any:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def model_digests(model: nn.Module) -> dict[str, str]:
    """Digests of the full tensors of ``model`` (FSDP1, FSDP2 or plain)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if PLAIN:  # DDP (accelerate on CPU in a process group) or a plain module
        sd = getattr(model, "module", model).state_dict()
    else:
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: sha(full(v)) for k, v in sorted(sd.items())}


def optimizer_digests(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    """Digests of the full optimizer state by parameter name (FSDP1, FSDP2 or plain)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=not PLAIN))
    out = {}
    for name, st in sorted(osd["state"].items()):
        for k, v in sorted(st.items()):
            out[f"{name}/{k}"] = sha(full(v)) if isinstance(v, torch.Tensor) else repr(v)
    return out


def write(doc: dict[str, Any]) -> None:
    (OUT / f"{MODE}.json").write_text(json.dumps(doc, indent=1, sort_keys=True))


def deterministic() -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def batch(step: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(shape, generator=g).to(device)


# ---- accelerate: AcceleratorCheckpointer with an FSDP2 plugin -----------------------------


def make_net(seed: int, dropout: float = 0.1) -> nn.Sequential:
    """Uneven layer widths: FSDP2's shards of 37, 23 and 5 rows."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 37), nn.ReLU(), nn.Dropout(dropout), nn.Linear(37, 23), nn.ReLU(),
        nn.Linear(23, 5),
    )  # fmt: skip


def accelerate_run(seed: int, *, resume: bool) -> None:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    from ckptstore.integrations.hf import AcceleratorCheckpointer

    deterministic()
    if PLAIN:
        acc = Accelerator(cpu=True)
    else:
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="size_based_wrap", min_num_params=100
        )
        acc = Accelerator(fsdp_plugin=plugin)
    model = make_net(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = acc.prepare(model, opt, sched)
    doc: dict[str, Any] = {
        "distributed_type": str(acc.distributed_type),
        "is_fsdp2": bool(getattr(acc, "is_fsdp2", False)),
        "dtensor_params": any(hasattr(p, "full_tensor") for p in model.parameters()),
        "device": str(next(model.parameters()).device),
    }
    ckpt = AcceleratorCheckpointer(acc, OUT / "acc-store", keep=None)
    start = ckpt.resume() if resume else 0
    doc["start"] = start
    if resume:
        doc["restored"] = {"model": model_digests(model), "optim": optimizer_digests(model, opt)}
    for step in range(start, STEPS):
        x = batch(step, (8, 16), acc.device)
        loss = model(x).square().mean()
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        if not resume and step in SAVE_AT:
            ckpt.save(step)
            ckpt.manager.wait()
            doc[f"saved{step}"] = {
                "model": model_digests(model),
                "optim": optimizer_digests(model, opt),
            }
    ckpt.close()
    doc["final"] = {"model": model_digests(model), "optim": optimizer_digests(model, opt)}
    doc["lr"] = sched.get_last_lr()
    write(doc)


# ---- Lightning: FSDPStrategy(state_dict_type="sharded") through CkptStoreIO ---------------


def lightning_run(*, resume: bool) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ckptstore.integrations.lightning import CkptStoreIO

    deterministic()
    records: dict[str, Any] = {}

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            # No dropout: Lightning's checkpoints do not hold the RNG state.
            self.net = make_net(0 if not resume else 5, dropout=0.0)

        def training_step(self, b: torch.Tensor, i: int) -> torch.Tensor:
            return self.net(b).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self) -> Any:
            data = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
            return torch.utils.data.DataLoader(data, batch_size=4)  # 2 steps an epoch

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            model = self.trainer.strategy.model
            records[f"epoch{self.current_epoch}"] = {
                "model": model_digests(model),
                "optim": optimizer_digests(model, self.trainer.optimizers[0]),
            }

        def on_train_start(self) -> None:
            model = self.trainer.strategy.model
            records["start"] = {
                "model": model_digests(model),
                "optim": optimizer_digests(model, self.trainer.optimizers[0]),
                "global_step": self.trainer.global_step,
            }

    if PLAIN:
        strategy: Any = "auto"
        accelerator = "cpu"
    else:
        from lightning.pytorch.strategies import FSDPStrategy

        strategy = FSDPStrategy(state_dict_type="sharded", auto_wrap_policy={nn.Linear})
        accelerator = "cuda"
    ckpt_dir = OUT / "lightning"
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator=accelerator,
        devices=1,
        max_epochs=3,
        plugins=[CkptStoreIO()],
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, save_last=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        default_root_dir=OUT,
    )
    module = Net()
    trainer.fit(module, ckpt_path=str(ckpt_dir / "epoch=0-step=2.ckpt") if resume else None)
    model = trainer.strategy.model
    records["final"] = {
        "model": model_digests(model),
        "optim": optimizer_digests(model, trainer.optimizers[0]),
        "global_step": trainer.global_step,
    }
    records["strategy"] = type(trainer.strategy).__name__
    records["checkpoints"] = sorted(p.name for p in ckpt_dir.iterdir())
    write(records)


# ---- transformers: Trainer with FSDP2 and CkptStoreCallback ------------------------------


def tiny_gpt2(seed: int) -> Any:
    """A 2-layer GPT-2 with eager attention (deterministic backward on a GPU)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
        attn_implementation="eager",
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def trainer_run(*, resume: bool) -> None:
    from transformers import Trainer, TrainingArguments

    from ckptstore.integrations.hf import CkptStoreCallback
    from tests._helpers import TokenData

    deterministic()
    model = tiny_gpt2(seed=0 if not resume else 9)
    fsdp: dict[str, Any] = (
        {"use_cpu": True} if PLAIN else {"fsdp": True, "fsdp_config": {"version": 2}}
    )
    args = TrainingArguments(
        output_dir=str(OUT / ("hf-b" if resume else "hf-a")),
        report_to=[],
        save_strategy="steps",
        save_steps=2,
        max_steps=STEPS,
        per_device_train_batch_size=2,
        logging_steps=1,
        learning_rate=1e-3,
        disable_tqdm=True,
        seed=0,
        **fsdp,
    )
    cb = CkptStoreCallback(OUT / "hf-store", keep=None)
    trainer = Trainer(model=model, args=args, train_dataset=TokenData(), callbacks=[cb])
    doc: dict[str, Any] = {"is_fsdp2": bool(getattr(trainer.accelerator, "is_fsdp2", False))}
    cb.train(trainer)
    doc["resumed_step"] = cb.resumed_step
    doc["global_step"] = trainer.state.global_step
    doc["losses"] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    doc["dtensor_params"] = any(hasattr(p, "full_tensor") for p in trainer.model.parameters())
    doc["final"] = {"model": model_digests(trainer.model)}
    doc["hf_dirs"] = sorted(p.name for p in Path(args.output_dir).glob("checkpoint-*"))
    write(doc)


def main() -> None:
    global MODE, OUT, PLAIN
    MODE, OUT, PLAIN = sys.argv[1], Path(sys.argv[2]), "--plain" in sys.argv[3:]
    OUT.mkdir(parents=True, exist_ok=True)
    try:
        if MODE in ("accelerate", "accelerate_resume"):
            accelerate_run(seed=0 if MODE == "accelerate" else 4, resume=MODE.endswith("resume"))
        elif MODE in ("lightning", "lightning_resume"):
            lightning_run(resume=MODE.endswith("resume"))
        elif MODE in ("trainer", "trainer_resume"):
            trainer_run(resume=MODE.endswith("resume"))
        else:
            raise SystemExit(f"unknown mode {MODE!r}")
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

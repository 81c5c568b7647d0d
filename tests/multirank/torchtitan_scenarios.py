"""Scenarios of torchtitan's own checkpointer saving through ckptstore (issue 23).

Every object torchtitan's ``Trainer`` hands its checkpointer is torchtitan's real class: the
``CheckpointManager`` (here :class:`~ckptstore.integrations.torchtitan.CkptStoreCheckpointManager`,
built from its ``Config`` as the trainer builds it), ``ModelWrapper`` (made by the manager),
``OptimizersContainer`` (AdamW, FQN-keyed flat state), ``LRSchedulersContainer`` (warmup then
linear decay) and a ``StateDictAdapter`` subclass for ``last_save_in_hf``. The model is a small
FSDP2 module (``fully_shard`` on a CPU mesh, gloo); the dataloader and the train state are
small ``Stateful`` stand-ins (torchtitan's dataloader needs ``torchdata``, its train state is
the ``Trainer``). The loop is the trainer's: ``load(step=load_step)``, then per step
``maybe_wait_for_staging``, a training step, ``save(step, last_step=...)``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpoint import CheckpointManager as TitanCheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from ckptstore import CheckpointManager
from ckptstore.integrations.torchtitan import CkptStoreCheckpointManager
from tests.multirank.dtensor_scenarios import _sha
from tests.multirank.scenarios import Ctx

DIM = 16


class Tiny(nn.Module):
    """Two linear layers and a norm: names like a transformer's, shapes that shard on 2, 3."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)])
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.layers[1](torch.relu(self.layers[0](x))))


class TinyAdapter(StateDictAdapter):  # type: ignore[misc]
    """torchtitan's adapter contract for :class:`Tiny`: its names as a HF model's."""

    def __init__(self, model_config: Any = None, hf_assets_path: str | None = None) -> None:
        super().__init__(model_config, hf_assets_path)

    @staticmethod
    def _hf(name: str) -> str:
        return "model." + name.replace("layers.0.", "layers.0.mlp.up_proj.").replace(
            "layers.1.", "layers.0.mlp.down_proj."
        )

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {self._hf(k): v for k, v in state_dict.items()}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        back = {self._hf(k): k for k in _names()}
        return {back[k]: v for k, v in hf_state_dict.items()}


def _names() -> list[str]:
    return list(Tiny().state_dict())


class Data(Stateful):
    """A dataloader's position (torchtitan saves its dataloader's ``state_dict``)."""

    def __init__(self) -> None:
        self.position = 0

    def batch(self, step: int) -> torch.Tensor:
        self.position += 1
        g = torch.Generator().manual_seed(1000 + step)
        return torch.randn(8, DIM, generator=g)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position = int(state_dict["position"])


class TrainState(Stateful):
    """What torchtitan's ``Trainer`` saves of itself (``train_state``)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.ntokens_seen = int(state_dict["ntokens_seen"])


class Job:
    """One torchtitan training job: model, optimizers, schedulers, data, checkpointer."""

    def __init__(
        self,
        base: Path,
        seed: int,
        steps: int,
        manager: Any = CkptStoreCheckpointManager,
        **checkpoint: Any,
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(seed)
        self.model = Tiny()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizers = OptimizersContainer.Config(
            param_groups=[
                ParamGroupConfig(
                    pattern=r".*",
                    optimizer_name="AdamW",
                    optimizer_kwargs={"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1},
                )
            ],
            implementation="for-loop",
        ).build(model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=steps
        )
        self.steps = steps
        self.data = Data()
        self.train_state = TrainState()
        options = {"enable": True, "folder": "store", "interval": 2, **checkpoint}
        self.checkpointer = manager.Config(**options).build(
            dataloader=self.data,
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            sd_adapter=TinyAdapter(),
            base_folder=str(base),
        )

    def train_step(self) -> None:
        step = self.train_state.step
        x = self.data.batch(step)
        loss = self.model(x).pow(2).mean()
        loss.backward()
        self.optimizers.step()
        self.lr_schedulers.step()
        self.optimizers.zero_grad()
        self.train_state.ntokens_seen += x.numel()

    def run(self, until: int, digests_at: dict[str, Any] | None = None) -> None:
        """The trainer's loop from the current step to ``until`` (saving as it goes)."""
        while self.train_state.step < until:
            self.train_state.step += 1
            self.checkpointer.maybe_wait_for_staging()
            self.train_step()
            step = self.train_state.step
            if digests_at is not None and step % self.checkpointer.interval == 0:
                digests_at[str(step)] = self.digests()  # before the save: what it holds
            self.checkpointer.save(step, last_step=step == self.steps)

    def digests(self) -> dict[str, str]:
        """Every full tensor and value the checkpointer saves (collective)."""
        out = {f"model/{k}": _sha(v) for k, v in sorted(self.model.state_dict().items())}
        for k, v in sorted(self.optimizers.state_dict().items()):
            out[f"optimizer/{k}"] = _sha(v) if isinstance(v, torch.Tensor) else repr(v)
        out["lr_scheduler"] = repr(self.lr_schedulers.state_dict())
        out["lr"] = repr([g["lr"] for o in self.optimizers for g in o.param_groups])
        out["dataloader"] = repr(self.data.state_dict())
        out["train_state"] = repr(self.train_state.state_dict())
        return out

    def close(self) -> None:
        self.checkpointer.maybe_wait_for_saving()
        self.checkpointer.close()


def _slow_writes(seconds: float) -> None:
    """Each ckptstore write under DCP starts ``seconds`` late (in DCP's save thread)."""
    import time

    if not seconds:
        return
    from ckptstore.dcp import CkptStoreWriter

    write = CkptStoreWriter.write_data

    def late(self: CkptStoreWriter, plan: Any, planner: Any) -> Any:
        time.sleep(seconds)
        return write(self, plan, planner)

    CkptStoreWriter.write_data = late  # type: ignore[method-assign]


def _store(base: Path) -> CheckpointManager:
    """The store torchtitan's checkpointer wrote under ``base``, opened by this process alone."""
    return CheckpointManager(base / "store", distributed=False, create=False)


def train_save_resume(ctx: Ctx) -> dict[str, Any]:
    """Train 6 steps saving every 2 (``async_mode``, ``keep_latest_k``), then on to 8; resume
    a fresh job (another seed) from step 6, compare, train it on to 8 and compare with the
    uninterrupted run's step 8. With ``delay``, ckptstore's write of each step waits that
    long in the background, so training goes on while a save is in flight."""
    mode = ctx.args.get("async_mode", "disabled")
    keep = int(ctx.args.get("keep", 2))
    delay = float(ctx.args.get("delay", 0.0))
    _slow_writes(delay)
    out: dict[str, Any] = {"saved": {}}
    job = Job(ctx.workdir, seed=0, steps=100, async_mode=mode, keep_latest_k=keep)
    assert job.checkpointer.load(step=-1) is False  # a fresh start: nothing to load
    job.run(6, out["saved"])
    future = job.checkpointer.save_future
    out["in_flight_after_save_6"] = future is not None and not future.done()
    job.run(8)  # steps 7 and 8 train while step 6 may still be written
    out["uninterrupted_8"] = job.digests()
    job.checkpointer.maybe_wait_for_saving()
    out["steps_at_8"] = job.checkpointer.store.steps()
    job.close()
    dist.barrier()
    with _store(ctx.workdir) as store:
        out["manifest_6"] = store.manifest(6).metadata

    # A fresh job (another seed, so every tensor differs) resumes from the newest step that
    # was committed before step 8 was saved: step 8 is deleted first, as a job killed
    # before its save of step 8 would leave the store.
    if ctx.rank == 0:
        with _store(ctx.workdir) as store:
            store.delete(8, force=True)
    dist.barrier()
    job = Job(ctx.workdir, seed=7, steps=100, async_mode=mode, keep_latest_k=keep)
    assert job.checkpointer.load(step=-1) is True
    out["resumed_step"] = job.train_state.step
    out["resumed"] = job.digests()
    job.run(8)
    out["continued_8"] = job.digests()
    job.close()
    return out


def resume_on_world(ctx: Ctx) -> dict[str, Any]:
    """Load step ``step`` of a store written by another world size (``load_step``)."""
    job = Job(
        ctx.workdir, seed=5, steps=100, keep_latest_k=0, load_only=ctx.args.get("load_only", False)
    )
    assert job.checkpointer.load(step=int(ctx.args["step"])) is True
    out = {"step": job.train_state.step, "digests": job.digests()}
    job.close()
    return out


def load_only_peer_gone(ctx: Ctx) -> dict[str, Any]:
    """A ``load_only`` job (evaluation) whose rank 1 hangs before the load (alive, its
    sockets open, for ``hang`` seconds, then gone): rank 0's load ends within
    ``barrier_timeout`` (``timeout``), not the default group's timeout."""
    job = Job(
        ctx.workdir,
        seed=5,
        steps=100,
        keep_latest_k=0,
        load_only=True,
        barrier_timeout=float(ctx.args["timeout"]),
    )
    dist.barrier()
    done = ctx.workdir / "rank0-done"
    if ctx.rank == 1:
        # Alive and silent (a dead peer's sockets close, which gloo notices at once) until
        # rank 0's load ended, or ``hang`` seconds.
        deadline = time.monotonic() + float(ctx.args["hang"])
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os._exit(3)
    t0 = time.monotonic()
    try:
        job.checkpointer.load(step=int(ctx.args["step"]))
        out: dict[str, Any] = {"ok": True}
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        out = {"ok": False, "error_type": type(e).__name__, "message": str(e)[:500]}
    out["seconds"] = time.monotonic() - t0
    done.touch()
    return out


def _last_step_hf(base: Path) -> dict[str, Any]:
    """Train to the last step (4) with ``last_save_in_hf`` and ``export_dtype=bfloat16``: the
    store's steps, the last one's manifest, the exported files and the full weights as the
    export should hold them."""
    job = Job(base, seed=3, steps=4, keep_latest_k=0, last_save_in_hf=True, export_dtype="bfloat16")
    job.run(4)
    full = {
        TinyAdapter._hf(k): _sha(v.full_tensor().to(torch.bfloat16))
        for k, v in job.model.state_dict().items()
    }
    job.close()
    dist.barrier()
    hf_dir = base / "hf" / "step-4"
    with _store(base) as store:
        return {
            "steps": store.steps(),
            "manifest_4": store.manifest(4).metadata,
            "hf_files": sorted(os.listdir(hf_dir)) if hf_dir.is_dir() else None,
            "expected": dict(sorted(full.items())),
        }


def _switch_from_stock(base: Path) -> dict[str, Any]:
    """A run checkpointed by torchtitan's stock manager (DCP ``step-2``, ``step-4``) switches
    to ckptstore (``async_with_pinned_mem``, saves slowed so training overlaps them): it
    resumes from step-4, saves 6 and 8 into the store; a third job resumes from step 8."""
    out: dict[str, Any] = {"saved": {}}
    job = Job(base, seed=0, steps=100, manager=TitanCheckpointManager, keep_latest_k=0)
    job.run(4, out["saved"])
    job.close()
    dist.barrier()
    job = Job(base, seed=1, steps=100, async_mode="async_with_pinned_mem", keep_latest_k=0)
    assert job.checkpointer.load(step=-1) is True
    out["resumed_stock"] = {"step": job.train_state.step, "digests": job.digests()}
    job.run(8, out["saved"])
    future = job.checkpointer.save_future
    out["in_flight_after_save_8"] = future is not None and not future.done()
    job.close()
    dist.barrier()
    job = Job(base, seed=2, steps=100, keep_latest_k=0)
    assert job.checkpointer.load(step=-1) is True
    out["resumed_store"] = {"step": job.train_state.step, "digests": job.digests()}
    job.close()
    dist.barrier()
    with _store(base) as store:
        out["steps"] = store.steps()
        out["manifest_8"] = store.manifest(8).metadata
    out["folder"] = sorted(p.name for p in (base / "store").iterdir() if p.name.startswith("step-"))
    return out


def switch_and_last_step(ctx: Ctx) -> dict[str, Any]:
    """:func:`_switch_from_stock` (in ``switch/``), then :func:`_last_step_hf` (in ``hf/``)."""
    _slow_writes(float(ctx.args.get("delay", 0.0)))
    return {
        "switch": _switch_from_stock(ctx.workdir / "switch"),
        "hf": _last_step_hf(ctx.workdir / "hf"),
    }


def resume_past_a_corrupt_step(ctx: Ctx) -> dict[str, Any]:
    """Train 6 steps saving every 2 (keep all); flip a byte of step 6's shards; a fresh job
    asked for the newest step resumes from step 4 and saves step 6 again; one asked for step
    6 itself raises."""
    out: dict[str, Any] = {"saved": {}}
    job = Job(ctx.workdir, seed=0, steps=100, keep_latest_k=0)
    job.run(6, out["saved"])
    job.close()
    dist.barrier()
    if ctx.rank == 0:
        step = ctx.workdir / "store" / "step-000000000006"
        shard = step / "_shards.rank00001.safetensors"
        raw = bytearray(shard.read_bytes())
        raw[-5] ^= 0x20  # a byte of the last box (tensor data, not the header)
        shard.write_bytes(bytes(raw))
    dist.barrier()
    job = Job(ctx.workdir, seed=7, steps=100, keep_latest_k=0)
    assert job.checkpointer.load(step=-1) is True
    out["resumed_step"] = job.train_state.step
    out["resumed"] = job.digests()
    job.run(6)  # saves step 6 again, over the corrupt one
    out["steps"] = job.checkpointer.store.steps()
    job.close()
    dist.barrier()
    with _store(ctx.workdir) as store:
        out["verify_6"] = store.verify(6).ok
    dist.barrier()  # every rank verified before rank 0 damages the step again
    if ctx.rank == 0:
        shard = ctx.workdir / "store" / "step-000000000006" / "_shards.rank00001.safetensors"
        raw = bytearray(shard.read_bytes())
        raw[-5] ^= 0x20
        shard.write_bytes(bytes(raw))
    dist.barrier()
    job = Job(ctx.workdir, seed=7, steps=100, keep_latest_k=0)
    try:
        job.checkpointer.load(step=6)
        out["explicit"] = "loaded"
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        out["explicit"] = type(e).__name__ + ": " + ("IntegrityError" in str(e)) * "integrity"
    job.close()
    return out

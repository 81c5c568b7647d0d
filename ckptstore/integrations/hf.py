"""Hugging Face integrations: accelerate's ``Accelerator`` and the transformers ``Trainer``.

**accelerate.** :class:`AcceleratorCheckpointer` saves what ``Accelerator.save_state`` saves,
read from the same registries (the prepared models, unwrapped; optimizers; schedulers;
dataloader positions; the ``GradScaler``; every object given to
``register_for_checkpointing``; the RNG state of each process; ``accelerator.step``), as one
atomic, checksummed ckptstore step. ``resume()`` restores the newest step that verifies::

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model, opt, sched, dl = accelerator.prepare(model, opt, sched, dl)
    accelerator.register_for_checkpointing(my_stats)
    ckpt = AcceleratorCheckpointer(accelerator, "runs/exp1/ckpt", keep=3)
    start = ckpt.resume()                       # 0 on an empty store, else restored step + 1
    for step in range(start, total_steps):
        ...
        if step % 500 == 499:
            ckpt.save(step)                     # on every process, like save_state

Why not ``save_state``'s hooks: ``register_save_state_pre_hook`` sees only the models and the
output directory; optimizers, schedulers, RNG and registered objects are still written by
``save_state`` itself, as pickles, one file after another into a directory that is visible
half-written, and ``load_state`` reads them back with ``weights_only=False``. A hook cannot
make that atomic or verified, so the checkpointer replaces the pair instead of patching it.

Resuming in the middle of an epoch: keep ``use_seedable_sampler=True`` (the order of an epoch
then depends only on its number, which is saved), call ``dl.set_epoch(epoch)`` each epoch and
skip the batches already seen with ``accelerator.skip_first_batches(dl, start %
len(dl))``; without a seedable sampler the order of the next epoch is restored only at epoch
boundaries (it is drawn from the RNG state when an epoch starts).

**transformers.** :class:`CkptStoreCallback` commits, at every save of the ``Trainer``
(``on_save``: after the trainer has captured its own checkpoint, so at the same point of the
random streams), the model weights, the optimizer, the scheduler, the ``GradScaler``, the
``TrainerState`` as plain data and each process's RNG state. To resume, the newest step
that verifies is written out as a regular Trainer checkpoint directory in a temporary place
and handed to ``trainer.train(resume_from_checkpoint=...)``: the Trainer then resumes by its
own rules (global step, epoch, skipping the batches already seen, RNG restored after the
skip, stateful callbacks, LR schedule) exactly as from its own checkpoint::

    ckpt = CkptStoreCallback("runs/exp1/ckpt", keep=3)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[ckpt])
    ckpt.train(trainer)                         # resumes from the newest good step, or starts

or, spelled out: ``with ckpt.resume_checkpoint(trainer) as path:
trainer.train(resume_from_checkpoint=path)``. The Trainer still writes its own
``checkpoint-N`` directories (its ``save`` cannot be skipped); by default the callback
removes each one once its ckptstore step is committed, so a step takes its disk space once
(except the best model's, which ``load_best_model_at_end`` reads).
``keep_hf_checkpoints=True`` keeps them all, which doubles the disk space of checkpoints.

Each step's metadata records the model's ``transformers`` config (``hf_configs``), which
``ckptstore export --hf`` writes as ``config.json``: the exported directory loads with
``from_pretrained``.

**Steps that exist already.** Resuming after the newest checkpoint failed verification goes
back to an older step, so training reaches the failed step again: a step that is committed
but does not verify is then replaced by the new save (with a warning). A step that verifies
is never overwritten (:class:`~ckptstore.StepExistsError`), except that the callback skips a
second save of the step it has just saved (the Trainer saves twice when a save step ends an
epoch).

**FSDP2.** Under accelerate's FSDP2 plugin (``fsdp_version=2``; the Trainer's
``fsdp=True``, ``fsdp_config={"version": 2}``) parameters and optimizer moments are
``DTensor`` shards: both classes save them sharded (every process writes its own shards,
the manifest goes last) and restore them in place on any number of processes.
``AcceleratorCheckpointer.resume`` restores into the prepared objects; the callback's resume
checkpoint holds the trainer state, scheduler and RNG files and two marker folders named as
the Trainer's FSDP checkpoints (``pytorch_model_fsdp_0``, ``optimizer_0``), and while it is
open the Trainer's FSDP loads of it (``load_fsdp_model``/``load_fsdp_optimizer``, as bound in
``transformers.trainer``) restore the model and optimizer from the store instead, each
process reading only what its shards overlap. FSDP version 1 (flat parameters), DeepSpeed and
Megatron-LM keep their state in their own engines, and the classes refuse to start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .._log import logger as log
from ..errors import ConfigError, MissingDependencyError, StateMismatchError, StepExistsError
from ..manager import CheckpointManager
from ..retention import RetentionPolicy
from ..save.staging import SaveHandle
from ..sharded.consolidate import HF_CONFIGS_KEY
from ..state.capture import STRICT_HINT
from ..state.modules import RNGState, de_parallel, load_module_state

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - the extra is not installed
    msg = "ckptstore.integrations.hf needs transformers: pip install 'ckptstore[hf]'"
    raise MissingDependencyError(msg) from e

__all__ = ["AcceleratorCheckpointer", "CkptStoreCallback"]

_SHARDED_ENGINES = ("FSDP", "DEEPSPEED", "MEGATRON_LM")
#: File names of a Trainer checkpoint directory (transformers.trainer).
_TRAINER_STATE = "trainer_state.json"
_WEIGHTS = "pytorch_model.bin"
_OPTIMIZER = "optimizer.pt"
_SCHEDULER = "scheduler.pt"
_SCALER = "scaler.pt"
#: Under FSDP2: the folders the Trainer recognises as an FSDP model and optimizer
#: checkpoint (``pytorch_model_fsdp_0``, ``optimizer_0``), and the marker they hold.
_FSDP_MODEL_DIR = "pytorch_model_fsdp_0"
_FSDP_OPTIMIZER_DIR = "optimizer_0"
_FSDP_MARKER = "ckptstore-restores-in-place.json"

Retention = int | RetentionPolicy | list[RetentionPolicy] | None


def _refuse_sharded(accelerator: Any) -> None:
    """Raise for an accelerator whose engine shards state in a way ckptstore cannot serve.

    FSDP2 (``fully_shard``: parameters and optimizer moments are ``DTensor`` shards) is
    served (every process saves its own shards); FSDP1's flat parameters, DeepSpeed and
    Megatron-LM keep their state inside their engines.
    """
    dtype = getattr(accelerator, "distributed_type", None)
    name = str(getattr(dtype, "value", dtype))
    if name not in _SHARDED_ENGINES:
        return
    if name == "FSDP" and getattr(accelerator, "is_fsdp2", False) is True:
        return
    if name == "FSDP":
        msg = (
            "accelerator: FSDP version 1 keeps parameters in flat buffers whose sharded state "
            "is FSDP's own; ckptstore serves FSDP2. Use "
            "FullyShardedDataParallelPlugin(fsdp_version=2) (each process then saves its "
            "DTensor shards into one step, which restores on any number of processes), or "
            "accelerator.save_state for this run"
        )
        raise ConfigError(msg)
    msg = (
        f"accelerator: distributed_type {name} shards the model and optimizer state in its "
        "own engine; ckptstore's Hugging Face integration covers one process, DDP, "
        "multi-CPU and FSDP2. Use accelerator.save_state for this run"
    )
    raise ConfigError(msg)


def _replace_if_corrupt(mgr: CheckpointManager, step: int, *, skip_if_saved: bool) -> bool:
    """Whether to save ``step`` (collective); False: it is saved already, skip.

    A committed ``step`` that fails deep verification is left to ``CheckpointManager.save``,
    which replaces it; one that verifies raises ``StepExistsError``.
    """

    def judge() -> str:
        if step not in mgr.steps():
            return "free"
        if skip_if_saved:
            return "skip"
        report = mgr.verify(step, deep=True)
        return "exists" if report.ok else "corrupt: " + "; ".join(report.problems)

    # Rank 0 judges; its error (a store it cannot list) is raised on every rank at once.
    verdict = mgr.coord.leader_value(judge, "hf:step", step)
    if verdict == "exists":
        raise StepExistsError(
            f"{mgr.storage.describe(step)} is already committed and verifies; steps are "
            "write-once. Save under a new step, or resume() first to continue after it"
        )
    # A corrupt committed step is replaced by CheckpointManager.save itself (with a warning).
    return verdict != "skip"


# ---- accelerate ----------------------------------------------------------------------


class _DataLoaderPosition:
    """Where a prepared dataloader is: its epoch counter and the state of its sampler.

    What ``save_state`` keeps of a dataloader (a ``SeedableRandomSampler``'s epoch and seed,
    a stateful dataloader's ``state_dict``), plus the epoch counter that decides the order of
    the next epoch and the state of a sampler's own ``torch.Generator``.
    """

    def __init__(self, dataloader: Any) -> None:
        self.dataloader = dataloader

    def _sampler(self) -> Any:
        try:
            from accelerate.data_loader import get_sampler

            return get_sampler(self.dataloader)
        except (ImportError, AttributeError):
            return getattr(self.dataloader, "sampler", None)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        dl = self.dataloader
        iteration = getattr(dl, "iteration", None)
        if isinstance(iteration, int):
            out["iteration"] = iteration
        sampler = self._sampler()
        for name in ("epoch", "initial_seed"):
            v = getattr(sampler, name, None)
            if isinstance(v, int) and not isinstance(v, bool):
                out.setdefault("sampler", {})[name] = v
        gen = getattr(sampler, "generator", None)
        if isinstance(gen, torch.Generator):
            out["generator"] = gen.get_state()
        if getattr(dl, "use_stateful_dataloader", False):
            out["stateful"] = dl.state_dict()
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        dl = self.dataloader
        if "iteration" in state_dict and hasattr(dl, "iteration"):
            dl.iteration = int(state_dict["iteration"])
        sampler = self._sampler()
        for name, v in dict(state_dict.get("sampler", {})).items():
            if hasattr(sampler, name):
                setattr(sampler, name, v)
        gen = getattr(sampler, "generator", None)
        if isinstance(gen, torch.Generator) and "generator" in state_dict:
            gen.set_state(state_dict["generator"])
        if "stateful" in state_dict and getattr(dl, "use_stateful_dataloader", False):
            dl.load_state_dict(state_dict["stateful"])


class _AcceleratorCounters:
    """``accelerator.step``: the gradient accumulation counter that ``save_state`` keeps."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.accelerator.step = int(state_dict["step"])


def _numbered(name: str, i: int) -> str:
    # The names save_state gives its files: model, model_1, ..., without the extension.
    return name if i == 0 else f"{name}_{i}"


class AcceleratorCheckpointer:
    """Checkpoints an ``Accelerator``'s training state through one :class:`CheckpointManager`.

    Collects, at each :meth:`save`, what ``Accelerator.save_state`` would: the prepared
    models (unwrapped), optimizers, schedulers and dataloaders, the ``GradScaler``, every
    object registered with ``register_for_checkpointing``, ``accelerator.step`` and the RNG
    state of every process (Python, NumPy, torch CPU and CUDA). Stored entries are named
    like ``save_state``'s files: ``model``, ``model_1``, ``optimizer``, ``scheduler``,
    ``dataloader``, ``custom_0``, ``scaler``, ``rng``, ``accelerator``.

    Args:
        accelerator: the ``Accelerator``; prepare and register everything before
            :meth:`resume` or :meth:`save`.
        root: the store (a directory or an fsspec URL).
        keep: retention, as for :class:`CheckpointManager` (``3`` keeps the last three).
        **options: other :class:`CheckpointManager` options (``format``, ``compression``,
            ``async_save``, ``barrier_timeout``, ``storage_options``, ``allow_pickle``).

    Raises:
        ValueError: the accelerator shards its state in its own engine (FSDP version 1,
            DeepSpeed, Megatron-LM), or an option is invalid.
    """

    def __init__(
        self, accelerator: Any, root: str | os.PathLike[str], keep: Retention = None, **options: Any
    ) -> None:
        _refuse_sharded(accelerator)
        self.accelerator = accelerator
        self.manager = CheckpointManager(root, keep, **options)

    def state(self) -> dict[str, Any]:
        """The state one :meth:`save` stores, built from the accelerator's registries now."""
        acc = self.accelerator
        state: dict[str, Any] = {}
        for i, model in enumerate(acc._models):
            state[_numbered("model", i)] = acc.unwrap_model(model)
        for i, opt in enumerate(acc._optimizers):
            state[_numbered("optimizer", i)] = opt
        for i, sched in enumerate(acc._schedulers):
            state[_numbered("scheduler", i)] = sched
        for i, dl in enumerate(acc._dataloaders):
            state[_numbered("dataloader", i)] = _DataLoaderPosition(dl)
        for i, obj in enumerate(acc._custom_objects):
            state[f"custom_{i}"] = obj
        if acc.scaler is not None:
            state["scaler"] = acc.scaler
        state["accelerator"] = _AcceleratorCounters(acc)
        state["rng"] = RNGState()  # last: restoring the others must not move the streams
        return state

    def save(
        self,
        step: int,
        *,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Commit the training state as ``step``; call it on every process (collective).

        A committed ``step`` that fails verification (the one a fallback resumed before) is
        replaced, with a warning.

        Returns:
            The manager's :class:`~ckptstore.SaveHandle`.

        Raises:
            StepExistsError: ``step`` is committed and verifies.
            CommitError: writing failed; the previous checkpoint is intact.
            BarrierTimeout: a process did not join in time.
        """
        _replace_if_corrupt(self.manager, step, skip_if_saved=False)
        state = self.state()
        configs = {k: c for k, v in state.items() if (c := model_config(v)) is not None}
        return self.manager.save(
            step, state, metrics=metrics, metadata=_with_configs(metadata, configs)
        )

    def restore(self, step: int | None = None) -> int:
        """Restore ``step`` (default: the newest that verifies) in place (collective).

        Returns:
            The restored step.

        Raises:
            NoCheckpointError: the store is empty, or nothing verifies.
            StateMismatchError: the checkpoint does not fit the prepared objects (another
                model, other registered objects).
        """
        with self._own_store():
            return self.manager.restore(self.state(), step=step)

    def resume(self) -> int:
        """Restore the newest good checkpoint if there is one (collective).

        Returns:
            0 on an empty store, else the restored step + 1 (the next step to run).

        Raises:
            StateMismatchError: as :meth:`restore`.
        """
        with self._own_store():
            return self.manager.resume(self.state())

    @contextlib.contextmanager
    def _own_store(self) -> Iterator[None]:
        """Say what a missing entry means here: neither method takes ``strict``.

        No ``accelerator`` or ``rng`` entry (every :meth:`save` writes both): another writer's
        store. Another missing entry: the job prepared or registered other objects.
        """
        try:
            yield
        except StateMismatchError as e:
            if not e.missing or not str(e).endswith(STRICT_HINT):
                raise
            said = str(e).removesuffix(STRICT_HINT)
            if {"accelerator", "rng"} & set(e.missing):
                advice = (
                    "it was not saved by AcceleratorCheckpointer: point the checkpointer at "
                    "the store its own save() wrote"
                )
            else:
                advice = (
                    "prepare and register the same objects, in the same order, as the job "
                    "that saved it"
                )
            raise StateMismatchError(
                f"{said}: {advice}", missing=e.missing, unexpected=e.unexpected
            ) from None

    def close(self) -> None:
        """Finish an async save and release the store."""
        self.manager.close()

    def __enter__(self) -> AcceleratorCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- transformers ----------------------------------------------------------------------


def _trainer_metrics(state: Any) -> dict[str, float]:
    """The numbers logged at the current step (``eval_loss``, ``loss``, ...)."""
    out: dict[str, float] = {}
    for entry in getattr(state, "log_history", None) or []:
        if not isinstance(entry, Mapping) or entry.get("step") != state.global_step:
            continue
        for k, v in entry.items():
            if k in ("step", "epoch") or isinstance(v, bool) or not isinstance(v, int | float):
                continue
            if math.isfinite(v):
                out[str(k)] = float(v)
    return out


def _rank_and_world(trainer: Any | None) -> tuple[int, int, bool]:
    """(process index, world size, distributed) as the Trainer names its RNG files."""
    args = getattr(trainer, "args", None)
    if args is not None:
        mode = str(getattr(getattr(args, "parallel_mode", None), "value", ""))
        return int(args.process_index), int(args.world_size), mode == "distributed"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        return torch.distributed.get_rank(), world, world > 1
    return 0, 1, False


def _trainer_rng(stored: Mapping[str, Any], distributed: bool) -> dict[str, Any]:
    """An :class:`RNGState` dict in the layout of the Trainer's ``rng_state.pth``."""
    out: dict[str, Any] = {
        "python": stored["python"],
        "numpy": stored["numpy"],
        "cpu": stored["torch"],
    }
    if torch.cuda.is_available():
        cuda = stored.get("cuda")
        if cuda is None:  # not initialized when saved: its state was the initial one
            cuda = torch.cuda.get_rng_state_all()
        cuda = list(cuda)
        out["cuda"] = cuda if distributed else cuda[min(torch.cuda.current_device(), len(cuda) - 1)]
    return out


class CkptStoreCallback(TrainerCallback):
    """A ``TrainerCallback`` that commits every Trainer save to a ckptstore store.

    See the module docstring for how it saves and how training resumes.

    Args:
        root: the store (a directory or an fsspec URL).
        keep: retention, as for :class:`CheckpointManager`.
        keep_hf_checkpoints: keep the Trainer's own ``checkpoint-N`` directories (twice the
            disk space of checkpoints). By default (``False``) each one is removed once its
            step is committed to the store (never the best model's, which
            ``load_best_model_at_end`` reads); resuming needs only the store.
        resume_dir: where :meth:`resume_checkpoint` writes the Trainer checkpoint it hands
            over (default: the system's temporary directory); it is removed afterwards.
        **options: other :class:`CheckpointManager` options (``format``, ``compression``,
            ``async_save``, ``barrier_timeout``, ``storage_options``, ``allow_pickle``).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        keep: Retention = None,
        *,
        keep_hf_checkpoints: bool = False,
        resume_dir: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> None:
        self.root = root
        self.keep = keep
        self.keep_hf_checkpoints = bool(keep_hf_checkpoints)
        self.resume_dir = resume_dir
        self.options = dict(options)
        self.trainer: Any | None = None
        #: The step the last :meth:`resume_checkpoint` restored (None: started fresh).
        self.resumed_step: int | None = None
        self._manager: CheckpointManager | None = None
        self._last_saved: int | None = None
        #: ``checkpoint-N`` folders of committed steps kept because each was the best model
        #: then: removed once another is (it held every folder of an improving metric).
        self._spared: set[str] = set()

    @property
    def manager(self) -> CheckpointManager:
        """The store's manager, opened on first use (collective under torch.distributed)."""
        if self._manager is None:
            self._manager = CheckpointManager(self.root, self.keep, **self.options)
        return self._manager

    def bind(self, trainer: Any) -> None:
        """Tell the callback its Trainer (:meth:`train` does).

        The Trainer gives the ``GradScaler`` to save, the process index that names the RNG
        files, and the model that a resume checks the stored weights against.
        """
        _refuse_sharded(getattr(trainer, "accelerator", None))
        self.trainer = trainer

    # ---- save ----

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Commit the state the Trainer has just checkpointed, as step ``global_step``."""
        step = int(state.global_step)
        mgr = self.manager
        if not _replace_if_corrupt(mgr, step, skip_if_saved=self._last_saved == step):
            return
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        scheduler = kwargs.get("lr_scheduler")
        if model is None or optimizer is None or scheduler is None:
            msg = "on_save got no model, optimizer or lr_scheduler from the Trainer"
            raise StateMismatchError(msg)
        # The JSON the Trainer writes as trainer_state.json, as plain data.
        trainer_state = json.loads(json.dumps(dataclasses.asdict(state)))
        ckpt: dict[str, Any] = {
            "model": model,
            "optimizer": optimizer,
            "scheduler": scheduler,
            "trainer_state": trainer_state,
        }
        scaler = getattr(getattr(self.trainer, "accelerator", None), "scaler", None)
        if scaler is not None:
            ckpt["scaler"] = scaler
        ckpt["rng"] = RNGState()
        metadata = {"transformers": {"global_step": step, "epoch": state.epoch}}
        config = model_config(model)
        metadata = _with_configs(metadata, {"model": config} if config is not None else {})
        mgr.save(step, ckpt, metrics=_trainer_metrics(state), metadata=metadata)
        self._last_saved = step
        if not self.keep_hf_checkpoints and args.should_save:
            self._remove_hf_checkpoint(args, state, step)

    def _remove_hf_checkpoint(self, args: Any, state: Any, step: int) -> None:
        # The save must be committed before its twin goes; its uploads need not be. Waiting
        # for them too (``wait``) held training at every save until the replica had every
        # step, and raised a failed upload out of the callback: saves go on locally.
        mgr = self.manager
        mgr.wait_save()
        if step not in mgr.steps():
            return  # the async save failed: the twin stays; the next save or close raises
        folder = os.path.abspath(os.path.join(args.output_dir, f"checkpoint-{step}"))
        best = state.best_model_checkpoint
        best = os.path.abspath(best) if best is not None else None
        self._spared.add(folder)
        for done in sorted(self._spared):
            if done == best:
                continue  # the best model's stays (load_best_model_at_end reads it)
            self._spared.discard(done)
            if os.path.isdir(done):
                shutil.rmtree(done, ignore_errors=True)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Refuse a run that starts before the store's newest step, not through a resume.

        ``trainer.train(resume_from_checkpoint=True)`` takes the newest ``checkpoint-N``
        folder left in ``output_dir``; the callback removes each once its step is committed,
        except the best model's, so the Trainer silently went back to the best step and
        failed a few steps later on a step the store holds (``StepExistsError``).

        Raises:
            ConfigError: naming the store's newest step and how to resume from it.
        """
        mgr = self.manager
        start = int(state.global_step)
        if self.resumed_step is not None and self.resumed_step == start:
            return  # resumed through resume_checkpoint: the newest step that verifies
        newest = mgr.coord.leader_value(mgr.latest_step, "hf:begin")
        if newest is not None and newest > start:
            raise ConfigError(
                f"{mgr.storage.describe(newest)} is committed, and this run starts at step "
                f"{start}: resume with ckpt.train(trainer), or `with "
                "ckpt.resume_checkpoint(trainer) as path: trainer.train("
                "resume_from_checkpoint=path)` (trainer.train(resume_from_checkpoint=True) "
                "takes the newest checkpoint-N folder of output_dir, which the callback "
                "removes once its step is committed, the best model's excepted); or give "
                "this run a store of its own"
            )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Finish an async save and release the store."""
        self.close()

    def close(self) -> None:
        """Finish an async save and release the store (it reopens when used again)."""
        if self._manager is not None:
            mgr, self._manager = self._manager, None
            mgr.close()

    # ---- resume ----

    @contextlib.contextmanager
    def resume_checkpoint(self, trainer: Any | None = None) -> Iterator[str | None]:
        """The newest step that verifies, as a Trainer checkpoint directory (collective).

        Yields a temporary directory holding ``trainer_state.json``, the model weights,
        ``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth`` (and ``scaler.pt``) of the
        restored step, for ``trainer.train(resume_from_checkpoint=path)``; ``None`` when the
        store is empty. Every byte was checked against the store's checksums first. With
        ``trainer``, the stored weights are also checked against (and loaded into)
        ``trainer.model``, so a model of another shape fails here, not after a warning.

        Raises:
            NoCheckpointError: the store holds checkpoints but none verifies.
            StateMismatchError: the stored weights do not fit ``trainer.model``.
        """
        if trainer is not None:
            self.bind(trainer)
        trainer = trainer if trainer is not None else self.trainer
        mgr = self.manager
        self.resumed_step = None
        if not mgr.coord.leader_value(lambda: bool(mgr.steps()), "hf:list"):
            yield None
            return
        fsdp2 = _is_fsdp2(trainer)
        keys = ("model", "optimizer", "scheduler", "trainer_state", "rng", "scaler")
        # Under FSDP2 the model and optimizer are restored later, in place, shard by shard
        # (_fsdp2_loads): never as full tensors in every process.
        wanted = keys[2:] if fsdp2 else keys
        stored: dict[str, Any] = dict.fromkeys(wanted)
        step = mgr.restore(stored, strict=False)  # plain targets: filled with the stored data
        missing = [k for k in wanted[:-1] if stored[k] is None]
        if missing:
            raise StateMismatchError(
                f"{mgr.storage.describe(step)} holds no {', '.join(missing)}: it was not saved "
                "by CkptStoreCallback",
                missing=missing,
            )
        if trainer is not None and not fsdp2:
            where = f"{mgr.storage.describe(step)}['model']"
            load_module_state(trainer.model, stored["model"], strict=True, where=where)
        best = stored["trainer_state"].get("best_model_checkpoint")
        if isinstance(best, str) and os.path.isdir(best):
            # Spared by the process before as the best model's folder: removed by this one
            # once another is (it was left behind at every restart).
            self._spared.add(os.path.abspath(best))
        rank, world, distributed = _rank_and_world(trainer)
        path = tempfile.mkdtemp(prefix=f"ckptstore-resume-{step}-", dir=self.resume_dir)
        try:
            _write_trainer_checkpoint(path, stored, rank, world, distributed, fsdp2=fsdp2)
            self.resumed_step = step
            log.info("resuming from %s via %s", mgr.storage.describe(step), path)
            with _fsdp2_loads(mgr, step, path, trainer) if fsdp2 else contextlib.nullcontext():
                yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def train(self, trainer: Any, **kwargs: Any) -> Any:
        """``trainer.train()`` from the newest good checkpoint (fresh on an empty store).

        Returns:
            What ``trainer.train`` returns.
        """
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        with self.resume_checkpoint(trainer) as path:
            return trainer.train(resume_from_checkpoint=path, **kwargs)


def model_config(model: Any) -> dict[str, Any] | None:
    """A ``transformers`` model's config as the JSON ``save_pretrained`` writes (all keys).

    Recorded in each step's metadata (``hf_configs``) so that ``ckptstore export --hf``
    writes the ``config.json`` that ``from_pretrained`` builds the model from. ``None`` for
    a model without one (or one that is not plain JSON: NaN, infinity).
    """
    if not isinstance(model, torch.nn.Module):
        return None
    config = getattr(de_parallel(model), "config", None)
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json):
        return None
    try:
        doc = json.loads(to_json(use_diff=False))
        json.dumps(doc, allow_nan=False)
    except (TypeError, ValueError) as e:
        log.warning("the model's config is not plain JSON (%s); it is not recorded", e)
        return None
    return doc if isinstance(doc, dict) else None


def _with_configs(
    metadata: Mapping[str, Any] | None, configs: Mapping[str, dict[str, Any]]
) -> dict[str, Any]:
    """``metadata`` with the models' configs under ``hf_configs`` (the caller's own wins)."""
    out = dict(metadata or {})
    if configs:
        out.setdefault(HF_CONFIGS_KEY, dict(configs))
    return out


def _is_fsdp2(trainer: Any | None) -> bool:
    accelerator = getattr(trainer, "accelerator", None)
    return getattr(accelerator, "is_fsdp2", False) is True


def _ours(input_dir: Any, path: str) -> bool:
    """Whether ``input_dir`` is (a folder of) the resume checkpoint at ``path``."""
    if not isinstance(input_dir, (str, os.PathLike)):
        return False
    here: str = os.path.realpath(os.fspath(input_dir))
    top = os.path.realpath(path)
    return here == top or os.path.dirname(here) == top


def _optimizes(optimizer: Any, model: Any) -> bool:
    """Whether ``optimizer`` steps exactly the parameters of ``model`` (both set up)."""
    groups = getattr(optimizer, "param_groups", None)
    if not groups or not isinstance(model, torch.nn.Module):
        return False
    owned = {id(p) for p in model.parameters()}
    params = [p for g in groups for p in g["params"]]
    return bool(params) and all(id(p) in owned for p in params)


@contextlib.contextmanager
def _fsdp2_loads(mgr: CheckpointManager, step: int, path: str, trainer: Any) -> Iterator[None]:
    """Serve the Trainer's FSDP loads of the resume checkpoint ``path`` from the store.

    While it is open, under FSDP2, the Trainer's FSDP model and optimizer loads of ``path``
    restore ``step`` of ``mgr`` in place instead (collective, as the Trainer's own loads
    are): each process reads the byte ranges its shards overlap, every block checked,
    whatever world size saved the step. The optimizer's state is keyed by parameter name,
    so it is restored with its model: at the model's load when the Trainer's optimizer
    already steps that model's parameters (one read of the step), else at its own load
    (the model's bytes are then read a second time).

    The Trainer calls ``load_fsdp_model`` and ``load_fsdp_optimizer`` (accelerate's, bound
    in ``transformers.trainer``) once the model is sharded and the optimizer built; for any
    other checkpoint they are accelerate's own.
    """
    import transformers.trainer

    hf_trainer: Any = transformers.trainer
    load_model, load_optimizer = hf_trainer.load_fsdp_model, hf_trainer.load_fsdp_optimizer
    restored: list[int] = []  # ids of the optimizers restored with their model

    def fsdp_model(
        plugin: Any, accelerator: Any, model: Any, input_dir: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if not _ours(input_dir, path):
            return load_model(plugin, accelerator, model, input_dir, *args, **kwargs)
        optimizer = getattr(trainer, "optimizer", None)
        if _optimizes(optimizer, model):
            mgr.restore({"model": model, "optimizer": optimizer}, step)
            restored.append(id(optimizer))
        else:
            mgr.restore({"model": model}, step)
        return None

    def fsdp_optimizer(
        plugin: Any,
        accelerator: Any,
        optimizer: Any,
        model: Any,
        input_dir: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if not _ours(input_dir, path):
            return load_optimizer(plugin, accelerator, optimizer, model, input_dir, *args, **kwargs)
        if id(optimizer) not in restored:
            mgr.restore({"model": model, "optimizer": optimizer}, step)
        return None

    hf_trainer.load_fsdp_model = fsdp_model
    hf_trainer.load_fsdp_optimizer = fsdp_optimizer
    try:
        yield
    finally:
        hf_trainer.load_fsdp_model = load_model
        hf_trainer.load_fsdp_optimizer = load_optimizer


def _write_trainer_checkpoint(
    path: str,
    stored: Mapping[str, Any],
    rank: int,
    world: int,
    distributed: bool,
    *,
    fsdp2: bool = False,
) -> None:
    """Lay ``stored`` out as the files ``Trainer._load_from_checkpoint`` & co. read.

    With ``fsdp2``, the model and optimizer are two folders named as the Trainer's FSDP
    checkpoints name them, holding only a marker: :func:`_fsdp2_loads` serves their loads.
    """
    with open(os.path.join(path, _TRAINER_STATE), "w", encoding="utf-8") as f:
        f.write(json.dumps(stored["trainer_state"], indent=2, sort_keys=True) + "\n")
    if fsdp2:
        for folder in (_FSDP_MODEL_DIR, _FSDP_OPTIMIZER_DIR):
            os.makedirs(os.path.join(path, folder))
            with open(os.path.join(path, folder, _FSDP_MARKER), "w", encoding="utf-8") as f:
                f.write(json.dumps({"ckptstore": path}) + "\n")
    else:
        # torch.save keeps tied weights tied; the Trainer reads these with weights_only=True.
        torch.save(stored["model"], os.path.join(path, _WEIGHTS))
        torch.save(stored["optimizer"], os.path.join(path, _OPTIMIZER))
    torch.save(stored["scheduler"], os.path.join(path, _SCHEDULER))
    if stored.get("scaler") is not None:
        torch.save(stored["scaler"], os.path.join(path, _SCALER))
    name = "rng_state.pth" if world <= 1 else f"rng_state_{rank}.pth"
    torch.save(_trainer_rng(stored["rng"], distributed), os.path.join(path, name))

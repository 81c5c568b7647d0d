"""torchtitan integration: its checkpointer, saving every step through ckptstore.

:class:`CkptStoreCheckpointManager` is torchtitan's own DCP ``CheckpointManager`` (0.3:
``torchtitan.components.checkpointer``) with its storage replaced: each save is a
``dcp.save``/``dcp.async_save`` of the very state torchtitan builds, through
:class:`~ckptstore.dcp.CkptStoreWriter`, so it commits as a ckptstore step (each rank its
own DTensor shards, CRC32C per block, manifest last, all or nothing), and each load is a
``dcp.load`` through :class:`~ckptstore.dcp.CkptStoreReader`, so every byte is checked before
it reaches the model. Everything else is torchtitan's code, unchanged: when to save
(``interval``, ``enable_first_step_checkpoint``, the last step), what to save (the flattened
model, the ``OptimizersContainer``, the LR schedulers, the dataloader, the train state),
``load_step``, ``exclude_from_loading``, ``initial_load_*``, the seed checkpoint.

Switching is a config change. torchtitan's ``Trainer.Config.checkpoint`` is typed as the
checkpoint-manager contract (``BaseCheckpointManager.Config``) and the trainer builds
whatever manager the config belongs to, so in a config registry (or a copy of one)::

    from ckptstore.integrations.torchtitan import CkptStoreCheckpointManager

    config = Trainer.Config(
        ...,
        checkpoint=CkptStoreCheckpointManager.Config(
            enable=True, folder="checkpoint", interval=500, keep_latest_k=3,
            async_mode="async", last_save_in_hf=True, export_dtype="bfloat16",
        ),
    )

or, on an existing config object, ``config.checkpoint =
CkptStoreCheckpointManager.from_config(config.checkpoint)``, which keeps every field of a
stock ``CheckpointManager.Config``.

How torchtitan's options map:

- ``folder`` (under ``dump_folder``) is the store's root: ``steps()``, ``ckptstore ls``,
  ``verify``, ``export`` and ``CheckpointManager(folder).restore`` all read it. Step ``N``
  lives in ``folder/step-00000000000N`` (ckptstore's name) instead of ``folder/step-N``.
- ``keep_latest_k`` is the store's retention (``keep=keep_latest_k``, ``0``: keep all),
  applied by ckptstore when a step commits, so a step is only deleted once a newer one is
  committed; torchtitan's purge thread is not started. (torchtitan's config still refuses
  ``keep_latest_k=1``; ckptstore would keep the last committed step safe with it.)
- ``async_mode="async"``: ``dcp.async_save`` in a thread, as torchtitan does, the state first
  copied to CPU; ckptstore writes and commits in that thread and ``maybe_wait_for_saving``
  waits for the commit. ``"async_with_pinned_mem"``: the copy itself runs in the background
  too (``maybe_wait_for_staging`` waits for it), into pinned memory where CUDA is available.
  Both use threads, where torchtitan's pinned mode uses a separate process
  (``AsyncCheckpointerType.PROCESS``): ckptstore's writer holds the store's writer lock and
  its process group, which cannot move to another process.
- ``last_save_model_only`` and ``export_dtype``: as in torchtitan, the last step keeps the
  model alone, in ``export_dtype``, as a ckptstore step. ``last_save_in_hf``: that step holds
  ``{"model": sd_adapter.to_hf(...)}`` (the Hugging Face names and layout torchtitan's
  adapter gives) and is then exported as a Hugging Face directory in ``hf_folder/step-N``
  (under ``dump_folder``), what ``ckptstore export ROOT --step N --hf OUT`` writes:
  ``model.safetensors``, or shards plus ``model.safetensors.index.json`` (5 GB shards; the
  adapter's ``fqn_to_index_mapping`` is not followed), consolidated from every rank's
  shards, with the ``config.json`` of ``hf_assets_path`` when there is one. It can be
  exported again any time later from the store.
- Loading (``load_step``, ``-1`` for the newest committed step) reads the store. With
  ``-1`` (a restarted job) a newest step that does not verify is passed over, with a
  warning, for the newest older one that does, as ``CheckpointManager.resume`` does, and
  the next save of that step replaces it; an explicit ``load_step`` loads that step or
  raises. An
  ``initial_load_path`` may be a ckptstore store (its newest step) or one of its step
  directories, besides torchtitan's own DCP and Hugging Face directories. A ``folder`` that
  holds torchtitan's own ``step-N`` DCP checkpoints (a run switched to ckptstore midway)
  resumes from the newest of them when it is newer than every ckptstore step; later saves go
  to the store, and the old directories are left as they are.

Also: ``barrier_timeout`` bounds every distributed wait of a save and of DCP's own
collectives (they run on ckptstore's gloo group), and ``replica`` (a second tier, e.g.
``s3://bucket/run``) is ckptstore's option of the same name. There is no ``compression``:
ranks read byte ranges of DTensor shards, which a compressed file cannot serve, so
ckptstore refuses zstd for the sharded state torchtitan saves.

The DCP item names are torchtitan's (``tok_embeddings.weight``,
``optimizer.state.layers.0.w.exp_avg``, ``train_state.step``, ...), so ``ckptstore export
--dcp`` of a step gives a directory torchtitan's stock checkpointer loads. Requires
torchtitan 0.3 (its checkpointer package) and torch.distributed.checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save, save
from torchtitan.components.checkpointer.base import MODEL
from torchtitan.components.checkpointer.dcp import AsyncMode
from torchtitan.components.checkpointer.dcp import CheckpointManager as _TitanManager
from torchtitan.tools import filesystem
from torchtitan.tools.utils import GarbageCollection

from .._log import logger
from ..dcp import CkptStoreReader, CkptStoreWriter, _id_step
from ..dist import Coordinator
from ..errors import ConfigError, IntegrityError, ManifestError
from ..layout import parse_step_dirname, step_dirname
from ..manager import CheckpointManager
from ..ops.stores import open_store

__all__ = ["CkptStoreCheckpointManager"]


class CkptStoreCheckpointManager(_TitanManager):  # type: ignore[misc]  # torchtitan is untyped
    """torchtitan's ``CheckpointManager``, saving and loading through a ckptstore store.

    Built by torchtitan's trainer from :class:`CkptStoreCheckpointManager.Config` (see the
    module), with the arguments of torchtitan's own manager. Under torch.distributed the
    constructor is collective (it opens the store on every rank), as is every save and load.

    Attributes:
        store: the :class:`~ckptstore.CheckpointManager` of ``folder`` (``None`` when
            checkpointing is disabled or ``load_only``; a ``load_only`` manager's loads run
            on a gloo group of ckptstore's own, bounded by ``barrier_timeout``).
        hf_folder: where ``last_save_in_hf`` exports the last step.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(_TitanManager.Config):  # type: ignore[misc]
        """torchtitan's checkpoint options, and ckptstore's own."""

        barrier_timeout: float = 600.0
        """Seconds for every distributed wait of a save or load (it must cover the
        longest save)."""

        replica: str | None = None
        """A second tier (an fsspec URL, e.g. ``s3://bucket/run``): each committed step is
        uploaded there in the background."""

        hf_folder: str = "hf"
        """Where ``last_save_in_hf`` exports the last step (``hf_folder/step-N``), relative
        to the trainer's dump folder."""

    store: CheckpointManager | None
    hf_folder: str
    _newest: tuple[int, list[int]] | None = None
    purge_thread: threading.Thread | None
    _saving_last: bool = False

    @classmethod
    def from_config(cls, config: Any, **ckptstore_options: Any) -> Config:
        """A :class:`Config` holding every field of torchtitan's ``config``.

        ``ckptstore_options`` sets the others (``barrier_timeout``,
        ``replica``, ``hf_folder``).
        """
        own = {f.name for f in dataclasses.fields(cls.Config)}
        given = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        kwargs = {k: v for k, v in given.items() if k in own and not k.startswith("_")}
        kwargs.update(ckptstore_options)
        return cls.Config(**kwargs)

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        self.store = None
        self._load_coord: Coordinator | None = None
        super().__init__(
            config,
            dataloader=dataloader,
            model_parts=model_parts,
            optimizers=optimizers,
            lr_schedulers=lr_schedulers,
            states=states,
            sd_adapter=sd_adapter,
            base_folder=base_folder,
        )
        if not self.enable:
            return
        # Retention is the store's: torchtitan's purge thread (started when
        # keep_latest_k > 0) is stopped before it is given anything.
        if self.purge_thread is not None:
            self.purge_queue.put(None)
            self.purge_thread.join()
            self.purge_thread = None
        self.hf_folder = filesystem.join(base_folder, config.hf_folder)
        if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            # torchtitan builds its stager at the first save unless there is one: this one
            # stages in a background thread, pinned (and non-blocking) where CUDA is.
            cuda = torch.cuda.is_available()
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=cuda,
                )
            )
        if not self.load_only:
            self.store = CheckpointManager(
                self.folder,
                keep=config.keep_latest_k or None,
                barrier_timeout=config.barrier_timeout,
                replica=config.replica,
            )
        else:
            # No store is opened (nothing is saved), but DCP's load still runs collectives:
            # on a gloo group of ckptstore's own, bounded by barrier_timeout as a save's
            # are, not on the default group (whose timeout is torch's: 30 minutes).
            self._load_coord = Coordinator(config.barrier_timeout)

    # ---- where steps are --------------------------------------------------------------

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        """Step ``step``'s directory.

        ckptstore's, or torchtitan's own ``step-N`` where only that one exists (a run
        switched to ckptstore midway).
        """
        folder = folder or self.folder
        ours = filesystem.join(folder, step_dirname(step))
        theirs = filesystem.join(folder, f"step-{step}")
        if not filesystem.isdir(ours) and filesystem.isdir(theirs):
            return str(theirs)
        return str(ours)

    def _find_load_step(self, folder: str = "") -> int:
        """The newest step in ``folder``, -1 if there is none.

        The newest committed step of the store, or torchtitan's newest ``step-N`` DCP
        checkpoint there if that is newer.
        """
        folder = folder or self.folder
        if self.store is not None and folder == self.folder:
            steps = self.store.steps()
        else:
            try:
                steps = open_store(folder).list_steps()
            except Exception:  # not a store (yet): torchtitan's own folders only
                steps = []
        ours = steps[-1] if steps else -1
        theirs = int(super()._find_load_step(folder))
        if theirs > ours:
            logger.warning(
                "%s: resuming from torchtitan's own DCP checkpoint step-%d (newer than any "
                "ckptstore step); later steps are saved through ckptstore",
                folder,
                theirs,
            )
            return theirs
        # Asked for the newest step (load_step=-1): dcp_load may fall back to older ones.
        self._newest = (ours, [s for s in reversed(steps) if s >= 1]) if ours >= 1 else None
        return ours

    def _purge_stale_checkpoints(self) -> None:
        """Nothing: the store's retention (``keep_latest_k``) runs as each step commits."""

    # ---- save -------------------------------------------------------------------------

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        """Save ``state_dict`` as the step ``checkpoint_id`` names, through ckptstore.

        Returns what torchtitan's ``dcp_save`` returns: ``None`` (synchronous), DCP's
        ``Future`` (``async``) or its ``AsyncSaveResponse`` (``async_with_pinned_mem``).
        """
        if self.store is None:
            raise ConfigError("CkptStoreCheckpointManager: load_only, nothing is saved")
        step = _id_step(checkpoint_id)
        if step is None:
            raise ConfigError(f"CkptStoreCheckpointManager: no step in {checkpoint_id!r}")
        meta: dict[str, Any] = {"saved_by": "torchtitan", "async_mode": async_mode.value}
        state = state_dict
        if to_hf:
            if self.sd_adapter is None:
                raise ConfigError("last_save_in_hf needs the model's state dict adapter")
            state = {MODEL: self.sd_adapter.to_hf(state_dict)}
            meta["hf"] = True
        if self._saving_last and self.last_save_model_only:
            meta["model_only"] = True
            meta["dtype"] = str(self.export_dtype).removeprefix("torch.")
        writer = CkptStoreWriter(self.store, metadata=meta)
        target = posixpath.join(self.store.root.rstrip("/"), step_dirname(step))
        ret: Any = None
        if async_mode == AsyncMode.DISABLED:
            save(
                state,
                checkpoint_id=target,
                storage_writer=writer,
                process_group=writer.process_group,
            )
        else:
            ret = async_save(
                state,
                checkpoint_id=target,
                storage_writer=writer,
                process_group=writer.process_group,
                async_stager=(
                    self.stager if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM else None
                ),
            )
        if to_hf:
            self._export_hf(step)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def _save_last_step(self, curr_step: int) -> None:
        """Torchtitan's last save, marked as such in the step's manifest metadata.

        Model only, in ``export_dtype``, in Hugging Face names with ``last_save_in_hf``.
        """
        self._saving_last = True
        try:
            super()._save_last_step(curr_step)
        finally:
            self._saving_last = False

    def _export_hf(self, step: int) -> None:
        """Rank 0 writes step ``step``'s ``model`` as a Hugging Face directory.

        Every rank returns once it is there, or raises rank 0's error.
        """
        from ..ops.export import export_hf_step

        assert self.store is not None
        store = self.store
        out = filesystem.join(self.hf_folder, f"step-{step}")

        def export() -> None:
            if not filesystem.is_remote(self.hf_folder):
                os.makedirs(self.hf_folder, exist_ok=True)
            assets = getattr(self.sd_adapter, "hf_assets_path", None)
            config = os.path.join(assets, "config.json") if assets else None
            res = export_hf_step(
                store.root,
                step,
                out,
                key=MODEL,
                storage_options=None,
                config=config if config and os.path.isfile(config) else None,
            )
            logger.info("exported step %d as Hugging Face safetensors to %s", step, res.out)

        # Rank 0 exports; its error (an interrupt included) is raised on every rank at once.
        store.coord.leader_value(export, "torchtitan:export-hf", step)

    # ---- load -------------------------------------------------------------------------

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        """Load ``checkpoint_id`` into ``state_dict``.

        A ckptstore step through :class:`~ckptstore.dcp.CkptStoreReader` (every byte
        checked); anything else (a Hugging Face directory, torchtitan's own DCP directory)
        as torchtitan does.
        """
        where = None if from_hf else _store_step(checkpoint_id)
        if where is None:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        root, step = where
        coord = self.store.coord if self.store is not None else self._load_coord
        group = coord.group if coord is not None else None
        newest, self._newest = self._newest, None
        # The newest step was asked for: one that does not verify is passed over for the
        # newest older one that does, as CheckpointManager.resume does (every rank sees the
        # same failure: DCP raises its CheckpointException on every rank). An explicit
        # load_step loads that step or raises.
        tries = newest[1] if newest is not None and step == newest[0] else [step]
        tried: list[str] = []
        for i, s in enumerate(tries):
            try:
                reader = CkptStoreReader(root, step=s)
                dcp_load(state_dict, storage_reader=reader, process_group=group)
            except CheckpointException as e:
                if not _corrupt(e) or i + 1 == len(tries):
                    if tried:
                        raise IntegrityError(
                            f"{root}: no step verifies; tried newest first: "
                            + " | ".join([*tried, f"step {s}: {_first_line(e)}"])
                        ) from e
                    raise
                tried.append(f"step {s}: {_first_line(e)}")
                logger.warning(
                    "%s: step %d does not verify (%s); loading step %d, the next older one",
                    root,
                    s,
                    _first_line(e),
                    tries[i + 1],
                )
                continue
            if s != step and step is not None and self.store is not None:
                self.store._session.known_bad.add(step)  # a save of it replaces it
            break
        # As torchtitan: the model's entries are flattened into state_dict.
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    # ---- lifecycle --------------------------------------------------------------------

    def _close(self) -> None:
        """Wait for the save in flight, stop torchtitan's threads, close the store.

        A failed save in flight is logged and raised once the rest is closed, as
        torchtitan's own ``close`` raises it: a job that ends on a save that did not commit
        does not exit 0. (``CheckpointException`` is a ``BaseException``: caught as an
        ``Exception`` it skipped the log, torchtitan's clean-up and the store's close.)
        """
        future = getattr(self, "save_future", None)
        error: BaseException | None = None
        if future is not None:
            self.save_future = None
            try:
                future.result()
            except (Exception, CheckpointException) as e:
                logger.error("the last torchtitan checkpoint save failed: %s", e)
                error = e
        try:
            super()._close()
        finally:
            store = getattr(self, "store", None)
            coord = getattr(self, "_load_coord", None)
            self._load_coord = None
            if coord is not None:
                coord.close()
            if store is not None:
                self.store = None
                store.close()
        if error is not None:
            raise error


def _corrupt(e: CheckpointException) -> bool:
    """Whether DCP's failure is a step that does not verify (not, say, a shape mismatch)."""
    causes = [v[0] if isinstance(v, tuple) else v for v in e.failures.values()]
    return bool(causes) and all(isinstance(c, IntegrityError | ManifestError) for c in causes)


def _first_line(e: CheckpointException) -> str:
    for v in e.failures.values():
        cause = v[0] if isinstance(v, tuple) else v
        return str(cause).splitlines()[0] if str(cause) else type(cause).__name__
    return str(e).splitlines()[0]


def _store_step(checkpoint_id: str) -> tuple[str, int | None] | None:
    """Where ``checkpoint_id`` is in a ckptstore store, as ``(root, step)``.

    ``step`` is ``None`` for a store (its newest step); the result is ``None`` for anything
    that is neither a store nor one of its step directories.
    """
    path = checkpoint_id.rstrip("/")
    step = parse_step_dirname(posixpath.basename(path))
    if step is not None and filesystem.isfile(filesystem.join(path, "manifest.json")):
        return posixpath.dirname(path), step
    if CkptStoreReader.validate_checkpoint_id(path):
        return path, None
    return None

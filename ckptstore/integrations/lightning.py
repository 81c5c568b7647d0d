"""Lightning integration: every checkpoint Lightning writes, committed atomically and verified.

Usage::

    from ckptstore.integrations.lightning import CkptStoreIO

    trainer = Trainer(
        plugins=[CkptStoreIO()],
        callbacks=[ModelCheckpoint(dirpath="ckpt", monitor="val_loss", save_top_k=2,
                                   save_last=True)],
    )
    trainer.fit(model, ckpt_path="last")   # resumes; skips a corrupt last.ckpt

**What a checkpoint path becomes.** Lightning names checkpoints like files
(``epoch=1-step=20.ckpt``, ``last.ckpt``), and its own code looks at those paths:
``ModelCheckpoint`` asks whether they exist (its version counter, top-k bookkeeping), and
``fit(ckpt_path="last")`` picks the newest ``last*.ckpt`` in the checkpoint directory by
modification time. So each path ``P`` stays a real entry at ``P``: a directory that is a
ckptstore store, holding one committed checkpoint per save to ``P``::

    ckpt/
      epoch=1-step=20.ckpt/         a store
        step-000000000020/          manifest.json, state.json, state_dict.safetensors, ...
      last.ckpt/
        step-000000000030/          the newest save to last.ckpt; older ones are pruned

- Saving to ``P`` commits a new step inside ``P``: ``max(global_step, newest step + 1)``, so
  the payloads are named by the training step and the newest step is always the latest save,
  also when a run restarts from scratch into the same directory. The previous version is
  pruned only after the new one is committed (``keep=1``; ``keep=n`` keeps ``n`` versions).
  A crash at any moment leaves the previous version intact and the newest.
- A ``P`` that does not exist yet is written as a whole store into a hidden sibling
  (``.ckptstore-tmp-<digest of P's name>-<uuid>``) and renamed into place, so ``P``
  appears complete or not at all and Lightning never finds a ``P`` that cannot load.
- A ``P`` that is a regular file (``torch.save`` by an earlier run) or a symlink (what
  ``ModelCheckpoint(save_last="link")`` makes) is replaced: the new store is completed aside,
  then the old entry is renamed away and the new one in. A crash between those two renames
  leaves ``P`` absent, never half-written; a link's target is never written through.
- ``remove_checkpoint(P)`` (top-k pruning) renames ``P`` to a hidden sibling, so it vanishes
  whole at once, then deletes it. A symlink is unlinked; its target stays.

**Loading** checks the manifest and the size and CRC32C of every file before decoding it, and
reads payloads with safetensors (or ``torch.load(weights_only=True)``); nothing is unpickled
unless ``allow_pickle=True`` and Lightning did not ask for ``weights_only=True``. A path whose
name starts with ``last`` (what ``save_last`` writes, and what ``ckpt_path="last"`` resolves
to) means "the newest state of this run": when its newest version does not verify, the plugin
logs a warning and loads instead the newest checkpoint that does: an older version in the same
store (``keep > 1``), else the newest other ``*.ckpt`` store in the same directory (by the
manifest's creation time, then global step). Any other path is loaded exactly: if it is corrupt,
:class:`~ckptstore.IntegrityError` says which file and why. A lone file at ``P`` (a
``torch.save`` checkpoint of an earlier run) loads after :func:`ckptstore.verify_file` has
checked its zip CRCs, with ``torch.load(weights_only=True)``.

**Metrics.** The value of each metric a ``ModelCheckpoint`` monitors goes into the manifest's
metrics (``ckptstore ls`` shows it): a top-k checkpoint gets the value it was ranked by; a
``last.ckpt`` gets it when a top-k checkpoint of the same global step was just saved, and
none otherwise (the callback's ``current_score`` would then be an earlier step's).

**What is stored.** Tensors and plain data as ckptstore stores them (types exact: int keys of
optimizer state, tuples, ``OrderedDict`` with its ``_metadata``, ``inf``). A few Python types
that Lightning checkpoints carry are converted losslessly and rebuilt on load, never pickled:
``argparse.Namespace`` and Lightning's ``AttributeDict`` (hyper-parameters), ``set``,
``frozenset`` and ``pathlib`` paths. Anything else (OmegaConf hyper-parameters, custom
objects) raises :class:`~ckptstore.UnsafeCheckpointError` naming the checkpoint and the key,
unless ``CkptStoreIO(allow_pickle=True)``: a pickle runs code when loaded, so only for stores
whose every reader trusts every writer.

**Distributed.** Lightning calls ``save_checkpoint`` and ``remove_checkpoint`` on global rank
0 only (``Strategy.save_checkpoint``: ``if self.is_global_zero``) and ``load_checkpoint`` on
every rank. The plugin's managers are therefore never collective
(``CheckpointManager(distributed=False)``): rank 0 writes alone while the other ranks wait
at Lightning's own barrier, and each rank reads and verifies the files itself (shared storage).
A fallback is chosen on each rank from the same files, so ranks land on the same checkpoint.

**Sharded strategies.** ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` and tensor
parallelism in ``configure_model``) never calls a ``CheckpointIO``: it saves with
``torch.distributed.checkpoint``. Given this plugin, its ``save_checkpoint`` and
``load_checkpoint`` go through ckptstore instead (Lightning's own code with any other
``checkpoint_io``; nothing else to change in the ``Trainer``)::

    trainer = Trainer(strategy=ModelParallelStrategy(), plugins=[CkptStoreIO()], devices=8)

- Saving to ``P`` is collective (Lightning calls it on every rank): the checkpoint, its model
  and optimizer state as this rank's DTensor shards, is committed as a new step of the store
  ``P`` by ``CheckpointManager.save`` on every rank. Each rank writes its own shards
  (``_shards.rankNNNNN.safetensors``, a CRC32C per block), rank 0 the rest, and the step
  exists only once every rank's files are in: the same store, step numbers, pruning and
  hidden-sibling rename as above (rank 0 renames), with no DCP ``.distcp`` or pickled
  ``.metadata`` anywhere. ``P`` must be on storage every rank sees (shared disk), and local:
  a URL raises :class:`~ckptstore.ConfigError`.
- Loading (``fit(ckpt_path=...)``, ``"last"`` included) is collective too: every rank builds
  its model and optimizer state dicts as *this* job shards them and ``restore`` fills them,
  each rank reading only the byte ranges its shards overlap, every block checked: a
  checkpoint saved by 2 ranks resumes on 1, 3 or 300. A corrupt ``P`` raises
  :class:`~ckptstore.IntegrityError` on every rank; a ``last*`` path falls back, on every
  rank alike, to an older version, else to the newest other ``*.ckpt`` beside it that loads.
  The returned checkpoint holds no ``state_dict``/``optimizer_states`` (already loaded into
  the model and optimizers, as Lightning's own sharded load does).
- In one process, ``CkptStoreIO().load_checkpoint(P)`` gives the whole checkpoint with full
  tensors (consolidation); ``ckptstore verify`` and ``ckptstore ls`` read ``P``.
- Refused when the ``Trainer`` is built (:class:`~ckptstore.ConfigError`):
  ``ModelParallelStrategy(save_distributed_checkpoint=False)`` (Lightning gathers the full
  state on rank 0 and then refuses to save into an existing directory, and loads files with
  ``torch.load``) and ``CkptStoreIO(compression="zstd")`` (shards are read by byte range).
- A subclass of ``ModelParallelStrategy`` that overrides ``save_checkpoint`` or
  ``load_checkpoint`` without calling ``super()`` bypasses the plugin, as it would bypass
  Lightning's own code.

``FSDPStrategy(state_dict_type="sharded")`` (FSDP version 1) is served the same way: FSDP1's
sharded state dicts hold ``ShardedTensor``s chunked along dim 0, which are saved as the
equivalent ``Shard(0)`` DTensors (the same memory) and restored into them (any other layout
raises :class:`~ckptstore.ConfigError`); its default ``state_dict_type="full"`` (the full
state gathered on rank 0, loaded with ``torch.load``) is refused when the ``Trainer`` is
built. ``DeepSpeedStrategy`` saves and loads through the DeepSpeed engine, whatever
``checkpoint_io`` holds, and is not served: handing it the plugin raises
:class:`~ckptstore.ConfigError` when the ``Trainer`` is built, instead of a run whose
checkpoints silently never went through ckptstore.

**Not covered.** ``LightningModule.load_from_checkpoint`` reads with ``torch.load`` itself,
bypassing ``CheckpointIO``: use ``trainer.validate/test/predict(ckpt_path=...)``, or
``model.load_state_dict(CkptStoreIO().load_checkpoint(path)["state_dict"])``. Lightning's
``AsyncCheckpointIO`` removes checkpoints while a save may still run; wrap with care. Object
stores (``s3://``, any fsspec URL) work, without the hidden-sibling rename (a step becomes
visible when its manifest is put) and without the fallback to other checkpoints.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import hashlib
import os
import pathlib
import re
import shutil
import uuid
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from .._log import logger as log
from ..errors import (
    CkptStoreError,
    CommitError,
    ConfigError,
    ConfigTypeError,
    IntegrityError,
    ManifestError,
    MissingDependencyError,
    NoCheckpointError,
    PathNotFoundError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from ..manager import CheckpointManager
from ..ops.single import fsync_path
from ..ops.verify import verify_file
from ..state.capture import kind_of

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.utilities.data import AttributeDict
except ImportError:  # the standalone packages (pytorch_lightning + lightning_fabric)
    try:
        from lightning_fabric.plugins.io.checkpoint_io import (  # type: ignore[assignment]
            CheckpointIO,
        )
        from lightning_fabric.utilities.data import AttributeDict  # type: ignore[assignment]
    except ImportError as e:
        msg = "ckptstore.integrations.lightning needs Lightning: pip install 'ckptstore[lightning]'"
        raise MissingDependencyError(msg) from e

__all__ = ["CkptStoreIO"]

#: Marks a value the plugin converted; the rest of the dict says how to rebuild it.
_TAG = "__ckptstore_lightning__"
#: ModelCheckpoint._find_last_checkpoints matches stems with ``re.match`` on this pattern:
#: every name starting with "last" is a "last" checkpoint to Lightning, and so to us.
_LAST_RE = re.compile(r"last(-(\d+))?")
_PATH_TYPES: dict[str, type[pathlib.PurePath]] = {
    c.__name__: c
    for c in (
        pathlib.PurePath,
        pathlib.PurePosixPath,
        pathlib.PureWindowsPath,
        pathlib.Path,
        pathlib.PosixPath,
        pathlib.WindowsPath,
    )
}
_MAX_DEPTH = 200
_LOCAL_PROTOCOLS = ("", "file", "local")
_FORMATS = ("safetensors", "torch")


class CkptStoreIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through ckptstore: atomic, checksummed, verified.

    See the module docstring for what each checkpoint path becomes on disk.

    Args:
        keep: versions kept in each checkpoint path (``last.ckpt`` is saved again and again);
            the newest and the newest that verifies are never pruned.
        format: payload format, ``"safetensors"`` or ``"torch"``.
        compression: ``None`` or ``"zstd"``.
        allow_pickle: store objects other than tensors, plain data and the types the plugin
            converts (``Namespace``, ``AttributeDict``, sets, paths) with pickle, and load
            them. Off by default: loading a pickle can run code.
        fallback: when a local ``last*.ckpt`` does not verify, load the newest checkpoint
            that does (an older version, else another ``*.ckpt`` in the same directory) with
            a warning.
        storage_options: passed to fsspec for checkpoint paths that are URLs.

    Raises:
        ValueError: an argument is invalid; the message names it.
    """

    def __init__(
        self,
        *,
        keep: int = 1,
        format: str = "safetensors",
        compression: str | None = None,
        allow_pickle: bool = False,
        fallback: bool = True,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            msg = f"keep must be an int >= 1 (versions kept per checkpoint path), got {keep!r}"
            raise ConfigError(msg)
        if format not in _FORMATS:
            msg = f"format must be 'safetensors' or 'torch', got {format!r}"
            raise ConfigError(msg)
        if compression not in (None, "zstd"):
            msg = f"compression must be None or 'zstd', got {compression!r}"
            raise ConfigError(msg)
        self.keep = keep
        self.format = format
        self.compression = compression
        self.allow_pickle = bool(allow_pickle)
        self.fallback = bool(fallback)
        self.storage_options = dict(storage_options) if storage_options else None
        #: monitor -> (global step, value) of the last top-k save seen (see _monitored).
        self._scores: dict[str, tuple[int | None, float]] = {}
        _guard_strategies()  # the Trainer package is imported by now, whichever it is

    def __repr__(self) -> str:
        return (
            f"CkptStoreIO(keep={self.keep}, format={self.format!r}, "
            f"compression={self.compression!r}, allow_pickle={self.allow_pickle})"
        )

    # ---- save ------------------------------------------------------------------------

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike[str],
        storage_options: Any | None = None,
    ) -> None:
        """Commit ``checkpoint`` as the newest version of ``path`` (a store directory).

        Args:
            checkpoint: the dict Lightning built (``Trainer.save_checkpoint``).
            path: where Lightning wants it, e.g. ``.../epoch=1-step=20.ckpt``.
            storage_options: not supported (give fsspec options to the constructor).

        Raises:
            TypeError: ``storage_options`` was passed, or ``checkpoint`` is not a mapping.
            UnsafeCheckpointError: the checkpoint holds an object that needs pickle.
            CommitError: writing failed; the previous version of ``path`` is intact.
        """
        if storage_options is not None:
            msg = (
                f"{type(self).__name__} takes no storage_options in save_checkpoint; pass "
                "fsspec options as CkptStoreIO(storage_options=...)"
            )
            raise ConfigTypeError(msg)
        if not isinstance(checkpoint, Mapping):
            msg = f"checkpoint must be a dict, got {type(checkpoint).__name__}"
            raise ConfigTypeError(msg)
        where = os.fspath(path)
        metrics = self._monitored(checkpoint, where)
        state = _encode_checkpoint(checkpoint)
        global_step = _int_or(checkpoint.get("global_step"), 0)
        metadata = {
            "lightning": {
                "global_step": global_step,
                "epoch": _int_or(checkpoint.get("epoch"), None),
                "rank": _global_rank(),
                # ModelCheckpoint(save_weights_only=True): no optimizer or loop state to
                # resume a fit from (the fall-back of a corrupt last.ckpt passes over it).
                "weights_only": "optimizer_states" not in checkpoint,
            }
        }
        try:
            local = _local_path(where)
            if local is None:
                self._commit_version(where, state, global_step, metadata, metrics)
            else:
                self._save_local(local, state, global_step, metadata, metrics)
        except UnsafeCheckpointError as e:
            raise _unsafe_checkpoint(where, e) from None

    def _monitored(self, checkpoint: Mapping[str, Any], where: str) -> dict[str, float]:
        """The values of the metrics ``ModelCheckpoint`` monitors, for this checkpoint.

        A top-k checkpoint's value is the one its callback ranked it by (its entry in
        ``best_k_models``). Any other save (``last.ckpt``) gets the value only when a top-k
        save of the same global step just had it: the callback's ``current_score`` is
        otherwise that of an earlier step, and a stale number is worse than none.
        """
        global_step = _int_or(checkpoint.get("global_step"), None)
        metrics: dict[str, float] = {}
        callbacks = checkpoint.get("callbacks")
        if not isinstance(callbacks, Mapping):
            return metrics
        for cb in callbacks.values():
            if not isinstance(cb, Mapping) or not isinstance(cb.get("monitor"), str):
                continue
            monitor = cb["monitor"]
            best = cb.get("best_k_models")
            value = _number(best.get(where)) if isinstance(best, Mapping) else None
            if value is not None:
                self._scores[monitor] = (global_step, value)
            else:
                seen = self._scores.get(monitor)
                if seen is None or seen[0] != global_step or global_step is None:
                    continue
                value = seen[1]
            metrics[monitor] = value
        return metrics

    def _save_local(
        self,
        path: str,
        state: dict[str, Any],
        global_step: int,
        metadata: dict[str, Any],
        metrics: dict[str, float],
    ) -> None:
        parent, name = os.path.split(path)
        os.makedirs(parent, exist_ok=True)
        _remove_stale_siblings(parent, name)
        if os.path.isdir(path) and not os.path.islink(path):
            self._commit_version(path, state, global_step, metadata, metrics)
            return
        # A new path (or a file or link to replace): complete the store aside, then rename it
        # in, so that Lightning (and a crash) never sees a path without a checkpoint in it.
        tmp = _sibling(parent, name, "tmp")
        try:
            self._commit_version(tmp, state, global_step, metadata, metrics)
            _rename_into_place(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _commit_version(
        self,
        root: str,
        state: dict[str, Any],
        global_step: int,
        metadata: dict[str, Any],
        metrics: dict[str, float],
    ) -> None:
        with self._manager(root, allow_pickle=self.allow_pickle) as mgr:
            latest = mgr.latest_step()
            step = global_step if latest is None else max(global_step, latest + 1)
            mgr.save(step, state, metadata=metadata, metrics=metrics)

    def _manager(self, root: str, *, allow_pickle: bool) -> CheckpointManager:
        # distributed=False: Lightning saves on rank 0 alone and loads on every rank on its
        # own; a collective here (even the manager's group creation) would hang the job.
        return CheckpointManager(
            root,
            keep=self.keep,
            format=self.format,
            compression=self.compression,
            storage_options=self.storage_options,
            allow_pickle=allow_pickle,
            distributed=False,
        )

    # ---- load ------------------------------------------------------------------------

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load and verify the newest version of ``path``; see the module docstring.

        Args:
            path: a checkpoint path Lightning (or this plugin) wrote.
            map_location: a device (``"cpu"``, ``torch.device``) to move tensors to; other
                forms (callables, dicts) leave them on the CPU.
            weights_only: ``True`` refuses pickled objects even with ``allow_pickle``.

        Returns:
            The checkpoint dict, equal to the one Lightning saved (tensors on the CPU or
            ``map_location``).

        Raises:
            FileNotFoundError: nothing at ``path``.
            IntegrityError: ``path`` does not verify (and, for ``last*.ckpt``, neither does
                any other checkpoint in its directory).
            UnsafeCheckpointError: the checkpoint holds pickles and they are not allowed.
        """
        where = os.fspath(path)
        allow = self.allow_pickle and weights_only is not True
        local = _local_path(where)
        if local is not None:
            if not os.path.lexists(local):
                raise PathNotFoundError(f"Checkpoint file not found: {where}", path=where)
            if os.path.isfile(local):
                return _load_torch_file(local, map_location)
        elif not self._remote_exists(where):
            raise PathNotFoundError(f"Checkpoint file not found: {where}", path=where)
        try:
            raw = self._load_store(where, allow_pickle=allow)
        except (IntegrityError, ManifestError, NoCheckpointError) as e:
            name = os.path.basename(where.rstrip("/"))
            is_last = _LAST_RE.match(os.path.splitext(name)[0]) is not None
            if not (self.fallback and is_last and local is not None):
                if isinstance(e, NoCheckpointError):
                    raise NoCheckpointError(
                        f"Lightning checkpoint {where}: {e}; CkptStoreIO did not write it, or "
                        "its first save never completed"
                    ) from None
                raise type(e)(
                    f"Lightning checkpoint {where} does not verify: {e}. Load another "
                    f"checkpoint; `ckptstore verify {where} --all` lists what is wrong"
                ) from None
            raw = self._fall_back(local, e, allow_pickle=allow)
        out: dict[str, Any] = _to_device(_decode_checkpoint(raw), map_location)
        return out

    def _load_store(self, root: str, *, allow_pickle: bool, older: bool = False) -> Any:
        """The newest version of a store, verified; with ``older`` the newest that verifies."""
        with self._manager(root, allow_pickle=allow_pickle) as mgr:
            steps = mgr.steps()
            if not steps:
                raise NoCheckpointError(f"{root} holds no committed checkpoint")
            _refuse_foreign(mgr, steps[-1], root)
            return mgr.load(None if older else steps[-1])

    def _fall_back(self, path: str, error: CkptStoreError, *, allow_pickle: bool) -> Any:
        """The newest checkpoint that verifies, in ``path`` itself or beside it."""
        tried = [f"{path}: {error}"]
        if os.path.isdir(path):
            with contextlib.suppress(IntegrityError, ManifestError, NoCheckpointError):
                raw = self._load_store(path, allow_pickle=allow_pickle, older=True)
                log.warning(
                    "%s does not verify (%s); loaded its newest older version that does",
                    path,
                    error,
                )
                return raw
        parent = os.path.dirname(path)
        for candidate, global_step in self._siblings(path):
            try:
                raw = self._load_store(candidate, allow_pickle=allow_pickle, older=True)
            except (IntegrityError, ManifestError, NoCheckpointError) as e:
                tried.append(f"{candidate}: {e}")
                continue
            log.warning(
                "%s does not verify (%s); loading %s (global step %s) instead, the newest "
                "checkpoint in %s that verifies (full checkpoints before weights-only ones)",
                path,
                error,
                candidate,
                global_step,
                parent,
            )
            return raw
        raise type(error)(
            f"Lightning checkpoint {path} does not verify, and no other checkpoint in {parent} "
            "does either; tried newest first: " + " | ".join(tried)
        )

    def _siblings(self, path: str) -> list[tuple[str, int | None]]:
        """Other stores beside ``path`` with its suffix, newest first (by their manifests).

        Full checkpoints come before weights-only ones (``save_weights_only=True``, as their
        manifests say): a fit resumed from one of those fails inside Lightning ("contains
        only the model") though an older full checkpoint beside it verifies.
        """
        parent, name = os.path.split(path)
        suffix = os.path.splitext(name)[1]
        real = os.path.realpath(path)
        found: list[tuple[tuple[bool, str, int], str, int | None]] = []
        for entry in sorted(os.listdir(parent)):
            candidate = os.path.join(parent, entry)
            if (
                entry == name
                or entry.startswith(".")
                or os.path.splitext(entry)[1] != suffix
                or not os.path.isdir(candidate)
                or os.path.realpath(candidate) == real
            ):
                continue
            try:
                with self._manager(candidate, allow_pickle=False) as mgr:
                    newest = mgr.latest_step()
                    if newest is None:
                        continue
                    manifest = mgr.manifest(newest)
            except (CkptStoreError, OSError):
                continue  # unreadable: it cannot be the one to load either
            info = manifest.metadata.get("lightning")
            if not isinstance(info, dict):
                continue  # another writer's store (_refuse_foreign): never a fall-back
            gs = _int_or(info.get("global_step"), None)
            full = info.get("weights_only") is not True
            found.append(((full, manifest.created, gs if gs is not None else -1), candidate, gs))
        found.sort(key=lambda f: f[0], reverse=True)
        return [(c, gs) for _, c, gs in found]

    # ---- remove ----------------------------------------------------------------------

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the checkpoint at ``path`` (top-k pruning); it vanishes whole at once.

        A symlink is unlinked, never its target; a missing ``path`` is not an error.
        """
        where = os.fspath(path)
        local = _local_path(where)
        if local is None:
            self._remove_remote(where)
            return
        parent, name = os.path.split(local)
        if os.path.islink(local) or os.path.isfile(local):
            os.unlink(local)
            fsync_path(parent, directory=True)
            return
        if not os.path.isdir(local):
            return
        trash = _sibling(parent, name, "trash")
        os.rename(local, trash)  # atomic: readers see the whole checkpoint or nothing
        fsync_path(parent, directory=True)
        shutil.rmtree(trash, ignore_errors=True)
        log.debug("removed checkpoint %s", local)

    # ---- fsspec URLs -----------------------------------------------------------------

    def _remote_exists(self, url: str) -> bool:
        fs, p = _url_to_fs(url, self.storage_options)
        return bool(fs.exists(p))

    def _remove_remote(self, url: str) -> None:
        fs, p = _url_to_fs(url, self.storage_options)
        if not fs.exists(p):
            return
        if fs.isdir(p):
            # Manifests first: a step without one is invisible, whatever remains of it.
            with self._manager(url, allow_pickle=False) as mgr:
                for step in mgr.steps():
                    mgr.storage.delete(step)
        fs.rm(p, recursive=True)


# The standalone package (pytorch_lightning) checks plugins against lightning_fabric's
# CheckpointIO, a class of its own: register there too, so that either Trainer accepts us.
with contextlib.suppress(ImportError):
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO as _StandaloneIO

    if not issubclass(CkptStoreIO, _StandaloneIO):
        _StandaloneIO.register(CkptStoreIO)


# ---- strategies that never call a CheckpointIO --------------------------------------------

#: Lightning strategies that save and load with their own code, whatever ``checkpoint_io``
#: holds: given ``CkptStoreIO``, they would write around it (Lightning sets the plugin and
#: says nothing). By class name, for both packages (``lightning``, ``pytorch_lightning``).
_BYPASSING = {
    "DeepSpeedStrategy": "it saves and loads through the DeepSpeed engine",
}
#: Strategies whose save and load CkptStoreIO takes over (lightning_sharded.py), and the
#: modules (of both packages) that define each.
_SERVED = {
    "ModelParallelStrategy": (
        "lightning.pytorch.strategies.model_parallel",
        "pytorch_lightning.strategies.model_parallel",
    ),
    "FSDPStrategy": (
        "lightning.pytorch.strategies.fsdp",
        "pytorch_lightning.strategies.fsdp",
    ),
}
_STRATEGY_MODULES = (
    "lightning.pytorch.strategies.strategy",
    "pytorch_lightning.strategies.strategy",
)


def _lightning_class(strategy: object, names: Collection[str]) -> type | None:
    """The first class of ``strategy``'s MRO that is Lightning's own and named in ``names``."""
    for cls in type(strategy).__mro__:
        if cls.__name__ in names and cls.__module__.startswith(
            ("lightning.", "pytorch_lightning.")
        ):
            return cls
    return None


def _refuse_bypassing(strategy: object, io: CkptStoreIO) -> None:
    """Raise when ``io`` cannot serve ``strategy``.

    That is: ``strategy`` never calls a ``CheckpointIO`` (see :data:`_BYPASSING`), or it is a
    ``ModelParallelStrategy`` with options the plugin cannot serve.
    """
    name = type(strategy).__name__
    served = _lightning_class(strategy, _SERVED)
    if served is not None:
        from .lightning_sharded import unserved_reason

        why = unserved_reason(strategy, io, served.__name__)
        if why is not None:
            raise ConfigError(f"CkptStoreIO cannot serve {name}: {why}")
        return
    cls = _lightning_class(strategy, _BYPASSING)
    if cls is None:
        return
    msg = (
        f"CkptStoreIO cannot serve {name}: {_BYPASSING[cls.__name__]}, never through a "
        "CheckpointIO, so the plugin would be bypassed without a word and nothing would be "
        "checksummed or committed atomically. Remove plugins=[CkptStoreIO()] (Lightning's own "
        "format); or shard with FSDP2 (fully_shard in configure_model) under "
        "ModelParallelStrategy, which CkptStoreIO serves; or save the sharded model and "
        "optimizer with ckptstore.CheckpointManager on every rank (docs/distributed.md, FSDP2)"
    )
    raise ConfigError(msg)


def _serves(strategy: Any) -> CkptStoreIO | None:
    """The ``CkptStoreIO`` that ``strategy`` holds, if any (never Lightning's default)."""
    io = getattr(strategy, "_checkpoint_io", None)
    return io if isinstance(io, CkptStoreIO) else None


def _guard_strategies() -> None:
    """Refuse the plugin where it cannot serve; route the sharded strategies through it.

    ``Strategy.checkpoint_io = CkptStoreIO(...)`` raises for a bypassing strategy, and the
    save and load of ``ModelParallelStrategy`` and ``FSDPStrategy`` go through the plugin
    when it holds one.
    Lightning hands the plugin to its strategy through that setter while the ``Trainer`` is
    built (``_AcceleratorConnector``), so the refusal comes at construction, before any
    training. Wrapped once per Lightning package that is imported; a strategy holding any
    other ``CheckpointIO`` behaves exactly as before.
    """
    import sys

    for module in _STRATEGY_MODULES:
        strategy_cls: Any = getattr(sys.modules.get(module), "Strategy", None)
        if strategy_cls is None:
            continue
        prop = strategy_cls.__dict__.get("checkpoint_io")
        if not isinstance(prop, property) or prop.fset is None:
            continue
        if getattr(prop.fset, "_ckptstore_guard", False):
            continue
        setter = prop.fset

        def guarded(self: Any, io: Any, _set: Callable[[Any, Any], None] = setter) -> None:
            if isinstance(io, CkptStoreIO):
                _refuse_bypassing(self, io)
            _set(self, io)

        guarded._ckptstore_guard = True  # type: ignore[attr-defined]
        strategy_cls.checkpoint_io = property(prop.fget, guarded, prop.fdel, prop.__doc__)
    for served, modules in _SERVED.items():
        for module in modules:
            _route_sharded(getattr(sys.modules.get(module), served, None))


def _route_sharded(cls: Any) -> None:
    """Wrap ``cls.save_checkpoint``/``load_checkpoint`` once.

    Through ckptstore when the strategy holds a ``CkptStoreIO``, Lightning's own code otherwise.
    """
    if cls is None or getattr(cls.save_checkpoint, "_ckptstore_route", False):
        return
    save, load = cls.save_checkpoint, cls.load_checkpoint

    @functools.wraps(save)
    def save_checkpoint(
        self: Any, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        io = _serves(self)
        if io is None:
            save(self, checkpoint, filepath, storage_options)
            return
        from .lightning_sharded import save_sharded

        save_sharded(self, io, checkpoint, filepath, storage_options)

    @functools.wraps(load)
    def load_checkpoint(
        self: Any, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        io = _serves(self)
        if io is None:
            out: dict[str, Any] = load(self, checkpoint_path, weights_only=weights_only)
            return out
        from .lightning_sharded import load_sharded

        def lightning_load(path: str, weights_only: bool | None) -> dict[str, Any]:
            full: dict[str, Any] = load(self, path, weights_only=weights_only)
            return full

        return load_sharded(self, io, checkpoint_path, weights_only, lightning_load)

    save_checkpoint._ckptstore_route = True  # type: ignore[attr-defined]
    cls.save_checkpoint = save_checkpoint
    cls.load_checkpoint = load_checkpoint


_guard_strategies()


# ---- paths ---------------------------------------------------------------------------


def _unsafe_checkpoint(where: str, e: UnsafeCheckpointError) -> UnsafeCheckpointError:
    """``e`` (a state that needs pickle) as said of the Lightning checkpoint at ``where``."""
    detail = e.message.replace("state[", "checkpoint[", 1)
    return UnsafeCheckpointError(
        f"cannot save Lightning checkpoint {where}: {detail} (here: CkptStoreIO(allow_pickle=True))"
    )


def _refuse_foreign(mgr: CheckpointManager, step: int, root: str) -> None:
    """Refuse a store whose ``step`` another writer committed (no ``lightning`` metadata).

    Its state is no Lightning checkpoint: Lightning failed on it with a bare ``KeyError``
    (``'pytorch-lightning_version'``). A manifest that cannot be read is left to the load,
    which reports it (and falls back where it may).

    Raises:
        StateMismatchError: naming the store and its writer.
    """
    try:
        manifest = mgr.manifest(step)
    except CkptStoreError:
        return
    if isinstance(manifest.metadata.get("lightning"), Mapping):
        return
    by = manifest.metadata.get("saved_by")
    writer = f"committed by {by}, not" if isinstance(by, str) else "not committed"
    raise StateMismatchError(
        f"{mgr.storage.describe(step)} was {writer} by CkptStoreIO (its manifest holds "
        f"no Lightning metadata): it is no Lightning checkpoint. Resume from a checkpoint "
        f"path that CkptStoreIO wrote; {root} is another writer's store"
    )


def _local_path(where: str) -> str | None:
    """The local filesystem path of ``where``, or ``None`` for another fsspec URL."""
    protocol, sep, rest = where.partition("://")
    if not sep:
        return os.path.abspath(os.path.expanduser(where))
    if protocol in _LOCAL_PROTOCOLS:
        return os.path.abspath(rest)
    return None


def _url_to_fs(url: str, options: Mapping[str, Any] | None) -> tuple[Any, str]:
    import fsspec

    fs, p = fsspec.core.url_to_fs(url, **dict(options or {}))
    return fs, str(p)


def _sibling_key(name: str) -> str:
    """The part of a sibling's name that says whose it is: a digest of ``name``."""
    return hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:24]


def _sibling(parent: str, name: str, kind: str) -> str:
    """A hidden, unique entry beside ``name``: ``.ckptstore-KIND-<digest of name>-<uuid>``.

    Lightning's ``*.ckpt`` listings skip it. Its name holds neither ``name`` nor
    ``ckpt_``: Lightning's SLURM auto-requeue resumes from ``hpc_ckpt_<N>.ckpt``, N the
    digits of every entry of the directory holding ``hpc_ckpt_`` run together, so a
    save of ``hpc_ckpt_2.ckpt`` killed mid-way (``.hpc_ckpt_2.ckpt.tmp-<uuid>`` left
    behind) sent every requeued job to a ``hpc_ckpt_27910150935...ckpt`` that is not there.
    """
    return os.path.join(parent, f".ckptstore-{kind}-{_sibling_key(name)}-{uuid.uuid4().hex}")


def _remove_stale_siblings(parent: str, name: str) -> None:
    """Leftovers of a crashed save or removal of ``name`` (only this process writes it).

    Those of releases before the digest too (``.<name>.tmp-<uuid>``).
    """
    key = re.escape(_sibling_key(name))
    pattern = re.compile(
        rf"\.ckptstore-(tmp|trash)-{key}-[0-9a-f]{{32}}|\.{re.escape(name)}\.(tmp|trash)-[0-9a-f]{{32}}"
    )
    with contextlib.suppress(OSError):
        for entry in os.listdir(parent):
            if pattern.fullmatch(entry):
                log.info("removing stale %s", os.path.join(parent, entry))
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _rename_into_place(tmp: str, path: str) -> None:
    """Move the completed store ``tmp`` to ``path``, replacing a file or symlink there."""
    parent, name = os.path.split(path)
    trash = None
    try:
        if os.path.lexists(path):
            # A directory cannot be renamed over a file or a link: move that away first.
            trash = _sibling(parent, name, "trash")
            os.rename(path, trash)
        try:
            os.rename(tmp, path)
        except BaseException:
            if trash is not None:
                with contextlib.suppress(OSError):
                    os.rename(trash, path)
            raise
        fsync_path(parent, directory=True)
    except OSError as e:
        raise CommitError(
            f"saving {path} failed: could not move the written checkpoint into place ({e}); "
            "the previous checkpoint is intact"
        ) from e
    if trash is not None:
        with contextlib.suppress(OSError):
            if os.path.isdir(trash) and not os.path.islink(trash):
                shutil.rmtree(trash)
            else:
                os.unlink(trash)


def _load_torch_file(path: str, map_location: Any) -> dict[str, Any]:
    """A lone ``torch.save`` checkpoint: zip CRCs checked first, then no pickle runs."""
    report = verify_file(path)
    if not report.ok:
        raise IntegrityError(
            f"Lightning checkpoint {path} (a torch.save file) does not verify: "
            + "; ".join(report.problems)
        )
    try:
        out = torch.load(path, map_location=map_location or "cpu", weights_only=True)
    except Exception as e:  # torch's UnpicklingError names the global it refused
        raise UnsafeCheckpointError(
            f"{path} is a torch.save file holding objects that weights_only loading refuses "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); CkptStoreIO "
            "never unpickles such files. Load it once with TorchCheckpointIO if you trust it"
        ) from None
    if not isinstance(out, dict):
        raise IntegrityError(f"{path} holds a {type(out).__name__}, not a checkpoint dict")
    return dict(out)


# ---- conversions ---------------------------------------------------------------------


def _number(value: Any) -> float | None:
    """A monitored value (a 0-d tensor, usually) as a float; ``None`` if it is none."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _int_or(value: Any, default: int | None) -> Any:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _global_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    return 0


def _is_attribute_dict(t: type) -> bool:
    """Lightning's AttributeDict, from either package (lightning or lightning_fabric)."""
    return (
        t.__name__ == "AttributeDict"
        and t.__module__.endswith("fabric.utilities.data")
        and issubclass(t, dict)
    )


def _encode_checkpoint(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The state handed to ckptstore: ``checkpoint`` with the known Python types converted.

    A top-level object with ``state_dict()`` would be saved as its state dict by the manager
    (and come back as a dict): it is boxed so that it is stored as itself, which needs pickle.
    """
    state: dict[str, Any] = {}
    for key, value in checkpoint.items():
        enc = _encode(value, 0)
        if kind_of(enc) is not None:
            enc = {_TAG: "object", "v": enc}
        state[key] = enc
    return state


def _map_dict(
    d: Mapping[Any, Any], fn: Callable[[Any], Any], *, keep_meta: bool = True
) -> Mapping[Any, Any]:
    """``d`` with ``fn`` applied to its values; ``d`` itself when nothing changed."""
    new = {k: fn(v) for k, v in d.items()}
    if all(new[k] is v for k, v in d.items()):
        return d
    out: dict[Any, Any] = collections.OrderedDict(new) if type(d) is not dict else new
    meta = getattr(d, "_metadata", None)
    if keep_meta and meta is not None:
        out._metadata = meta  # type: ignore[attr-defined]  # module versions of state_dict()
    return out


def _encode(v: Any, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise UnsafeCheckpointError(f"checkpoint nested deeper than {_MAX_DEPTH} levels")
    t = type(v)

    def enc(x: Any) -> Any:
        return _encode(x, depth + 1)

    if t is dict or t is collections.OrderedDict:
        if _TAG in v:  # user data that looks like ours: escape it, keys and values apart
            items = [[k, enc(x)] for k, x in v.items()]
            return {_TAG: "dict", "odict": t is not dict, "items": items}
        return _map_dict(v, enc)
    if t is list:
        new = [enc(x) for x in v]
        return v if all(a is b for a, b in zip(new, v, strict=True)) else new
    if t is tuple:
        tnew = tuple(enc(x) for x in v)
        return v if all(a is b for a, b in zip(tnew, v, strict=True)) else tnew
    if t is argparse.Namespace or t is AttributeDict or _is_attribute_dict(t):
        kind = "namespace" if t is argparse.Namespace else "attrdict"
        fields = vars(v) if t is argparse.Namespace else v
        if _TAG in fields:
            items = [[k, enc(x)] for k, x in fields.items()]
            return {_TAG: f"{kind}-items", "items": items}
        # The fields sit beside the tag, so an error names them as the user wrote them:
        # checkpoint['hyper_parameters']['args']['lr'].
        return {_TAG: kind, **_map_dict(fields, enc)}
    if t is set or t is frozenset:
        items = list(v)
        with contextlib.suppress(TypeError):
            items = sorted(v)  # deterministic bytes for the same set, where comparable
        return {_TAG: t.__name__, "v": [enc(x) for x in items]}
    if t.__name__ in _PATH_TYPES and _PATH_TYPES[t.__name__] is t:
        return {_TAG: "path", "cls": t.__name__, "v": str(v)}
    return v  # tensors and plain data for ckptstore; anything else needs pickle there


def _decode_checkpoint(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise IntegrityError(f"the stored checkpoint is a {type(raw).__name__}, not a dict")
    return {k: _decode(v, 0) for k, v in raw.items()}


def _decode(v: Any, depth: int) -> Any:
    if depth > _MAX_DEPTH + 5:
        raise IntegrityError("checkpoint nested too deeply; it is corrupt")

    def dec(x: Any) -> Any:
        return _decode(x, depth + 1)

    t = type(v)
    if t is dict and _TAG in v:
        return _rebuild(v, dec)
    if t is dict or t is collections.OrderedDict:
        return _map_dict(v, dec)
    if t is list:
        new = [dec(x) for x in v]
        return v if all(a is b for a, b in zip(new, v, strict=True)) else new
    if t is tuple:
        tnew = tuple(dec(x) for x in v)
        return v if all(a is b for a, b in zip(tnew, v, strict=True)) else tnew
    return v


def _rebuild(node: Mapping[str, Any], dec: Callable[[Any], Any]) -> Any:
    kind = node[_TAG]
    try:
        if kind == "object":
            return node["v"]
        if kind == "dict":
            out: dict[Any, Any] = collections.OrderedDict() if node["odict"] else {}
            for k, x in node["items"]:
                out[k] = dec(x)
            return out
        if kind in ("namespace", "attrdict", "namespace-items", "attrdict-items"):
            if kind.endswith("-items"):  # a field named like our tag: stored as pairs
                fields = {k: dec(x) for k, x in node["items"]}
            else:
                fields = {k: dec(x) for k, x in node.items() if k != _TAG}
            if kind.startswith("namespace"):
                return argparse.Namespace(**fields)
            return AttributeDict(fields)
        if kind in ("set", "frozenset"):
            items = [dec(x) for x in node["v"]]
            return set(items) if kind == "set" else frozenset(items)
        if kind == "path":
            cls = _PATH_TYPES[str(node["cls"])]
            return cls(str(node["v"]))
    except (KeyError, TypeError, ValueError, NotImplementedError) as e:
        raise IntegrityError(
            f"malformed {kind!r} value in the checkpoint ({type(e).__name__}: {e})"
        ) from None
    raise IntegrityError(f"unknown converted value {kind!r} in the checkpoint")


def _to_device(obj: Any, map_location: Any) -> Any:
    if isinstance(map_location, int) and not isinstance(map_location, bool):
        map_location = torch.device(map_location)
    if not isinstance(map_location, str | torch.device):
        return obj
    device = torch.device(map_location)
    if device.type == "cpu":
        return obj

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(device)
        t = type(x)
        if t is dict or t is collections.OrderedDict:
            return _map_dict(x, move)
        if t is list:
            return [move(y) for y in x]
        if t is tuple:
            return tuple(move(y) for y in x)
        return x

    return move(obj)

"""Lightning's sharded strategies saving and loading through ckptstore.

``ModelParallelStrategy`` (FSDP2, tensor parallel) and ``FSDPStrategy`` (FSDP1, sharded
state dicts). FSDP1's ``ShardedTensor`` state is taken with ``get_model_state_dict`` /
``get_optimizer_state_dict`` and saved and restored through ``Shard(0)`` DTensor views of
the same memory (:mod:`ckptstore.integrations._sharded_tensor`); the rest is as below.

Used by :mod:`ckptstore.integrations.lightning`: when such a Lightning strategy holds a
:class:`~ckptstore.integrations.lightning.CkptStoreIO`, its ``save_checkpoint`` and
``load_checkpoint`` (which never call a ``CheckpointIO``) run :func:`save_sharded` and
:func:`load_sharded` instead of ``torch.distributed.checkpoint``; with any other
``checkpoint_io`` they are Lightning's own. Nothing here is public API: see the docstring
of :mod:`ckptstore.integrations.lightning` ("Sharded strategies").

**Save** (every rank; Lightning calls it on every rank): the checkpoint dict as Lightning
built it, its ``state_dict`` and ``optimizer_states`` holding this rank's DTensor shards
(``get_model_state_dict``/``get_optimizer_state_dict``, not full state), is committed as one
step of the store at the checkpoint path by ``CheckpointManager.save`` on every rank: each
rank writes its own shards (``_shards.rankNNNNN.*``, a CRC32C per block), rank 0 the plain
values, the manifest last, once every rank's files are in. The path keeps CkptStoreIO's
semantics (a store per path, a new step per save, the previous one pruned only after the
commit, a new path completed in a hidden sibling and renamed into place by rank 0).

**Load** (every rank, collective): the model's and optimizers' state dicts as this job
shards them are filled by ``CheckpointManager.restore`` (each rank reads the byte ranges its
shards overlap, every block checked, on any world size), then set with
``set_model_state_dict``/``set_optimizer_state_dict``; the rest of the checkpoint (loops,
callbacks, schedulers, hyper-parameters) is read from the same step and returned to
Lightning, without ``state_dict`` and ``optimizer_states`` (as Lightning's own sharded load
returns it). A ``last*`` path falls back, on every rank alike, to an older step of its
store, else to the newest other checkpoint beside it that loads; any other path loads its
newest step exactly or raises :class:`~ckptstore.IntegrityError` on every rank.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import TYPE_CHECKING, Any

import torch

from .._log import logger as log
from ..errors import (
    CkptStoreError,
    CommitError,
    ConfigError,
    ConfigTypeError,
    IntegrityError,
    ManifestError,
    NoCheckpointError,
    PathNotFoundError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from ..manager import CheckpointManager
from ..ops.inspect import read_state_root
from ..ops.verify import verify_file
from .lightning import (
    _LAST_RE,
    _decode_checkpoint,
    _encode_checkpoint,
    _int_or,
    _local_path,
    _remove_stale_siblings,
    _rename_into_place,
    _sibling,
    _unsafe_checkpoint,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..manifest import Manifest
    from .lightning import CkptStoreIO

__all__ = ["load_sharded", "save_sharded", "unserved_reason"]

#: The entries of Lightning's checkpoint dict that hold the sharded model and optimizers.
_TENSOR_KEYS = ("state_dict", "optimizer_states")


def unserved_reason(strategy: Any, io: CkptStoreIO, kind: str) -> str | None:
    """Why ``io`` cannot serve this strategy (``kind``: the Lightning class), or ``None``."""
    if kind == "FSDPStrategy" and getattr(strategy, "_state_dict_type", "full") != "sharded":
        return (
            "with state_dict_type='full' (its default) it gathers the full state on rank 0, "
            "and loads a checkpoint path with torch.load itself. Pass "
            "FSDPStrategy(state_dict_type='sharded'): every rank then saves its shards into "
            "one ckptstore step, which loads on any world size (and in one process: "
            "CkptStoreIO().load_checkpoint(path) gives full tensors)"
        )
    if kind == "ModelParallelStrategy" and (
        getattr(strategy, "_save_distributed_checkpoint", True) is not True
    ):
        return (
            "with save_distributed_checkpoint=False it gathers the full state on rank 0, "
            "refuses to save again into an existing checkpoint directory and loads files with "
            "torch.load itself. Use the default save_distributed_checkpoint=True: every rank "
            "then saves its shards into one ckptstore step, which loads on any world size "
            "(and in one process: CkptStoreIO().load_checkpoint(path) gives full tensors)"
        )
    if io.compression is not None:
        return (
            f"compression={io.compression!r} cannot hold sharded (DTensor) state: ranks read "
            "byte ranges of the shard files, which a compressed file cannot serve. Use "
            "CkptStoreIO() without compression"
        )
    return None


def _broadcast(strategy: Any, obj: Any) -> Any:
    return strategy.broadcast(obj, src=0)


def _agree(strategy: Any, error: BaseException | None, what: str) -> None:
    """Raise on every rank when any rank failed (``error`` is this rank's): none waits on.

    Collective over the default group, what each rank sends and receives not growing with
    the world size: an all-reduce (MIN) of one integer finds the first rank that failed,
    which then broadcasts its error's text (``strategy.broadcast``). This rank raises its
    own error; the others a ``CommitError`` naming the first rank that failed and its
    error.
    """
    dist = torch.distributed
    text = None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        world = dist.get_world_size()
        device = getattr(strategy, "root_device", None) or torch.device("cpu")
        first = torch.tensor([world if error is None else dist.get_rank()], device=device)
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        rank = int(first.item())
        if rank < world:
            mine = None if error is None else f"{type(error).__name__}: {error}"
            text = strategy.broadcast(mine, src=rank)
    if error is not None:
        raise error
    if text is not None:
        raise CommitError(f"{what} failed on rank {rank}: {text}; nothing was saved")


def _manager(io: CkptStoreIO, root: str, *, allow_pickle: bool, create: bool) -> CheckpointManager:
    # Collective: every rank constructs it (a gloo group of its own for ckptstore's waits).
    return CheckpointManager(
        root,
        keep=io.keep,
        format=io.format,
        compression=io.compression,
        allow_pickle=allow_pickle,
        distributed=True,
        create=create,
    )


# ---- save ------------------------------------------------------------------------------


def save_sharded(
    strategy: Any,
    io: CkptStoreIO,
    checkpoint: dict[str, Any],
    filepath: str | os.PathLike[str],
    storage_options: Any = None,
) -> None:
    """``ModelParallelStrategy.save_checkpoint`` through ckptstore; on every rank, collective.

    Raises:
        TypeError: ``storage_options`` was passed (on every rank).
        ConfigError: the path is not a local (shared) path.
        UnsafeCheckpointError: the checkpoint holds an object that needs pickle.
        CommitError: writing failed on some rank; the previous version of the path is intact.
    """
    if storage_options is not None:
        msg = (
            "ModelParallelStrategy.save_checkpoint takes no storage_options with CkptStoreIO; "
            "pass fsspec options as CkptStoreIO(storage_options=...)"
        )
        raise ConfigTypeError(msg)
    # Rank 0's path, as Lightning's own save does: every rank must write into one store.
    where = os.fspath(_broadcast(strategy, os.fspath(filepath)))
    local = _local_path(where)
    if local is None:
        msg = (
            f"CkptStoreIO saves ModelParallelStrategy checkpoints to local (shared) paths "
            f"only, not {where!r}: every rank writes its shards there and rank 0 renames a new "
            "checkpoint into place"
        )
        raise ConfigError(msg)
    metrics = io._monitored(checkpoint, where)
    global_step = _int_or(checkpoint.get("global_step"), 0)
    metadata = {
        "lightning": {
            "global_step": global_step,
            "epoch": _int_or(checkpoint.get("epoch"), None),
            "strategy": type(strategy).__name__,
            "keys": [str(k) for k in checkpoint],
        }
    }
    parent, name = os.path.split(local)
    plan: tuple[str, bool] | None = None
    error: BaseException | None = None
    try:
        if _is_fsdp1(strategy):
            checkpoint = _fsdp1_checkpoint(strategy, checkpoint)
        state = _encode_checkpoint(checkpoint)
        if strategy.is_global_zero:
            os.makedirs(parent, exist_ok=True)
            _remove_stale_siblings(parent, name)
            in_place = os.path.isdir(local) and not os.path.islink(local)
            # A new path (or a file or link to replace) is completed aside, then renamed in.
            plan = (local if in_place else _sibling(parent, name, "tmp"), in_place)
    except UnsafeCheckpointError as e:
        error = _unsafe_checkpoint(where, e)
    except Exception as e:
        error = e
    _agree(strategy, error, f"saving {where}")
    root, in_place = _broadcast(strategy, plan)
    try:
        with _manager(io, root, allow_pickle=io.allow_pickle, create=True) as mgr:
            latest = mgr.latest_step()
            step = global_step if latest is None else max(global_step, latest + 1)
            step = int(_broadcast(strategy, step))  # the same step on every rank
            mgr.save(step, state, metadata=metadata, metrics=metrics)
    except UnsafeCheckpointError as e:  # raised on every rank alike
        _discard(strategy, root, in_place)
        raise _unsafe_checkpoint(where, e) from None
    except BaseException:
        _discard(strategy, root, in_place)
        raise
    error = None
    if not in_place and strategy.is_global_zero:
        try:
            _rename_into_place(root, local)
        except Exception as e:
            shutil.rmtree(root, ignore_errors=True)
            error = e
    _agree(strategy, error, f"saving {where}")
    log.debug("saved sharded Lightning checkpoint %s (step %d)", where, step)


def _is_fsdp1(strategy: Any) -> bool:
    """Whether ``strategy`` is Lightning's ``FSDPStrategy`` (FSDP1: ``ShardedTensor`` state)."""
    from .lightning import _lightning_class

    return _lightning_class(strategy, ("FSDPStrategy",)) is not None


def _optimizers(strategy: Any) -> list[Any]:
    return [getattr(o, "_optimizer", o) for o in strategy.optimizers]


def _fsdp1_checkpoint(strategy: Any, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with FSDP1's sharded model and optimizer state as DTensors.

    Lightning's ``FSDPStrategy`` put ``ShardedTensor``s there; they are taken again with
    ``get_model_state_dict``/``get_optimizer_state_dict`` (FQN keys, as Lightning's own) and
    viewed as ``Shard(0)`` DTensors (no copy), which every rank saves as FSDP2 state.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from ._sharded_tensor import as_dtensors

    model = strategy.model
    out = dict(checkpoint)
    out["state_dict"] = as_dtensors(get_model_state_dict(model), "state_dict")
    if "optimizer_states" in checkpoint:
        out["optimizer_states"] = [
            as_dtensors(get_optimizer_state_dict(model, o), f"optimizer_states[{i}]")
            for i, o in enumerate(_optimizers(strategy))
        ]
    return out


def _discard(strategy: Any, root: str, in_place: bool) -> None:
    """Rank 0 removes the hidden sibling of a save that failed (every rank raises)."""
    if not in_place and strategy.is_global_zero:
        shutil.rmtree(root, ignore_errors=True)


# ---- load ------------------------------------------------------------------------------


def load_sharded(
    strategy: Any,
    io: CkptStoreIO,
    checkpoint_path: str | os.PathLike[str],
    weights_only: bool | None,
    lightning_load: Callable[..., dict[str, Any]],
) -> dict[str, Any]:
    """``ModelParallelStrategy.load_checkpoint`` through ckptstore; on every rank, collective.

    Loads the model and optimizers in place; returns the rest of the checkpoint.

    Raises:
        FileNotFoundError: nothing at the path.
        NoCheckpointError: the path is a directory without a ckptstore store (a checkpoint
            Lightning wrote itself).
        IntegrityError: the checkpoint does not verify (for ``last*``: nor does any older
            version or other checkpoint beside it); raised on every rank.
        StateMismatchError: the checkpoint does not fit the model or optimizers.
    """
    where = os.fspath(_broadcast(strategy, os.fspath(checkpoint_path)))
    local = _local_path(where)
    if local is None:
        msg = (
            f"CkptStoreIO loads ModelParallelStrategy checkpoints from local (shared) paths "
            f"only, not {where!r}"
        )
        raise ConfigError(msg)
    if not os.path.lexists(local):
        raise PathNotFoundError(f"Checkpoint file not found: {where}", path=where)
    allow = io.allow_pickle and weights_only is not True
    if os.path.isfile(local):
        # A full checkpoint file of an earlier run (torch.save): checked, then Lightning's
        # own loader reads it, never unpickling anything.
        report = verify_file(local)
        if not report.ok:
            raise IntegrityError(
                f"Lightning checkpoint {where} (a torch.save file) does not verify: "
                + "; ".join(report.problems)
            )
        return lightning_load(local, weights_only=True)
    name = os.path.basename(local.rstrip("/"))
    is_last = _LAST_RE.match(os.path.splitext(name)[0]) is not None
    fallback = io.fallback and is_last
    try:
        return _restore(strategy, io, local, allow_pickle=allow, newest_good=fallback)
    except (IntegrityError, ManifestError, NoCheckpointError) as e:
        if not fallback:
            if isinstance(e, NoCheckpointError):
                raise NoCheckpointError(
                    f"Lightning checkpoint {where}: {e}; CkptStoreIO did not write it (a "
                    "checkpoint Lightning wrote itself loads without plugins=[CkptStoreIO()]), "
                    "or its first save never completed"
                ) from None
            raise type(e)(
                f"Lightning checkpoint {where} does not verify: {e}. Load another "
                f"checkpoint; `ckptstore verify {where} --all` lists what is wrong"
            ) from None
        return _fall_back(strategy, io, local, e, allow_pickle=allow)


def _fall_back(
    strategy: Any, io: CkptStoreIO, path: str, error: CkptStoreError, *, allow_pickle: bool
) -> dict[str, Any]:
    """The newest other checkpoint beside ``path`` that loads (every rank tries the same)."""
    tried = [f"{path}: {error}"]
    parent = os.path.dirname(path)
    # Rank 0 lists them; its failure (a directory it cannot list) is raised on every rank,
    # which otherwise waited in the broadcast for the strategy's timeout (found by review).
    listed: tuple[str, Any] = ("ok", None)
    if strategy.is_global_zero:
        try:
            listed = ("ok", io._siblings(path))
        except Exception as e:
            listed = ("error", f"{type(e).__name__}: {e}")
    status, candidates = _broadcast(strategy, listed)
    if status == "error":
        raise type(error)(
            f"Lightning checkpoint {path} does not verify ({error}), and rank 0 could not "
            f"list the checkpoints beside it in {parent}: {candidates}"
        )
    for candidate, global_step in candidates:
        try:
            out = _restore(strategy, io, candidate, allow_pickle=allow_pickle, newest_good=True)
        except (IntegrityError, ManifestError, NoCheckpointError, StateMismatchError) as e:
            # StateMismatchError: a checkpoint that does not fit this run, such as a
            # weights-only one beside the full ones (its own ModelCheckpoint with
            # save_weights_only=True); the fall-back stopped there, short of a full one.
            tried.append(f"{candidate}: {e}")
            continue
        log.warning(
            "%s does not verify (%s); loaded %s (global step %s) instead, the newest "
            "checkpoint in %s that verifies",
            path,
            error,
            candidate,
            global_step,
            parent,
        )
        return out
    raise type(error)(
        f"Lightning checkpoint {path} does not verify, and no other checkpoint in {parent} "
        "does either; tried newest first: " + " | ".join(tried)
    )


def _rest_keys(manifest: Manifest, root: str, step: int) -> list[str]:
    """The entries of ``step`` besides the model and optimizer states, as listed in its manifest.

    Those are Lightning's loops, callbacks and the like. StateMismatchError for a step that
    CkptStoreIO did not save under ModelParallelStrategy.
    """
    info = manifest.metadata.get("lightning")
    keys = info.get("keys") if isinstance(info, dict) else None
    if not isinstance(keys, list):
        how = (
            "it was saved by CkptStoreIO under another strategy (one full, unsharded "
            "checkpoint: load it with the strategy that saved it)"
            if isinstance(info, dict)
            else "its manifest has no Lightning record (CkptStoreIO did not save it)"
        )
        raise StateMismatchError(
            f"{root} step {step} was not saved under ModelParallelStrategy: {how}"
        )
    return [k for k in keys if isinstance(k, str) and k not in _TENSOR_KEYS]


def _stored_keys(mgr: CheckpointManager, manifest: Manifest, entry: str) -> list[str] | None:
    """The keys of the dict ``entry`` of the step of ``manifest``, from its ``state.json``.

    None where the entry is no dict of string keys: the restore judges it.

    Raises:
        IntegrityError, ManifestError: the manifest or ``state.json`` does not read.
    """
    _, keys, vals = read_state_root(mgr.storage, manifest)
    node = vals[keys.index(entry)] if entry in keys else None
    if not isinstance(node, dict) or node.get("t") not in ("dict", "odict"):
        return None
    stored = node.get("keys")
    if not isinstance(stored, list) or not all(isinstance(k, str) for k in stored):
        return None
    return stored


def _check_model_keys(
    mgr: CheckpointManager, manifest: Manifest, root: str, step: int, state_dict: dict[str, Any]
) -> None:
    """Refuse, before anything is read, a checkpoint whose model keys are not the model's.

    Under ``strict_loading`` Lightning's ``load_state_dict`` raised torch's RuntimeError
    (missing or unexpected keys) only after the restore had read the other tensors into the
    model's own shards. Every rank reads the same verified ``state.json``, so every rank
    raises alike.
    """
    with contextlib.suppress(IntegrityError, ManifestError, OSError):
        stored = _stored_keys(mgr, manifest, "state_dict")
        if stored is None:
            return
        have = set(stored)
        missing = sorted(
            k for k, v in state_dict.items() if k not in have and isinstance(v, torch.Tensor)
        )
        unexpected = sorted(have.difference(state_dict))
        if not missing and not unexpected:
            return
        parts = []
        if missing:
            parts.append(
                f"the model has {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
                "which the checkpoint lacks"
            )
        if unexpected:
            parts.append(
                f"the checkpoint has {unexpected[:8]}"
                f"{' ...' if len(unexpected) > 8 else ''}, which the model lacks"
            )
        raise StateMismatchError(
            f"{root} step {step} does not fit the model: {'; '.join(parts)}. Nothing was "
            "loaded. Build the model the checkpoint was saved from, or set "
            "strict_loading = False on the LightningModule to load the keys both have",
            missing=missing,
        )


def _everyone(strategy: Any, ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (collective where there is a process group)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return bool(strategy.reduce_boolean_decision(ok, all=True))
    return ok


def _load_rest(
    strategy: Any,
    mgr: CheckpointManager,
    root: str,
    step: int,
    targets: dict[str, Any],
    *,
    newest_good: bool,
) -> dict[str, Any]:
    """Load the rest of ``step``, whose model and optimizer states ``targets`` hold already.

    Where it does not verify (a corrupt ``callbacks.safetensors``) and ``newest_good``, the
    next older step of the store that verifies whole is restored instead, on every rank
    alike; else the error is raised.
    """
    older = [s for s in mgr.steps() if s < step] if newest_good else []
    while True:
        failed: CkptStoreError | None = None
        try:
            rest = _rest_keys(mgr.manifest(step), root, step)
            raw = mgr.load(step, keys=rest) if rest else {}
        except (IntegrityError, ManifestError) as e:
            failed = e
        if _everyone(strategy, failed is None):
            return raw
        if failed is None:
            failed = IntegrityError(f"{root} step {step} does not verify on another rank")
        while True:
            if not older:
                raise failed
            candidate = older.pop()
            log.warning(
                "%s step %d does not verify (%s); restoring step %d", root, step, failed, candidate
            )
            try:
                step = mgr.restore(targets, candidate)
                break
            except (IntegrityError, ManifestError) as e:  # raised on every rank alike
                failed, step = e, candidate


def _restore(
    strategy: Any, io: CkptStoreIO, root: str, *, allow_pickle: bool, newest_good: bool
) -> dict[str, Any]:
    """Restore the model and optimizers from the store ``root``; the rest of the checkpoint.

    ``newest_good``: the newest step that verifies on every rank; else the newest step,
    exactly. Collective.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from ._sharded_tensor import as_dtensors, back_to_shards

    model = strategy.model
    optimizers = _optimizers(strategy)
    fsdp1 = _is_fsdp1(strategy)
    strict = bool(getattr(strategy.lightning_module, "strict_loading", True))
    with _manager(io, root, allow_pickle=allow_pickle, create=False) as mgr:
        newest = mgr.latest_step()
        if newest is None:
            raise NoCheckpointError(f"{root} holds no committed checkpoint")
        # This job's own shards: restore reads into them whatever world size saved.
        own: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
        if optimizers:
            own["optimizer_states"] = [get_optimizer_state_dict(model, o) for o in optimizers]
        # A checkpoint of another kind, or of another model, is refused before anything is
        # read into the model (a manifest that does not read is the restore's to judge).
        # The newest manifest read once for both checks.
        manifest: Manifest | None = None
        with contextlib.suppress(IntegrityError, ManifestError):
            manifest = mgr.manifest(newest)
        if manifest is not None:
            _rest_keys(manifest, root, newest)
            if strict:
                _check_model_keys(mgr, manifest, root, newest, own["state_dict"])
        # FSDP1's ShardedTensors are filled through DTensor views of their shards.
        targets = as_dtensors(own, "state") if fsdp1 else own
        step = mgr.restore(targets, None if newest_good else newest)
        raw = _load_rest(strategy, mgr, root, step, targets, newest_good=newest_good)
        if fsdp1:
            own = back_to_shards(own, targets)
    checkpoint = _decode_checkpoint(raw)
    if fsdp1:  # FSDP1 loads sharded state only through the state-dict API
        set_model_state_dict(model, own["state_dict"], options=StateDictOptions(strict=strict))
    else:
        model.load_state_dict(own["state_dict"], strict=strict)
    for optimizer, osd in zip(optimizers, own.get("optimizer_states", []), strict=False):
        set_optimizer_state_dict(
            model, optimizer, optim_state_dict=osd, options=StateDictOptions(cpu_offload=True)
        )
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        strategy.barrier()
    log.debug("loaded sharded Lightning checkpoint %s (step %d)", root, step)
    return checkpoint

"""Exporting a checkpoint as one ``.safetensors`` or ``.pt`` file, or a Hugging Face directory.

What ``ckptstore export`` writes, for Python: :func:`export_step` (one file, written
atomically) and :func:`export_hf_step` (a Hugging Face checkpoint directory, streamed one
tensor at a time; see :func:`ckptstore.sharded.consolidate.export_hf`). DTensor checkpoints are
consolidated into full tensors on any world size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from .._progress import Progress
from ..errors import (
    CkptStoreError,
    ConfigError,
    IntegrityError,
    ManifestError,
    NoCheckpointError,
    PathExistsError,
    PathNotFoundError,
)
from ..manager import CheckpointManager
from ..manifest import Manifest
from ..sharded.consolidate import DEFAULT_MAX_SHARD, HFExportResult, choose_entry, export_hf
from ..state.capture import is_ema_state
from ..storage.base import step_gone
from .inspect import EntryInfo, read_state_entries
from .single import atomic_save, atomic_write
from .stores import committed_step, open_store, partial_copies_explained, reaching

if TYPE_CHECKING:
    from .export_dcp import DCPExportResult

__all__ = ["ExportResult", "export_dcp_step", "export_hf_step", "export_step"]


@dataclasses.dataclass
class ExportResult:
    """What ``ckptstore export`` wrote."""

    out: str
    step: int
    format: str
    key: str | None
    tensors: int
    bytes: int
    #: For a DTensor checkpoint, the world size whose shards were consolidated.
    consolidated_from: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return dataclasses.asdict(self)


def _choose_key(entries: list[EntryInfo], key: str | None, where: str) -> EntryInfo:
    chosen = choose_entry({e.key: e.kind for e in entries}, key, where)
    return next(e for e in entries if e.key == chosen)


def _refuse_per_rank(manifest: Manifest, where: str) -> None:
    """Per-rank state of several ranks has no one full form: never export one rank's part."""
    if manifest.sharding_kind == "sharded" and manifest.world_size > 1:
        raise CkptStoreError(
            f"{where} holds per-rank state saved with sharded=True by {manifest.world_size} "
            "ranks: each rank's part is opaque (e.g. an optimizer partition), so there is no "
            "full state to export, and one rank's part is not the model. Restore it on that "
            "many ranks instead (DTensor/FSDP2 checkpoints export in full)"
        )


def _flat_tensors(value: Any, key: str, where: str) -> dict[str, Any]:
    """The ``{name: tensor}`` dict to write as safetensors, copies only where needed."""
    if not isinstance(value, Mapping):
        raise CkptStoreError(
            f"{where}[{key!r}] is a {type(value).__name__}, not a state dict; export it to a "
            ".pt file instead"
        )
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in value.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise CkptStoreError(
                f"{where}[{key!r}][{name!r}] is a {type(t).__name__}, not a tensor; safetensors "
                "holds tensors only: export to a .pt file instead"
            )
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        covers = t.storage_offset() == 0 and t.numel() * t.element_size() == storage.nbytes()
        # safetensors refuses tensors that share memory (tied weights): store a copy each.
        if t.numel() and (ptr in seen or not covers):
            t = t.clone()
        elif t.numel():
            seen.add(ptr)
        out[name] = t
    return out


def _atomic_save_safetensors(
    tensors: dict[str, Any], out: str, metadata: dict[str, str], *, replace: bool
) -> None:
    """``safetensors.torch.save_file`` that is never seen half-written (tmp, fsync, replace)."""
    from safetensors.torch import save_file

    atomic_write(out, lambda tmp: save_file(tensors, tmp, metadata=metadata), replace=replace)


@contextlib.contextmanager
def _not_deleted(mgr: CheckpointManager, step: int) -> Iterator[None]:
    """Say a step deleted while it was exported was deleted, not that it is corrupt.

    Raises:
        NoCheckpointError: what failed was a read of a step no longer in the store.
    """
    try:
        yield
    except (IntegrityError, ManifestError):
        if not step_gone(mgr.storage, step):
            raise
        raise NoCheckpointError(
            f"{mgr.storage.describe(step)} was deleted while it was exported (a running "
            "job's retention, `ckptstore prune` or `rm`); it was not corrupt"
        ) from None


def _publish(out: str, write: Callable[[], None]) -> None:
    """Run ``write``; a file made at ``out`` while the export ran is kept, not replaced.

    Raises:
        PathExistsError: ``out`` appeared meanwhile (``write`` publishes without replacing
            unless ``--force``: nothing was replaced).
    """
    try:
        write()
    except PathExistsError:
        raise PathExistsError(
            f"{out}: made while the export ran, and not replaced; pass --force to overwrite it",
            path=out,
        ) from None


def _manifest(root: str | os.PathLike[str], step: int, so: Mapping[str, Any] | None) -> Manifest:
    storage = open_store(root, so)
    with reaching(storage.root):
        return storage.read_manifest(committed_step(storage, step))


def export_step(
    root: str | os.PathLike[str],
    step: int,
    out: str | os.PathLike[str],
    *,
    key: str | None = None,
    force: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
) -> ExportResult:
    """Write checkpoint ``step`` as one ``.safetensors`` (model weights) or ``.pt`` file.

    ``out`` ending in ``.safetensors`` gets one entry's tensors (``key``, default
    ``model``; an EMA entry gives its weights); any other name gets the whole state, or
    the entry ``key`` as it is stored, written with ``torch.save``, so that ``ckptstore
    import`` (or ``torch.load`` with ``weights_only=True``, numpy arrays allowed) reads it
    back. The file is written atomically (tmp, fsync, rename).

    A DTensor (FSDP2/TP) checkpoint is consolidated: every DTensor is assembled into its
    full tensor from the chunks all ranks saved (``load()`` without a process group), on
    any world size; ``consolidated_from`` then says how many ranks saved it. Per-rank
    ``sharded=True`` state of several ranks is refused. The state is loaded whole: for
    large models, :func:`export_hf_step` streams one tensor at a time.

    Args:
        root: the store: a local directory or an fsspec URL.
        step: the step to export.
        out: the file to write.
        key: the entry to write (safetensors: default ``model``, or the only entry; a
            ``.pt`` file: default the whole state).
        force: overwrite ``out`` if it exists.
        storage_options: fsspec options for a URL.
        progress: called as the export advances.

    Raises:
        FileExistsError: ``out`` exists and ``force`` is false.
        FileNotFoundError: the directory of ``out`` does not exist.
        NoCheckpointError: no store at ``root``, or no such step.
        IntegrityError: the checkpoint is corrupt.
        CkptStoreError: the chosen entry is not a flat dict of tensors (for safetensors),
            or the checkpoint holds per-rank state of several ranks.
    """
    out = os.fspath(out)
    if os.path.lexists(out) and not force:
        raise PathExistsError(f"{out}: already exists; pass --force to overwrite it", path=out)
    if os.path.isdir(out):  # --force replaces a file, never a directory
        raise PathExistsError(
            f"{out}: a directory; export writes one file here (give a file name, or --dcp / "
            "--hf for a directory)",
            path=out,
        )
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise PathNotFoundError(f"{parent}: no such directory", path=parent)
    report = progress or (lambda done, total, what: None)
    manifest = _manifest(root, step, storage_options)
    with CheckpointManager(
        root, keep=None, storage_options=storage_options, distributed=False
    ) as mgr:
        where = mgr.storage.describe(step)
        _refuse_per_rank(manifest, where)
        consolidated = manifest.world_size if manifest.dtensor else None
        report(0, 2, f"reading step {step}")
        if not out.endswith(".safetensors"):
            chosen = None
            if key is None:
                data = mgr.load(step)
            else:  # that entry, as it is stored (it was ignored: the whole state was written)
                chosen = _choose_key(read_state_entries(mgr.storage, manifest), key, where).key
                data = mgr.load(step, keys=[chosen])[chosen]
            report(1, 2, f"writing {os.path.basename(out)}")
            _publish(out, lambda: atomic_save(data, out, replace=force))
            report(2, 2, "done")
            n = _count_tensors(data)
            size = os.path.getsize(out)
            return ExportResult(
                out, step, "torch", None if chosen is None else str(chosen), n, size, consolidated
            )
        with _not_deleted(mgr, step):
            entry = _choose_key(read_state_entries(mgr.storage, manifest), key, where)
            # That entry alone: a model's weights are a third of a step with AdamW's moments.
            value = mgr.load(step, keys=[entry.key])[entry.key]
        if is_ema_state(value, entry.kind) and isinstance(value, Mapping):
            # An EMA's state, {"weights": state dict, "counters": ...}, with its kind or
            # without (one that lost it through export and import, as a restore reads it).
            value = value["weights"]
        tensors = _flat_tensors(value, str(entry.key), where)
        report(1, 2, f"writing {os.path.basename(out)}")
        meta = {"format": "pt", "ckptstore_step": str(step), "ckptstore_key": str(entry.key)}
        _publish(out, lambda: _atomic_save_safetensors(tensors, out, meta, replace=force))
        report(2, 2, "done")
        return ExportResult(
            out,
            step,
            "safetensors",
            str(entry.key),
            len(tensors),
            os.path.getsize(out),
            consolidated,
        )


def export_hf_step(
    root: str | os.PathLike[str],
    step: int,
    out_dir: str | os.PathLike[str],
    *,
    key: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD,
    storage_options: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
    config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
) -> HFExportResult:
    """Write one entry of ``step`` as a Hugging Face checkpoint directory (streaming, atomic).

    See :func:`ckptstore.sharded.consolidate.export_hf`: ``model.safetensors``, or shards of at most
    ``max_shard_size`` plus ``model.safetensors.index.json``; DTensor state consolidated on
    any world size, one tensor in memory at a time; ``out_dir`` appears whole or not at all.

    Args:
        root: the store: a local directory or an fsspec URL.
        step: the step to export.
        out_dir: the directory to create (it must not exist, or be empty).
        key: the entry to write (default: ``model``, or the only entry).
        max_shard_size: the largest shard, in bytes or as ``"5GB"``.
        storage_options: fsspec options for a URL.
        progress: called with the bytes written so far.
        config: the model's ``transformers`` config for ``config.json``: a JSON file's path
            or the dict; by default the one the HF integrations recorded in the checkpoint
            (without either, no ``config.json`` is written).

    Raises:
        FileExistsError: ``out_dir`` exists and is not an empty directory.
        NoCheckpointError: no store at ``root``, or no such step.
        IntegrityError: the checkpoint is corrupt.
        CkptStoreError: no such entry, not a flat dict of tensors, or per-rank state; a
            ``config`` that is not a readable JSON object.
    """
    given = _load_config(config)
    storage = open_store(root, storage_options)
    with reaching(storage.root):
        manifest = storage.read_manifest(committed_step(storage, step))
    _refuse_per_rank(manifest, storage.describe(step))
    written = [0]

    def advance(_name: str, n: int) -> None:
        written[0] += n
        if progress is not None:
            progress(written[0], None, _name)

    with partial_copies_explained(storage, manifest):
        return export_hf(
            storage,
            step,
            os.fspath(out_dir),
            key=key,
            max_shard_size=max_shard_size,
            manifest=manifest,
            progress=advance,
            config=given,
        )


def export_dcp_step(
    root: str | os.PathLike[str],
    step: int,
    out_dir: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    allow_pickle: bool = False,
) -> DCPExportResult:
    """Write ``step`` as a plain DCP checkpoint directory (streaming, atomic).

    See :func:`ckptstore.ops.export_dcp.export_dcp`: ``.metadata`` and ``__0_0.distcp``,
    DTensor chunks kept as DCP items, one chunk in memory at a time.

    Raises:
        PathExistsError: ``out_dir`` exists and is not an empty directory.
        NoCheckpointError: no store at ``root``, or no such step.
        IntegrityError: the checkpoint is corrupt (nothing is left behind).
        CkptStoreError: per-rank state of several ranks.
    """
    # Imported here: DCP's modules pull in torch.distributed.tensor (~0.55 s on the test
    # VM), which the other exports do without where the step has no DTensor state.
    from .export_dcp import export_dcp

    storage = open_store(root, storage_options)
    with reaching(storage.root):
        manifest = storage.read_manifest(committed_step(storage, step))
    _refuse_per_rank(manifest, storage.describe(step))
    with partial_copies_explained(storage, manifest):
        return export_dcp(storage, step, out_dir, manifest=manifest, allow_pickle=allow_pickle)


#: The largest model config ``export --hf --config`` reads (HF configs are kilobytes).
MAX_CONFIG_BYTES = 16 << 20


def _read_config_file(where: str) -> bytes:
    """A regular file's bytes, up to :data:`MAX_CONFIG_BYTES`.

    A FIFO or a device is refused without blocking (``/dev/zero`` was read without end, a
    FIFO hung the export).

    Raises:
        OSError: it cannot be opened or read.
        ConfigError: it is not a regular file, or too large.
    """
    from ..storage.directio import open_nonblocking

    fd = open_nonblocking(where, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{where}: cannot read the model config (not a regular file)")
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{where}: cannot read the model config (larger than {MAX_CONFIG_BYTES} bytes)"
        )
    return data


def _load_config(
    config: str | os.PathLike[str] | Mapping[str, Any] | None,
) -> dict[str, Any] | None:
    """``export_hf_step``'s ``config``: a dict, read (and checked) before anything is written."""
    if config is None:
        return None
    if isinstance(config, Mapping):
        doc: Any = dict(config)
        where = "config"
    else:
        where = os.fspath(config)
        try:
            doc = json.loads(_read_config_file(where).decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            msg = f"{where}: cannot read the model config ({e})"
            raise ConfigError(msg) from None
    if not isinstance(doc, dict):
        msg = f"{where}: a model config must be a JSON object, got {type(doc).__name__}"
        raise ConfigError(msg)
    try:
        json.dumps(doc, allow_nan=False)
    except (TypeError, ValueError) as e:
        msg = f"{where}: the model config must be JSON without NaN or infinity ({e})"
        raise ConfigError(msg) from None
    return doc


def _count_tensors(obj: Any, depth: int = 0) -> int:
    if isinstance(obj, torch.Tensor):
        return 1
    if depth > 200:
        return 0
    if isinstance(obj, Mapping):
        return sum(_count_tensors(v, depth + 1) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_count_tensors(v, depth + 1) for v in obj)
    return 0

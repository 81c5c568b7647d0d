"""The ``ckptstore`` command line: ls, verify, prune, gc, inspect, diff, import, export.

Each command parses its arguments, calls one typed function that does the work and returns a
result object, then prints it (a table for people, ``--json`` for programs). One place,
:func:`main`, maps errors to exit codes and messages:

- 0: all is well;
- 1: a problem was found (a checkpoint fails to verify, no checkpoint, a corrupt input, any
  :class:`~ckptstore.errors.CkptStoreError`, an unreadable path); one line on stderr,
  ``ckptstore: error: <message>``, never a traceback;
- 2: usage errors (unknown options, bad values, missing flags).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime as _dt
import errno
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TextIO

from . import __version__
from .chunks import INDEX_FILE, ChunkIndex
from .codec.tree import SUPPORTED_DTYPES
from .consolidate import (
    DEFAULT_MAX_SHARD,
    HFExportResult,
    StepTensors,
    TensorRef,
    choose_entry,
    export_hf,
    parse_size,
)
from .errors import CkptStoreError, IntegrityError, NoCheckpointError, StoreLockedError
from .importers import read_source
from .integrity import VerifyReport, format_crc
from .layout import MANIFEST_NAME, STATE_NAME, parse_step_dirname, state_file
from .manager import CheckpointManager
from .manifest import Manifest
from .retention import KeepBest, KeepEvery, KeepLast, RetentionPolicy
from .single import atomic_save, atomic_write
from .storage import LocalStorage, Storage
from .verify import verify_checkpoint, verify_file

__all__ = ["main"]

PROG = "ckptstore"
#: Wrapper prefixes stripped from the keys of imported state dicts (DDP, torch.compile).
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_INT_RE = re.compile(r"-?\d+")
_FLOAT_RE = re.compile(r"-?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
_JSON_WORDS: dict[str, Any] = {"true": True, "false": False, "null": None}


class UsageError(Exception):
    """Arguments that parse but make no sense together; exit code 2."""


# ---- small formatting helpers ------------------------------------------------------------


def human_bytes(n: int) -> str:
    """A size for people, in SI units: ``160 B``, ``1.2 kB``, ``3.4 GB``."""
    if n < 1000:
        return f"{n} B"
    value = float(n)
    for unit in ("kB", "MB", "GB", "TB", "PB"):
        value /= 1000.0
        if value < 999.95 or unit == "PB":
            return f"{value:.1f} {unit}"
    return f"{n} B"  # pragma: no cover - unreachable


def _created_dt(manifest: Manifest) -> _dt.datetime | None:
    dt = manifest.created_datetime
    if dt is None:
        return None
    if dt.tzinfo is None:  # the manifest always writes UTC; a naive time is UTC too
        dt = dt.replace(tzinfo=_dt.timezone.utc)
    return dt.astimezone(_dt.timezone.utc)


def _created_text(manifest: Manifest) -> str:
    dt = _created_dt(manifest)
    return dt.strftime("%Y-%m-%d %H:%M:%S") if dt is not None else (manifest.created or "-")


def _created_json(manifest: Manifest) -> str:
    dt = _created_dt(manifest)
    return dt.strftime("%Y-%m-%dT%H:%M:%SZ") if dt is not None else manifest.created


def _metric_json(v: float) -> float | str:
    # JSON has no NaN/inf; spell them as the manifest does.
    if math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def _metrics_text(metrics: Mapping[str, float]) -> str:
    return ",".join(f"{k}={v:.6g}" for k, v in sorted(metrics.items()))


def _table(rows: Sequence[Sequence[str]], *, right: Sequence[int] = (), indent: str = "") -> str:
    """Align ``rows`` (the first is the header) in columns; ``right`` columns right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append((indent + "  ".join(cells)).rstrip())
    return "\n".join(lines)


def _one_line(message: str) -> str:
    parts = [p.strip() for p in message.splitlines() if p.strip()]
    return " | ".join(parts) if parts else message


# ---- progress -----------------------------------------------------------------------------


class _NullBar:
    """Stands in for a tqdm bar when stderr is not a terminal."""

    def update(self, n: int = 1) -> None:
        """Do nothing."""

    def set_postfix_str(self, s: str) -> None:
        """Do nothing."""


@contextlib.contextmanager
def _progress(total: int | None, desc: str, unit: str = "it") -> Iterator[Any]:
    """A tqdm bar on stderr when stderr is a terminal, else a no-op stand-in."""
    if not sys.stderr.isatty():
        yield _NullBar()
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()


# ---- opening stores -----------------------------------------------------------------------


def parse_storage_options(items: Sequence[str] | None) -> dict[str, Any]:
    """``["anon=true", "client_kwargs.region_name=eu-west-1"]`` -> fsspec storage options.

    Values ``true``/``false``/``null`` and numbers become JSON values, a value that is a JSON
    string or object is parsed (``secret='"0123"'`` stays the string ``0123``), anything
    else stays a string. Dots in a key nest it: ``client_kwargs.region_name=x`` gives
    ``{"client_kwargs": {"region_name": "x"}}``.

    Raises:
        UsageError: an item is not ``KEY=VALUE``, or a key is both a value and a parent.
    """
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, text = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise UsageError(f"--storage-option expects KEY=VALUE, got {item!r}")
        value: Any
        if text in _JSON_WORDS:
            value = _JSON_WORDS[text]
        elif _INT_RE.fullmatch(text):
            value = int(text)
        elif _FLOAT_RE.fullmatch(text):
            value = float(text)
        elif text[:1] in ('"', "{"):
            try:
                value = json.loads(text)
            except ValueError:
                raise UsageError(f"--storage-option {key}: invalid JSON {text!r}") from None
        else:
            value = text
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise UsageError(f"--storage-option {key}: {p!r} already has a value")
            node = child
        node[leaf] = value
    return out


def _open(
    root: str,
    storage_options: Mapping[str, Any],
    *,
    keep: RetentionPolicy | Sequence[RetentionPolicy] | None = None,
) -> CheckpointManager:
    """A manager for an existing store: a local ``root`` that does not exist is an error.

    Raises:
        UsageError: an argument the manager refuses (e.g. storage options for a local path).
        NoCheckpointError: ``root`` is a local path that does not exist.
    """
    try:
        mgr = CheckpointManager(root, keep=keep, storage_options=storage_options or None)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if isinstance(mgr.storage, LocalStorage) and not os.path.isdir(mgr.root):
        mgr.close()
        raise NoCheckpointError(f"{mgr.root}: no such directory")
    return mgr


# ---- ls -----------------------------------------------------------------------------------


@dataclasses.dataclass
class StepInfo:
    """One row of ``ckptstore ls``: a committed step, or one whose manifest is broken."""

    step: int
    pinned: bool
    manifest: Manifest | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``ckptstore ls --json``)."""
        m = self.manifest
        return {
            "step": self.step,
            "created": _created_json(m) if m else None,
            "bytes": m.total_bytes if m else None,
            "files": len(m.files) if m else None,
            "metrics": {k: _metric_json(v) for k, v in m.metrics.items()} if m else None,
            "pinned": self.pinned,
            "format": m.format if m else None,
            "world_size": m.world_size if m else None,
            "sharded": m.sharded if m else None,
            "sharding": m.sharding_kind if m else None,
            "error": self.error,
        }


@dataclasses.dataclass
class LsResult:
    """What ``ckptstore ls`` found."""

    root: str
    steps: list[StepInfo]
    garbage: list[str]


def list_store(root: str, storage_options: Mapping[str, Any]) -> LsResult:
    """Every committed step of ``root`` with its manifest (or why it cannot be read).

    Raises:
        NoCheckpointError: ``root`` is a local path that does not exist.
    """
    with _open(root, storage_options) as mgr:
        infos = []
        steps, garbage = mgr.storage.scan()
        # The storage read, not mgr.manifest(): that re-lists the store per step, quadratic
        # on an object store; and a local store answers from its listing cache.
        manifests = mgr.storage.read_manifests(steps, complete=True)
        for step in steps:
            pinned = mgr.storage.is_pinned(step)
            m = manifests[step]
            if isinstance(m, CkptStoreError):
                infos.append(StepInfo(step, pinned, error=_one_line(str(m))))
            else:
                infos.append(StepInfo(step, pinned, manifest=m))
        return LsResult(mgr.root, infos, garbage)


def _print_ls(res: LsResult, as_json: bool, out: TextIO) -> None:
    if as_json:
        print(json.dumps([s.to_dict() for s in res.steps], indent=2), file=out)
        return
    if not res.steps:
        print(f"{res.root}: no checkpoints", file=out)
    else:
        rows = [
            ["step", "created (UTC)", "size", "files", "world", "sharding", "metrics", "pinned"]
        ]
        for s in res.steps:
            if s.manifest is None:
                rows.append([str(s.step), "-", "-", "-", "-", "-", f"BROKEN: {s.error}", ""])
                continue
            m = s.manifest
            rows.append(
                [
                    str(s.step),
                    _created_text(m),
                    human_bytes(m.total_bytes),
                    str(len(m.files)),
                    str(m.world_size),
                    m.sharding_kind,
                    _metrics_text(m.metrics),
                    "yes" if s.pinned else "",
                ]
            )
        print(_table(rows, right=(0, 2, 3, 4)), file=out)
        total = sum(s.manifest.total_bytes for s in res.steps if s.manifest)
        print(f"{len(res.steps)} checkpoints, {human_bytes(total)}", file=out)
    if res.garbage:
        n = len(res.garbage)
        print(
            f"{n} stale {'entry' if n == 1 else 'entries'} (interrupted saves or deletions): "
            f"{', '.join(res.garbage)}; `ckptstore gc` removes them",
            file=out,
        )


def cmd_ls(args: argparse.Namespace) -> int:
    """``ckptstore ls ROOT``."""
    res = list_store(args.root, _storage_options(args))
    _print_ls(res, _json(args), sys.stdout)
    return 1 if any(s.error for s in res.steps) else 0


# ---- verify -------------------------------------------------------------------------------


def _local_path(target: str) -> str | None:
    """The local path ``target`` names, or ``None`` for a non-local URL."""
    protocol, sep, rest = target.partition("://")
    if not sep:
        return target
    return rest if protocol in ("file", "local") else None


def verify_target(
    target: str,
    storage_options: Mapping[str, Any],
    *,
    step: int | None = None,
    all_steps: bool = False,
    deep: bool = True,
) -> list[VerifyReport]:
    """Verify a store (the newest step, ``step``, or every step), a step directory, or a file.

    Raises:
        NoCheckpointError: the store is empty or ``step`` is not committed.
        UsageError: ``--step``/``--all`` given for a lone file.
    """
    path = _local_path(target)
    if path is not None and os.path.isfile(path):
        if step is not None or all_steps:
            raise UsageError(f"{target} is a file: --step and --all apply to stores only")
        return [verify_file(path, deep=deep)]
    if path is not None and not os.path.exists(path):
        raise NoCheckpointError(f"{path}: no such file or directory")
    if path is not None and step is None and not all_steps:
        # A step directory given directly (ROOT/step-000000001000): verify that step.
        name = os.path.basename(os.path.normpath(path))
        parsed = parse_step_dirname(name)
        if parsed is not None and os.path.isfile(os.path.join(path, MANIFEST_NAME)):
            target, step = os.path.dirname(os.path.abspath(path)), parsed
    with _open(target, storage_options) as mgr:
        if not all_steps:
            return [mgr.verify(step, deep=deep)]
        steps = mgr.steps()
        if not steps:
            raise NoCheckpointError(f"{mgr.root}: no committed checkpoint")
        reports = []
        with _progress(len(steps), "verify", unit="ckpt") as bar:
            for s in steps:
                bar.set_postfix_str(f"step {s}")
                reports.append(verify_checkpoint(mgr.storage, s, deep=deep))
                bar.update(1)
        return reports


def _print_verify(reports: list[VerifyReport], as_json: bool, out: TextIO) -> None:
    if as_json:
        print(json.dumps([r.to_dict() for r in reports], indent=2), file=out)
        return
    for r in reports:
        name = f"step {r.step}" if r.step is not None else r.target
        if r.ok:
            files = f"{r.files} file" + ("" if r.files == 1 else "s")
            checked = (
                f"{human_bytes(r.bytes_checked)} checked"
                if r.deep
                else "quick: sizes and headers, no checksums"
            )
            print(f"{name}: OK ({files}, {checked})", file=out)
        else:
            print(f"{name}: FAILED", file=out)
            for p in r.problems:
                print(f"    {_one_line(p)}", file=out)
    if len(reports) > 1:
        bad = sum(not r.ok for r in reports)
        print(f"{len(reports)} checkpoints verified, {bad} failed", file=out)


def cmd_verify(args: argparse.Namespace) -> int:
    """``ckptstore verify ROOT|FILE [--step N|--all] [--quick]``."""
    reports = verify_target(
        args.target,
        _storage_options(args),
        step=args.step,
        all_steps=args.all,
        deep=not args.quick,
    )
    _print_verify(reports, _json(args), sys.stdout)
    return 0 if all(r.ok for r in reports) else 1


# ---- prune / gc ---------------------------------------------------------------------------


@dataclasses.dataclass
class PruneResult:
    """Steps deleted (or, for a dry run, that would be) and steps kept."""

    root: str
    dry_run: bool
    deleted: list[int]
    kept: list[int]

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "root": self.root,
            "dry_run": self.dry_run,
            "deleted": self.deleted,
            "kept": self.kept,
        }


def build_policy(
    *,
    keep_last: int | None = None,
    keep_best: int | None = None,
    metric: str | None = None,
    mode: str = "min",
    keep_every: int | None = None,
) -> list[RetentionPolicy]:
    """The retention policies the prune flags ask for (their union is applied).

    Raises:
        UsageError: no keep flag, or ``--keep-best`` without ``--metric`` (or the reverse).
    """
    policies: list[RetentionPolicy] = []
    if keep_last is not None:
        policies.append(KeepLast(keep_last))
    if keep_best is not None:
        if not metric:
            raise UsageError("--keep-best needs --metric NAME (the metric to rank by)")
        policies.append(KeepBest(keep_best, metric, mode))
    elif metric is not None:
        raise UsageError("--metric is only meaningful with --keep-best K")
    if keep_every is not None:
        policies.append(KeepEvery(keep_every))
    if not policies:
        raise UsageError(
            "say what to keep: --keep-last N, --keep-best K --metric M, and/or --keep-every S"
        )
    return policies


def prune_store(
    root: str,
    storage_options: Mapping[str, Any],
    policies: list[RetentionPolicy],
    *,
    dry_run: bool,
) -> PruneResult:
    """Apply (or with ``dry_run`` only plan) retention on ``root``.

    Raises:
        StoreLockedError: another process writes the store (not for a dry run).
        CommitError: a checkpoint could not be deleted.
    """
    with _open(root, storage_options, keep=policies) as mgr:
        before = mgr.steps()
        try:
            deleted = mgr.plan_prune() if dry_run else mgr.prune()
        except StoreLockedError as e:
            # The generic advice ("give this one its own directory") is for a second job.
            raise StoreLockedError(
                f"{e.message.split(';')[0]}: nothing was deleted. A job is writing this store, "
                "and its own keep= policy prunes after each of its saves; run `ckptstore "
                "prune` once it has stopped (--dry-run shows the plan now)"
            ) from None
        gone = set(deleted)
        return PruneResult(mgr.root, dry_run, deleted, [s for s in before if s not in gone])


def _steps_text(steps: Sequence[int]) -> str:
    return ", ".join(str(s) for s in steps)


def _print_prune(res: PruneResult, as_json: bool, out: TextIO) -> None:
    if as_json:
        print(json.dumps(res.to_dict(), indent=2), file=out)
        return
    if not res.deleted and not res.kept:
        print(f"{res.root}: no checkpoints", file=out)
        return
    n = len(res.deleted)
    if not res.deleted:
        print("nothing to delete", file=out)
    elif res.dry_run:
        print(f"would delete {n} step{'s' * (n != 1)}: {_steps_text(res.deleted)}", file=out)
    else:
        print(f"deleted {n} step{'s' * (n != 1)}: {_steps_text(res.deleted)}", file=out)
    k = len(res.kept)
    print(
        f"{'would keep' if res.dry_run else 'kept'} {k} step{'s' * (k != 1)}: "
        f"{_steps_text(res.kept)}",
        file=out,
    )
    if res.dry_run:
        print("dry run: nothing was deleted", file=out)


def cmd_prune(args: argparse.Namespace) -> int:
    """``ckptstore prune ROOT --keep-last N [--keep-best K --metric M] [--keep-every S]``."""
    policies = build_policy(
        keep_last=args.keep_last,
        keep_best=args.keep_best,
        metric=args.metric,
        mode=args.mode,
        keep_every=args.keep_every,
    )
    res = prune_store(args.root, _storage_options(args), policies, dry_run=args.dry_run)
    _print_prune(res, _json(args), sys.stdout)
    return 0


def gc_store(root: str, storage_options: Mapping[str, Any]) -> list[str]:
    """Remove stale tmp/trash entries and manifest-less step directories; their names.

    Raises:
        StoreLockedError: another process writes the store (a save may be in flight).
    """
    with _open(root, storage_options) as mgr:
        return mgr.gc()


def cmd_gc(args: argparse.Namespace) -> int:
    """``ckptstore gc ROOT``."""
    removed = gc_store(args.root, _storage_options(args))
    if _json(args):
        print(json.dumps({"removed": removed}, indent=2))
    elif not removed:
        print("nothing to remove")
    else:
        for name in removed:
            print(f"removed {name}")
    return 0


# ---- inspect ------------------------------------------------------------------------------


@dataclasses.dataclass
class TensorInfo:
    """One tensor recorded in ``state.json`` (no payload is read)."""

    name: str
    dtype: str
    shape: list[int]
    bytes: int
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return dataclasses.asdict(self)


@dataclasses.dataclass
class EntryInfo:
    """One top-level entry of a stored state: its kind, tensors and a summary."""

    key: str | int
    kind: str
    summary: str
    tensors: list[TensorInfo]

    @property
    def stored_bytes(self) -> int:
        """Bytes of the tensors stored for this entry (views and shared ones not counted)."""
        return sum(t.bytes for t in self.tensors if not t.note.startswith(("view", "shares")))

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "key": self.key,
            "kind": self.kind,
            "summary": self.summary,
            "tensor_bytes": self.stored_bytes,
            "tensors": [t.to_dict() for t in self.tensors],
        }


@dataclasses.dataclass
class ShardedTensorInfo:
    """One sharded (DTensor) tensor of the chunk index: its full shape and how it was laid out."""

    name: str
    dtype: str
    shape: list[int]
    bytes: int
    mesh: list[int]
    mesh_dims: list[str]
    placements: list[str]
    chunks: int

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return dataclasses.asdict(self)

    @property
    def mesh_text(self) -> str:
        """``shard=2`` / ``replicate=2,shard=4``, or ``[2]`` for unnamed mesh dimensions."""
        if not self.mesh:
            return "-"
        if len(self.mesh_dims) == len(self.mesh):
            return ",".join(f"{n}={d}" for n, d in zip(self.mesh_dims, self.mesh, strict=True))
        return str(self.mesh)


@dataclasses.dataclass
class InspectResult:
    """A checkpoint's manifest and the structure of its state."""

    where: str
    manifest: Manifest
    pinned: bool
    entries: list[EntryInfo]
    sharded_tensors: list[ShardedTensorInfo] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        m = self.manifest
        return {
            "where": self.where,
            "step": m.step,
            "created": _created_json(m),
            "format": m.format,
            "format_version": m.format_version,
            "world_size": m.world_size,
            "sharded": m.sharded,
            "sharding": m.sharding_kind,
            "pinned": self.pinned,
            "versions": dict(m.versions),
            "metrics": {k: _metric_json(v) for k, v in m.metrics.items()},
            "metadata": dict(m.metadata),
            "files": {n: e.to_json() for n, e in sorted(m.files.items())},
            "bytes": m.total_bytes,
            "entries": [e.to_dict() for e in self.entries],
            "sharded_tensors": [t.to_dict() for t in self.sharded_tensors],
        }


_MAX_WALK_DEPTH = 250


class _TreeWalker:
    """Collects tensors and kinds from a ``state.json`` tree without loading any payload."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.seen: dict[tuple[Any, Any], str] = {}

    def bad(self, what: str) -> IntegrityError:
        return IntegrityError(f"{self.where}: {what}; the checkpoint is corrupt")

    def entry(self, key: str | int, node: Any) -> EntryInfo:
        kind = "data"
        if isinstance(node, dict) and node.get("t") == "stateful":
            k = node.get("kind")
            kind = k if isinstance(k, str) else "stateful"
            node = node.get("v")
        tensors: list[TensorInfo] = []
        self.walk(node, [], tensors, 0)
        return EntryInfo(key, kind, _summary(node), tensors)

    def walk(self, node: Any, path: list[str], out: list[TensorInfo], depth: int) -> None:
        if depth > _MAX_WALK_DEPTH:
            raise self.bad("state nested too deeply")
        if isinstance(node, list):
            for i, x in enumerate(node):
                self.walk(x, [*path, str(i)], out, depth + 1)
            return
        if not isinstance(node, dict):
            return
        t = node.get("t")
        if t in ("dict", "odict"):
            keys, vals = node.get("keys"), node.get("vals")
            if not isinstance(keys, list) or not isinstance(vals, list) or len(keys) != len(vals):
                raise self.bad(f"malformed dict at {'.'.join(path) or '<root>'}")
            for k, v in zip(keys, vals, strict=True):
                self.walk(v, [*path, str(k)], out, depth + 1)
        elif t in ("tuple", "stateful"):
            self.walk(node.get("v"), path, out, depth + 1)
        elif t in ("tensor", "view", "ndarray", "dtensor"):
            out.append(self.tensor(node, ".".join(path) or "_"))

    def tensor(self, node: Mapping[str, Any], name: str) -> TensorInfo:
        dtype, shape = node.get("dtype"), node.get("shape")
        if (
            not isinstance(dtype, str)
            or not isinstance(shape, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise self.bad(f"tensor {name!r} has a malformed dtype or shape")
        td = SUPPORTED_DTYPES.get(dtype)
        numel = math.prod(shape)
        nbytes = numel * td.itemsize if td is not None else 0
        ref = (node.get("file"), node.get("key"))
        note = ""
        if node.get("t") == "dtensor":
            return TensorInfo(name, dtype, list(shape), nbytes, "sharded")
        if node.get("t") == "view":
            note = f"view of {self.seen.get(ref, ref[1])}"
        elif ref in self.seen:
            note = f"shares {self.seen[ref]}"
        elif node.get("t") == "ndarray":
            note = "numpy"
        if node.get("t") != "view":
            self.seen.setdefault(ref, name)
        return TensorInfo(name, dtype, list(shape), nbytes, note)


def _summary(node: Any) -> str:
    """A few words on a node of ``state.json``: ``int 5``, ``dict (3 keys)``, ..."""
    if node is None or isinstance(node, bool | int | float | str):
        text = json.dumps(node)
        text = text if len(text) <= 40 else text[:37] + "..."
        return f"{type(node).__name__} {text}" if node is not None else "None"
    if isinstance(node, list):
        return f"list ({len(node)} items)"
    if isinstance(node, dict):
        t = node.get("t")
        if t in ("dict", "odict"):
            keys = node.get("keys")
            return f"dict ({len(keys) if isinstance(keys, list) else '?'} keys)"
        if t == "tuple":
            v = node.get("v")
            return f"tuple ({len(v) if isinstance(v, list) else '?'} items)"
        if t in ("tensor", "view", "ndarray", "dtensor"):
            return f"{t} {node.get('dtype')}{node.get('shape')}"
        if t in ("dtype", "device"):
            return f"{t} {node.get('v')}"
        return str(t)
    return type(node).__name__


def inspect_step(
    root: str, storage_options: Mapping[str, Any], step: int | None = None
) -> InspectResult:
    """The manifest and state structure of ``step`` (default: the newest).

    Only ``manifest.json``, ``state.json`` and, for a DTensor checkpoint, its chunk index
    ``dtensors.json`` are read (their checksums checked), never a payload. For a DTensor
    checkpoint the result lists every sharded tensor: full shape, dtype, the mesh and
    placements it was saved with, and its number of saved chunks.

    Raises:
        NoCheckpointError: no such step.
        ManifestError, IntegrityError: the manifest, ``state.json`` or the index is corrupt.
    """
    with _open(root, storage_options) as mgr:
        manifest = mgr.manifest(step)
        s = manifest.step
        where = mgr.storage.describe(s)
        return InspectResult(
            where,
            manifest,
            mgr.storage.is_pinned(s),
            _state_entries(mgr.storage, manifest),
            _sharded_tensors(mgr.storage, manifest),
        )


def _sharded_tensors(storage: Storage, manifest: Manifest) -> list[ShardedTensorInfo]:
    """The tensors of a DTensor checkpoint's chunk index (none for other checkpoints)."""
    if not manifest.dtensor:
        return []
    entry = manifest.files.get(INDEX_FILE)
    if entry is None:
        raise IntegrityError(f"{storage.describe(manifest.step)}: manifest lists no {INDEX_FILE}")
    raw = storage.read_file(manifest.step, INDEX_FILE, entry)  # checksum checked
    index = ChunkIndex.from_bytes(raw, manifest.files, storage.describe(manifest.step, INDEX_FILE))
    return [
        ShardedTensorInfo(
            name,
            t.dtype,
            list(t.shape),
            t.nbytes,
            list(t.mesh),
            list(t.mesh_dims),
            list(t.placements),
            len(t.chunks),
        )
        for name, t in sorted(index.tensors.items())
    ]


def _state_entries(storage: Storage, manifest: Manifest) -> list[EntryInfo]:
    # Per-rank state has one tree per rank: rank 0's shows the structure.
    name = state_file(0) if manifest.sharding_kind == "sharded" else STATE_NAME
    where = storage.describe(manifest.step, name)
    entry = manifest.files.get(name)
    if entry is None:
        raise IntegrityError(f"{storage.describe(manifest.step)}: manifest lists no {name}")
    raw = storage.read_file(manifest.step, name, entry)  # checksum checked
    try:
        tree = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise IntegrityError(f"{where}: not valid JSON ({e})") from None
    root = tree.get("root") if isinstance(tree, dict) else None
    keys = root.get("keys") if isinstance(root, dict) else None
    vals = root.get("vals") if isinstance(root, dict) else None
    if not isinstance(keys, list) or not isinstance(vals, list) or len(keys) != len(vals):
        raise IntegrityError(f"{where}: malformed root; the checkpoint is corrupt")
    walker = _TreeWalker(where)
    out = []
    for k, v in zip(keys, vals, strict=True):
        if isinstance(k, bool) or not isinstance(k, str | int):
            raise IntegrityError(f"{where}: top-level key {k!r} is not str or int")
        out.append(walker.entry(k, v))
    return out


def _print_inspect(res: InspectResult, as_json: bool, out: TextIO) -> None:
    if as_json:
        print(json.dumps(res.to_dict(), indent=2, default=str), file=out)
        return
    m = res.manifest
    head = [
        ["step", f"{m.step}  ({res.where})"],
        ["created", f"{_created_text(m)} UTC"],
        [
            "format",
            f"{m.format}, format version {m.format_version}, world size {m.world_size}, "
            f"{m.sharding_kind}",
        ],
        ["versions", ", ".join(f"{k} {v}" for k, v in sorted(m.versions.items())) or "-"],
        ["metrics", _metrics_text(m.metrics) or "-"],
        [
            "metadata",
            json.dumps(dict(m.metadata), sort_keys=True, default=str) if m.metadata else "-",
        ],
        ["pinned", "yes" if res.pinned else "no"],
        ["size", f"{human_bytes(m.total_bytes)} in {len(m.files)} files"],
    ]
    print(_table(head), file=out)
    print("\nfiles", file=out)
    rows = [["name", "size", "crc32c", "codec", "compression", "rank"]]
    for name, e in sorted(m.files.items()):
        rows.append(
            [
                name,
                human_bytes(e.bytes),
                format_crc(e.crc32c),
                e.codec,
                e.compression or "-",
                "-" if e.rank is None else str(e.rank),
            ]
        )
    print(_table(rows, right=(1,), indent="  "), file=out)
    per_rank = " (rank 0's part of per-rank state)" if m.sharding_kind == "sharded" else ""
    print(f"\nstate{per_rank}", file=out)
    for ent in res.entries:
        n = len(ent.tensors)
        extra = f"{n} tensor{'s' * (n != 1)}, {human_bytes(ent.stored_bytes)}" if n else ent.summary
        print(f"  {ent.key!s}: {ent.kind} ({extra})", file=out)
        if ent.tensors:
            trows = [["name", "dtype", "shape", "bytes", ""]]
            for t in ent.tensors:
                shape = "[" + ", ".join(str(d) for d in t.shape) + "]"
                trows.append([t.name, t.dtype, shape, human_bytes(t.bytes), t.note])
            print(_table(trows, right=(3,), indent="    "), file=out)
    if res.sharded_tensors:
        n = len(res.sharded_tensors)
        chunks = sum(t.chunks for t in res.sharded_tensors)
        print(
            f"\nsharded tensors ({n} in {INDEX_FILE}, {chunks} chunks, saved by "
            f"{m.world_size} rank{'s' * (m.world_size != 1)})",
            file=out,
        )
        srows = [["name", "dtype", "shape", "bytes", "mesh", "placements", "chunks"]]
        for sti in res.sharded_tensors:
            srows.append(
                [
                    sti.name,
                    sti.dtype,
                    "[" + ", ".join(str(d) for d in sti.shape) + "]",
                    human_bytes(sti.bytes),
                    sti.mesh_text,
                    ",".join(sti.placements) or "-",
                    str(sti.chunks),
                ]
            )
        print(_table(srows, right=(3, 6), indent="  "), file=out)


def cmd_inspect(args: argparse.Namespace) -> int:
    """``ckptstore inspect ROOT [--step N]``."""
    res = inspect_step(args.root, _storage_options(args), args.step)
    _print_inspect(res, _json(args), sys.stdout)
    return 0


# ---- import -------------------------------------------------------------------------------


@dataclasses.dataclass
class ImportResult:
    """What ``ckptstore import`` stored."""

    source: str
    where: str
    step: int
    keys: list[str]
    bytes: int
    notes: list[str]
    kind: str = "torch"

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return dataclasses.asdict(self)


def _strip_wrapper_prefix(sd: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Remove ``module.``/``_orig_mod.`` prefixes shared by every key of a flat state dict."""
    keys = list(sd)
    stripped = ""
    changed = True
    while changed and keys:
        changed = False
        for p in _WRAPPER_PREFIXES:
            if all(k.startswith(p) and len(k) > len(p) for k in keys):
                keys = [k[len(p) :] for k in keys]
                stripped += p
                changed = True
    if not stripped:
        return sd, ""
    out: dict[str, Any] = (
        collections.OrderedDict() if isinstance(sd, collections.OrderedDict) else {}
    )
    for old, new in zip(sd, keys, strict=True):
        out[new] = sd[old]
    meta = getattr(sd, "_metadata", None)
    if isinstance(meta, dict):
        # Module versions keyed by submodule path: keep the wrapped module's, re-rooted.
        new_meta = {}
        outer = stripped[:-1]
        for k, v in meta.items():
            if k == outer:
                new_meta[""] = v
            elif k.startswith(stripped):
                new_meta[k[len(stripped) :]] = v
        out._metadata = new_meta  # type: ignore[attr-defined]
    return out, stripped


def _is_flat_tensor_dict(obj: Any) -> bool:
    import torch

    return (
        isinstance(obj, dict)
        and len(obj) > 0
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())
    )


def prepare_import(obj: Any, *, key: str = "model") -> tuple[dict[Any, Any], list[str]]:
    """Shape a loaded ``torch.save`` object for :meth:`CheckpointManager.save`.

    A bare state dict (``{name: tensor}``) is stored under ``key``; every flat tensor dict
    loses a ``module.``/``_orig_mod.`` prefix shared by all its keys. Returns the state and
    notes on what was changed.

    Raises:
        CkptStoreError: ``obj`` is not a dict.
    """
    notes: list[str] = []
    if not isinstance(obj, dict):
        raise CkptStoreError(
            f"the file holds a {type(obj).__name__}, not a dict; ckptstore stores a dict of "
            "named entries (e.g. {'model': state_dict, 'optimizer': ...})"
        )
    if _is_flat_tensor_dict(obj):
        sd, prefix = _strip_wrapper_prefix(obj)
        notes.append(f"a bare state dict: stored under {key!r}")
        if prefix:
            notes.append(f"stripped {prefix!r} from the keys of {key!r}")
        return {key: sd}, notes
    state: dict[Any, Any] = {}
    for k, v in obj.items():
        if _is_flat_tensor_dict(v):
            v, prefix = _strip_wrapper_prefix(v)
            if prefix:
                notes.append(f"stripped {prefix!r} from the keys of {k!r}")
        state[k] = v
    return state, notes


def import_file(
    source: str,
    root: str,
    step: int,
    storage_options: Mapping[str, Any],
    *,
    key: str = "model",
    format: str = "safetensors",
    compression: str | None = None,
    skip_unsafe: bool = False,
) -> ImportResult:
    """Load a foreign checkpoint (never running its code) and commit it as ``step``.

    ``source`` is a ``torch.save`` file, a Lightning ``.ckpt`` or a
    ``torch.distributed.checkpoint`` directory (see :mod:`ckptstore.importers`).

    Raises:
        CkptStoreError: the source needs code to load (see ``skip_unsafe``), is not a dict,
            or cannot be stored.
        IntegrityError: the source is corrupt.
        StepExistsError: ``step`` is already committed.
        StoreLockedError: another process writes the store.
    """
    with _progress(2, "import", unit="phase") as bar:
        bar.set_postfix_str(f"reading {os.path.basename(os.path.normpath(source))}")
        src = read_source(source, skip_unsafe=skip_unsafe)
        state, notes = prepare_import(src.obj, key=key)
        notes = src.notes + notes
        bar.update(1)
        bar.set_postfix_str(f"writing step {step}")
        try:
            mgr = CheckpointManager(
                root,
                keep=None,
                format=format,
                compression=compression,
                storage_options=storage_options or None,
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
        with mgr:
            metadata = {"imported_from": os.path.abspath(source), **src.metadata}
            manifest = mgr.save(step, state, metadata=metadata).wait()
            where = mgr.storage.describe(step)
        bar.update(1)
    return ImportResult(
        source=source,
        where=where,
        step=step,
        keys=[str(k) for k in state],
        bytes=manifest.total_bytes if manifest is not None else 0,
        notes=notes,
        kind=src.kind,
    )


def cmd_import(args: argparse.Namespace) -> int:
    """``ckptstore import FILE ROOT --step N``."""
    res = import_file(
        args.file,
        args.root,
        args.step,
        _storage_options(args),
        key=args.key,
        format=args.format,
        compression=args.compression,
        skip_unsafe=args.skip_unsafe,
    )
    if _json(args):
        print(json.dumps(res.to_dict(), indent=2))
    else:
        for note in res.notes:
            print(f"note: {note}")
        print(
            f"imported {res.source} as step {res.step} ({', '.join(res.keys)}; "
            f"{human_bytes(res.bytes)}) into {res.where}"
        )
    return 0


# ---- export -------------------------------------------------------------------------------


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
    import torch

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


def _atomic_save_safetensors(tensors: dict[str, Any], out: str, metadata: dict[str, str]) -> None:
    """``safetensors.torch.save_file`` that is never seen half-written (tmp, fsync, replace)."""
    from safetensors.torch import save_file

    atomic_write(out, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def export_step(
    root: str,
    step: int,
    out: str,
    storage_options: Mapping[str, Any],
    *,
    key: str | None = None,
    force: bool = False,
) -> ExportResult:
    """Write checkpoint ``step`` as one ``.safetensors`` (model weights) or ``.pt`` file.

    A DTensor (FSDP2/TP) checkpoint is consolidated: every DTensor is assembled into its
    full tensor from the chunks all ranks saved (``load()`` without a process group), on
    any world size; ``consolidated_from`` then says how many ranks saved it. Per-rank
    ``sharded=True`` state of several ranks is refused. The state is loaded whole: for
    large models, :func:`ckptstore.consolidate.export_hf` streams one tensor at a time.

    Raises:
        FileExistsError: ``out`` exists and ``force`` is false.
        NoCheckpointError: no such step.
        IntegrityError: the checkpoint is corrupt.
        CkptStoreError: the chosen entry is not a flat dict of tensors (for safetensors),
            or the checkpoint holds per-rank state of several ranks.
    """
    if os.path.lexists(out) and not force:
        raise FileExistsError(errno.EEXIST, "already exists; pass --force to overwrite it", out)
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise FileNotFoundError(errno.ENOENT, "no such directory", parent)
    as_safetensors = out.endswith(".safetensors")
    with _open(root, storage_options) as mgr, _progress(2, "export", unit="phase") as bar:
        manifest = mgr.manifest(step)
        where = mgr.storage.describe(step)
        _refuse_per_rank(manifest, where)
        consolidated = manifest.world_size if manifest.dtensor else None
        if not as_safetensors:
            bar.set_postfix_str(f"reading step {step}")
            data = mgr.load(step)
            bar.update(1)
            bar.set_postfix_str(f"writing {os.path.basename(out)}")
            atomic_save(data, out)
            bar.update(1)
            n = _count_tensors(data)
            return ExportResult(out, step, "torch", None, n, os.path.getsize(out), consolidated)
        entry = _choose_key(_state_entries(mgr.storage, manifest), key, where)
        bar.set_postfix_str(f"reading step {step}")
        value = mgr.load(step)[entry.key]
        if entry.kind == "ema" and isinstance(value, Mapping) and "weights" in value:
            value = value["weights"]  # EMA state: {"weights": state dict, "counters": ...}
        tensors = _flat_tensors(value, str(entry.key), where)
        bar.update(1)
        bar.set_postfix_str(f"writing {os.path.basename(out)}")
        _atomic_save_safetensors(
            tensors,
            out,
            {"format": "pt", "ckptstore_step": str(step), "ckptstore_key": str(entry.key)},
        )
        bar.update(1)
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
    root: str,
    step: int,
    out_dir: str,
    storage_options: Mapping[str, Any],
    *,
    key: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD,
) -> HFExportResult:
    """Write one entry of ``step`` as a Hugging Face checkpoint directory (streaming, atomic).

    See :func:`ckptstore.consolidate.export_hf`: ``model.safetensors``, or shards of at most
    ``max_shard_size`` plus ``model.safetensors.index.json``; DTensor state consolidated on
    any world size, one tensor in memory at a time; ``out_dir`` appears whole or not at all.

    Raises:
        FileExistsError: ``out_dir`` exists and is not an empty directory.
        NoCheckpointError: no such step.
        IntegrityError: the checkpoint is corrupt.
        CkptStoreError: no such entry, not a flat dict of tensors, or per-rank state.
    """
    with _open(root, storage_options) as mgr:
        manifest = mgr.manifest(step)
        _refuse_per_rank(manifest, mgr.storage.describe(step))
        with _progress(None, "export", unit="B") as bar:
            return export_hf(
                mgr.storage,
                step,
                out_dir,
                key=key,
                max_shard_size=max_shard_size,
                manifest=manifest,
                progress=lambda _name, n: bar.update(n),
            )


def _count_tensors(obj: Any, depth: int = 0) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return 1
    if depth > 200:
        return 0
    if isinstance(obj, Mapping):
        return sum(_count_tensors(v, depth + 1) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_count_tensors(v, depth + 1) for v in obj)
    return 0


def _consolidated_text(world: int | None) -> str:
    if world is None:
        return ""
    return f"; consolidated from the DTensor shards of {world} rank{'s' * (world != 1)}"


def cmd_export(args: argparse.Namespace) -> int:
    """``ckptstore export ROOT --step N OUT`` or ``... --step N --hf OUT_DIR``."""
    if args.hf:
        if args.force:
            raise UsageError("--hf never overwrites: OUT_DIR must not exist (or be empty)")
        hf = export_hf_step(
            args.root,
            args.step,
            args.out,
            _storage_options(args),
            key=args.key,
            max_shard_size=args.max_shard_size or DEFAULT_MAX_SHARD,
        )
        if _json(args):
            print(json.dumps(hf.to_dict(), indent=2))
        else:
            world = hf.world_size if hf.sharding == "dtensor" else None
            n = len([f for f in hf.files if f.endswith(".safetensors")])
            print(
                f"exported step {hf.step} (entry {hf.key!r}, {hf.tensors} tensors, "
                f"{human_bytes(hf.total_size)}{_consolidated_text(world)}) to {hf.out} "
                f"(Hugging Face safetensors, {n} file{'s' * (n != 1)}: {', '.join(hf.files)})"
            )
        return 0
    if args.max_shard_size is not None:
        raise UsageError("--max-shard-size applies to --hf only")
    res = export_step(
        args.root, args.step, args.out, _storage_options(args), key=args.key, force=args.force
    )
    if _json(args):
        print(json.dumps(res.to_dict(), indent=2))
    else:
        what = f"entry {res.key!r}" if res.key is not None else "the whole state"
        print(
            f"exported step {res.step} ({what}, {res.tensors} tensors"
            f"{_consolidated_text(res.consolidated_from)}) to {res.out} "
            f"({res.format}, {human_bytes(res.bytes)})"
        )
    return 0


# ---- diff -------------------------------------------------------------------------------


@dataclasses.dataclass
class DiffRow:
    """One difference between two checkpoints."""

    path: str
    change: str  # "added", "removed", "changed"
    a: str = ""
    b: str = ""
    max_abs_diff: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        d = dataclasses.asdict(self)
        if self.max_abs_diff is not None and not math.isfinite(self.max_abs_diff):
            d["max_abs_diff"] = str(self.max_abs_diff)
        return d


@dataclasses.dataclass
class DiffResult:
    """What ``ckptstore diff`` found."""

    root: str
    a: int
    b: int
    rows: list[DiffRow]
    same: int
    notes: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "root": self.root,
            "a": self.a,
            "b": self.b,
            "same": self.same,
            "differences": [r.to_dict() for r in self.rows],
            "notes": list(self.notes),
        }


def _describe(v: Any) -> str:
    import torch

    if isinstance(v, TensorRef):
        return v.describe()
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    try:
        return type(a) is type(b) and bool(a == b)
    except (ValueError, RuntimeError):  # numpy arrays and the like
        return repr(a) == repr(b)


def _leaves(src: StepTensors) -> dict[str, Any]:
    """``{"model/inp.weight": TensorRef, "step": 3, ...}``: the state's leaves by path."""
    out: dict[str, Any] = {}
    for key in src.keys:
        for path, value in src.leaves(key):
            out["/".join(str(p) for p in path)] = value
    return out


def _param_groups(leaves: Mapping[str, Any], key: str) -> list[Any] | None:
    groups: list[Any] = []
    while isinstance(leaves.get(f"{key}/param_groups/{len(groups)}/params"), list):
        groups.append(leaves[f"{key}/param_groups/{len(groups)}/params"])
    return groups or None


def _match_optimizer_names(
    left: dict[str, Any], right: dict[str, Any], keys: set[str], steps: tuple[int, int]
) -> list[str]:
    """Key numbered optimizer state (``Optimizer.state_dict()``) by parameter name.

    A DTensor save stores optimizer state keyed by parameter name, in its parameter groups'
    order; a replicated save of the same optimizer numbers the parameters in that order. When
    one side names and the other numbers, with groups of the same sizes, the numbered side
    is renamed (in place) so the two compare entry by entry. Returns a note per entry.
    """
    notes = []
    for key in sorted(keys):
        gl, gr = _param_groups(left, key), _param_groups(right, key)
        if gl is None or gr is None or [len(g) for g in gl] != [len(g) for g in gr]:
            continue
        fl = [p for g in gl for p in g]
        fr = [p for g in gr for p in g]
        named = None
        if all(isinstance(p, str) for p in fl) and all(type(p) is int for p in fr):
            named, numbered, names, ids = 0, right, fl, fr
        elif all(isinstance(p, str) for p in fr) and all(type(p) is int for p in fl):
            named, numbered, names, ids = 1, left, fr, fl
        if named is None or len(set(names)) != len(names):
            continue
        rename = {str(i): n for i, n in zip(ids, names, strict=True)}
        prefix = f"{key}/state/"
        for path in [p for p in numbered if p.startswith(prefix)]:
            pid, sep, rest = path[len(prefix) :].partition("/")
            if pid in rename:
                numbered[f"{prefix}{rename[pid]}{sep}{rest}"] = numbered.pop(path)
        for g, group in enumerate(gl if named == 1 else gr):
            numbered[f"{key}/param_groups/{g}/params"] = [rename[str(i)] for i in group]
        notes.append(
            f"{key}: step {steps[1 - named]} numbers the optimizer's parameters, step "
            f"{steps[named]} names them (a DTensor save); matched by position in the "
            "parameter groups"
        )
    return notes


def _diff_tensors(path: str, x: Any, y: Any) -> DiffRow | None:
    """``None`` when equal (NaNs in the same places count as equal), else the row."""
    import torch

    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        if _same_value(x, y):
            return None
        return DiffRow(path, "changed", a=_describe(x), b=_describe(y))
    if x.dtype != y.dtype or x.shape != y.shape:
        return DiffRow(path, "changed", a=_describe(x), b=_describe(y))
    if torch.equal(x, y) or (
        x.is_floating_point()
        and torch.equal(x.isnan(), y.isnan())
        and torch.equal(x.nan_to_num(), y.nan_to_num())
    ):
        return None
    wide = torch.complex128 if x.is_complex() else torch.float64
    delta = (x.to(wide) - y.to(wide)).abs().nan_to_num(nan=math.inf)
    return DiffRow(
        path,
        "changed",
        a=_describe(x),
        b=_describe(y),
        max_abs_diff=float(delta.max()) if delta.numel() else 0.0,
    )


def diff_steps(root: str, a: int, b: int, storage_options: Mapping[str, Any]) -> DiffResult:
    """Compare two checkpoints entry by entry (tensors by max absolute difference).

    Full tensors are compared, read one pair at a time (never a whole checkpoint in memory):
    a DTensor checkpoint is consolidated from its chunks, so steps saved on different world
    sizes, or a DTensor step and a replicated step of the same model, compare value by
    value. Optimizer state keyed by parameter name (DTensor saves) is matched with numbered
    state (replicated saves) by position in the parameter groups; ``notes`` says so.

    Raises:
        NoCheckpointError: no such step.
        IntegrityError: a checkpoint is corrupt.
        CkptStoreError: per-rank state of several ranks (it has no full form to compare).
    """
    with (
        _open(root, storage_options) as mgr,
        StepTensors(mgr.storage, a, manifest=mgr.manifest(a)) as sa,
        StepTensors(mgr.storage, b, manifest=mgr.manifest(b)) as sb,
    ):
        left, right = _leaves(sa), _leaves(sb)
        common = {str(k) for k in sa.keys} & {str(k) for k in sb.keys}
        notes = _match_optimizer_names(left, right, common, (a, b))
        rows: list[DiffRow] = []
        same = 0
        for path in sorted(set(left) | set(right)):
            if path not in right:
                rows.append(DiffRow(path, "removed", a=_describe(left[path])))
                continue
            if path not in left:
                rows.append(DiffRow(path, "added", b=_describe(right[path])))
                continue
            x, y = left[path], right[path]
            if isinstance(x, TensorRef) and isinstance(y, TensorRef):
                if (x.dtype, x.shape) != (y.dtype, y.shape):
                    rows.append(DiffRow(path, "changed", a=x.describe(), b=y.describe()))
                    continue
                row = _diff_tensors(path, sa.load(x), sb.load(y))  # one pair in memory
            elif isinstance(x, TensorRef) or isinstance(y, TensorRef):
                row = DiffRow(path, "changed", a=_describe(x), b=_describe(y))
            else:
                row = _diff_tensors(path, x, y)
            if row is None:
                same += 1
            else:
                rows.append(row)
    return DiffResult(root, a, b, rows, same, notes)


def _print_diff(res: DiffResult, as_json: bool, out: TextIO) -> None:
    if as_json:
        print(json.dumps(res.to_dict(), indent=2), file=out)
        return
    print(f"diff step {res.a} -> step {res.b} ({res.root})", file=out)
    for note in res.notes:
        print(f"  note: {note}", file=out)
    marks = {"added": "+", "removed": "-", "changed": "~"}
    table = []
    for r in res.rows:
        if r.change == "changed" and r.max_abs_diff is not None:
            detail = f"{r.a}  max |a-b| {r.max_abs_diff:.6g}"
        elif r.change == "changed":
            detail = f"{r.a} -> {r.b}"
        else:
            detail = r.a or r.b
        table.append([marks[r.change], r.path, detail])
    if table:
        print(_table(table, indent="  "), file=out)
    counts = collections.Counter(r.change for r in res.rows)
    print(
        f"{res.same} same, {counts['changed']} changed, {counts['added']} added, "
        f"{counts['removed']} removed",
        file=out,
    )


def cmd_diff(args: argparse.Namespace) -> int:
    """``ckptstore diff ROOT A B``: exit 0 when identical, 1 when they differ (like diff)."""
    res = diff_steps(args.root, args.a, args.b, _storage_options(args))
    _print_diff(res, _json(args), sys.stdout)
    return 1 if res.rows else 0


# ---- shell completion ---------------------------------------------------------------------

_BASH_COMPLETION = r"""# bash completion for ckptstore
# zsh: run `autoload -U +X bashcompinit && bashcompinit` before sourcing this
_ckptstore() {
    local cur="${COMP_WORDS[COMP_CWORD]}" cmd="" i
    for ((i = 1; i < COMP_CWORD; i++)); do
        case "${COMP_WORDS[i]}" in -*) ;; *) cmd="${COMP_WORDS[i]}"; break ;; esac
    done
    if [[ -z "$cmd" ]]; then
        COMPREPLY=($(compgen -W "%(commands)s %(common)s" -- "$cur"))
        return
    fi
    case "$cmd" in
%(cases)s
    esac
    if [[ "$cur" == -* ]]; then
        COMPREPLY=($(compgen -W "$opts %(common)s" -- "$cur"))
    else
        COMPREPLY=($(compgen -f -- "$cur"))
    fi
}
complete -o filenames -F _ckptstore ckptstore
"""


def completion_script(shell: str) -> str:
    """A completion script for ``shell`` (bash; zsh through bashcompinit).

    Install: ``ckptstore completion bash > ~/.local/share/bash-completion/completions/ckptstore``
    or ``eval "$(ckptstore completion bash)"`` in your shell's rc file.
    """
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    cases = []
    for name, p in sub.choices.items():
        opts = sorted(
            o for a in p._actions for o in a.option_strings if o.startswith("--") and o != "--help"
        )
        common = {"--json", "--storage-option", "--verbose"}
        opts = [o for o in opts if o not in common]
        cases.append(f'        {name}) local opts="{" ".join(opts)}" ;;')
    return _BASH_COMPLETION % {
        "commands": " ".join(sub.choices),
        "common": "--json --storage-option --verbose --help --version",
        "cases": "\n".join(cases),
    }


def cmd_completion(args: argparse.Namespace) -> int:
    """``ckptstore completion bash|zsh``: print a shell completion script."""
    print(completion_script(args.shell), end="")
    return 0


# ---- argument parsing and the one place errors become exit codes --------------------------


def _step_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer step: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a step is >= 0, got {value}")
    return value


def _positive_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _json(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "json", False))


def _storage_options(args: argparse.Namespace) -> dict[str, Any]:
    return parse_storage_options(getattr(args, "storage_option", None))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``ckptstore`` command."""
    # Common options are accepted before or after the command; SUPPRESS keeps a subcommand
    # from resetting a value given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="machine-readable JSON on stdout",
    )
    common.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        default=argparse.SUPPRESS,
        help="fsspec storage option for URL stores (repeatable), e.g. anon=true",
    )
    common.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="log what ckptstore does (to stderr)",
    )
    parser = argparse.ArgumentParser(
        prog=PROG,
        parents=[common],
        description="Inspect, verify and maintain ckptstore checkpoint stores.",
        epilog="Exit status: 0 all is well, 1 a problem was found, 2 usage error.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, func: Callable[[argparse.Namespace], int], help: str) -> Any:
        p = sub.add_parser(name, parents=[common], help=help, description=help)
        p.set_defaults(func=func, subparser=p)
        return p

    p = add("ls", cmd_ls, "list the committed checkpoints of a store")
    p.add_argument("root", metavar="ROOT", help="store directory or fsspec URL")

    p = add("verify", cmd_verify, "verify checkpoints of a store, or a lone .pt/.safetensors file")
    p.add_argument("target", metavar="ROOT|FILE", help="store, step directory, or file")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=_step_arg, help="verify this step (default: the newest)")
    which.add_argument("--all", action="store_true", help="verify every committed step")
    p.add_argument(
        "--quick", action="store_true", help="sizes and headers only, no checksums (fast)"
    )

    p = add("prune", cmd_prune, "delete checkpoints by retention policy (union of the flags)")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--keep-last", type=_positive_arg, metavar="N", help="keep the N newest")
    p.add_argument(
        "--keep-best", type=_positive_arg, metavar="K", help="keep the K best by --metric"
    )
    p.add_argument("--metric", metavar="M", help="metric for --keep-best, e.g. val_loss")
    p.add_argument("--mode", choices=("min", "max"), default="min", help="best is min or max")
    p.add_argument(
        "--keep-every", type=_positive_arg, metavar="S", help="keep steps divisible by S"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="show what would be deleted; delete nothing"
    )

    p = add("gc", cmd_gc, "remove stale tmp/trash entries of interrupted saves and deletions")
    p.add_argument("root", metavar="ROOT")

    p = add("inspect", cmd_inspect, "show a checkpoint's manifest and the structure of its state")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--step", type=_step_arg, help="the step (default: the newest)")

    p = add("completion", cmd_completion, "print a shell completion script (bash, zsh)")
    p.add_argument("shell", choices=("bash", "zsh"))

    p = add("diff", cmd_diff, "compare two checkpoints: keys added/removed/changed, max |a-b|")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("a", metavar="A", type=_step_arg, help="first step")
    p.add_argument("b", metavar="B", type=_step_arg, help="second step")

    p = add(
        "import",
        cmd_import,
        "store a torch.save file, a Lightning .ckpt or a DCP directory as a step (no code runs)",
    )
    p.add_argument("file", metavar="SOURCE", help="FILE.pt, FILE.ckpt, or a DCP directory")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--step", type=_step_arg, required=True, help="step to store it as")
    p.add_argument(
        "--key", default="model", help="entry name for a bare state dict (default: model)"
    )
    p.add_argument("--format", choices=("safetensors", "torch"), default="safetensors")
    p.add_argument("--compression", choices=("zstd",), default=None)
    p.add_argument(
        "--skip-unsafe",
        action="store_true",
        help="drop the entries that need code to load (listed) instead of refusing the source",
    )

    p = add(
        "export",
        cmd_export,
        "write a checkpoint as one .safetensors or .pt file, or a Hugging Face directory (--hf); "
        "DTensor (FSDP2/TP) checkpoints are consolidated into full tensors",
    )
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--step", type=_step_arg, required=True, help="the step to export")
    p.add_argument(
        "out",
        metavar="OUT",
        help="*.safetensors: model weights; with --hf a new directory; else the whole state",
    )
    p.add_argument(
        "--hf",
        action="store_true",
        help="write OUT as a Hugging Face checkpoint directory of the entry's weights "
        "(model.safetensors, or shards + model.safetensors.index.json), one tensor at a time",
    )
    p.add_argument(
        "--max-shard-size",
        type=_size_arg,
        metavar="SIZE",
        default=None,
        help="with --hf: largest shard, e.g. 5GB (default), 500MB, 2GiB",
    )
    p.add_argument("--key", default=None, help="entry to write as safetensors (default: model)")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    return parser


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 2


def _error(message: str) -> int:
    print(f"{PROG}: error: {_one_line(message)}", file=sys.stderr)
    return 1


def _os_error_text(e: OSError) -> str:
    if e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e)


@contextlib.contextmanager
def _logging(verbose: bool) -> Iterator[None]:
    """Route the library's log records to stderr for the duration of one command."""
    logger = logging.getLogger("ckptstore")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s: %(message)s"))
    handler.setLevel(logging.INFO if verbose else logging.WARNING)
    old_level = logger.level
    if verbose:
        logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def main(argv: list[str] | None = None) -> int:
    """Run the ``ckptstore`` command line; returns the exit status.

    Args:
        argv: the arguments (without the program name); ``None`` reads ``sys.argv``.

    Returns:
        0 when all is well, 1 when a problem was found, 2 on usage errors.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help, --version, usage errors
        return _exit_code(e.code)
    try:
        with _logging(bool(getattr(args, "verbose", False))):
            return int(args.func(args))
    except UsageError as e:
        args.subparser.print_usage(sys.stderr)
        print(f"{args.subparser.prog}: error: {e}", file=sys.stderr)
        return 2
    except CkptStoreError as e:
        return _error(str(e))
    except BrokenPipeError:
        # stdout was closed early (``ckptstore ls ROOT | head``): not an error worth a line.
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 1
    except OSError as e:
        return _error(_os_error_text(e))
    except ImportError as e:  # an fsspec backend that is not installed; the message says which
        return _error(str(e))
    except TypeError as e:
        if not getattr(args, "storage_option", None):
            raise
        # fsspec passes unknown options on to the backend's client, which refuses them here.
        return _error(f"the storage options were refused by the filesystem: {e}")
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130

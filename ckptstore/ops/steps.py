"""Managing the steps of an existing store from outside a training job: prune, gc, rm, pin.

What ``ckptstore prune``, ``gc``, ``rm``, ``pin`` and ``unpin`` do, for Python. Each opens an
existing store and creates nothing where there is none (no lock file in a directory that is
not a store: see :mod:`ckptstore.ops.stores`). Deletions are those of retention: under the
store's writer lock (a job writing the store makes them fail with ``StoreLockedError``), a
checkpoint vanishes whole at once (renamed to ``.trash-``, the root fsynced, then removed;
on object stores its manifest goes first), and the newest checkpoint that verifies is never
deleted unless asked to with ``force``. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from .._log import logger as log
from ..errors import (
    CkptStoreError,
    CommitError,
    ConfigError,
    ManifestError,
    StoreLockedError,
    UsageError,
)
from ..layout import LOCAL_RANKS_NAME, parse_old_dirname, step_dirname
from ..retention import CheckpointInfo, KeepBest, RetentionPolicy, Union, as_policy, plan_deletions
from ..storage import Storage, wait_for_deletions
from ..tiers import upload_parts
from ..tiers.safety import read_replica_url, replicated_steps
from .stores import committed_step, open_store, reaching
from .verify import verify_checkpoint

__all__ = [
    "DeleteResult",
    "PinResult",
    "PruneResult",
    "delete_steps",
    "gc_store",
    "pin_steps",
    "prune_store",
]


@dataclasses.dataclass
class PruneResult:
    """Steps deleted (or, for a dry run, that would be) and steps kept."""

    root: str
    dry_run: bool
    deleted: list[int]
    kept: list[int]

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return dataclasses.asdict(self)


@dataclasses.dataclass
class DeleteResult:
    """Steps deleted by :func:`delete_steps`, and the steps left."""

    root: str
    deleted: list[int]
    kept: list[int]

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return dataclasses.asdict(self)


@dataclasses.dataclass
class PinResult:
    """What :func:`pin_steps` did: the steps asked for and those whose pin changed."""

    root: str
    pinned: bool
    steps: list[int]
    changed: list[int]

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return dataclasses.asdict(self)


@contextlib.contextmanager
def _writer(storage: Storage, what: str) -> Iterator[None]:
    """Hold the store's writer lock (local stores), with a message for the CLI's case."""
    lock = storage.writer_lock()
    if lock is None:  # object stores have none; their deletions are manifest-first
        yield
        return
    try:
        lock.acquire_maintenance()
    except StoreLockedError as e:
        # The generic advice ("give this one its own directory") is for a second job.
        raise StoreLockedError(
            f"{e.message.split(' (')[0]}: nothing was {what}. Another process holds its "
            "writer lock: a job writing it (its own keep= policy prunes after each of its "
            "saves), or another maintenance command; try again once it has stopped"
        ) from None
    try:
        yield
    finally:
        lock.release()


def _refuse_node_local(storage: Storage, steps: Iterable[int], what: str) -> None:
    """Refuse to plan deletions on one node's root of a job with node-local roots.

    Each node holds its ranks' part of every step (a ``local-ranks`` marker): whether a step
    is whole on every node is known only to the job's ranks together. Judged from one node,
    a step published there alone (a power cut) passed as the newest good one, and prune
    deleted the last step good on every node: resume found none (found by review).
    """
    for s in steps:
        if storage._exists(f"{step_dirname(s)}/{LOCAL_RANKS_NAME}"):
            raise CkptStoreError(
                f"{storage.root} is one node's root of a job with node-local roots (step {s} "
                "holds only some ranks' files): from here, whether a step is whole on every "
                f"node cannot be known, so nothing was {what}. Call CheckpointManager.prune() "
                "on every rank of the job (the nodes agree on the newest step good on all of "
                "them), or pass --force"
            )


def _not_replicated(storage: Storage, steps: Sequence[int]) -> tuple[str | None, list[int]]:
    """The replica the root records, and those of ``steps`` not yet recorded safe on it."""
    url = read_replica_url(storage)
    if url is None:
        return None, []
    safe = replicated_steps(storage, steps, replica=url)
    return url, [s for s in steps if s not in safe]


def _last_good(storage: Storage, steps: Iterable[int]) -> int | None:
    """The newest of ``steps`` that verifies deeply (a quick check passes a flipped byte)."""
    for s in sorted(steps, reverse=True):
        if verify_checkpoint(storage, s, deep=True).ok:
            return s
    return None


def _metrics(storage: Storage, steps: list[int]) -> dict[int, Mapping[str, float]]:
    got = storage.read_manifests(steps, complete=True)
    return {s: {} if isinstance(m, ManifestError) else m.metrics for s, m in got.items()}


def _keep_best(policy: RetentionPolicy) -> list[KeepBest]:
    if isinstance(policy, KeepBest):
        return [policy]
    if isinstance(policy, Union):
        return [p for member in policy.policies for p in _keep_best(member)]
    return []


def _check_metrics(policy: RetentionPolicy, metrics: Mapping[int, Mapping[str, float]]) -> None:
    """A ``KeepBest`` metric that no checkpoint records is a typo, not "keep the newest"."""
    if not metrics:
        return
    have = sorted({k for m in metrics.values() for k in m})
    for p in _keep_best(policy):
        if p.metric not in have:
            names = ", ".join(have) if have else "none (no checkpoint records a metric)"
            msg = (
                f"no checkpoint of the store records the metric {p.metric!r}, so KeepBest "
                f"would keep nothing for it; the metrics the store has: {names}"
            )
            raise UsageError(msg)


def prune_store(
    root: str | os.PathLike[str],
    keep: int | RetentionPolicy | Sequence[RetentionPolicy],
    *,
    dry_run: bool = False,
    force: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> PruneResult:
    """Apply (or with ``dry_run`` only plan) a retention policy to the store at ``root``.

    Never deletes the newest checkpoint, a pinned one, or the newest one that verifies
    (deep); see :func:`ckptstore.retention.plan_deletions`. Nor, unless ``force``, a step
    not yet recorded safe on the replica the root records (a job uploads it, as its own
    retention holds it); and one node's root of a job with node-local roots is refused
    (only the job's ranks together know which steps are whole).

    Args:
        root: the store: a local directory or an fsspec URL.
        keep: as ``CheckpointManager(keep=...)``: an int (``KeepLast``), a policy, or a list
            of policies (their union).
        dry_run: plan only; delete nothing and take no lock.
        force: delete steps not yet on the replica too, and prune a node's root.
        storage_options: fsspec options for a URL.

    Returns:
        The steps deleted (or that would be) and those kept.

    Raises:
        ValueError: ``keep`` is invalid, or names a ``KeepBest`` metric that no checkpoint
            of the store records (the message lists those it has).
        NoCheckpointError: no store at ``root``.
        CkptStoreError: one node's root of node-local roots (without ``force``).
        StoreLockedError: a job is writing the store (not for a dry run).
        CommitError: a checkpoint could not be deleted.
    """
    policy = as_policy(list(keep) if isinstance(keep, list | tuple) else keep)
    storage = open_store(root, storage_options)
    with reaching(storage.root):
        if not storage.list_steps():  # nothing to plan: take no lock, create nothing
            return PruneResult(storage.root, dry_run, [], [])
        lock = contextlib.nullcontext() if dry_run else _writer(storage, "deleted")
        with lock:
            steps = storage.list_steps()
            if not force:
                _refuse_node_local(storage, steps, "deleted")
            metrics = _metrics(storage, steps) if policy.needs_metrics else {}
            _check_metrics(policy, metrics)
            # The deep verify first (minutes on a large store), the pins after it: `pin`
            # takes no lock, and a step pinned while the steps were verified was deleted.
            last_good = _last_good(storage, steps)
            url, behind = (None, []) if force else _not_replicated(storage, steps)
            held = set(behind)
            if held:
                log.warning(
                    "%s: %s %s not yet on the replica %s: kept (the job uploads %s; "
                    "--force deletes anyway)",
                    storage.root,
                    "step" if len(held) == 1 else "steps",
                    _steps_text(sorted(held)),
                    url,
                    "it" if len(held) == 1 else "them",
                )
            infos = [
                CheckpointInfo(s, metrics.get(s, {}), s in held or storage.is_pinned(s))
                for s in steps
            ]
            doomed = plan_deletions(infos, policy, last_good=last_good)
            deleted = doomed if dry_run else _delete(storage, doomed, spare_pinned=True)
    gone = set(deleted)
    return PruneResult(storage.root, dry_run, deleted, [s for s in steps if s not in gone])


def _delete(storage: Storage, steps: Iterable[int], *, spare_pinned: bool = False) -> list[int]:
    """Delete ``steps`` one by one; with ``spare_pinned``, not one pinned since it was planned."""
    deleted = []
    try:
        for s in steps:
            try:
                if not storage.delete(s, spare_pinned=spare_pinned):
                    log.warning("%s was pinned since it was planned: kept", storage.describe(s))
                    continue
            except FileNotFoundError:
                continue
            except OSError as e:
                raise CommitError(f"could not delete {storage.describe(s)}: {e}") from e
            deleted.append(s)
    finally:
        # The renames are durable (the root fsynced) and the space freed before we return.
        wait_for_deletions()
    return deleted


def delete_steps(
    root: str | os.PathLike[str],
    steps: Iterable[int],
    *,
    force: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> DeleteResult:
    """Delete committed steps, each atomically, as retention deletes them.

    Refused, with nothing deleted, when a step is not committed, is pinned, is not yet on
    the replica the root records, lies in one node's root of a job with node-local roots,
    or is the last checkpoint that verifies (every other step is corrupt or also being
    deleted): deleting it would leave nothing to resume from. ``force`` deletes those too.

    Args:
        root: the store: a local directory or an fsspec URL.
        steps: the steps to delete.
        force: delete pinned steps and the last good one too.
        storage_options: fsspec options for a URL.

    Returns:
        The steps deleted and the steps left.

    Raises:
        ValueError: no step given.
        NoCheckpointError: no store at ``root``, or a step is not committed.
        CkptStoreError: a step is pinned, or the last that verifies (without ``force``).
        StoreLockedError: a job is writing the store.
        CommitError: a checkpoint could not be deleted.
    """
    wanted = sorted(set(steps))
    if not wanted:
        msg = "no step to delete: give at least one"
        raise ConfigError(msg)
    storage = open_store(root, storage_options)
    with reaching(storage.root), _writer(storage, "deleted"):
        for s in wanted:
            committed_step(storage, s)
        have = storage.list_steps()
        if not force:
            _refuse_node_local(storage, wanted, "deleted")
            url, behind = _not_replicated(storage, wanted)
            if behind:
                raise _protected(
                    storage,
                    f"step{'s' * (len(behind) > 1)} {_steps_text(behind)} "
                    f"{'is' if len(behind) == 1 else 'are'} not yet on the replica {url}",
                    "a job uploading it would lose it; pass --force to delete anyway",
                )
            _refuse_protected(storage, wanted, have)
        deleted = _delete(storage, wanted, spare_pinned=not force)
    return DeleteResult(storage.root, deleted, [s for s in have if s not in set(deleted)])


def _refuse_protected(storage: Storage, doomed: list[int], have: list[int]) -> None:
    pinned = [s for s in doomed if storage.is_pinned(s)]
    if pinned:
        raise _protected(
            storage,
            f"step {_steps_text(pinned)} {'is' if len(pinned) == 1 else 'are'} pinned",
            "unpin it first (`ckptstore unpin`), or pass --force",
        )
    rest = [s for s in have if s not in set(doomed)]
    if _last_good(storage, rest) is not None:
        return
    good = _last_good(storage, doomed)
    if good is not None:
        # Only the newest of the doomed steps was verified: never call it the only one.
        if rest:
            what = (
                f"no step this leaves ({_steps_text(rest)}) verifies, and step {good}, the "
                "newest of those it deletes, does"
            )
        elif len(doomed) == 1:
            what = f"step {good} is the only step, and it verifies"
        else:
            what = f"this deletes every step, and step {good}, the newest of them, verifies"
        raise _protected(
            storage,
            what,
            "that leaves nothing to resume from; pass --force to delete anyway",
        )


def _protected(storage: Storage, what: str, fix: str) -> CkptStoreError:
    return CkptStoreError(f"{storage.root}: {what}; nothing was deleted: {fix}")


def _steps_text(steps: Sequence[int]) -> str:
    return ", ".join(str(s) for s in steps)


def pin_steps(
    root: str | os.PathLike[str],
    steps: Iterable[int],
    *,
    pinned: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> PinResult:
    """Pin (or with ``pinned=False`` unpin) committed steps: retention never deletes a pin.

    Takes no lock, as ``CheckpointManager.pin`` takes none: pinning while a job writes the
    store is what a pin is for.

    Raises:
        ValueError: no step given.
        NoCheckpointError: no store at ``root``, or a step is not committed.
        CommitError: the marker could not be written or removed (read-only store, a link).
    """
    wanted = sorted(set(steps))
    if not wanted:
        msg = "no step given"
        raise ConfigError(msg)
    storage = open_store(root, storage_options)
    changed = []
    with reaching(storage.root):
        for s in wanted:
            committed_step(storage, s)
        for s in wanted:
            if storage.is_pinned(s) == pinned:
                continue
            try:
                storage.set_pinned(s, pinned)
            except OSError as e:
                if isinstance(e, CommitError):
                    raise
                what = "pin" if pinned else "unpin"
                raise CommitError(f"could not {what} {storage.describe(s)}: {e}") from e
            changed.append(s)
    return PinResult(storage.root, pinned, wanted, changed)


def gc_store(
    root: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    pending: bool = False,
) -> list[str]:
    """Remove stale ``.tmp-``/``.trash-`` entries and manifest-less step directories.

    An object store has no writer lock: a job may be uploading to it (a replica), its
    pending steps (manifest-less, per-rank parts) still to be completed. There only the
    pending entries older than the newest committed step are removed, the rule the
    uploaders themselves follow (:func:`ckptstore.tiers.upload_parts.clean`);
    :func:`ckptstore.tiers.upload_parts.held` names the others. ``pending=True`` removes those
    too (for a prefix no job uploads to any more). A local store is gc'd under its writer
    lock, which a job's manager holds: every stale entry goes.

    Returns:
        The names removed.

    Raises:
        NoCheckpointError: no store at ``root``.
        StoreLockedError: a job is writing the store (a save may be in flight).
    """
    storage = open_store(root, storage_options)
    with reaching(storage.root):
        if not storage.list_garbage() and not _has_old(storage):
            return []  # nothing to remove: take no lock, create nothing
        if not storage.atomic_rename and not pending:
            removed = upload_parts.clean(storage)
            wait_for_deletions()
            return removed
        with _writer(storage, "removed"):
            removed = storage.gc(include_tmp=True)
            wait_for_deletions()
    return removed


def _has_old(storage: Storage) -> bool:
    """Whether a replacement was cut short between its two renames (``gc`` finishes it)."""
    return any(parse_old_dirname(n) is not None for n in storage._list(""))

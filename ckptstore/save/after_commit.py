"""Save stage 6, after the commit: the replica queue, retention, and deletion.

In: the :class:`~ckptstore.session.Session` and the step just committed (or a request to
prune, delete or collect garbage). Out: the step queued for upload (on the uploading rank),
the steps retention deleted, what the session knows of the store brought up to date.
Retention is planned by the pure :class:`~ckptstore.retention.RetentionPlanner`; a step
found corrupt is never counted as the newest good one. A failure of retention after a
commit never fails the save.
"""

from __future__ import annotations

from .._log import logger as log
from ..errors import CkptStoreError, CommitError, StepProtectedError
from ..ops.verify import verify_checkpoint
from ..retention import RetentionPlanner, keep_best_policies
from ..session import Session
from ..storage import wait_for_deletions
from .failures import plain_oserror

__all__ = ["after_commit", "delete", "gc", "plan_prune", "prune", "replica_safe", "set_pinned"]


def after_commit(session: Session, step: int) -> None:
    """Retention runs only after a commit; its failure never fails the save.

    With a replica, the step is queued for upload first (on the uploading rank).
    """
    if session.replica is not None:
        session.replica.submit(step)
    if not session.node_leader:
        return
    try:
        prune(session)
    except (CkptStoreError, OSError, ValueError) as e:
        log.warning("retention after step %d failed: %s", step, e)


def replica_safe(session: Session, step: int) -> None:
    """The uploader's callback: ``step`` is safe on the replica.

    Local steps that retention held back for the replica may go now (on the uploader's
    thread: retention takes the manager's lock, the training thread does not wait).
    """
    if session.replica is not None and session.replica.holding and session.claimed:
        session.replica.holding = False
        prune(session)


def plan_prune(session: Session) -> list[int]:
    """The steps :func:`prune` would delete now (see ``CheckpointManager.plan_prune``)."""
    with session.mutex:
        known = session.known()
        if not len(known):
            return []
        _check_store_metrics(session, known)
        if not known.incremental:
            # A policy of the user's own may look at pins: give it every step's.
            for s in known:
                known.set_pinned(s, session.storage.is_pinned(s))
        doomed = known.plan(last_good=_last_good(session, known))
        if session.replica is not None:  # a step not yet safe on the replica is held
            doomed = session.replica.deletable(doomed)
        # Built-in policies are planned without reading every step's pin (a pin only
        # ever keeps a step; another process may have pinned one): read the doomed ones'.
        out = []
        for s in doomed:
            if session.storage.is_pinned(s):
                known.set_pinned(s, True)
            else:
                out.append(s)
        return out


def _check_store_metrics(session: Session, known: RetentionPlanner) -> None:
    for b in keep_best_policies(session.policy):
        if b.missing != "error" or known.metric_count(b.metric):
            continue
        have = ", ".join(repr(m) for m in known.metric_names()) or "none"
        msg = (
            f"{b!r}: no checkpoint in {session.root} has the metric {b.metric!r} (the store's "
            f"metrics: {have}); nothing was deleted. Check the metric's name"
        )
        raise ValueError(msg)


def _last_good(session: Session, known: RetentionPlanner) -> int | None:
    for s in reversed(known):
        if s in session.known_good:
            return s
        # Deep: a quick check (sizes, headers) passes a flipped byte, and retention
        # would then delete the only checkpoint that still loads.
        report = verify_checkpoint(session.storage, s, deep=True)
        if report.ok:
            session.known_good.add(s)
            return s
        session.known_bad.add(s)
        log.warning(
            "retention keeps an older step: step %d does not verify: %s",
            s,
            "; ".join(report.problems),
        )
    return None


def prune(session: Session) -> list[int]:
    """Apply the retention policy now; returns the deleted steps (``CheckpointManager.prune``)."""
    session.check_open()
    with session.mutex:
        if not session.claimed:
            if not session.storage.list_steps():
                return []  # nothing to delete: take (create) no lock here
            session.acquire()
        doomed = plan_prune(session)
        deleted = []
        for s in doomed:
            try:
                session.storage.delete(s)
            except FileNotFoundError:
                session.forget(s)
                continue
            except OSError as e:
                raise CommitError(f"could not delete {session.storage.describe(s)}: {e}") from e
            session.forget(s)
            deleted.append(s)
        if deleted:
            log.info("retention deleted steps %s", deleted)
        return deleted


def delete(session: Session, step: int, *, force: bool) -> None:
    """Delete one committed checkpoint now (``CheckpointManager.delete``, its arguments checked)."""
    with session.mutex:
        if not session.claimed:
            if step not in session.storage.list_steps():
                session.resolve(step)  # raises NoCheckpointError; takes (creates) no lock
            session.acquire()
        known = session.known()
        if step not in known:
            session.resolve(step)
        where = session.storage.describe(step)
        root = session.root.rstrip("/")
        if not force:
            if session.storage.is_pinned(step):
                raise StepProtectedError(
                    f"{where} is pinned; nothing was deleted. Unpin it first "
                    f"(mgr.unpin({step}), `ckptstore unpin {root} --step {step}`), or "
                    f"delete it anyway with force=True (`ckptstore rm {root} --step "
                    f"{step} --force`)"
                )
            if not _another_good(session, known, step):
                report = verify_checkpoint(session.storage, step, deep=True)
                if report.ok:
                    others = len(known) - 1
                    raise StepProtectedError(
                        f"{where} is the only checkpoint in {root} that verifies "
                        f"({others} other step{'s' * (others != 1)}); deleting it would "
                        "leave nothing to resume from, so nothing was deleted. Delete "
                        f"it anyway with force=True (`ckptstore rm {root} --step {step} "
                        "--force`)"
                    )
        try:
            # Durable on return; on object stores the files go now, not later, so a
            # new save of the same step cannot lose its files to a late deletion.
            session.storage.delete(step, background=False, durable=True)
        except FileNotFoundError:
            pass  # gone meanwhile: what was asked is done
        except OSError as e:
            raise CommitError(f"could not delete {where}: {e}; it is still there") from e
        session.forget(step)
        log.info("deleted %s", where)


def _another_good(session: Session, known: RetentionPlanner, step: int) -> bool:
    """Whether a committed step other than ``step`` verifies (newest first, deep)."""
    for s in reversed(known):
        if s == step or s in session.known_bad:
            continue
        if s in session.known_good:
            return True
        if verify_checkpoint(session.storage, s, deep=True).ok:
            session.known_good.add(s)
            return True
        session.known_bad.add(s)
    return False


def gc(session: Session) -> list[str]:
    """Remove stale entries (``CheckpointManager.gc``, once no save of ours is in flight)."""
    with session.mutex:
        if not session.claimed:
            if session.storage.root_state().kind != "store":
                return []  # take (create) no lock in a directory that is no store
            session.acquire()
        removed = session.storage.gc(include_tmp=True)
        # gc may bring back a step an interrupted replacement had moved aside: list anew.
        session.planner = None
    wait_for_deletions()
    return removed


def set_pinned(session: Session, step: int, pinned: bool) -> None:
    """Pin or unpin ``step`` (``CheckpointManager.pin``/``unpin``): retention keeps a pinned one.

    Raises:
        NoCheckpointError: ``step`` is not committed.
        CommitError: the marker could not be written or removed.
    """
    s = session.resolve(step)
    try:
        session.storage.set_pinned(s, pinned)
    except OSError as e:
        if not plain_oserror(e):
            raise
        what = "pin" if pinned else "unpin"
        raise CommitError(f"could not {what} {session.storage.describe(s)}: {e}") from e
    with session.mutex:
        if session.planner is not None:
            session.planner.set_pinned(s, pinned)

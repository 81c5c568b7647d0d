"""Save stage 6, after the commit: the replica queue, retention, and deletion.

In: the :class:`~ckptstore.session.Session` and the step just committed (or a request to
prune, delete or collect garbage). Out: the step queued for upload (on the uploading rank),
the steps retention deleted, what the session knows of the store brought up to date.
Retention is planned by the pure :class:`~ckptstore.retention.RetentionPlanner`; a step
found corrupt is never counted as the newest good one. A failure of retention after a
commit never fails the save.
"""

from __future__ import annotations

from typing import Any

from .._log import logger as log
from ..dist import Call, same_call
from ..errors import CkptStoreError, CommitError, StepProtectedError, UsageError
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


def plan_prune(session: Session, *, agree: bool = False) -> list[int]:
    """The steps :func:`prune` would delete now (see ``CheckpointManager.plan_prune``).

    ``agree``: called on every rank (``CheckpointManager.plan_prune``); on node-local roots
    the nodes then agree on the newest step good on every node (:func:`_agreed`).
    """
    if agree and session.split:
        return _agreed(session, delete=False)
    with session.mutex:
        known = session.known()
        if not len(known):
            return []
        _check_store_metrics(session, known)
        if session.split:  # no exchange here: what every node already agreed on
            last_good, floor = _agreed_good(session, known)
        else:
            last_good, floor = _last_good(session, known), None
        return _plan(session, known, last_good, floor)


def _plan(
    session: Session, known: RetentionPlanner, last_good: int | None, floor: int | None
) -> list[int]:
    """The doomed steps, ``last_good`` kept; with a ``floor``, no step at or below it."""
    with session.mutex:
        if not known.incremental:
            # A policy of the user's own may look at pins: give it every step's.
            for s in known:
                known.set_pinned(s, session.storage.is_pinned(s))
        else:
            # A step pinned once stayed pinned here for the life of the job: an unpin
            # (`ckptstore unpin`, another process) never let retention delete it.
            for s in known.pinned_steps():
                if not session.storage.is_pinned(s):
                    known.set_pinned(s, False)
        doomed = known.plan(last_good=last_good)
        if floor is not None:
            doomed = [s for s in doomed if s > floor]
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
        raise UsageError(msg)


def _last_good(session: Session, known: RetentionPlanner) -> int | None:
    for s in reversed(known):
        # A step this job could not restore is never the last good one, even where a deep
        # verify passes it now (a read that failed once, a defect verify cannot see):
        # retention would then keep it and delete the steps the job saved since it resumed
        # from an older one (and read all of it again at every save).
        if s in session.known_bad:
            continue
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


def prune(session: Session, *, agree: bool = False) -> list[int]:
    """Apply the retention policy now; returns the deleted steps (``CheckpointManager.prune``).

    ``agree``: called on every rank; on node-local roots the nodes first agree on the newest
    step good on every node (:func:`_agreed`), and every rank returns the same steps.
    """
    session.check_open()
    if agree and session.split:
        return _agreed(session, delete=True)
    if not session.node_leader:
        # The store's writer (the lowest rank sharing it) prunes it. Another rank, with
        # no lock, deleted steps of the store rank 0 writes by a policy of its own.
        return []
    with session.mutex:
        if not session.claimed:
            if not session.storage.list_steps():
                return []  # nothing to delete: take (create) no lock here
            session.acquire()
        return _delete(session, plan_prune(session))


def _delete(session: Session, doomed: list[int]) -> list[int]:
    with session.mutex:
        deleted = []
        for s in doomed:
            try:
                gone = session.storage.delete(s, spare_pinned=True)
            except FileNotFoundError:
                session.forget(s)
                continue
            except OSError as e:
                raise CommitError(f"could not delete {session.storage.describe(s)}: {e}") from e
            if not gone:  # pinned since it was planned (a pin takes no lock)
                session.known().set_pinned(s, True)
                log.warning("%s was pinned meanwhile: kept", session.storage.describe(s))
                continue
            session.forget(s)
            deleted.append(s)
        if deleted:
            log.info("retention deleted steps %s", deleted)
        return deleted


# ---- node-local roots: a step is good for retention only if it is good on every node ----
#
# Each node holds a part of every step, so "the newest step that verifies" is the newest one
# that verifies on every node: one node's verdict on its own part says nothing of the
# others'. ``known_good`` holds only steps good on every node (committed by every node, read
# by a restore on every rank, or agreed below); ``known_bad`` steps found bad on any node.


def _agreed_good(session: Session, known: RetentionPlanner) -> tuple[int | None, int | None]:
    """``(last_good, floor)`` from what the nodes already agreed on; no exchange, no read.

    For retention after a save (the step just committed everywhere is good everywhere)
    and on the uploader's thread. The newest step not known bad anywhere that is known good
    everywhere is the last good step; a step that is neither (not checked by every node)
    stops the walk as the ``floor``: no step at or below it is deleted, since the newest step
    good on every node may be any of them.
    """
    for s in reversed(known):
        if s in session.known_bad:
            continue
        if s in session.known_good:
            return s, None
        log.info("retention deletes no step up to %d: not known good on every node yet", s)
        return None, s
    return None, None


def _agreed(session: Session, *, delete: bool) -> list[int]:
    """``plan_prune``/``prune`` on node-local roots, on every rank: two exchanges.

    1. ``prune:agree``: each node's leader walks its steps newest first and stops at the
       first one good here (known good everywhere, or verifying deep on this node), noting
       the newer ones it found bad; rank 0 turns the reports into one verdict for every
       rank: the last good step when every node stopped at the same one, else a floor (the
       lowest stop: the newest step good on every node is at or below it, and nothing
       there is deleted), and the steps bad on some node (bad on every node from then on).
    2. ``prune:done``: each leader plans (and with ``delete`` deletes) with that verdict;
       every rank returns the union of the nodes' steps, or raises the same error.

    What a non-zero rank sends and receives is bounded by the steps checked, not the world.

    Raises:
        BarrierTimeout: a rank did not take part (it is named); nothing deleted before it.
        CommitError: a node could not plan or delete (named with its error).
        StoreLockedError, UsageError: as ``prune``, from the first node that raised it.
    """
    coord = session.coord
    mine: tuple[str, Any] = ("none", None)
    if session.node_leader:
        try:
            mine = ("ok", _walk(session, delete=delete))
        except (CkptStoreError, OSError, ValueError) as e:
            mine = ("error", e)
    # With the call, checked first: a prune on one rank met another's save, and both
    # raised a bare "too many values to unpack" (found by review).
    call: Call = ("prune" if delete else "plan_prune", ())
    status, value = coord.reduce((call, *mine), _verdict, "prune:agree")
    if status == "error":
        raise value
    good, floor, bad = value
    out: tuple[str, Any] = ("none", None)
    if session.node_leader:
        try:
            with session.mutex:
                for s in bad:
                    session.known_bad.add(s)
                    session.known_good.discard(s)
                if good is not None:
                    session.known_good.add(good)
                    session.known_bad.discard(good)
                known = session.known()
                doomed = _plan(session, known, good, floor) if len(known) else []
                if delete and not session.claimed:
                    doomed = []  # the store had no step when this node walked it: no lock
                if floor is not None:
                    log.warning(
                        "retention deletes no step up to %d: the nodes do not agree on the "
                        "newest step that verifies on every node (found bad on some node: %s)",
                        floor,
                        bad,
                    )
                out = ("ok", _delete(session, doomed) if delete else doomed)
        except (CkptStoreError, OSError, ValueError) as e:
            out = ("error", e)
    status, value = coord.reduce(out, _union, "prune:done")
    if status == "error":
        raise value
    return value  # type: ignore[no-any-return]


def _walk(session: Session, *, delete: bool) -> tuple[int | None, list[int]]:
    """A node's report: the newest step good here (or None), and the newer ones found bad."""
    with session.mutex:
        if not session.claimed:
            if not session.storage.list_steps():
                return None, []  # nothing here: take (create) no lock
            if delete:
                session.acquire()
        known = session.known()
        if len(known):
            _check_store_metrics(session, known)
        bad: list[int] = []
        for s in reversed(known):
            if s in session.known_bad:
                bad.append(s)
                continue
            if s in session.known_good:
                return s, bad
            report = verify_checkpoint(session.storage, s, deep=True)
            if report.ok:
                return s, bad  # good on this node: every node must say so too
            bad.append(s)
            log.warning(
                "retention keeps an older step: step %d does not verify on this node: %s",
                s,
                "; ".join(report.problems),
            )
        return None, bad


#: How many failing ranks a verdict names.
_SHOWN = 8


def _verdict(sent: list[Any]) -> tuple[str, Any]:
    """Rank 0's verdict from every rank's report: ``("ok", (good, floor, bad))`` or an error.

    Raises (on every rank): ``UsageError`` where a rank made another call (:func:`same_call`).
    """
    same_call([e[0] if isinstance(e, tuple) and len(e) == 3 else e for e in sent])
    every: list[tuple[str, Any]] = [(e[1], e[2]) for e in sent]
    failed = [(r, v) for r, (st, v) in enumerate(every) if st == "error"]
    if failed:
        return "error", _failure(failed, "could not check its steps")
    reports = [v for st, v in every if st == "ok"]
    stops = [stop for stop, _ in reports]
    bad = sorted({s for _, b in reports for s in b})
    found = [s for s in stops if s is not None]
    if not found:
        return "ok", (None, None, bad)  # no step verifies on any node
    if len(set(stops)) == 1:
        return "ok", (found[0], None, bad)
    # A node with no good step: nothing is good everywhere; keep what is good somewhere.
    floor = max(found) if None in stops else min(found)
    return "ok", (None, floor, bad)


def _union(every: list[tuple[str, Any]]) -> tuple[str, Any]:
    failed = [(r, v) for r, (st, v) in enumerate(every) if st == "error"]
    if failed:
        return "error", _failure(failed, "could not apply retention")
    return "ok", sorted({s for st, v in every if st == "ok" for s in v})


def _failure(failed: list[tuple[int, Any]], what: str) -> BaseException:
    """The error every rank raises.

    The first node's own when every failing node raised the same kind of error (a
    ``StoreLockedError``, a ``UsageError``), else a ``CommitError`` naming each.
    """
    first = failed[0][1]
    if isinstance(first, CkptStoreError) and all(type(e) is type(first) for _, e in failed):
        return first
    detail = "; ".join(f"rank {r}: {e}" for r, e in failed[:_SHOWN])
    return CommitError(f"retention: the local store of {len(failed)} node(s) {what} ({detail})")


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
            gone = session.storage.delete(
                step, background=False, durable=True, spare_pinned=not force
            )
        except FileNotFoundError:
            gone = True  # gone meanwhile: what was asked is done
        except OSError as e:
            raise CommitError(f"could not delete {where}: {e}; it is still there") from e
        if not gone:
            raise StepProtectedError(
                f"{where} was pinned while it was being deleted; nothing was deleted"
            )
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
            if not session.split:  # node-local roots: good on this node only
                session.known_good.add(s)
            return True
        session.known_bad.add(s)
    return False


def gc(session: Session) -> list[str]:
    """Remove stale entries (``CheckpointManager.gc``, once no save of ours is in flight)."""
    if not session.node_leader:
        # Only the store's writer knows no save of its is in flight: another rank's gc
        # removed rank 0's .tmp- of an async save under way, and its commit failed.
        return []
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

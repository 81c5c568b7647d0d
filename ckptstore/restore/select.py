"""Restore stage 1, select: which committed steps to try, newest first, in either tier.

In: the :class:`~ckptstore.session.Session` and the step asked for (None: the newest that
verifies). Out: the candidates (rank 0 lists them; the restore loop broadcasts them), a
replica step fetched into the local store first (:func:`bring_local`, collective), and
whether a step vanished (deleted by a running job's retention) rather than failed.
"""

from __future__ import annotations

import contextlib
from typing import Any

from .._log import logger as log
from ..dist import told_by
from ..errors import IntegrityError, NoCheckpointError
from ..session import Session
from ..tiers import twotier as tiers
from ..tiers.replica import list_within

__all__ = [
    "bring_local",
    "candidates",
    "ensure_local",
    "on_replica",
    "replica_timeout",
    "restore_steps",
    "seen_there",
    "vanished",
    "written_by_rank0",
]


def vanished(session: Session, step: int, *, fetched: bool = False) -> bool:
    """Whether ``step`` is no longer committed: deleted (by retention), not corrupt.

    ``fetched``: its replica copy failed as this restore fetched it, so it was never local
    (or its local copy failed too): deleted only where neither tier lists it any more (the
    replica's retention, while a new node fetched it: "no checkpoint verifies" was raised
    though a newer step had landed there). Taken for deleted while the replica still listed
    it, it was listed again and fetched again, 17 times over, before it was skipped.

    False where the stores cannot say (any error listing them, a replica's listing given
    up after ``replica_timeout`` included): the step's own failure is then the error to
    raise, not the listing's.
    """
    replica = session.replica_storage if fetched else None
    if fetched and replica is None:
        return False
    try:
        if step in session.storage.list_steps():
            return False
        return replica is None or step not in list_within(replica, replica_timeout(session))
    except Exception as e:  # botocore's errors are no OSError
        log.warning(
            "could not list %s to tell a deleted step %d from a corrupt one: %s",
            session.root if replica is None else f"{session.root} or the replica {replica.root}",
            step,
            e,
        )
        return False


def restore_steps(session: Session) -> list[int]:
    """The committed steps a restore chooses from: both tiers' when there is a replica.

    The replica's listing is given up after ``replica_timeout`` (then it is taken to hold
    what this process last saw there).

    Raises:
        ReplicaUnavailableError: the replica does not list, and this process never saw
            what it holds (:func:`ckptstore.tiers.twotier.all_steps`).
    """
    if session.replica_storage is None:
        return session.steps()
    return tiers.all_steps(
        session.storage,
        session.replica_storage,
        seen_there(session),
        timeout=replica_timeout(session),
    )


def replica_timeout(session: Session) -> float:
    """Seconds a listing of the replica may take (``replica_timeout``)."""
    up = session.replica
    return up.timeout if up is not None else tiers.DEFAULT_REPLICA_TIMEOUT


def on_replica(session: Session, step: int) -> bool:
    """Whether the replica holds ``step`` (:func:`ckptstore.tiers.twotier.on_replica`).

    Listed within ``replica_timeout``; else what this process last saw there decides.
    """
    return tiers.on_replica(
        session.replica_storage, step, seen_there(session), timeout=replica_timeout(session)
    )


def seen_there(session: Session) -> set[int] | None:
    """The steps this process last saw the replica hold (None: it never listed it)."""
    return session.replica.seen_there() if session.replica is not None else None


def ensure_local(session: Session, step: int, *, replace: bool = False) -> bool:
    """``tiers.ensure_local`` into this session's store, under its writer lock if free.

    :meth:`Session.fetching`: a ``gc`` run meanwhile must not take the fetch for garbage.
    """
    assert session.replica_storage is not None
    with session.fetching():
        return tiers.ensure_local(session.storage, session.replica_storage, step, replace=replace)


def bring_local(session: Session, step: int, *, replace: bool, broadcast: bool) -> None:
    """Make ``step`` readable from the local store, fetching it from the replica.

    Collective: rank 0 fetches first (on a shared filesystem that serves every rank),
    then every other rank fetches what its own (node-local) root still lacks, unless
    rank 0 alone reads (``broadcast``). Every rank raises rank 0's error alike. On
    node-local roots the lowest rank of each node fetches into its store (replacing a
    copy that failed, or that holds only some ranks' files), the others wait for it.
    """
    assert session.replica_storage is not None
    session.coord.leader_value(
        lambda: ensure_local(session, step, replace=replace), "restore:fetch", step
    )
    if session.split:
        mine: tuple[str, Any] = ("ok", None)
        own: BaseException | None = None
        if session.node_leader and not session.coord.is_leader and not broadcast:
            try:
                ensure_local(session, step, replace=replace)
            except BaseException as e:
                mine, own = ("error", e), e
        failed = session.coord.reduce(mine, _first_failure, "restore:fetched", step)
        if failed is not None:
            r, err = failed
            if r == session.coord.rank and own is not None:
                raise own
            if not isinstance(err, BaseException):
                raise IntegrityError(f"rank {r}: {err}")
            raise told_by(r, err)
    elif not session.coord.is_leader and not broadcast:
        ensure_local(session, step)


def written_by_rank0(session: Session, step: int) -> bool:
    """Collective: whether ``step`` is a replicated save (rank 0's node alone holds it).

    On node-local roots such a step is read by rank 0 and broadcast to the others.
    """
    plain: tuple[str, Any] = ("ok", False)
    if session.coord.is_leader:
        # Unreadable (whatever the store raised): every rank reads its own copy, and the
        # verdicts say why.
        with contextlib.suppress(Exception):
            plain = ("ok", not session.storage.read_manifest(step).sharded)
    _, value = session.coord.broadcast(plain, "restore:kind", step)
    return bool(value)


def candidates(session: Session, step: int | None, listed: list[int] | None = None) -> list[int]:
    """The steps to try, newest first: exactly ``step``, or every committed one.

    ``listed``: :func:`restore_steps` already called (a resume's listing: the replica is
    listed once per restore, not twice).
    """
    steps = restore_steps(session) if listed is None else listed
    if step is not None:
        if step not in steps:
            session.resolve(step)  # raises NoCheckpointError with context
        return [step]
    if not steps:
        raise NoCheckpointError(
            f"{session.root}: no committed checkpoint to restore; check the path, or use "
            "resume(), which starts from scratch on an empty store"
        )
    return list(reversed(steps))


def _first_failure(every: list[tuple[str, Any]]) -> tuple[int, Any] | None:
    """The first rank that failed and its error, or None: rank 0's verdict for every rank."""
    return next(((r, v) for r, (st, v) in enumerate(every) if st == "error"), None)

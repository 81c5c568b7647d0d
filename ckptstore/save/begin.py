"""Save stage 3 of a sharded save, begin: open the tmp directory every rank writes into.

In: the :class:`~ckptstore.session.Session`, the step, and whether the save replaces a
corrupt committed step. Out: this rank's :class:`~ckptstore.storage.Pending` checkpoint
(opened by the lowest rank of its store, known by name on the others), or the error of
whichever rank failed to open its store's directory, raised on every rank alike.
"""

from __future__ import annotations

from typing import Any

from ..errors import CommitError
from ..session import Session
from ..storage import Pending
from .failures import commit_error, plain_oserror
from .phases import PhaseClock, mark

__all__ = ["open_everywhere", "open_here", "opened"]


def open_everywhere(
    session: Session, step: int, replace: bool, clock: PhaseClock | None
) -> Pending:
    """Phase 0 of a sharded save: rank 0 opens the tmp directory every rank writes into.

    On node-local roots the lowest rank of each node opens one in its own store (a
    node's copy is replaced when rank 0 replaces its own, or when it holds the step).
    """
    told, pending = open_here(session, step, replace)
    mark(clock, "begin")
    every = session.coord.all_gather(told, "save:begin", step)
    mark(clock, "x:begin")
    return opened(session, pending, every, step)


def open_here(session: Session, step: int, replace: bool) -> tuple[tuple[str, Any], Pending | None]:
    """The lowest rank of this store opens the tmp directory of ``step``.

    Returns what to tell the others (``("ok", dirname)``, ``("error", e)``; ``("ok",
    None)`` on the other ranks) and the pending checkpoint where this rank opened it.
    """
    if not session.node_leader:
        return ("ok", None), None
    try:
        if session.split and not session.coord.is_leader:
            session.take_lock()
            replace = step in session.storage.list_steps()
        pending = session.storage.begin(step, replace=replace)
    except BaseException as e:
        where = session.storage.describe(step)
        err = commit_error(e, where, session.previous(step)) if plain_oserror(e) else e
        return ("error", err), None
    return ("ok", pending.dirname), pending


def opened(
    session: Session, pending: Pending | None, every: list[tuple[str, Any]], step: int
) -> Pending:
    """The pending checkpoint on this rank, once every rank said how opening went.

    ``every`` holds each rank's :func:`open_here` answer: a failure anywhere (on
    node-local roots, in any node's store) aborts this rank's directory and is raised.
    """
    failed = [v for st, v in every if st == "error"]
    if failed:
        if pending is not None:
            session.storage.abort(pending)
        value = failed[0]
        raise value if isinstance(value, BaseException) else CommitError(str(value))
    value = every[min(session.peers)][1]
    return pending if pending is not None else Pending(session.storage, step, value)

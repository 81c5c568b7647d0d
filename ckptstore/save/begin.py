"""Save stage 3 of a sharded save, begin: open the tmp directory every rank writes into.

In: the :class:`~ckptstore.session.Session`, the step, and whether the save replaces a
corrupt committed step. Out: this rank's :class:`~ckptstore.storage.Pending` checkpoint
(opened by the lowest rank of its store, known by name on the others), or the error of
whichever rank failed to open its store's directory, raised on every rank alike.
"""

from __future__ import annotations

from typing import Any

from .._phases import PhaseClock, mark
from ..errors import CommitError
from ..session import Session
from ..storage import Pending
from .failures import commit_error, plain_oserror

__all__ = ["open_everywhere", "open_here", "open_verdict", "opened", "post_dirname"]


def open_everywhere(
    session: Session, step: int, replace: bool, clock: PhaseClock | None
) -> Pending:
    """Phase 0 of a sharded save: rank 0 opens the tmp directory every rank writes into.

    On node-local roots the lowest rank of each node opens one in its own store (a
    node's copy is replaced when rank 0 replaces its own, or when it holds the step).
    One :meth:`~ckptstore.dist.Coordinator.reduce`: what a rank receives is rank 0's
    directory and the first failure, whatever the world size.
    """
    told, pending = open_here(session, step, replace)
    mark(clock, "begin")
    seq = session.coord.seq
    post_dirname(session, pending, step, seq)
    verdict = session.coord.reduce(told, open_verdict, "save:begin", step)
    mark(clock, "x:begin")
    return opened(session, pending, verdict, step, seq)


def post_dirname(session: Session, pending: Pending | None, step: int, seq: int) -> None:
    """A node leader other than rank 0 tells its node where to write, through the store.

    Node-local roots: the ranks of a node write into their leader's directory. The store,
    not a collective, carries it: a collective would bring every node's name to every rank.
    """
    if session.split and pending is not None and not session.coord.is_leader:
        session.coord.post(f"dir/{step}/{seq}/{session.coord.rank}", pending.dirname)


def open_verdict(every: list[tuple[str, Any]]) -> dict[str, Any]:
    """Rank 0's answer to an opening exchange: its directory and the first failure."""
    error = next((v for st, v in every if st == "error"), None)
    return {"dirname": every[0][1], "open_error": error}


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
    session: Session, pending: Pending | None, verdict: dict[str, Any], step: int, seq: int
) -> Pending:
    """The pending checkpoint of this rank, once rank 0 said how opening went everywhere."""
    error = verdict["open_error"]
    if error is not None:
        if pending is not None:
            session.storage.abort(pending)
        raise error if isinstance(error, BaseException) else CommitError(str(error))
    if pending is not None:
        return pending
    dirname = verdict["dirname"]
    if session.split and not session.coord.is_leader and min(session.peers) != 0:
        dirname = session.coord.read_post(f"dir/{step}/{seq}/{min(session.peers)}")
        if dirname is None:  # the leader posts before the exchange it then joined
            msg = f"rank {session.coord.rank}: its node's leader did not say where to write"
            raise CommitError(msg)
    return Pending(session.storage, step, dirname)

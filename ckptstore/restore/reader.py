"""The restore pipeline: select -> plan -> read + check -> load, for one manager.

In: the state to restore into (or the entries to load as plain data) and the step asked
for. Out: the restored step, every rank on the same one, or the same error on every rank.
Restore is collective under torch.distributed: rank 0 lists the candidates (newest first,
:mod:`.select`), every rank reads and verifies the step (:mod:`.read`; or rank 0 reads
and broadcasts, for node-local disks), and a step that fails anywhere is skipped by all.
Payload bytes reach a target's tensors only once their checksum passed (per 4 MiB
block); ``in_place=False`` keeps every target unchanged until the whole step has been
checked (at the cost of a second copy of the state in memory).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, MutableMapping
from typing import Any

from .._gc import gc_paused
from .._log import logger as log
from .._phases import PhaseClock, mark
from ..codec.tree import STATE_FORMAT
from ..dist import Call, same_call, told_by
from ..errors import (
    BarrierTimeout,
    CkptStoreError,
    IntegrityError,
    ManifestError,
    NoCheckpointError,
    StateMismatchError,
)
from ..session import Session
from ..state.capture import apply_state
from ..state.modules import EMA
from .load import collect_targets
from .read import decode, read_blobs
from .select import (
    bring_local,
    candidates,
    ensure_local,
    on_replica,
    restore_steps,
    vanished,
    written_by_rank0,
)

__all__ = ["STATE_FORMAT", "Reader", "collect_targets"]

#: How often a restore looks for the new newest checkpoint when the one it was reading was
#: deleted under it; past that, a deleted step counts as a failed one.
_RELISTS = 16


class Reader:
    """Restore, resume and load for one manager; composed into it, sharing its session.

    Args:
        session: the store and what the manager knows of it.
        allow_pickle: load objects stored via pickle.
        raise_bg_error: raises the failure of the last async save (the save pipeline's), so
            that a restore reports it on every rank as a save does.
    """

    def __init__(
        self, session: Session, *, allow_pickle: bool, raise_bg_error: Callable[..., None]
    ) -> None:
        self.session = session
        self.allow_pickle = allow_pickle
        self.raise_bg_error = raise_bg_error
        #: Seconds (and CPU seconds of this process) per phase of the last restore that
        #: returned on this rank (``_phases``; empty before one did).
        self.last_restore_phases: dict[str, float] = {}
        self.last_restore_cpu: dict[str, float] = {}

    def restore(
        self,
        state: MutableMapping[Any, Any],
        step: int | None = None,
        *,
        strict: bool = True,
        broadcast: bool = False,
        in_place: bool | None = None,
        clock: PhaseClock | None = None,
        listed: list[int] | None = None,
    ) -> int:
        """``CheckpointManager.restore`` once the manager is open and no save is in flight.

        The cyclic garbage collector is paused meanwhile (and put back as it was): a
        restore makes and frees many small objects (the index's chunks, the tree's nodes,
        ``load_state_dict``'s), and a full collection walking every live object of the job
        ran on them in every other sharded restore of the bench (0.24 s of 1.5 s).
        ``clock``: a resume's, already running; ``listed``: the resume's listing of the
        steps (rank 0's; the replica is listed once per restore).
        """
        clock = clock or PhaseClock()
        with gc_paused():
            restored = self._restore(
                state, step, strict, broadcast, in_place, clock=clock, listed=listed
            )
        self._keep(clock, f"restore of step {restored}")
        return restored

    def _keep(self, clock: PhaseClock, what: str) -> None:
        """``clock``'s phases as the last restore's (see ``last_restore_phases``)."""
        self.last_restore_phases = dict(clock.phases)
        self.last_restore_cpu = dict(clock.cpu)
        log.debug("%s, phases: %s", what, clock.describe())

    def _restore(
        self,
        state: MutableMapping[Any, Any],
        step: int | None,
        strict: bool,
        broadcast: bool,
        in_place: bool | None,
        *,
        clock: PhaseClock | None = None,
        listed: list[int] | None = None,
    ) -> int:
        session = self.session
        # The first exchange (its barrier names the ranks that never came): every rank
        # restores the same step alike (same_call), or every rank refuses at once.
        call: Call = (
            "restore",
            (("step", step), ("strict", strict), ("broadcast", broadcast), ("in_place", in_place)),
        )
        session.coord.reduce(call, same_call, "restore:enter", step)
        mark(clock, "x:enter")
        keys = list(state.keys())

        def choose() -> list[int]:
            # A failed async save (only rank 0 writes) is raised on every rank, carried by
            # this first exchange, as save carries it by "save:enter".
            self.raise_bg_error(everywhere=True)
            return candidates(session, step, listed)

        value = session.coord.leader_value(choose, "restore:choose", step)
        mark(clock, "x:choose")
        skipped: list[str] = []
        queue, bad, relists = list(value), set(), 0
        refetched: set[int] = set()
        dirty: dict[int, str] = {}  # target tensors a failed step may have written
        while queue:
            s = queue.pop(0)
            touched: dict[int, str] = {}
            covered: dict[str, Any] = {}
            stored: dict[Any, Any] | None = None
            kinds: dict[Any, str | None] = {}
            mine: tuple[str, Any] = ("ok", None)
            blobs: dict[str, bytearray] | None = None
            checks = _Checks(session, s)
            caught: BaseException | None = None
            try:
                if session.replica_storage is not None:
                    try:
                        bring_local(session, s, replace=s in refetched, broadcast=broadcast)
                    except (IntegrityError, ManifestError):
                        # The replica's copy failed as it was fetched (every rank raises
                        # rank 0's error alike): no copy there to fall back on.
                        refetched.add(s)
                        raise
                    mark(clock, "fetch")
                if session.split and not broadcast and written_by_rank0(session, s):
                    send = True  # node-local roots: only rank 0's node holds this step
                else:
                    send = broadcast
                if session.split and not broadcast:
                    mark(clock, "x:kind")
                if send:
                    if session.coord.is_leader:
                        try:
                            blobs = read_blobs(session, s)
                        except BaseException:
                            session.coord.broadcast_bytes({}, "restore:broadcast", s)
                            raise
                    blobs = session.coord.broadcast_bytes(blobs, "restore:broadcast", s)
                    if not blobs:
                        raise IntegrityError(f"step {s}: rank 0 could not read it")
                    mark(clock, "fetch")
                stored, kinds = decode(
                    session,
                    s,
                    keys,
                    allow_pickle=self.allow_pickle,
                    blobs=blobs or None,
                    targets=state,
                    strict=strict,
                    in_place=in_place,
                    touched=touched,
                    report=covered,
                    checked=checks,
                    clock=clock,
                )
            except BarrierTimeout:
                raise
            except BaseException as e:
                caught = e
                mark(clock, "failed")  # this step's work up to its failure, not an exchange
            if not checks.done:  # this rank never reached its targets' checks
                try:
                    checks(caught)
                except _PeerRefused as e:
                    caught = e
            if isinstance(caught, _PeerRefused):
                mine = ("peer", None)
            elif isinstance(caught, IntegrityError | ManifestError):
                mine = ("skip", caught)
            elif caught is not None:
                mine = ("error", caught)
            hard, soft = session.coord.reduce(mine, _load_verdict, "restore:load", s)
            mark(clock, "x:load")
            if mine[0] == "peer" and not hard and not soft:  # cannot be: whoever refused says
                raise CkptStoreError(f"step {s}: another rank refused its targets")
            if hard:
                r, err = hard[0]
                # This rank's own exception (its traceback and cause), not the copy the
                # exchange unpickled.
                raise caught if r == session.coord.rank and caught is not None else told_by(r, err)
            if soft and session.replica_storage is not None:
                # The local copy failed: rank 0 looks for the replica's, which replaces it
                # (rank 0 decides whether one was tried already, so every rank agrees).
                there: tuple[str, Any] = ("ok", False)
                if session.coord.is_leader and s not in refetched:
                    there = ("ok", on_replica(session, s))
                _, retry = session.coord.broadcast(there, "restore:replica", s)
                mark(clock, "x:replica")
                if retry:
                    why = "; ".join(f"rank {r}: {v}" for r, v in soft)
                    log.warning("step %d: the local copy failed (%s); using the replica's", s, why)
                    refetched.add(s)
                    queue.insert(0, s)
                    continue
            if soft and step is not None:
                # An explicit step: raised only once the replica's copy was tried too (above);
                # one deleted while it was read (retention) is gone, not corrupt.
                # Rank 0 looks; where it cannot tell (the store does not answer), the
                # step's own error stands (vanished()). leader_value: an exception of rank
                # 0 there reaches every rank at once.
                vanished_here = session.coord.leader_value(
                    functools.partial(vanished, session, s, fetched=s in refetched),
                    "restore:vanished",
                    s,
                )
                mark(clock, "x:vanished")
                if vanished_here:
                    raise NoCheckpointError(_deleted_while_read(session, s))
                r, err = soft[0]
                raise caught if r == session.coord.rank and caught is not None else told_by(r, err)
            if soft and relists < _RELISTS:
                # Deleted while we read it (a running job's retention), not corrupt: rank 0
                # looks again, and every rank goes on with the new newest.
                def rechoose(s: int = s) -> list[int] | None:
                    if not vanished(session, s, fetched=s in refetched):
                        return None
                    return [c for c in candidates(session, None) if c not in bad]

                fresh = session.coord.leader_value(rechoose, "restore:rechoose", s)
                mark(clock, "x:rechoose")
                if fresh is not None:
                    # What the deleted step already wrote in place stays to be overwritten
                    # by the step restored, as after a corrupt one (checked below).
                    dirty.update(touched)
                    relists += 1
                    queue = fresh
                    continue
            if soft:
                dirty.update(touched)
                bad.add(s)
                # A save of this step (or of one after it, once training resumed before
                # it) replaces it; it does not count as the newest (see save()).
                session.known_bad.add(s)
                session.known_good.discard(s)
                why = "; ".join(f"rank {r}: {v}" for r, v in soft)
                log.warning("skipping step %d: %s", s, why)
                skipped.append(f"step {s}: {why}")
                continue
            assert stored is not None
            if covered.get("whole"):
                # Every entry read and checked, by the ranks together (each per-rank part by
                # its own rank: the same world size). A restore of some entries checked
                # only their files: retention must still verify the step before it trusts
                # it as the newest good one and deletes the older steps.
                session.known_good.add(s)
                session.known_bad.discard(s)
            # Applied on every rank, then agreed on: a module's load_state_dict raising on
            # one rank left the others training on alone (found by review).
            applied: BaseException | None = None
            described = session.storage.describe(s)
            try:
                try:
                    apply_state(state, stored, kinds, strict=strict, where=described)
                except StateMismatchError as e:
                    if in_place is False or not touched:
                        raise
                    raise StateMismatchError(
                        f"{e}; but the tensors of the modules and optimizers in state were already "
                        f"read in place from step {s} (they hold its values). Restore with "
                        "in_place=False to keep every target unchanged when an entry refuses"
                    ) from e
                left = sorted(name for i, name in dirty.items() if i not in touched)
                if left and in_place is not False:
                    raise IntegrityError(
                        f"{described} was restored, but {len(left)} tensors of state "
                        f"were partly written by a newer step that failed its checksum or was "
                        f"deleted while it was read, and this step holds no value for them: "
                        f"{', '.join(left[:5])}. Restore with in_place=False to keep every target "
                        "unchanged until a step verifies"
                    )
            except BarrierTimeout:
                raise
            except BaseException as e:
                applied = e
            mark(clock, "apply")
            failed = session.coord.reduce(applied, _first_failure, "restore:applied", s)
            mark(clock, "x:applied")
            if failed is not None:
                r, err = failed
                raise applied if applied is not None else told_by(r, err)
            if not strict and "keys" in covered:
                _warn_if_none_restored(state, covered["keys"], session.storage.describe(s))
            return int(s)
        raise NoCheckpointError(
            f"{session.root}: no checkpoint verifies (`ckptstore verify --all` shows why); "
            "tried newest first: " + " | ".join(skipped)
        )

    def resume(
        self,
        state: MutableMapping[Any, Any],
        *,
        strict: bool = True,
        broadcast: bool = False,
        in_place: bool | None = None,
    ) -> int:
        """``CheckpointManager.resume`` once the manager is open and no save is in flight."""
        session = self.session
        # The first exchange carries the call, as save's and restore's do: a resume on one
        # rank paired its broadcast with another rank's save or restore, and every rank
        # timed out naming no one, the group broken for good (found by review).
        call: Call = (
            "resume",
            (("strict", strict), ("broadcast", broadcast), ("in_place", in_place)),
        )
        clock = PhaseClock()
        session.coord.reduce(call, same_call, "resume:enter")
        mark(clock, "x:resume")

        def listing() -> list[int]:
            self.raise_bg_error(everywhere=True)  # on every rank, as in restore
            return restore_steps(session)

        # Rank 0's listing, kept for the restore's choice: the replica was listed twice,
        # each waiting on an endpoint that does not answer (found by review).
        listed = session.coord.leader_value(listing, "resume:list")
        mark(clock, "x:list")
        if not listed:
            self._keep(clock, "resume of an empty store")
            return 0
        step = self.restore(
            state,
            strict=strict,
            broadcast=broadcast,
            in_place=in_place,
            clock=clock,
            listed=list(listed) if session.coord.is_leader else None,
        )
        return step + 1

    def load(self, step: int | None, rank: int | None, wanted: list[Any] | None) -> dict[Any, Any]:
        """``CheckpointManager.load``, its arguments checked (its docstring says what it reads).

        The cyclic garbage collector is paused meanwhile, as in :meth:`restore`.
        """
        with gc_paused():
            return self._load(step, rank, wanted)

    def _load(self, step: int | None, rank: int | None, wanted: list[Any] | None) -> dict[Any, Any]:
        session = self.session
        skipped: list[str] = []
        queue, bad, relists = candidates(session, step), set(), 0
        refetched: set[int] = set()
        while queue:
            s = queue.pop(0)
            try:
                if session.replica_storage is not None:
                    try:
                        ensure_local(session, s, replace=s in refetched)
                    except (IntegrityError, ManifestError):
                        refetched.add(s)  # the replica's copy failed: none to fall back on
                        raise
                covered: dict[str, Any] = {}
                out, _ = decode(
                    session,
                    s,
                    wanted,
                    allow_pickle=self.allow_pickle,
                    rank=rank,
                    require=True,
                    report=covered,
                )
            except (IntegrityError, ManifestError) as e:
                if s not in refetched and on_replica(session, s):
                    log.warning("step %d: the local copy failed (%s); using the replica's", s, e)
                    refetched.add(s)
                    queue.insert(0, s)
                    continue
                if (
                    step is None
                    and relists < _RELISTS
                    and vanished(session, s, fetched=s in refetched)
                ):
                    # Deleted while we read it (a running job's retention), not corrupt.
                    relists += 1
                    queue = [c for c in candidates(session, None) if c not in bad]
                    continue
                if step is not None:
                    if vanished(
                        session, s, fetched=s in refetched
                    ):  # retention deleted it: not corrupt
                        raise NoCheckpointError(_deleted_while_read(session, s)) from e
                    raise
                bad.add(s)
                session.known_bad.add(s)
                session.known_good.discard(s)
                log.warning("skipping step %d: %s", s, e)
                skipped.append(f"step {s}: {e}")
                continue
            # Known good only when this one read checked all of the step: every entry and,
            # of a per-rank step, its only rank's part (on node-local roots, one node's
            # copy says nothing of the others').
            if covered.get("whole") and covered.get("ranks") == 1 and not session.split:
                session.known_good.add(s)
            return out
        raise NoCheckpointError(
            f"{session.root}: no checkpoint verifies (`ckptstore verify --all` shows why); "
            "tried newest first: " + " | ".join(skipped)
        )


#: How many ranks' failures a verdict carries back to every rank.
SHOWN = 8


def _deleted_while_read(session: Session, step: int) -> str:
    return (
        f"{session.storage.describe(step)} was deleted while it was read (a running job's "
        "retention, `ckptstore prune` or `rm`); it was not corrupt. Ask for a step that is "
        "kept (`ckptstore ls`), or for the newest with step=None"
    )


class _PeerRefused(Exception):
    """Another rank refused its targets: this one reads nothing into its own."""


class _Checks:
    """``restore:check``, once per step tried, on every rank: whether any rank refused.

    Each rank checks its targets against the step's ``state.json`` before it reads a byte
    into them; a refusal on one rank (a model of another shape there) used to leave the
    others reading the step in place, so their models held its values while every rank
    raised. Called by ``decode`` once the checks passed, or by the loop with the error that
    stopped this rank before them. A flag a rank; rank 0's answer one flag.
    """

    def __init__(self, session: Any, step: int) -> None:
        self.session = session
        self.step = step
        self.done = False

    def __call__(self, err: BaseException | None) -> None:
        self.done = True
        hard = err is not None and not isinstance(err, IntegrityError | ManifestError)
        refused = self.session.coord.reduce(hard, any, "restore:check", self.step)
        if refused and not hard:
            raise _PeerRefused


def _first_failure(every: list[BaseException | None]) -> tuple[int, BaseException] | None:
    """Rank 0's answer at 'restore:applied': the first rank whose state refused, and why."""
    return next(((r, e) for r, e in enumerate(every) if e is not None), None)


def _load_verdict(
    every: list[tuple[str, Any]],
) -> tuple[list[tuple[int, Any]], list[tuple[int, Any]]]:
    """Rank 0's answer at 'restore:load': the first hard errors and the first skipped copies.

    Each list is cut at :data:`SHOWN` so what every rank receives stays small; an empty
    list means no rank had one.
    """
    hard = [(r, v) for r, (st, v) in enumerate(every) if st == "error"]
    soft = [(r, v) for r, (st, v) in enumerate(every) if st == "skip"]
    return hard[:SHOWN], soft[:SHOWN]


def _warn_if_none_restored(
    state: MutableMapping[Any, Any], stored: Collection[Any], where: str
) -> None:
    """Warn when a restore with ``strict=False`` found none of ``state``'s entries.

    An EMA aside (rebuilt from its source), such a restore restored nothing, yet returns a
    step as if it had; a typo in a key is the usual cause.
    """
    asked = [k for k, v in state.items() if not isinstance(v, EMA)]
    if asked and not any(k in stored for k in asked):
        log.warning(
            "%s holds none of the entries of the state restored (%s; it holds %s): "
            "strict=False skipped them all, and nothing was restored",
            where,
            ", ".join(map(repr, asked)),
            ", ".join(map(repr, stored)) or "nothing",
        )

"""The save pipeline: admit -> capture/encode -> plan -> stage -> write -> commit -> after-commit.

In: a state the manager has checked (step, state, metrics, metadata, ``sharded``,
``allow_older``). Out: a :class:`~.staging.SaveHandle`, done for a synchronous save, or
running on the background writer for an async one. :class:`Saver` runs one save at a
time through the stage modules of this package and keeps what outlives a save: the
staging buffers, the background writer (and its own process group), the cached DTensor
plan, the phase timings of the last save and the error of a failed async save.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from .._log import logger as log
from .._phases import PhaseClock, mark
from ..dist import Call, Coordinator, same_call, told_by
from ..errors import BarrierTimeout, CkptStoreError, CommitError, ReplicaError, UsageError
from ..manifest import Manifest
from ..session import Session
from ..sharded import plan as sharding
from ..state.modules import RNGState
from ..state.structure import differences, structure_digest
from ..storage import Pending
from . import commit, commit_sharded
from .admit import admit
from .after_commit import after_commit
from .begin import open_everywhere
from .encode import encode
from .failures import shard_error
from .jobs import SaveJob, SaveOptions, ShardJob
from .plan import PlanCache, plan_dtensor
from .staging import BackgroundWriter, SaveHandle, StagingPool
from .write import write_dtensor, write_files

__all__ = ["Saver"]


class Saver:
    """Runs saves through the pipeline's stages for one manager (see the module docstring)."""

    def __init__(self, session: Session, opts: SaveOptions) -> None:
        self.session = session
        self.opts = opts
        self.staging = StagingPool()
        self.plan_cache = PlanCache()
        self.writer: BackgroundWriter | None = None
        # The background writer's own group, for the commit of async DTensor saves.
        self.bg_coord: Coordinator | None = None
        #: Seconds per phase of the last synchronous save on this rank (see ``phases``).
        self.last_save_phases: dict[str, float] = {}
        #: CPU seconds of this process per phase of that save.
        self.last_save_cpu: dict[str, float] = {}
        self.last_blocked_s = 0.0
        self.clock: PhaseClock | None = None
        self.inflight: SaveHandle | None = None
        self.bg_error: BaseException | None = None
        #: ``bg_error`` was raised on this rank already (by ``SaveHandle.wait``, ``wait`` or
        #: ``close``): it stays until the next save's first exchange has told every rank.
        self.bg_seen = False
        #: The warnings of replicated states that differ between ranks given so far.
        self.differ_warned: set[str] = set()
        _savers.add(self)

    def _forget_in_child(self) -> None:
        """In a forked child: the parent's writer thread and save are not this process's."""
        self.writer = None
        self.inflight = None

    def save(  # noqa: PLR0917 - private, one call site
        self,
        step: int,
        state: Mapping[Any, Any],
        metrics_d: dict[str, float],
        metadata_d: dict[str, Any],
        sharded: bool,
        allow_older: bool,
        *,
        refused: BaseException | None = None,
    ) -> SaveHandle:
        """``CheckpointManager.save`` once its arguments are checked and no save is in flight.

        ``refused``: this rank's arguments failed their checks; raised on every rank at the
        save's first exchange (nothing is written).
        """
        session, coord, opts = self.session, self.session.coord, self.opts
        t0 = time.perf_counter()
        clock = self.clock = PhaseClock()
        # The first exchange of a save (its barrier names the ranks that never called save,
        # at 'save:enter'): an async failure is raised on every rank, not only where it
        # happened; DTensor leaves on any rank make the save sharded on all of them; and
        # rank 0, which holds the store's listing, says whether the save may go ahead at
        # all (the same error on every rank, before anything is written).
        refusal: BaseException | None = refused
        replace = False
        if coord.is_leader and refused is None:
            refusal, replace = admit(session, step, metrics_d, allow_older)
        # async_save too: ranks that disagree on it pair one's staging broadcast with the
        # other's write broadcast, and a step committed while every rank raised.
        call: Call = (
            "save",
            (
                ("step", step),
                ("sharded", sharded),
                ("allow_older", allow_older),
                ("async_save", bool(self.opts.async_save)),
            ),
        )
        # The failure of the last async save, if any, and whether this rank raised it.
        seen, self.bg_seen = self.bg_seen, False
        bg = self.take_bg_error()
        dtensors_here = sharding.has_dtensors(state)
        # A replicated save writes rank 0's state alone: each rank says what its own looks
        # like (entries, dtypes, shapes; a few bytes an entry) so that one holding state
        # rank 0's lacks is named rather than dropped without a word (state/structure.py).
        # DTensor saves write every rank's shards and check their layouts in their plan.
        replicated = coord.enabled and not sharded and not dtensors_here
        shape = structure_digest(state) if replicated else None
        mine = ((bg, seen) if bg is not None else None, dtensors_here, refusal, call, shape)
        clock.mark("admit")
        prev, dtensor, refused, differ = coord.reduce(mine, _enter_verdict, "save:enter", step)
        clock.mark("x:enter")
        if differ is not None and coord.is_leader and differ not in self.differ_warned:
            self.differ_warned.add(differ)  # once a manager: every save would repeat it
            log.warning("step %d: %s", step, differ)
        if prev is not None:
            raise prev if isinstance(prev, CkptStoreError) else CommitError(str(prev))
        if refused is not None:
            raise refused
        # Per-rank generators are gathered so each rank resumes its own random stream.
        rng = {
            key: coord.gather(value.state_dict(), "save:rng", step)
            for key, value in state.items()
            if isinstance(value, RNGState) and coord.enabled and (dtensor or not sharded)
        }
        clock.mark("x:rng")
        if sharded or dtensor:
            done = self._save_sharded(step, state, metrics_d, metadata_d, rng, dtensor, replace)
            if isinstance(done, SaveHandle):
                self.last_blocked_s = time.perf_counter() - t0
                return done
            return self._done(step, done, t0)
        job: SaveJob | None = None
        error: BaseException | None = None
        if coord.is_leader:
            try:
                # Captured and encoded in the caller's thread (the one copy if async).
                encoded = encode(
                    state,
                    rng,
                    None,
                    allow_pickle=opts.allow_pickle,
                    fmt=opts.fmt,
                    compression=opts.compression,
                    staging=self.staging if opts.async_save else None,
                    device_staging=self.staging,
                )
                job = SaveJob(step, encoded, metrics_d, metadata_d, rank=None, replace=replace)
            except BaseException as e:  # reported to every rank below
                error = e
        if not opts.async_save:
            manifest = commit.commit_replicated(session, job, error, step, opts, self.clock)
            return self._done(step, manifest, t0)
        # Async: rank 0 has copied the state into staging buffers; the rest is background.
        failure = coord.broadcast(error, "save:staged", step)
        if failure is not None:
            # As a synchronous save raises it: a KeyboardInterrupt during the copy stays one
            # (it came out as CommitError(''), past the caller's `except KeyboardInterrupt`),
            # and a state_dict()'s own error keeps its type.
            raise failure if isinstance(failure, BaseException) else CommitError(str(failure))
        self.last_blocked_s = time.perf_counter() - t0
        if not coord.is_leader:
            return SaveHandle(step, result=None)
        assert job is not None
        if self.writer is None:
            self.writer = self._start_writer()
        blocked = self.last_blocked_s
        ready = job

        def run() -> Manifest:
            m = commit.commit_job(session, ready, opts)
            after_commit(session, step)
            self._log_summary(step, m, time.perf_counter() - t0, blocked)
            return m

        return self._in_background(step, run)

    def _in_background(self, step: int, work: Callable[[], Manifest]) -> SaveHandle:
        """Run an async save's ``work`` on the writer; a failure is kept for the next call."""
        assert self.writer is not None
        replica = self.session.replica

        held = replica.held() if replica is not None else contextlib.nullcontext()

        def run() -> Manifest:
            try:
                return work()
            except BaseException as e:
                hint = self._gone_hint()
                log.error("async save of step %d failed: %s%s", step, e, hint)
                # One object: the future's error is the manager's (``_error_seen``).
                err = CommitError(f"{e}{hint}") if hint else e
                self.bg_error = err
                self.bg_seen = False
                if err is not e:
                    raise err from e
                raise
            finally:
                held.__exit__(None, None, None)

        # Recorded before the job can run: an interrupt between the submit and this record
        # (Ctrl-C at the end of save) left the save untracked, and the next save staged into
        # the buffers it was still writing: a committed step held the next one's values
        # (found by review, with real SIGINTs).
        future: concurrent.futures.Future[Manifest] = concurrent.futures.Future()
        entered = False
        try:
            self.inflight = SaveHandle(step, future, on_error=self._error_seen)
            held.__enter__()  # uploads wait until this save commits
            entered = True
            self.writer.submit_to(future, run)
        except BaseException:
            # Never started, it never will (nothing holds the buffers); else it runs on.
            if future.cancel() and entered:
                held.__exit__(None, None, None)
            raise
        return self.inflight

    def _gone_hint(self) -> str:
        """Why an async save failed, where the job took its process group away under it.

        A script that calls ``dist.destroy_process_group()`` before ``close()`` (as many do
        at their end) left its last step uncommitted, and said only that a group "is not
        registered" (found by review).
        """
        if not self.session.coord.enabled:
            return ""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return ""
        return (
            " (torch.distributed's process group was destroyed before this save finished: "
            "call mgr.wait() or mgr.close() before dist.destroy_process_group(); the step "
            "is not committed, the one before it is the newest)"
        )

    def _done(self, step: int, manifest: Manifest, t0: float) -> SaveHandle:
        self.last_blocked_s = time.perf_counter() - t0
        if self.clock is not None:
            self.clock.mark("done")
            self.last_save_phases = dict(self.clock.phases)
            self.last_save_cpu = dict(self.clock.cpu)
            log.debug("step %d save phases: %s", step, self.clock.describe())
            self.clock = None
        if self.session.coord.is_leader:
            self._log_summary(step, manifest, self.last_blocked_s, self.last_blocked_s)
        return SaveHandle(step, result=manifest)

    def _save_sharded(  # noqa: PLR0917 - private, one call site
        self,
        step: int,
        state: Mapping[Any, Any],
        metrics: dict[str, float],
        metadata: dict[str, Any],
        rng: Mapping[Any, Any],
        dtensor: bool,
        replace: bool,
    ) -> Manifest | SaveHandle:
        """Two-phase commit: every rank writes its shard, rank 0 gathers and commits.

        Per-rank state (``sharded=True``): every rank writes its own tree and payloads.
        DTensor state: every rank writes the DTensor boxes the global plan gives it, rank 0
        the rest of the state once, and rank 0 adds the chunk index before the manifest.
        With ``async_save`` a DTensor save returns once every rank has staged its boxes;
        the writes and the commit (with its collectives, on a group of their own) go on in
        the background.
        """
        session, opts = self.session, self.opts
        coord = session.coord
        rank = coord.rank
        meta = {"metrics": metrics, "metadata": metadata}
        mine: tuple[str, Any]
        if dtensor:
            # Rank 0 opens the tmp directory before planning, and says so in the plan
            # exchange: one collective less than an exchange of its own.
            pending, mine = plan_dtensor(
                session, state, step, rng, replace, opts, self.plan_cache, self.staging, self.clock
            )
        else:
            pending = open_everywhere(session, step, replace, self.clock)
        if dtensor and opts.async_save:
            # Every rank must choose the same group for the commit: decide it together.
            job = self._staged_everywhere(pending, mine, step)
            return self._submit_sharded(pending, job, step, meta)
        try:
            if dtensor:
                if mine[0] == "ok":
                    mine = write_dtensor(pending, mine[1], rank, coord.is_leader, opts)
                    mark(self.clock, "write")
            else:
                # Sharded saves complete before save returns: encoded without staging.
                encoded = encode(
                    state,
                    None,
                    None,
                    allow_pickle=opts.allow_pickle,
                    fmt=opts.fmt,
                    compression=opts.compression,
                    staging=None,
                )
                write_files(pending, encoded, rank, opts)
                mine = ("ok", {"files": {n: e for n, e in pending.files.items() if e.rank == rank}})
        except BarrierTimeout:
            if session.node_leader:
                session.storage.abort(pending)
            raise
        except BaseException as e:
            log.error("rank %d failed to write its shard of step %d: %s", rank, step, e)
            mine = ("error", e)
        return commit_sharded.finish_sharded(
            session, pending, mine, step, meta, dtensor, coord, opts, self.clock
        )

    def _staged_everywhere(self, pending: Pending, mine: tuple[str, Any], step: int) -> ShardJob:
        """An async DTensor save goes to the background only if every rank staged its boxes.

        One exchange on the main group: each rank says whether it planned and staged its
        part. Only when all did does every rank hand the save to its background writer
        (whose commit runs on the background group); otherwise every rank aborts its
        directory and raises the same error naming the rank(s) that failed, at once. A
        rank deciding alone would commit on the main group while the others wait on the
        background group, each blaming a live rank after ``barrier_timeout``.

        Returns:
            This rank's job (boxes staged).

        Raises:
            CommitError, UnsafeCheckpointError: some rank could not plan or stage.
            BarrierTimeout: a rank did not join the exchange.
        """
        session = self.session
        said = ("ok", None) if mine[0] == "ok" else mine
        try:
            failed, nfailed = session.coord.reduce(said, _staged_verdict, "save:staged", step)
        except BarrierTimeout:
            if session.node_leader:
                session.storage.abort(pending)
            raise
        mark(self.clock, "x:staged")
        if nfailed:
            if session.node_leader:
                session.storage.abort(pending)
            where = session.storage.describe(step)
            raise shard_error(failed, where, session.previous(step))
        job: ShardJob = mine[1]
        return job

    def _submit_sharded(
        self, pending: Pending, job: ShardJob, step: int, meta: Mapping[str, Any]
    ) -> SaveHandle:
        """Write and commit a staged DTensor save in the background on every rank.

        The commit's collectives run on a second group of ckptstore's own, used only by the
        background writer (one save in flight at most), so they never interleave with the
        training thread's; they are bounded by ``barrier_timeout`` like every other.
        """
        session, opts = self.session, self.opts
        if self.bg_coord is None:
            self.bg_coord = Coordinator(opts.barrier_timeout, enabled=session.coord.enabled)
        bg = self.bg_coord
        coord = session.coord
        if self.writer is None:
            self.writer = self._start_writer()
        t0 = time.perf_counter()

        def run() -> Manifest:
            try:
                mine = write_dtensor(pending, job, coord.rank, coord.is_leader, opts)
            except BaseException as e:
                log.error("rank %d failed to write its shard of step %d: %s", bg.rank, step, e)
                mine = ("error", e)
            m = commit_sharded.finish_sharded(
                session, pending, mine, step, meta, True, bg, opts, None
            )
            if bg.is_leader:
                self._log_summary(step, m, time.perf_counter() - t0, self.last_blocked_s)
            return m

        return self._in_background(step, run)

    def _log_summary(self, step: int, manifest: Manifest, seconds: float, blocked: float) -> None:
        nbytes = manifest.total_bytes
        log.info(
            "saved step %d: %d bytes in %.3fs (%.2f GB/s), blocked %.1f ms",
            step,
            nbytes,
            seconds,
            nbytes / max(seconds, 1e-9) / 1e9,
            blocked * 1e3,
        )

    # ---- async bookkeeping ----------------------------------------------------------

    def take_bg_error(self) -> BaseException | None:
        """The failure of the last async save (once), as the error to raise for it."""
        err, self.bg_error = self.bg_error, None
        return _as_raised(err)

    def _error_seen(self, err: BaseException) -> None:
        """The caller got ``err`` from ``SaveHandle.wait``: this rank has seen it.

        Kept for the next save's first exchange: a rank that has not seen it (it wrote
        nothing, or has not waited) must be told, and then every rank raises it, this one
        again (``_enter_verdict``); where every rank has seen it, none raises it again.
        """
        if self.bg_error is err:
            self.bg_seen = True

    def raise_bg_error(self, *, everywhere: bool = False) -> None:
        """Raise the failure of the last async save, if any, where this rank has not yet.

        ``everywhere``: the caller hands the error to every rank (a restore's first
        exchange): it is raised even where this rank saw it (another rank has not), and
        forgotten. Otherwise (``wait``, ``close``: this rank alone) it is kept, seen, for
        the next save's first exchange to tell the other ranks.
        """
        if self.bg_error is None:
            return
        alone = self.session.coord.world_size == 1  # nobody else to tell
        if self.bg_seen and (not everywhere or alone):
            if everywhere:
                self.take_bg_error()
                self.bg_seen = False
            return
        if everywhere:
            err = self.take_bg_error()
            self.bg_seen = False
        else:
            self.bg_seen = True
            err = _as_raised(self.bg_error)
        if err is not None:
            raise err

    def wait_save(self) -> None:
        """Wait for the in-flight async save, if any (its error is raised by ``wait``).

        The save stays in flight until it is over: forgotten first, a wait cut short (a
        Ctrl-C, or another thread's ``gc()`` waiting at the same time) let the next save
        copy into the staging buffers the writer was still writing out, and the older step
        committed the newer one's bytes, under CRCs that match them.
        """
        h = self.inflight
        if h is not None:
            h._settle()  # its error stays pending until raised (once) to the caller
            if self.inflight is h:  # not a save another thread started since
                self.inflight = None

    def _start_writer(self) -> BackgroundWriter:
        """A background writer for this saver, stopped when the saver is collected.

        A manager dropped without ``close()`` left its thread waiting for a job for good.
        """
        writer = BackgroundWriter()
        weakref.finalize(self, writer.shutdown, wait=False)
        return writer

    def close(self, *, uploads: bool = True) -> None:
        """``CheckpointManager.close``: finish the save and uploads, release the lock and groups.

        ``uploads=False``: the in-flight save still finishes, but the replica's queued
        uploads are dropped, the one in flight abandoned (the next manager uploads them).

        Raises:
            CommitError: the last async save failed.
            ReplicaError: an upload failed.
        """
        session = self.session
        if session.closed:
            return
        try:
            self.wait_save()
            if self.writer is not None:
                self.writer.shutdown()
            upload_error: ReplicaError | None = None
            if session.replica is not None:
                try:
                    session.replica.close(wait=uploads)
                except ReplicaError as e:
                    upload_error = e
            self.raise_bg_error()
            if upload_error is not None:
                raise upload_error
        finally:
            h = self.inflight
            if h is not None and not h.done():
                # The wait above was cut short (a Ctrl-C): the writer still commits, with
                # the lock and the groups released below only once it is over.
                h._settle()
            if self.writer is not None:
                # Stopped here too: a Ctrl-C before the shutdown above left its thread and
                # the staging buffers it holds alive, and a second close() returns at once.
                self.writer.shutdown()
            if session.replica is not None:
                session.replica.close(wait=False)  # a no-op once closed above
            session.closed = True
            session.claimed = False
            session.planner = None
            if session.lock is not None:
                session.lock.release()
            if self.bg_coord is not None:
                self.bg_coord.close()
            session.coord.close()


#: Every saver of this process (see :meth:`Saver._forget_in_child`).
_savers: weakref.WeakSet[Saver] = weakref.WeakSet()


def _forget_savers_in_child() -> None:
    for saver in list(_savers):
        saver._forget_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_savers_in_child)


def _as_raised(err: BaseException | None) -> BaseException | None:
    """A background save's failure as the error raised for it (ours as it is)."""
    if err is None or isinstance(err, CkptStoreError):
        return err
    return CommitError(f"the previous async save failed: {err}")


#: How many ranks' errors a verdict carries back to every rank (the rest are counted).
SHOWN = 8


#: What a rank sends at 'save:enter': (its last async failure and whether it raised it,
#: whether it holds DTensors, its refusal, its :data:`Call`, its state's structure digest).
_Enter = tuple[
    tuple[BaseException, bool] | None, bool, BaseException | None, Call, dict[str, bytes] | None
]


def _enter_verdict(
    every: list[_Enter],
) -> tuple[BaseException | None, bool, BaseException | None, str | None]:
    """Rank 0's answer at 'save:enter': async failure, DTensors anywhere, refusal, warning.

    The warning says what other ranks hold that rank 0's replicated state lacks.
    An async failure (each rank's ``(error, seen here)``) is raised on every rank unless
    every rank has raised it already (``SaveHandle.wait``, ``wait``, ``close``): a rank
    that saw it raises it again rather than go on alone while the others raise. Where no
    rank holds DTensors, a replicated state holding what rank 0's lacks is described
    (:func:`~ckptstore.state.structure.differences`).

    Raises (on every rank): ``UsageError`` where the ranks' calls differ (:func:`same_call`):
    another step, ``sharded`` or ``allow_older``, or another call (a rank in a restore).
    """
    calls = [e[3] if isinstance(e, tuple) and len(e) == 5 else e for e in every]
    try:
        same_call(calls)
    except UsageError as refused:
        prev = next(
            (
                e[0][0]
                for e in every
                if isinstance(e, tuple) and len(e) == 5 and isinstance(e[0], tuple)
            ),
            None,
        )
        if prev is not None:  # taken from its rank's manager: said here, or lost
            raise UsageError(f"{refused}; and the previous async save failed: {prev}") from None
        raise
    failures = [e for e, _, _, _, _ in every if e is not None]
    told = len(failures) == len(every) and all(seen for _, seen in failures)
    prev = None if told or not failures else failures[0][0]
    # Rank 0's refusal (admit), else the first rank whose arguments failed their checks.
    answer: BaseException | None = None
    for r, (_, _, refusal, _, _) in enumerate(every):
        if refusal is not None:
            answer = refusal if r == 0 else told_by(r, refusal)
            break
    dtensors = any(flag for _, flag, _, _, _ in every)
    differ = None if dtensors else differences([shape for _, _, _, _, shape in every])
    return prev, dtensors, answer, differ


def _staged_verdict(every: list[tuple[str, Any]]) -> tuple[list[tuple[int, Any]], int]:
    """Rank 0's answer at 'save:staged': the first failures (rank, error), and how many."""
    failed = [(r, v) for r, (st, v) in enumerate(every) if st != "ok"]
    return [(r, v) for r, v in failed if v is not None][:SHOWN], len(failed)

"""Save stage 5, commit to one store: write, wait for every rank, publish, announce.

In: a :class:`~.jobs.SaveJob` (rank 0 of a replicated save, or the async writer) and the
:class:`~ckptstore.session.Session`. Out: the committed :class:`~ckptstore.manifest.Manifest`
on every rank, or the same error on every rank with nothing of the step visible. The
order of the commit itself (payloads, fsync, manifest last, rename) is the storage base's;
the two-phase commits of sharded saves and node-local roots are in :mod:`.commit_sharded`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._phases import PhaseClock, mark
from ..dist import Coordinator
from ..errors import BarrierTimeout, CommitError
from ..manifest import Manifest
from ..session import Session
from .after_commit import after_commit
from .failures import commit_error, plain_oserror
from .jobs import SaveJob, SaveOptions, Written
from .write import make_manifest, write_files

__all__ = [
    "announce",
    "commit_job",
    "commit_replicated",
    "outgoing",
    "publish",
    "write_job",
]


def write_job(session: Session, job: SaveJob, opts: SaveOptions) -> Written:
    """Write payloads and state.json durably into a pending checkpoint (rank 0 only).

    Everything but the commit itself, so the caller can check that every rank is still
    there before the checkpoint becomes visible.
    """
    step = job.step
    where = session.storage.describe(step)
    try:
        pending = session.storage.begin(step, replace=job.replace)
    except OSError as e:
        raise commit_error(e, where, session.previous(step)) from e
    try:
        write_files(pending, job.encoded, job.rank, opts)
        manifest = make_manifest(
            step,
            pending.files,
            job.metrics,
            job.metadata,
            opts,
            session.coord.world_size,
            sharded=False,
        )
    except BaseException as e:
        session.storage.abort(pending)
        if plain_oserror(e):
            raise commit_error(e, where, session.previous(step)) from e
        raise
    return Written(pending, manifest)


def publish(session: Session, written: Written) -> None:
    """Commit a fully written checkpoint; on failure nothing of it stays visible."""
    pending, manifest = written.pending, written.manifest
    try:
        session.storage.commit(pending, manifest)
    except BaseException as e:
        session.storage.abort(pending)
        if plain_oserror(e):
            where = session.storage.describe(pending.step)
            raise commit_error(e, where, session.previous(pending.step)) from e
        raise
    session.committed(manifest)


def commit_job(session: Session, job: SaveJob, opts: SaveOptions) -> Manifest:
    """Write and commit in one go (the async writer, which has no one to wait for)."""
    written = write_job(session, job, opts)
    publish(session, written)
    return written.manifest


def commit_replicated(  # noqa: PLR0917 - private to the pipeline
    session: Session,
    job: SaveJob | None,
    error: BaseException | None,
    step: int,
    opts: SaveOptions,
    clock: PhaseClock | None,
) -> Manifest:
    """Rank 0 writes; once every rank is known to be alive it commits; all learn how.

    The "save:write" wait sits between writing and committing (arrive/commit/depart),
    so a rank that died during the save leaves nothing visible.
    """
    coord = session.coord
    written: Written | None = None
    told: tuple[str, Any] = ("ok", None)
    if coord.is_leader:
        if error is None:
            assert job is not None
            try:
                written = write_job(session, job, opts)
            except BaseException as e:
                told = ("error", e)
        else:
            told = ("error", error)
    try:
        status, value = coord.broadcast(told, "save:write", step)
    except BarrierTimeout:
        if written is not None:
            session.storage.abort(written.pending)
        raise
    if status == "error":
        raise value if isinstance(value, BaseException) else CommitError(str(value))
    outcome: tuple[str, Any] = ("ok", b"")
    if coord.is_leader:
        assert written is not None
        try:
            publish(session, written)
            outcome = ("ok", outgoing(session, written.manifest))
        except BaseException as e:
            outcome = ("error", e)
    return announce(session, outcome, step, coord, clock)


def outgoing(session: Session, manifest: Manifest, *, trim: bool = False) -> Manifest | bytes:
    """The committed manifest as other ranks receive it: its bytes, re-validated there.

    ``trim`` (a sharded save): only the files of no rank (the state, the chunk index) are
    sent. The full list has an entry per rank's file, so sending it would make what every
    rank receives grow with the world size; the manifest on disk lists them all.
    """
    if not session.coord.enabled:
        return manifest
    if trim:
        files = {n: e for n, e in manifest.files.items() if e.rank is None}
        manifest = dataclasses.replace(manifest, files=files)
    return manifest.to_bytes()


def announce(  # noqa: PLR0917 - private to the pipeline
    session: Session,
    outcome: tuple[str, Any],
    step: int,
    coord: Coordinator,
    clock: PhaseClock | None,
    full: Manifest | None = None,
) -> Manifest:
    """Broadcast rank 0's commit outcome; every rank returns the manifest or raises it.

    ``clock`` is the synchronous save's (None on the background writer's group). ``full``:
    the manifest rank 0 committed, where the outcome carries a trimmed one (rank 0 returns
    the whole).
    """
    status, value = coord.broadcast(outcome, "save:commit", step)
    mark(clock, "x:commit")
    if status == "error":
        raise value if isinstance(value, BaseException) else CommitError(str(value))
    after_commit(session, step)
    mark(clock, "after_commit")
    if full is not None and coord.is_leader:
        return full
    return value if isinstance(value, Manifest) else Manifest.from_bytes(value)

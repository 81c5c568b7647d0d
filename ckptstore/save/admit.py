"""Save stage 0, admit (rank 0): may this step be saved at all? Nothing is written.

In: the :class:`~ckptstore.session.Session`, the step, its metrics, ``allow_older``.
Out: ``(error, replace)``: the error every rank raises (or None), and whether the save
replaces a committed step that does not verify. Takes the writer lock (a lock just taken
also clears the leftovers of crashed saves); refuses a step that lacks a ``KeepBest``
metric, one older than the newest good step, and one that is committed and verifies.
"""

from __future__ import annotations

from collections.abc import Mapping

from .._log import logger as log
from ..errors import StepExistsError, UsageError
from ..ops.verify import verify_checkpoint
from ..retention import RetentionPlanner, keep_best_policies
from ..session import Session
from ..storage.base import step_exists_message
from .failures import commit_error, plain_oserror

__all__ = ["admit"]


def admit(
    session: Session, step: int, metrics: Mapping[str, float], allow_older: bool
) -> tuple[BaseException | None, bool]:
    """Rank 0: may ``step`` be saved? Takes the writer lock; nothing is written.

    Returns:
        ``(error, replace)``: the error every rank raises (or ``None``), and whether the
        save replaces a committed step that does not verify.
    """
    try:
        _check_policy_metrics(session, step, metrics)
        session.take_lock()
        with session.mutex:
            known = session.known()
            if not allow_older:
                _check_order(session, step, known)
                _check_replica(session, step, known)
            return None, _claim_step(session, step, known)
    except BaseException as e:  # raised on every rank by save()
        if plain_oserror(e):  # listing the store or taking its lock failed
            return commit_error(e, session.storage.describe(step), None), False
        return e, False


def _check_policy_metrics(session: Session, step: int, metrics: Mapping[str, float]) -> None:
    """A save must carry the metric of every ``KeepBest`` (or the policy allows it)."""
    lacking = [b for b in keep_best_policies(session.policy) if b.metric not in metrics]
    if not lacking:
        return
    got = ", ".join(repr(k) for k in sorted(metrics)) or "none"
    refused = [b for b in lacking if b.missing == "error"]
    if refused:
        b = refused[0]
        msg = (
            f"refusing to save step {step} in {session.root}: its metrics lack {b.metric!r}, "
            f"which {b!r} ranks checkpoints by (got metrics: {got}); nothing was written. "
            "Without it retention would keep only the newest steps and delete the best. "
            f"Pass metrics={{{b.metric!r}: ...}}, fix the metric's name, or use "
            f"KeepBest(..., missing='keep') to keep such steps"
        )
        raise UsageError(msg)
    for b in lacking:
        log.warning(
            "step %d has no metric %r (got metrics: %s): %r keeps it for good; retention "
            "never deletes it for lacking the metric (mgr.delete(%d) does)",
            step,
            b.metric,
            got,
            b,
            step,
        )


def _check_order(session: Session, step: int, known: RetentionPlanner) -> None:
    """Refuse a step older than the newest committed one not known to be corrupt.

    Restarting training without ``resume()`` saves steps below those in the store:
    retention would delete them at once (they are not the newest) and the next resume
    would pass them over. A step restore skipped as corrupt does not count, so training
    that resumed before it saves it (and the ones after it) again.
    """
    newest = next((s for s in reversed(known) if s not in session.known_bad), None)
    if newest is None or step >= newest:
        return
    have = list(known)
    held = f"{len(have)} step{'s' * (len(have) != 1)}, {have[0]}..{have[-1]}"
    msg = (
        f"refusing to save step {step} in {session.root}: the store already holds newer "
        f"checkpoints ({held}; newest {newest}); nothing was written. Training probably "
        "restarted without resume(): call mgr.resume(state) before training to continue "
        f"after step {newest}, or save(..., allow_older=True) to save it anyway "
        "(retention may delete it at once: it is not the newest)"
    )
    raise UsageError(msg)


def _check_replica(session: Session, step: int, known: RetentionPlanner) -> None:
    """Refuse a step the replica holds already, or one older than the replica's newest.

    A new node's empty disk says nothing of the run: a job started there without
    ``resume()`` saved steps 1, 2, ... and its uploads replaced the replica's trained
    copies of them, the run's only ones (found by review). What the replica holds is what
    this process last saw it hold (its uploader's listing at start-up, kept current); a
    step a restore of this job skipped there as corrupt does not count, as locally.
    """
    seen = session.replica.seen_there() if session.replica is not None else None
    if not seen:
        return
    there = sorted(s for s in seen if s not in session.known_bad)
    newest = there[-1] if there else None
    if newest is None or step > newest or (step == newest and step in known):
        return
    assert session.replica is not None
    url = session.replica.url
    if step < newest:
        what = f"the replica {url} holds newer checkpoints (steps {there[0]}..{newest})"
    else:
        what = f"the replica {url} holds step {step} already (steps {there[0]}..{newest})"
    msg = (
        f"refusing to save step {step} in {session.root}: {what}; nothing was written, and "
        "its upload would replace the replica's copies. Training probably restarted without "
        f"resume() (on a new node, say): call mgr.resume(state) before training to continue "
        f"after step {newest}, or save(..., allow_older=True) to save it anyway"
    )
    raise UsageError(msg)


def _claim_step(session: Session, step: int, known: RetentionPlanner) -> bool:
    """Make sure ``step`` may be written: absent, or committed but corrupt (replaced).

    Corrupt means: a restore of this job skipped it (``known_bad``), or it fails a deep
    verify here.

    After ``restore`` skipped a corrupt newest checkpoint, training reaches that step
    again; refusing the save then would stop the job for good. A committed step that
    verifies is never overwritten. A corrupt one is replaced only when the new save
    commits (``Storage.begin(replace=True)``): if its verification failed transiently
    and the new save fails, it is still there.

    Returns:
        Whether the save replaces a committed (corrupt) step.

    Raises:
        StepExistsError: ``step`` is committed and verifies.
    """
    if step not in known:
        return False
    if step in session.known_bad:
        # A restore of this job skipped it (on node-local roots: it was whole on some
        # nodes only, what a crash or a power cut between the nodes' renames leaves, and
        # this node's part may well verify alone). Training resumed before it and reached
        # it again: the save replaces it.
        log.warning(
            "%s was skipped by the restore (it does not verify, or is not whole on every "
            "node); this save replaces it when it commits",
            session.storage.describe(step),
        )
        session.known_good.discard(step)
        return True
    report = verify_checkpoint(session.storage, step, deep=True)
    if report.ok:
        raise StepExistsError(step_exists_message(session.storage, step))
    log.warning(
        "%s is committed but does not verify (%s); this save replaces it when it commits",
        session.storage.describe(step),
        "; ".join(report.problems),
    )
    session.known_good.discard(step)
    return True

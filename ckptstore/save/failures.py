"""The errors a failed save raises on every rank (used by the save stages, not a stage).

In: the exception a stage caught (an ``OSError`` of the system, the errors of the ranks
that failed), where the save was going, and the step that stays the newest. Out: a
:class:`~ckptstore.errors.CommitError` (or ``UnsafeCheckpointError``) whose message says
what failed and that nothing of the step is visible.
"""

from __future__ import annotations

import errno
from typing import Any

from ..errors import CkptStoreError, CommitError, UnsafeCheckpointError

__all__ = ["commit_error", "plain_oserror", "shard_error"]


def plain_oserror(e: BaseException) -> bool:
    """Whether ``e`` is an ``OSError`` of the system, not one of ckptstore's own errors."""
    return isinstance(e, OSError) and not isinstance(e, CkptStoreError)


#: What the errors a save meets most often mean, in words.
_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "the filesystem is read-only",
    errno.EIO: "an I/O error",
}


def _reason(e: Any) -> str | None:
    """``e``'s errno in words (:data:`_REASONS`), for an ``OSError`` of the system."""
    return _REASONS.get(getattr(e, "errno", None) or 0) if plain_oserror(e) else None


def commit_error(e: BaseException, where: str, previous: int | None) -> CommitError:
    """The error of a save that failed for ``e`` (an ``OSError``): what, and what is left."""
    reason = _reason(e) or type(e).__name__
    prev = (
        f"step {previous} is still the newest checkpoint"
        if previous is not None
        else "nothing was committed"
    )
    return CommitError(
        f"saving {where} failed: {reason} ({e}); nothing of it is visible and {prev}"
    )


#: A failure message names at most this many ranks, and gives the errors of fewer.
_RANKS = 32
_DETAILS = 8


def shard_error(failed: list[tuple[int, Any]], where: str, previous: int | None) -> BaseException:
    """The error every rank raises when some ranks could not write their part of a save.

    A state that cannot be saved at all (it needs pickle, compression with DTensors, a
    Partial placement, an optimizer without its model) stays an ``UnsafeCheckpointError``,
    as in a replicated save; a failure to write is a ``CommitError``. An interrupt
    (KeyboardInterrupt, SystemExit) on a rank stays itself, as a replicated save raises
    it: it came out as ``CommitError`` with an empty reason, past the caller's ``except
    KeyboardInterrupt`` (found by review).
    """
    for _, e in failed:
        if isinstance(e, BaseException) and not isinstance(e, Exception):
            return e
    prev = (
        f"step {previous} is still the newest checkpoint"
        if previous is not None
        else "nothing was committed"
    )
    # Bounded whatever the world size: the message travels to every rank.
    # A rank's OSError arrives whole (it pickles with its errno): said in words too.
    detail = "; ".join(
        f"rank {r}: {why} ({e})" if (why := _reason(e)) else f"rank {r}: {str(e) or repr(e)}"
        for r, e in failed[:_DETAILS]
    )
    ranks = ", ".join(str(r) for r, _ in failed[:_RANKS])
    if len(failed) > _DETAILS:
        detail += f"; ... ({len(failed)} ranks in all)"
    if len(failed) > _RANKS:
        ranks += f" and {len(failed) - _RANKS} more"
    if failed and all(isinstance(e, UnsafeCheckpointError) for _, e in failed):
        return UnsafeCheckpointError(
            f"sharded save of {where} refused by rank(s) {ranks} ({detail}); nothing of it is "
            f"visible and {prev}"
        )
    return CommitError(
        f"sharded save of {where} aborted: rank(s) {ranks} failed to write their shard ({detail}); "
        f"nothing of it is visible and {prev}"
    )

"""The commit of a sharded step on node-local roots: every node's copy, or none.

Each node's lowest rank (its leader) holds a tmp directory with its ranks' files. Rank 0
sends the manifest and its files of no rank; then two rounds, each closed by an exchange of
verdicts among all ranks:

1. **prepare**: each leader writes rank 0's files into its copy, the ``local-ranks`` marker
   and the manifest, and fsyncs the directory (:meth:`Storage.prepare`). Nothing is
   visible yet. A failure on any node (a full disk, say) aborts every node's copy: the
   previous step stays the newest on every node.
2. **publish**: each leader renames its copy into place (:meth:`Storage.publish`). A
   rename that fails leaves nothing visible on its node; the nodes whose rename succeeded
   then take their copy back (a durable delete), so the step is on no node.

Taking a published copy back is safe: the caller queues the step for upload only after
this function returns (the uploader does not list the local store, it uploads what it is
given), so no uploader has started on it and nothing of it is on the replica; retention
ran on no node either. A process killed between its rename and the take-back leaves a
copy on its node whose other nodes lack theirs: its uploader, restarted, uploads that
node's part, but the remote manifest is put only once every rank's part is there, which
never happens, so the replica never shows the step (``upload_parts.clean`` removes the
part once a newer step is committed there). When the step replaced a corrupt copy of
itself, that copy is gone after a take-back (it was corrupt).

A rank that does not arrive at an exchange raises :class:`BarrierTimeout` on the others.
In the prepare round nothing is visible yet, and each leader aborts its copy. In the publish
round a leader that had already published keeps its copy: the exchange may have broken
after rank 0 told some ranks that every node published (and they returned from ``save``),
so the outcome is not known, and a take-back could lose an acknowledged step. A step on
some nodes and not others is never restored (a restore takes the newest step whole on
every node) and never counted good by retention; the next save of that step replaces it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

from .._log import logger as log
from ..errors import BarrierTimeout, CommitError
from ..manifest import Manifest
from ..storage import Pending, Storage
from .nodes import write_marker, write_plain

if TYPE_CHECKING:  # torch-free at import
    from ..dist import Coordinator

__all__ = ["commit_everywhere"]


def commit_everywhere(
    storage: Storage,
    pending: Pending,
    manifest: Manifest,
    blobs: Mapping[str, bytes],
    coord: Coordinator,
    *,
    leader: bool,
    peers: Collection[int],
    previous: int | None,
    explain: Callable[[BaseException], BaseException] | None = None,
) -> None:
    """Commit this node's copy of ``manifest``'s step only if every node can (collective).

    Args:
        storage: this node's local store.
        pending: this node's tmp directory of the step (used on the node's leader only).
        manifest: the step's full manifest, from rank 0.
        blobs: rank 0's files of no rank, copied into every other node's copy.
        coord: the group of the save (every rank takes part in both exchanges).
        leader: whether this rank writes its node's store.
        peers: the ranks of this node (their files are in ``pending``).
        previous: the newest step before this one (named in the error).
        explain: turns a leader's failure into the error reported (default: as it is).

    Raises:
        CommitError: a node failed; it names the rank(s) of the nodes that failed, and
            nothing of the step is visible on any node.
        BarrierTimeout: a rank did not arrive at an exchange; this node's copy is gone.
    """
    step = manifest.step
    where = storage.describe(step)
    say = explain or (lambda e: e)
    prev = (
        f"step {previous} is still the newest checkpoint"
        if previous is not None
        else "nothing was committed"
    )

    mine: tuple[str, Any] = ("ok", None)
    if leader:
        try:
            if not coord.is_leader:  # rank 0's tmp directory holds its files already
                write_plain(pending, manifest.files, blobs)
            write_marker(pending, peers, coord.world_size)
            storage.prepare(pending, manifest)
        except BaseException as e:
            log.error("rank %d could not prepare its node's copy of %s: %s", coord.rank, where, e)
            storage.abort(pending)
            mine = ("error", say(e))
    prepared = leader and mine[0] == "ok"
    try:
        failed = coord.reduce(mine, _failures, "save:ready", step)
    except BarrierTimeout:
        if prepared:
            storage.abort(pending)
        raise
    if failed:
        if prepared:
            storage.abort(pending)
        raise CommitError(
            f"sharded save of {where} aborted on every node: the local store of "
            f"{_ranks(failed)} could not prepare its copy ({_detail(failed)}); nothing of it is "
            f"visible on any node and {prev}"
        )

    mine = ("ok", None)
    published = False
    if leader:
        try:
            storage.publish(pending)
            published = True
        except BaseException as e:
            log.error("rank %d could not publish its node's copy of %s: %s", coord.rank, where, e)
            storage.abort(pending)
            mine = ("error", say(e))
    try:
        failed = coord.reduce(mine, _failures, "save:commit", step)
    except BarrierTimeout as e:
        # The outcome is not known here: rank 0 may have sent "every node published" to
        # some ranks before the exchange broke (a rank dying while the verdict is on its
        # way), and those ranks returned from save. Taking this copy back would then lose
        # an acknowledged step on this node. It stays: a restore takes a step only where
        # it is whole on every node, and retention never counts it good until then.
        if published:
            log.warning(
                "%s: a rank did not report its commit (%s); this node's copy stays, and the "
                "step counts only where every node holds it",
                where,
                e.missing_ranks,
            )
        raise
    if failed:
        if published:
            _take_back(storage, step, f"the commit failed on {_ranks(failed)}")
        raise CommitError(
            f"sharded save of {where} rolled back on every node: the local store of "
            f"{_ranks(failed)} could not commit its copy ({_detail(failed)}); the nodes that "
            f"had committed theirs removed them, and {prev}"
        )


def _take_back(storage: Storage, step: int, why: str) -> None:
    """Remove this node's just-published copy of ``step`` (durably: it must not return)."""
    log.warning("%s: taking back this node's copy (%s)", storage.describe(step), why)
    try:
        storage.delete(step, durable=True)
    except OSError as e:
        log.error(
            "%s: could not take back this node's copy (%s): it holds a step the other nodes "
            "lack; delete it (`ckptstore rm`)",
            storage.describe(step),
            e,
        )


def _ranks(failed: list[tuple[int, Any]]) -> str:
    return "rank(s) " + ", ".join(str(r) for r, _ in failed)


def _detail(failed: list[tuple[int, Any]]) -> str:
    return "; ".join(f"rank {r}: {e}" for r, e in failed)


#: How many failing ranks a verdict carries back to every rank.
_SHOWN = 8


def _failures(every: list[tuple[str, Any]]) -> list[tuple[int, Any]]:
    """Rank 0's verdict for every rank: the first ranks whose store failed, with their errors.

    Cut at :data:`_SHOWN` (only node leaders fail here, and what every rank receives must
    not grow with the world size).
    """
    return [(r, v) for r, (st, v) in enumerate(every) if st == "error"][:_SHOWN]

"""Save stage 5 of a sharded save, commit: gather every rank's files, commit all or nothing.

In: this rank's pending checkpoint and its write outcome (``("ok", {"files": ...})`` or
``("error", e)``), the coordinator of the thread that commits (the caller's, or the
background writer's own group). Out: the committed manifest on every rank, or the same
error on every rank with nothing of the step visible. One store: rank 0 commits it (tmp
directory + rename, the storage base's order). Node-local roots: every node prepares its
copy, then all publish (:mod:`ckptstore.tiers.node_commit`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import ranktable
from .._phases import PhaseClock, mark
from ..dist import Coordinator
from ..errors import BarrierTimeout, CommitError
from ..manifest import RANK_TABLE_NAME, FileEntry, Manifest
from ..session import Session
from ..sharded import plan as sharding
from ..sharded import split_index
from ..sharded.chunks import INDEX_FILE
from ..storage import Pending
from ..tiers import node_commit, nodes
from .after_commit import after_commit
from .commit import announce, outgoing
from .failures import commit_error, plain_oserror, shard_error
from .jobs import SaveOptions
from .write import make_manifest

__all__ = ["commit_split", "finish_sharded"]


def finish_sharded(  # noqa: PLR0917 - private to the pipeline
    session: Session,
    pending: Pending,
    mine: tuple[str, Any],
    step: int,
    meta: Mapping[str, Any],
    dtensor: bool,
    coord: Coordinator,
    opts: SaveOptions,
    clock: PhaseClock | None,
) -> Manifest:
    """Phase 2: rank 0 gathers every rank's files and commits only if all succeeded.

    ``clock`` is the synchronous save's (None on the background writer's group).
    """
    where = session.storage.describe(step)
    md = mine[1].pop("md", None) if dtensor and mine[0] == "ok" else None
    try:
        tables = coord.gather(mine, "save:gather", step)
        mark(clock, "x:gather")
    except BarrierTimeout:
        if session.node_leader:
            session.storage.abort(pending)
        raise
    outcome: tuple[str, Any] = ("ok", b"")
    full: Manifest | None = None
    if coord.is_leader:
        assert tables is not None
        failed = [(r, v) for r, (s, v) in enumerate(tables) if s == "error"]
        if failed or any(s != "ok" for s, _ in tables):
            session.storage.abort(pending)
            outcome = ("error", shard_error(failed, where, session.previous(step)))
        else:
            files: dict[str, FileEntry] = {}
            for _, table in tables:
                files.update(table["files"])
            try:
                split = dtensor and bool(tables[0][1].get("split"))
                if dtensor:
                    assert md is not None  # rank 0's tensor_meta (and split index)
                    index = _index(md, [t for _, t in tables], files, f"{where}/{INDEX_FILE}")
                    pending.write_bytes(INDEX_FILE, index, codec="json")
                    files[INDEX_FILE] = pending.files[INDEX_FILE]
                table = None
                if split:  # format 4: the ranks' files go in the rank table, a line a rank
                    rows: dict[int, dict[str, FileEntry]] = {}
                    for name, e in files.items():
                        if e.rank is not None:
                            rows.setdefault(e.rank, {})[name] = e
                    data, table = ranktable.encode(rows, session.coord.world_size)
                    pending.write_bytes(RANK_TABLE_NAME, data, codec="json")
                    files[RANK_TABLE_NAME] = pending.files[RANK_TABLE_NAME]
                manifest = make_manifest(
                    step,
                    files,
                    meta["metrics"],
                    meta["metadata"],
                    opts,
                    session.coord.world_size,
                    sharded=True,
                    dtensor=dtensor,
                    split=split,
                    rank_table=table,
                    strided=split and bool(md is not None and md.get("strided")),
                )
                mark(clock, "index")
                if session.split:  # every node commits its copy: commit_split
                    outcome = ("ok", (manifest.to_bytes(), nodes.plain_blobs(pending, files)))
                else:
                    session.storage.commit(pending, manifest)
                    mark(clock, "commit")
                    session.committed(manifest)
                    outcome = ("ok", outgoing(session, manifest, trim=True))
                    full = manifest
            except BaseException as e:
                session.storage.abort(pending)
                err = commit_error(e, where, session.previous(step)) if plain_oserror(e) else e
                outcome = ("error", err)
    if session.split:
        return commit_split(session, pending, outcome, step, coord)
    return announce(session, outcome, step, coord, clock, full)


def _index(
    md: Mapping[str, Any], tables: list[Mapping[str, Any]], files: Mapping[str, Any], where: str
) -> bytes:
    """The ``dtensors.json`` rank 0 writes, once it is sure no box is missing.

    Split index: the layout rank 0 built, after checking that the ranks wrote, of every
    tensor, exactly as many elements as it holds (one number a tensor from each rank).
    Format 2: every chunk of every rank, checked as a reader checks it.

    Raises:
        CommitError: a box no rank wrote (the save must not commit).
    """
    if md["global"] is not None:
        if any(t.get("volumes") is None for t in tables):
            raise CommitError(f"{where}: a rank did not write its part of the split index")
        short = split_index.check_volumes(md["meta"], [t["volumes"] for t in tables])
        if short:
            raise CommitError(
                f"{where}: the shards the ranks wrote do not make a whole checkpoint: "
                f"{len(short)} tensor(s) are not written exactly once ({short[:5]}); every "
                "rank must save the same state, laid out on the same device meshes"
            )
        return bytes(md["global"])
    index = sharding.index_bytes(md["meta"], [t["packed"] for t in tables])
    sharding.check_cover(index, files, where)
    return index


def commit_split(
    session: Session, pending: Pending, prepared: tuple[str, Any], step: int, coord: Coordinator
) -> Manifest:
    """Phase 3 on node-local roots: every node commits its copy of the step, or none.

    Rank 0 sends the outcome and the manifest trimmed to the files of no rank to every
    rank, and the whole manifest with its files of no rank (the plain state, the chunk
    index, the rank table) to the node leaders only, down their tree (``save:prepared``,
    :meth:`~ckptstore.dist.Coordinator.broadcast_tree`): the rank table grows with the
    world size, and only the nodes' copies need it. Then two rounds
    (:mod:`ckptstore.tiers.node_commit`): every node leader prepares its copy (those
    files, the ``local-ranks`` marker, the manifest, fsynced, still a ``.tmp-``
    directory), and only once every node reports prepared do they publish it (the
    rename). A node failing to prepare aborts every node's copy (the previous step stays
    the newest everywhere); a node failing its rename makes the nodes that renamed take
    their copy back. Either way every rank raises an error naming the rank(s) whose store
    failed.
    """
    where = session.storage.describe(step)
    said, whole = prepared, None
    if coord.is_leader and prepared[0] == "ok":
        body, blobs = prepared[1]
        full = Manifest.from_bytes(body)
        said = ("ok", outgoing(session, full, trim=True))
        whole = (body, blobs)
    (status, value), whole = coord.broadcast_tree(said, whole, session.links, "save:prepared", step)
    if status == "error":
        if session.node_leader and not coord.is_leader:
            session.storage.abort(pending)
        raise value if isinstance(value, BaseException) else CommitError(str(value))
    blobs = {}
    if session.node_leader:  # this node's copy needs every file and the whole manifest
        if whole is None:
            raise CommitError(f"{where}: rank 0 sent no manifest to this node's leader")
        body, blobs = whole
        manifest = Manifest.from_bytes(body)
        if manifest.rank_table is not None:  # every rank's files, for this node's copy
            table = blobs.get(RANK_TABLE_NAME)
            if table is None:
                raise CommitError(f"{where}: rank 0 sent no {RANK_TABLE_NAME}")
            manifest = ranktable.expand(manifest, table, f"{where}/{RANK_TABLE_NAME}")
    else:
        manifest = value if isinstance(value, Manifest) else Manifest.from_bytes(value)
    previous = session.previous(step)
    node_commit.commit_everywhere(
        session.storage,
        pending,
        manifest,
        blobs,
        coord,
        leader=session.node_leader,
        peers=session.peers,
        previous=previous,
        explain=lambda e: commit_error(e, where, previous) if plain_oserror(e) else e,
    )
    if session.node_leader:
        session.committed(manifest)
    after_commit(session, step)  # only now the uploader learns of the step
    return manifest

"""Save stage 2 of a DTensor save, plan: who writes which DTensor box.

In: the state, the per-rank RNG states, the :class:`~ckptstore.session.Session`, and the
:class:`PlanCache` of the last save. Out: this rank's pending checkpoint (rank 0 opens the
tmp directory in the same exchange) and ``("ok", ShardJob)``, ``("error", e)`` where this
rank failed, or ``("aborted", None)`` where another did. Every rank encodes the same tree
and makes its local plan; which rank writes a box that several hold is decided locally, by
one rule every rank applies (:func:`ckptstore.sharded.plan.writes_here`), so no rank sees
another's plan. The one exchange is a :meth:`~ckptstore.dist.Coordinator.reduce`: each rank
says whether it planned, with a digest of its DTensors' names, dtypes and shapes
(:func:`~ckptstore.sharded.plan.state_digest`, ~50 bytes); rank 0 answers with its directory,
who failed, and its own digest. A rank whose DTensors differ from rank 0's (pipeline stages:
rank 0 would index only its own) refuses the save with ``UnsafeCheckpointError``, naming both
sides, and the others abort it. What a non-zero rank sends and receives in it does not grow
with the world size.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._log import logger as log
from .._phases import PhaseClock, mark
from ..errors import BarrierTimeout, CommitError, IntegrityError, UnsafeCheckpointError
from ..session import Session
from ..sharded import plan as sharding
from ..sharded import split_index
from ..sharded.chunks import INDEX_FILE
from ..state.redistribute import shard_is_box
from ..storage import Pending
from .begin import open_here, open_verdict, opened, post_dirname
from .encode import Encoded, encode, stage_group
from .jobs import SaveOptions, ShardJob
from .staging import StagingPool

__all__ = ["PlanCache", "plan_dtensor"]


@dataclass
class PlanCache:
    """The last DTensor save's plan on this rank, reused while the layout key is equal.

    ``entry``: (DTensor layout key, this rank's part of the global save plan, its metadata,
    the box specs of that part, the DTensors' layouts), or None.
    ``checks``: (layout key, whether its DTensors allow the split index, their digest), or
    None: both depend on nothing but what the key holds, so an equal key skips them.
    """

    entry: tuple[Any, Any, Any, Any, Any] | None = None
    checks: tuple[Any, bool, tuple[int, str, str]] | None = None


def plan_dtensor(  # noqa: PLR0917 - private to the pipeline
    session: Session,
    state: Mapping[Any, Any],
    step: int,
    rng: Mapping[Any, Any],
    replace: bool,
    opts: SaveOptions,
    cache: PlanCache,
    staging: StagingPool,
    clock: PhaseClock | None,
) -> tuple[Pending, tuple[str, Any]]:
    """Open the tmp directory, encode the state, agree on who writes which DTensor box.

    Collective. Rank 0 opens the tmp directory every rank writes into; every rank
    encodes the state (the same tree, so the same DTensor names) and makes a local
    plan; the plans (and rank 0's directory) are exchanged, and every rank computes the
    same deduplicated global plan from them. A rank that fails before the exchange
    still takes part in it, so no rank waits for it. With ``async_save`` the boxes and
    rank 0's plain tensors are copied into staging buffers here: the one copy the
    caller waits for. A synchronous save with GPU tensors stages them too (``_on_gpu``).

    Returns:
        The pending checkpoint, and ``("ok", job)``, ``("error", e)`` where this rank
        failed, ``("aborted", None)`` where another rank did (and says why).

    Raises:
        BarrierTimeout: a rank did not join the exchange (rank 0's directory is gone).
        Exception: rank 0 could not open the directory (raised on every rank).
    """
    coord = session.coord
    rank = coord.rank
    collector = sharding.DTensorCollector()
    planned: tuple[str, Any]
    encoded = Encoded(b"", {})
    told, pending = open_here(session, step, replace)
    mark(clock, "begin")
    key: Any = None
    split = False
    digest: tuple[int, str, str] | None = None
    try:
        if opts.compression is not None:
            msg = (
                f"compression={opts.compression!r} cannot be used with DTensor state: "
                "ranks read byte ranges of the shards; save with compression=None"
            )
            raise UnsafeCheckpointError(msg)
        # Not staged here: the boxes and the plain tensors are staged together below.
        encoded = encode(
            state,
            rng,
            collector,
            allow_pickle=opts.allow_pickle,
            fmt=opts.fmt,
            compression=opts.compression,
            staging=None,
        )
        mark(clock, "encode")
        key = sharding.layout_key(collector.flat)
        if cache.checks is not None and cache.checks[0] == key:
            _, split, digest = cache.checks  # every save of one layout: ~3 ms a rank less
        else:
            _check_boxes(collector.flat)
            if session.split and session.replica_storage is None:
                _check_nodes(collector.flat, session.peers, session.root)
            split = split_index.splittable(collector.flat, coord.world_size)
            digest = sharding.state_digest(collector.flat)
            cache.checks = (key, split, digest)
        planned = ("ok", None)
    except BaseException as e:
        log.error("rank %d could not plan its shard of step %d: %s", rank, step, e)
        planned = ("error", e)
    mark(clock, "plan")
    seq = coord.seq
    post_dirname(session, pending, step, seq)
    try:
        # Rank 0's first name goes into the verdict; the others' stay home (see _differs).
        said = digest if digest is None or coord.is_leader else (digest[0], "", digest[2])
        verdict = coord.reduce((planned[0], told, split, said), _plan_verdict, "save:plan", step)
    except BarrierTimeout:
        if pending is not None:
            session.storage.abort(pending)
        raise
    mark(clock, "x:plan")
    pending = opened(session, pending, verdict, step, seq)
    if planned[0] != "ok":
        return pending, planned
    if verdict["differ"] and digest is not None and digest[2] != verdict["digest"][2]:
        return pending, ("error", _differs(digest, verdict))
    if verdict["failed"] or verdict["differ"]:
        return pending, ("aborted", None)
    try:
        job = _job(session, collector, key, verdict["split"], encoded, opts, cache, staging, clock)
    except BaseException as e:
        log.error("rank %d could not plan its shard of step %d: %s", rank, step, e)
        return pending, ("error", e)
    return pending, ("ok", job)


def _check_boxes(flat: Mapping[str, Any]) -> None:
    """Refuse a DTensor whose part on this rank is not one box of it (a strided shard).

    A checkpoint stores each part as a box (its offsets and sizes); such a part would be
    written as the box of its first offset, with other rows in it (the commit then finds
    boxes that overlap, and says only that the shards do not cover the tensor).

    Raises:
        UnsafeCheckpointError: naming the tensor and its placements.
    """
    for name, t in flat.items():
        if sharding.is_dtensor(t) and not shard_is_box(t.shape, t.device_mesh, t.placements):
            placements = ", ".join(str(p) for p in t.placements)
            msg = (
                f"DTensor {name!r} is laid out as ({placements}): this rank's part of it is not "
                "one box of the tensor (a strided shard), and a checkpoint stores parts as "
                "boxes; lay it out as FSDP2 over tensor parallelism does, or with "
                "Shard/Replicate placements"
            )
            raise UnsafeCheckpointError(msg)


def _check_nodes(flat: Mapping[str, Any], peers: list[int], root: str) -> None:
    """Refuse, on node-local roots without a replica, a box whose replicas span nodes.

    One rank writes each box of a replicated DTensor (:func:`~ckptstore.sharded.plan.
    writes_here`), and its file is in its own node's store only: a node whose ranks hold
    the box but did not write it could not restore it, though every node's copy verifies
    (HSDP with the replicate dim across nodes, tensor parallelism under data parallelism
    across nodes). Checked by every rank for its own boxes, before anything is written;
    the holders are seen on the root mesh, as the split index records them.

    Raises:
        UnsafeCheckpointError: naming the tensor, its holders and what to do.
    """
    here = set(peers)
    seen: dict[tuple[int, tuple[Any, ...]], None] = {}
    roots: dict[int, Any] = {}
    for name, t in flat.items():
        if not sharding.is_dtensor(t):
            continue
        view = sharding.root_view(t, roots) or (t.device_mesh, tuple(t.placements))
        mesh, placements = view
        key = (id(mesh), placements)
        if key in seen or not any(p.is_replicate() for p in placements):
            continue
        seen[key] = None
        coord = mesh.get_coordinate()
        if coord is None:
            continue
        at = tuple(
            slice(None) if p.is_replicate() else c for p, c in zip(placements, coord, strict=True)
        )
        holders = sorted(int(r) for r in mesh.mesh[at].reshape(-1).tolist())
        away = [r for r in holders if r not in here]
        if away:
            msg = (
                f"DTensor {name!r} is replicated over ranks {holders}, and ranks {away} do "
                f"not share this rank's node-local root {root}: one of them writes each box, "
                "so the other nodes could not restore the step from their own disks. Save "
                "to a shared root, add a replica (replica=...) that fills in the other "
                "nodes' files, or lay the mesh out so a box's replicas share a node "
                "(replicate within a node, shard across nodes)"
            )
            raise UnsafeCheckpointError(msg)


def _plan_verdict(every: list[tuple[str, tuple[str, Any], bool, Any]]) -> dict[str, Any]:
    """Rank 0's answer to the plan exchange: its directory, who failed, the index's form.

    ``every`` holds each rank's (plan status, :func:`open_here` answer, whether its DTensors
    allow the split index, :func:`~ckptstore.sharded.plan.state_digest`). Only the first
    failure to open a directory is sent back (it is raised everywhere), and the number of
    ranks that could not plan (each sends its own error to rank 0 at the commit). The split
    index is used only where every rank can. ``differ`` counts the ranks that planned
    DTensors other than rank 0's; each of them refuses the save, naming rank 0's
    (``digest``), and the others abort it.
    """
    verdict = open_verdict([e[1] for e in every])
    verdict["failed"] = sum(1 for e in every if e[0] != "ok")
    verdict["split"] = all(e[2] for e in every)
    ref = every[0][3]
    verdict["digest"] = ref
    verdict["differ"] = (
        sum(1 for e in every if e[0] == "ok" and e[3][2] != ref[2]) if every[0][0] == "ok" else 0
    )
    verdict["ranks"] = len(every)
    return verdict


def _differs(mine: tuple[int, str, str] | None, verdict: Mapping[str, Any]) -> Exception:
    """The refusal of a rank whose DTensors differ from rank 0's (see ``_plan_verdict``)."""
    assert mine is not None
    assert verdict["digest"] is not None
    count, first, _ = mine
    count0, first0, _ = verdict["digest"]
    return UnsafeCheckpointError(
        f"it holds {count} DTensors (the first by name {first!r}) and rank 0 holds {count0} "
        f"(the first {first0!r}), with other names, dtypes or shapes ({verdict['differ']} of "
        f"{verdict['ranks']} ranks differ from rank 0): every rank must save the same "
        "DTensors, each holding its shard or none; a pipeline-parallel job whose stages "
        "hold different layers cannot be saved as one sharded checkpoint"
    )


def _on_gpu(
    boxes: Mapping[str, tuple[Any, Any, torch.Tensor]],
    groups: Mapping[str, Mapping[str, torch.Tensor]],
) -> bool:
    """Whether this rank has tensors on a GPU to save.

    A synchronous save then copies them out through the staging buffers too (pinned,
    reused from save to save, each placed for an ``O_DIRECT`` write from where it lies), as
    a plain save does (``encode``'s ``device_staging``), not ``.cpu()`` per box into fresh
    pageable memory.
    """
    return any(t.device.type == "cuda" for _, _, t in boxes.values()) or any(
        t.device.type == "cuda" for g in groups.values() for t in g.values()
    )


def _describe(md: dict[str, Any], flat: Mapping[str, Any], split: bool) -> None:
    """Fill rank 0's ``md`` (see ``ShardJob.md``) from the DTensors of ``flat``."""
    meta = sharding.tensor_meta(flat)
    glob = split_index.global_bytes(flat) if split else None
    strided = split and split_index.is_strided(flat)
    if glob is not None:
        # Read back as a reader will, once per layout (kept with the plan), beside the shard
        # writes: a layout no reader takes must never commit (one with a mesh stride of -1
        # did, and resume() went back to the step before it without a word).
        try:
            split_index.Layout.from_bytes(glob, INDEX_FILE, strided=strided)
        except IntegrityError as e:
            msg = (
                f"the chunk index this save made is one no reader would take ({e}); nothing "
                "was committed (a ckptstore bug: please report it with the DTensors' meshes "
                "and placements)"
            )
            raise CommitError(msg) from None
    md["global"], md["strided"] = glob, strided
    md["meta"] = meta  # last: None until the whole description is made


def _job(  # noqa: PLR0917 - private to this stage
    session: Session,
    collector: sharding.DTensorCollector,
    key: Any,
    split: bool,
    encoded: Encoded,
    opts: SaveOptions,
    cache: PlanCache,
    staging: StagingPool,
    clock: PhaseClock | None,
) -> ShardJob:
    """The boxes of this rank: its local plan, less the boxes another replica writes.

    The plan is kept while the DTensors' layout key is unchanged (the planning is the
    costly part: ~0.3 ms a DTensor).
    """
    coord = session.coord
    groups: dict[str, dict[str, torch.Tensor]] = encoded.groups
    if cache.entry is not None and cache.entry[0] == (key, split):
        _, mine, meta, specs, layout = cache.entry
    else:
        local = sharding.save_plans(collector.flat, coord.is_leader)
        mine = sharding.dedup_local(local, collector.flat, split=split)
        meta = None
        if coord.is_leader:  # what rank 0 writes dtensors.json from: see describe below
            meta = {"meta": None, "global": None, "strided": False}
        elif split:  # every rank counts what it wrote of each tensor, in one order
            meta = {"names": sorted(collector.flat)}
        specs = sharding.box_specs(mine)
        layout = sharding.layouts(collector.flat)  # what the layout key also holds
        cache.entry = ((key, split), mine, meta, specs, layout)
    describe = None
    if meta is not None and "meta" in meta and meta["meta"] is None:
        # Rank 0's description of every DTensor (~15 ms for 600 of them), made beside its
        # shard writes rather than before them; kept with the plan for the next saves.
        describe = functools.partial(_describe, meta, collector.flat, split)
    mark(clock, "global_plan")
    boxes = sharding.local_boxes(mine, collector.flat, specs)
    if opts.async_save or _on_gpu(boxes, groups):
        staging.begin()
        offsets = sharding.box_file_offsets({k: t for k, (_, _, t) in boxes.items()})
        boxes = {
            k: (n, o, staging.stage(f"_shards/{k}", t, offsets[k]))
            for k, (n, o, t) in boxes.items()
        }
        if coord.is_leader:
            groups = {
                g: stage_group(staging, g, t, fmt=opts.fmt, compression=opts.compression)
                for g, t in groups.items()
            }
        staging.end()
    job = ShardJob(
        boxes=boxes,
        layout=layout,
        md=meta,
        encoded=Encoded(encoded.tree, groups),
        split=split,
        describe=describe,
    )
    mark(clock, "boxes")
    return job

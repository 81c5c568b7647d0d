"""Save stage 2 of a DTensor save, plan: who writes which DTensor box.

In: the state, the per-rank RNG states, the :class:`~ckptstore.session.Session`, and the
:class:`PlanCache` of the last save. Out: this rank's pending checkpoint (rank 0 opens the
tmp directory in the same exchange) and ``("ok", ShardJob)``, ``("error", e)`` where this
rank failed, or ``("aborted", None)`` where another did. Every rank encodes the same tree,
makes a local plan, and computes the same deduplicated global plan from everyone's (one
flag per rank instead of a plan while the DTensors' layout is unchanged). The arithmetic
of the plans is in :mod:`ckptstore.sharded.plan`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._log import logger as log
from ..errors import BarrierTimeout, UnsafeCheckpointError
from ..session import Session
from ..sharded import plan as sharding
from ..storage import Pending
from .begin import open_here, opened
from .encode import Encoded, encode, stage_group
from .jobs import SaveOptions, ShardJob
from .phases import PhaseClock, mark
from .staging import StagingPool

__all__ = ["PlanCache", "plan_dtensor"]


@dataclass
class PlanCache:
    """The last DTensor save's plan on this rank, reused while the layout key is equal.

    ``entry``: (DTensor layout key, this rank's part of the global save plan, its metadata,
    the box specs of that part, the DTensors' layouts), or None.
    """

    entry: tuple[Any, Any, Any, Any, Any] | None = None


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
    caller waits for.

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
    local: Any = None
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
        # The same layout as the last save on every rank: its global plan still holds,
        # and the exchange carries one flag instead of every rank's plan.
        hit = cache.entry is not None and cache.entry[0] == key
        local = None if hit else sharding.save_plans(collector.flat, coord.is_leader)
        planned = ("ok", local)
    except BaseException as e:
        log.error("rank %d could not plan its shard of step %d: %s", rank, step, e)
        planned = ("error", e)
    mark(clock, "plan")
    try:
        plans = coord.all_gather((*planned, told), "save:plan", step)
    except BarrierTimeout:
        if pending is not None:
            session.storage.abort(pending)
        raise
    mark(clock, "x:plan")
    pending = opened(session, pending, [p[2] for p in plans], step)
    if planned[0] != "ok":
        return pending, planned
    if any(s != "ok" for s, _, _ in plans):
        return pending, ("aborted", None)
    try:
        others = [p for _, p, _ in plans]
        job = _agree(
            session,
            collector,
            others,
            step,
            key=key,
            local=local,
            encoded=encoded,
            opts=opts,
            cache=cache,
            staging=staging,
            clock=clock,
        )
    except BarrierTimeout:
        if session.node_leader:
            session.storage.abort(pending)
        raise
    except BaseException as e:
        log.error("rank %d could not plan its shard of step %d: %s", rank, step, e)
        return pending, ("error", e)
    return pending, ("ok", job)


def _agree(
    session: Session,
    collector: sharding.DTensorCollector,
    plans: list[Any],
    step: int,
    *,
    key: Any,
    local: Any,
    encoded: Encoded,
    opts: SaveOptions,
    cache: PlanCache,
    staging: StagingPool,
    clock: PhaseClock | None,
) -> ShardJob:
    """The global plan from every rank's local plan (or the cached one): this rank's job.

    ``plans`` holds ``None`` for a rank whose layout key equals its cached plan's.
    """
    coord = session.coord
    rank = coord.rank
    groups: dict[str, dict[str, torch.Tensor]] = encoded.groups
    if any(p is None for p in plans) and any(p is not None for p in plans):
        # Some ranks kept their layout, others did not: plan again, all of them.
        local = local or sharding.save_plans(collector.flat, coord.is_leader)
        plans = [p for _, p in coord.all_gather(("ok", local), "save:plan", step)]
    if all(p is None for p in plans):
        assert cache.entry is not None
        _, mine, md, specs, layout = cache.entry
    else:
        final, md = sharding.global_plan(plans)
        mine = final[rank]
        specs = sharding.box_specs(mine)
        layout = sharding.layouts(collector.flat)  # what the layout key also holds
        cache.entry = (key, mine, md, specs, layout)
    mark(clock, "global_plan")
    boxes = sharding.local_boxes(mine, collector.flat, specs)
    if opts.async_save:
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
    job = ShardJob(boxes=boxes, layout=layout, md=md, encoded=Encoded(encoded.tree, groups))
    mark(clock, "boxes")
    return job

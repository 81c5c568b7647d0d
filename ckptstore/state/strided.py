"""FSDP2 over tensor parallelism's ``_StridedShard``: which arrangements are nested chunks.

One rule, in integers, for the two places that ask it: ``redistribute.shard_is_box`` of a
DTensor's own placements, and the split index of its spelling
(``split_index.strided_problem``). Imports nothing of torch: reading an index need not.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["strided_problem"]


def strided_problem(
    tshape: Sequence[int], mshape: Sequence[int], shards: Sequence[tuple[int | None, int]]
) -> str | None:
    """Why a layout with ``_StridedShard`` is not nested ``torch.chunk`` splits, or ``None``.

    ``shards``: per mesh dim, the tensor dim it shards (``None``: ``Replicate`` or
    ``Partial``) and the split factor of a ``_StridedShard`` (0: ``Shard``). The one case
    admitted is the one FSDP2 over tensor parallelism makes: a tensor dim sharded by
    ``_StridedShard(d, sf)`` on one mesh dim and ``Shard(d)`` on one later mesh dim of
    ``sf`` ranks, with ``sf`` dividing the tensor dim. Then rank ``(i, j)`` holds part
    ``i`` of the ``j``-th of ``sf`` equal pieces: nested ``torch.chunk``, the later (TP)
    mesh dim first (checked against DTensor's arithmetic in the tests), one box on every
    rank. torch's TP needs the divisibility anyway; where it fails, DTensor's rows and
    nested chunks can differ (7 rows on a 3x2 mesh). A layout with no ``_StridedShard``
    has no problem.
    """
    by_dim: dict[int, list[int]] = {}
    for mdim, (d, _) in enumerate(shards):
        if d is not None:
            by_dim.setdefault(d, []).append(mdim)
    for d, mdims in by_dim.items():
        strided = [m for m in mdims if shards[m][1]]
        if not strided:
            continue
        if len(mdims) != 2 or strided != [mdims[0]]:
            spelled = [f"_S({d}, {shards[m][1]})" if shards[m][1] else f"S({d})" for m in mdims]
            return f"tensor dim {d} is sharded as {spelled}, not as _S(d, sf) then S(d)"
        sf, tp = shards[mdims[0]][1], mdims[1]
        if sf != mshape[tp]:
            return f"split factor {sf} is not the {mshape[tp]} ranks of mesh dim {tp}"
        if not 0 <= d < len(tshape) or tshape[d] % sf:
            return f"split factor {sf} does not divide tensor dim {d}"
    return None

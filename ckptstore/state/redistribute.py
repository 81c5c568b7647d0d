"""Full (replicated) stored tensors restored into ``DTensor`` targets: each rank its part.

A replicated checkpoint (a DDP job's, or one process's) holds whole tensors; a job that now
shards its model (FSDP2 ``fully_shard``, tensor parallel) has ``DTensor`` parameters and
optimizer moments. Every rank read the whole stored tensor itself, so each takes the part
its own shard covers, with no communication: ``Shard``, ``Replicate`` and the strided shard
of FSDP2 over tensor parallelism (:func:`cuttable`). A ``Partial`` placement is not cut: a
module's load refuses it before anything is loaded (``StateMismatchError``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from itertools import chain
from typing import Any

import torch

__all__ = [
    "cuttable",
    "dtensor_type",
    "dtensors_possible",
    "is_dtensor",
    "laid_out_like",
    "local_part",
    "optimizer_state",
    "shard_is_box",
]


_DTENSOR: list[type | None] = []  # the DTensor class, once looked up


def dtensor_type() -> type | None:
    """``torch.distributed.tensor.DTensor``, or ``None`` in a torch without it."""
    if _DTENSOR:
        return _DTENSOR[0]
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        _DTENSOR.append(None)
        return None
    _DTENSOR.append(DTensor)
    return DTensor


def dtensors_possible() -> bool:
    """Whether a DTensor can exist in this process: ``torch.distributed.tensor`` was imported.

    Asked before :func:`dtensor_type`, which imports it: 0.37 s of a 2.8 s ``ckptstore
    export`` of a sharded step on the test VM, for nothing, and as long again in the first
    save of any process that had not imported it (one that built a torch optimizer has:
    torch's optimizers import it).
    """
    return "torch.distributed.tensor" in sys.modules and dtensor_type() is not None


def is_dtensor(v: object) -> bool:
    """Whether ``v`` is a ``torch.distributed.tensor.DTensor``.

    The class is imported only where one can exist (:func:`dtensors_possible`).
    """
    if type(v) is torch.Tensor or not (_DTENSOR or dtensors_possible()):
        return False
    cls = _DTENSOR[0]
    return cls is not None and isinstance(v, cls)


def shard_is_box(shape: Any, mesh: Any, placements: Any) -> bool:
    """Whether this rank's part of a ``shape`` tensor laid out so is one box of it.

    A box is a range of every dim: what checkpoints store and read as a part. Always so for
    ``Shard`` and ``Replicate``, and for FSDP2 over tensor parallelism (``(_StridedShard(d),
    Shard(d))``). Not for every ``_StridedShard``: with ``(Shard(0), _StridedShard(0,
    split_factor=2))`` a rank holds rows 0 and 2 of 8, and
    ``compute_local_shape_and_global_offset``, which gives a part's first offset and its
    sizes, describes the box of rows 0 and 1. Such a part is refused, never read or written
    as that box. Walks the rows each placement gives this rank, as DTensor does (placement
    by placement, left to right); a rank outside the mesh holds nothing (a box). FSDP2 over
    TP with rows the TP size divides is known a box without the walk (:func:`_nested`),
    whose index tensors cost O(rows) of CPU a tensor at a first save.
    """
    strided = _strided_type()
    if strided is None or not any(type(p) is strided for p in placements):
        return True
    coord = mesh.get_coordinate()
    if coord is None or _nested(shape, mesh, placements, strided):
        return True
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShardOffsetMode

    held: dict[int, list[int]] = {}
    sizes = [int(n) for n in shape]
    for mdim, place in enumerate(placements):
        p: Any = place  # a DTensor placement: Shard, _StridedShard, Replicate, Partial
        if type(place) is strided:
            n, offs = p.local_shard_size_and_offset(
                sizes[p.dim], mesh.size(mdim), coord[mdim], _StridedShardOffsetMode.ALL
            )
            index = [int(i) for i in offs] if isinstance(offs, list) else []
        elif isinstance(p, Shard):
            n, first = Shard.local_shard_size_and_offset(sizes[p.dim], mesh.size(mdim), coord[mdim])
            index = list(range(int(first), int(first) + int(n)))
        else:
            continue
        before = held.get(p.dim)
        held[p.dim] = [before[i] for i in index] if before is not None else index
        sizes[p.dim] = int(n)
    return all(rows == list(range(rows[0], rows[0] + len(rows))) for rows in held.values() if rows)


def _nested(shape: Any, mesh: Any, placements: Any, strided: type) -> bool:
    """Whether every ``_StridedShard`` here is FSDP2 over TP's, whose parts are boxes.

    The arrangement :func:`ckptstore.state.strided.strided_problem` admits, the rule the
    split index computes boxes by: each rank's part is nested ``torch.chunk`` splits.
    """
    from torch.distributed.tensor import Shard

    from .strided import strided_problem

    shards: list[tuple[int | None, int]] = []
    for place in placements:
        p: Any = place  # Shard, _StridedShard (not a Shard subclass), Replicate, Partial
        if type(place) is strided:
            shards.append((int(p.dim), int(p.split_factor)))
        elif isinstance(place, Shard):
            shards.append((int(p.dim), 0))
        else:
            shards.append((None, 0))
    mshape = [mesh.size(m) for m in range(len(shards))]
    return strided_problem([int(n) for n in shape], mshape, shards) is None


def _strided_type() -> type | None:
    """DTensor's ``_StridedShard`` class, where this torch has it."""
    from torch.distributed.tensor import placement_types

    strided = getattr(placement_types, "_StridedShard", None)
    return strided if isinstance(strided, type) else None


def cuttable(like: Any) -> bool:
    """Whether a whole tensor can be laid out as the ``DTensor`` ``like`` by cutting it.

    ``Shard`` and ``Replicate`` placements, and the ``_StridedShard`` of FSDP2 over tensor
    parallelism (torchtitan's 2-D layout: each rank's part is still one box of the whole,
    the box ``compute_local_shape_and_global_offset`` gives, as for a sharded restore);
    not a strided layout whose part is not a box (:func:`shard_is_box`), nor ``Partial``
    (a rank's part is a summand, not a piece).
    """
    from torch.distributed.tensor import Replicate, Shard

    kinds: tuple[type, ...] = (Shard, Replicate)
    strided = _strided_type()
    if strided is not None:
        kinds = (*kinds, strided)
    return all(type(p) in kinds for p in like.placements) and shard_is_box(
        like.shape, like.device_mesh, like.placements
    )


def local_part(full: torch.Tensor, like: Any) -> Any:
    """``full`` laid out as ``like`` (a ``DTensor`` of ``full``'s shape): this rank's part.

    Returns ``full`` itself when it cannot be cut: another shape, or a placement
    :func:`cuttable` refuses (``Partial``).
    """
    if is_dtensor(full) or tuple(full.shape) != tuple(like.shape):
        return full  # before the imports: an import statement costs ~2 us a call
    if not cuttable(like):
        return full
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        like.shape, like.device_mesh, like.placements
    )
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
    # A check's stand-ins live on the meta device, and stay there.
    device = full.device if full.is_meta else like.to_local().device
    local = full[index].to(device=device).contiguous()
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def laid_out_like(value: Any, target: Any) -> Any:
    """``value`` (a restored plain entry) with each whole tensor laid out as its target.

    Where ``target`` (the caller's plain data: dicts, lists, tuples) holds a ``DTensor`` at
    the place ``value`` holds a plain tensor of its shape, this rank's part of that tensor
    takes its place (:func:`local_part`), as a module's or an optimizer's does. A replicated
    checkpoint, or a tensor saved plain beside sharded ones, restored into a state dict of
    ``DTensor`` values (``get_model_state_dict`` of an FSDP2 model) then hands back
    ``DTensor`` values, as a ``DTensor`` leaf's restore does, not the whole tensor on every
    rank in place of the caller's ``DTensor``. Everything else is ``value`` as it was.
    Dicts and lists of ``value`` are updated in place (they are the restore's own). The
    walk follows ``value``, a decoded tree, so it ends whatever ``target`` holds.
    """
    if not (_DTENSOR or dtensors_possible()):
        return value
    if isinstance(value, torch.Tensor):
        if is_dtensor(target) and not is_dtensor(value):
            return local_part(value, target)
        return value
    if isinstance(value, dict) and isinstance(target, Mapping):
        for k, v in value.items():
            if k in target:
                value[k] = laid_out_like(v, target[k])
        return value
    if isinstance(value, list | tuple) and isinstance(target, list | tuple):
        if len(value) != len(target):
            return value
        items = [laid_out_like(v, t) for v, t in zip(value, target, strict=True)]
        if isinstance(value, list):
            value[:] = items
        elif type(value) is tuple:
            return tuple(items)
    return value


def optimizer_state(optimizer: torch.optim.Optimizer, stored: Any) -> Any:
    """``stored`` (an optimizer state dict) with full tensors cut for DTensor parameters.

    Parameters are matched as ``Optimizer.load_state_dict`` matches them (the stored groups'
    ids in order against this optimizer's parameters); a state tensor of its parameter's
    shape becomes that parameter's layout. ``stored`` is returned as is when no parameter
    is a ``DTensor`` or it is not an optimizer state dict.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not any(is_dtensor(p) for p in params):
        return stored
    if not isinstance(stored, Mapping):
        return stored
    groups, state = stored.get("param_groups"), stored.get("state")
    if not isinstance(groups, list) or not isinstance(state, Mapping):
        return stored
    ids = list(chain.from_iterable(g.get("params", []) for g in groups if isinstance(g, Mapping)))
    if len(ids) != len(params):
        return stored  # load_state_dict refuses it with its own message
    by_id = dict(zip(ids, params, strict=True))
    new_state: dict[Any, Any] = {}
    for pid, entry in state.items():
        param = by_id.get(pid)
        if param is None or not is_dtensor(param) or not isinstance(entry, Mapping):
            new_state[pid] = entry
            continue
        new_state[pid] = {
            k: local_part(v, param)
            if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(param.shape)
            else v
            for k, v in entry.items()
        }
    out = dict(stored)
    out["state"] = new_state
    return out

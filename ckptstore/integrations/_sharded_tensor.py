"""FSDP1's ``ShardedTensor`` state as ``DTensor``s, so that ckptstore's sharded path saves it.

FSDP (version 1) built without a ``device_mesh`` gives its sharded state dicts
(``SHARDED_STATE_DICT``, and ``get_model_state_dict``/``get_optimizer_state_dict`` of
``torch.distributed.checkpoint.state_dict``) as ``ShardedTensor``s: each tensor chunked along
dim 0 over the FSDP process group with ``torch.chunk``'s rule, one shard a rank (none on
the ranks past the last chunk). That is exactly the layout of a ``DTensor`` placed
``Shard(0)`` on a 1-D mesh of the same group, so :func:`as_dtensors` views each one as such a
``DTensor`` sharing the local shard's memory (no copy) and ckptstore saves and restores it
like FSDP2 state, on any world size. Any other layout is refused, never guessed at.

Used by :mod:`ckptstore.integrations.lightning_sharded` for Lightning's ``FSDPStrategy``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import ConfigError

__all__ = ["as_dtensors", "back_to_shards"]


def _is_sharded_tensor(value: object) -> bool:
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor

    return isinstance(value, ShardedTensor)


def _map(tree: Any, fn: Callable[[Any, str], Any], where: str) -> Any:
    """``tree`` with ``fn`` applied to each leaf (dicts and lists rebuilt, others kept)."""
    if isinstance(tree, dict):
        return {k: _map(v, fn, f"{where}[{k!r}]") for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map(v, fn, f"{where}[{i}]") for i, v in enumerate(tree)]
    return fn(tree, where)


def _mesh_of(group: Any, device_type: str) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device_type)


def _to_dtensor(st: Any, where: str, meshes: dict[tuple[int, str], Any]) -> Any:
    """``st`` (a dim-0 chunked ``ShardedTensor``) as a ``Shard(0)`` DTensor on its group."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    group = st._process_group
    size = tuple(st.size())
    shards = st.local_shards()
    device_type = (
        shards[0].tensor.device.type
        if shards
        else st.metadata().shards_metadata[0].placement.device().type
    )
    key = (id(group), device_type)
    mesh = meshes.get(key)
    if mesh is None:
        mesh = meshes[key] = _mesh_of(group, device_type)
    world = dist.get_world_size(group)
    rows = size[0] if size else 0

    def refuse(why: str) -> ConfigError:
        return ConfigError(
            f"{where}: a ShardedTensor of shape {list(size)} that is not chunked along dim 0 "
            f"over its {world} ranks as FSDP shards ({why}); ckptstore saves FSDP's sharded "
            "state dicts and DTensors, not other ShardedTensor layouts"
        )

    if not size:
        raise refuse("it is a scalar")
    step = -(-rows // world)  # torch.chunk's chunk size
    # Every shard of the metadata: group rank r holds rows [r * step, (r + 1) * step).
    for md in st.metadata().shards_metadata:
        rank = dist.get_group_rank(group, md.placement.rank())
        offsets, sizes = list(md.shard_offsets), list(md.shard_sizes)
        start = min(rank * step, rows)
        want = [min(step, rows - start), *size[1:]]
        if offsets != [start] + [0] * (len(size) - 1) or sizes != want:
            raise refuse(f"rank {rank} holds offsets {offsets}, sizes {sizes}")
    local_shape, _ = compute_local_shape_and_global_offset(size, mesh, [Shard(0)])
    if len(shards) > 1:
        raise refuse(f"{len(shards)} shards on one rank")
    if shards:
        local = shards[0].tensor
        if tuple(local.shape) != tuple(local_shape):
            raise refuse(f"a local shard of shape {list(local.shape)}")
    else:
        if torch.Size(local_shape).numel() != 0:
            raise refuse("no local shard where the chunk rule puts rows")
        local = torch.empty(local_shape, dtype=st.dtype, device=torch.device(device_type))
    stride = torch.empty(size, device="meta").stride()
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=torch.Size(size), stride=stride
    )


def as_dtensors(tree: Any, where: str) -> Any:
    """``tree`` with every ``ShardedTensor`` viewed as a ``Shard(0)`` ``DTensor``.

    The DTensors share their local shard's memory. Dicts and lists are rebuilt, anything
    else is kept as is.

    Raises:
        ConfigError: a ``ShardedTensor`` is not laid out as FSDP lays out its shards.
    """
    meshes: dict[tuple[int, str], Any] = {}

    def convert(value: Any, at: str) -> Any:
        return _to_dtensor(value, at, meshes) if _is_sharded_tensor(value) else value

    return _map(tree, convert, where)


def back_to_shards(sharded: Any, restored: Any) -> Any:
    """The restored tree, with each ``ShardedTensor`` of ``sharded`` back in its place.

    ``restored`` is :func:`as_dtensors` of ``sharded`` after a restore filled it: each
    DTensor's local shard is copied into its ``ShardedTensor`` (only where the restore did
    not write into the shared memory itself); every other value is the restored one.
    """
    if isinstance(sharded, dict) and isinstance(restored, dict):
        return {
            k: back_to_shards(sharded[k], v) if k in sharded else v for k, v in restored.items()
        }
    if isinstance(sharded, list) and isinstance(restored, list) and len(sharded) == len(restored):
        return [back_to_shards(a, b) for a, b in zip(sharded, restored, strict=True)]
    if _is_sharded_tensor(sharded):
        shards = sharded.local_shards()
        if shards:
            src = restored.to_local()
            dst = shards[0].tensor
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src)
        return sharded
    return restored

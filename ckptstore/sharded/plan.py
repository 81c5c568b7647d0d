"""DTensor state (FSDP2, tensor parallel, HSDP): naming, planning, writing shards, restore targets.

A state whose modules, optimizers or plain data hold ``DTensor`` leaves is saved sharded, no
flag needed. Each DTensor leaf gets a flat name (its path in the state, ``model/0.weight``),
and ``torch.distributed.checkpoint``'s planners decide who writes what: every rank's local
plan lists the boxes it holds (``__create_write_items__``), ``dedup_save_plans`` keeps one
copy of every replicated box (load-balanced over the ranks), ``create_default_global_save_plan``
gives the global metadata. On restore, ``targets.read_items`` computes which saved boxes
overlap each target shard (the boxes DCP's ``create_default_local_load_plan`` would find,
whatever the mesh, placement or world size, without its per-tensor objects).

ckptstore runs those planners itself instead of calling ``dcp.save``/``dcp.load``: their
collectives would wait on a process group without naming the ranks that are missing, and
``dcp.load`` reads DCP's pickled ``.metadata``. Here every exchange goes through the manager's
:class:`~ckptstore.dist.Coordinator` (bounded, names missing ranks), and the metadata is the
typed JSON chunk index of :mod:`ckptstore.sharded.chunks`.

Optimizer state is stored keyed by parameter name (``state/<fqn>/exp_avg``), converted here
from and to ``Optimizer.state_dict()``: DCP's ``get_optimizer_state_dict`` would first run a
zero-gradient ``step()`` on an optimizer that has no state yet (a save at step 0 would then
change the training run it checkpoints), so the conversion is done without it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..codec import safetensors as safetensors_codec
from ..codec.tree import format_path
from ..errors import CommitError, IntegrityError, StateMismatchError, UnsafeCheckpointError
from ..integrity import SubBlocks
from ..state.modules import EMA, de_parallel
from ..state.redistribute import dtensors_possible, is_dtensor
from ..storage import iomode
from ..storage.directio import run_all
from .chunks import (
    BLOCK,
    INDEX_FORMAT,
    Chunk,
    ChunkIndex,
    TensorEntry,
    block_crcs,
    dtype_name,
    entry_key,
)
from .chunks import shard_file as shard_file_name

__all__ = [
    "BoxSpec",
    "DTensorCollector",
    "box_specs",
    "build_index",
    "check_cover",
    "dedup_local",
    "has_dtensors",
    "index_bytes",
    "indexed_optimizer_state",
    "is_dtensor",
    "layout_key",
    "layouts",
    "local_boxes",
    "named_optimizer_state",
    "owner_of",
    "pack_table",
    "root_view",
    "save_plans",
    "shard_layout",
    "split_parts",
    "state_digest",
    "tensor_meta",
    "write_shards",
    "writes_here",
]

_SCAN_LIMIT = 100_000


def has_dtensors(state: Mapping[Any, Any]) -> bool:
    """Whether any module, optimizer or plain value of ``state`` holds a DTensor."""
    if not dtensors_possible():
        return False
    budget = [_SCAN_LIMIT]

    def walk(v: Any, depth: int) -> bool:
        budget[0] -= 1
        if budget[0] < 0 or depth > 64:
            return False
        if isinstance(v, torch.Tensor):
            return is_dtensor(v)
        if isinstance(v, EMA):
            return walk(v.module, depth + 1)
        if isinstance(v, nn.Module):
            return any(is_dtensor(t) for t in (*v.parameters(), *v.buffers()))
        if isinstance(v, torch.optim.Optimizer):
            return any(is_dtensor(p) for g in v.param_groups for p in g["params"])
        if isinstance(v, Mapping):
            return any(walk(x, depth + 1) for x in v.values())
        if isinstance(v, list | tuple):
            return any(walk(x, depth + 1) for x in v)
        return False

    return any(walk(v, 0) for v in state.values())


def placement_names(
    t: Any, view: tuple[Any, tuple[Any, ...]] | None = None
) -> tuple[tuple[int, ...], tuple[str, ...], tuple[str, ...]]:
    """``(mesh shape, mesh dim names, placements)`` of a DTensor, spelled for the index.

    ``view``: another ``(mesh, placements)`` to spell (:func:`root_view`'s).
    """
    mesh, placements = view if view is not None else (t.device_mesh, t.placements)
    names = tuple(mesh.mesh_dim_names or ())
    out = []
    for p in placements:
        if p.is_shard():
            out.append(f"S({p.dim})")
        elif p.is_replicate():
            out.append("R")
        else:
            out.append(str(p))
    return tuple(mesh.shape), names, tuple(out)


class DTensorCollector:
    """A :class:`~ckptstore.codec.tree.TreeEncoder` hook: DTensor leaves become named nodes.

    Each DTensor found at ``path`` is recorded under a flat name (the path joined with
    ``/``, made unique) and replaced in ``state.json`` by ``{"t": "dtensor", "name": ...}``.
    """

    def __init__(self) -> None:
        self.flat: dict[str, Any] = {}

    def __call__(self, t: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        """Record the DTensor ``t`` found at ``path``; return its ``state.json`` node."""
        for p in t.placements:
            if p.is_partial():
                msg = (
                    f"{format_path(path)}: a DTensor with a Partial placement holds unreduced "
                    "values; redistribute it to Shard/Replicate before saving"
                )
                raise UnsafeCheckpointError(msg)
        try:
            dtype = dtype_name(t.dtype)
        except KeyError:
            msg = f"{format_path(path)}: DTensors of dtype {t.dtype} cannot be stored"
            raise UnsafeCheckpointError(msg) from None
        base = "/".join(str(p) for p in path) or "_"
        name, n = base, 1
        while name in self.flat:
            n += 1
            name = f"{base}#{n}"
        self.flat[name] = t
        node: dict[str, Any] = {
            "t": "dtensor",
            "name": name,
            "dtype": dtype,
            "shape": list(t.shape),
        }
        if isinstance(t, nn.Parameter):
            node["param"] = True
        if t.requires_grad:
            node["requires_grad"] = True
        return node


# ---- optimizer state keyed by parameter name -------------------------------------------


def owner_of(opt: torch.optim.Optimizer, state: Mapping[Any, Any]) -> Any:
    """The key of the module in ``state`` that holds every parameter of ``opt``, or ``None``."""
    params = {id(p) for g in opt.param_groups for p in g["params"]}
    for key, value in state.items():
        module = value.module if isinstance(value, EMA) else value
        if isinstance(module, nn.Module):
            have = {id(p) for p in de_parallel(module).parameters()}
            if params <= have:
                return key
    return None


def _param_names(opt: torch.optim.Optimizer, model: nn.Module, where: str) -> list[str]:
    """The name of each parameter of ``opt``, in ``Optimizer.state_dict()``'s numbering."""
    names = {id(p): n for n, p in de_parallel(model).named_parameters()}
    out = []
    for g in opt.param_groups:
        for p in g["params"]:
            n = names.get(id(p))
            if n is None:
                msg = f"{where}: a parameter of the optimizer is not a parameter of the model"
                raise StateMismatchError(msg)
            out.append(n)
    return out


def named_optimizer_state(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """``opt.state_dict()`` with parameters named by their path in ``model``, not numbered."""
    sd = opt.state_dict()
    names = _param_names(opt, model, "optimizer")
    state = {names[i]: v for i, v in sd["state"].items()}
    groups = [dict(g, params=[names[i] for i in g["params"]]) for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def check_named_optimizer_state(
    opt: torch.optim.Optimizer, model: nn.Module, stored: Any, where: str
) -> None:
    """Raise :class:`StateMismatchError` unless ``stored`` fits ``opt``'s parameter groups."""
    names = _param_names(opt, model, where)
    groups = stored.get("param_groups") if isinstance(stored, Mapping) else None
    if not isinstance(groups, list) or not isinstance(stored.get("state"), Mapping):
        raise StateMismatchError(f"{where}: stored optimizer state is malformed")
    if len(groups) != len(opt.param_groups):
        raise StateMismatchError(
            f"{where}: the checkpoint has {len(groups)} parameter group(s), the optimizer "
            f"{len(opt.param_groups)}; build the optimizer as it was when saved"
        )
    pos = 0
    for i, (g, tg) in enumerate(zip(groups, opt.param_groups, strict=True)):
        want = names[pos : pos + len(tg["params"])]
        pos += len(tg["params"])
        have = g.get("params") if isinstance(g, Mapping) else None
        if not isinstance(have, list) or set(have) != set(want):
            got = set(have) if isinstance(have, list) else set()
            extra, lack = sorted(map(str, got - set(want))), sorted(set(want) - got)
            raise StateMismatchError(
                f"{where}: parameter group {i} differs: checkpoint has {extra[:5]} the "
                f"optimizer lacks, and lacks {lack[:5]}; build the optimizer as it was saved"
            )


def indexed_optimizer_state(
    opt: torch.optim.Optimizer, model: nn.Module, stored: Mapping[str, Any], where: str
) -> dict[str, Any]:
    """Name-keyed optimizer state (see :func:`named_optimizer_state`) as ``opt`` numbers it.

    The result is what ``opt.load_state_dict`` takes.

    Raises:
        StateMismatchError: the parameter groups differ.
    """
    check_named_optimizer_state(opt, model, stored, where)
    names = _param_names(opt, model, where)
    index = {n: i for i, n in enumerate(names)}
    groups = []
    pos = 0
    for g, tg in zip(stored["param_groups"], opt.param_groups, strict=True):
        # Optimizer.load_state_dict pairs saved and current parameters by position: list
        # them in the current optimizer's order.
        groups.append(dict(g, params=list(range(pos, pos + len(tg["params"])))))
        pos += len(tg["params"])
    state = {index[n]: v for n, v in stored["state"].items() if n in index}
    return {"state": state, "param_groups": groups}


# ---- save: planning and writing ---------------------------------------------------------


def save_plans(flat: Mapping[str, Any], is_leader: bool) -> Any:
    """The local DCP save plan of this rank's DTensors.

    The plan ``create_default_local_save_plan`` makes, item for item, but DCP's per-DTensor
    work (``compute_local_shape_and_global_offset`` and the item's properties, ~1 ms a
    DTensor on a loaded CPU: 0.6 s of a 2-rank save of 588 DTensors) is done once per
    distinct layout: a model's layers, and the moments of AdamW beside each parameter, repeat
    a few shapes. Only the name differs between the items of DTensors of one layout.
    """
    from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem

    memo: dict[tuple[Any, ...], list[Any]] = {}
    items: list[Any] = []
    # Under no_grad, to_local() returns the local tensor instead of running an autograd
    # function (~0.1 ms a DTensor that requires grad); one no_grad block for all of them.
    # DCP's own planning runs outside it: the properties it records (requires_grad) are
    # those of a to_local() with grad enabled.
    with torch.no_grad():
        locals_ = [t.to_local() if is_dtensor(t) else None for t in flat.values()]
    for (fqn, t), local in zip(flat.items(), locals_, strict=True):
        if local is None or type(local) is not torch.Tensor:
            # Not a plain DTensor (a nested subclass plans itself): DCP as it is.
            items += create_default_local_save_plan({fqn: t}, is_leader).items
            continue
        if t.device_mesh.get_coordinate() is None:
            continue  # this rank is not in the DTensor's mesh: it writes none of it
        key = (
            tuple(t.shape),
            tuple(t.placements),
            id(t.device_mesh),
            t.requires_grad,
            local.dtype,
            local.layout,
            local.is_pinned(),
        )
        template = memo.get(key)
        if template is None:
            template = memo[key] = create_default_local_save_plan({fqn: t}, is_leader).items
        # The template's items with this DTensor's name (WriteItem and MetadataIndex are
        # built directly: dataclasses.replace costs ~10 us an item).
        items += [
            WriteItem(
                index=MetadataIndex(fqn, it.index.offset, it.index.index),
                type=it.type,
                bytes_io_data=it.bytes_io_data,
                tensor_data=it.tensor_data,
            )
            for it in template
        ]
    return SavePlan(items)


_NEVER_EQUAL = itertools.count()


def _mesh_key(mesh: Any) -> tuple[Any, ...]:
    """What a save plan depends on of a device mesh: its ranks, their order, this rank's place.

    Not ``id(mesh)``: a mesh built after another was freed may get its address, and a
    different order of the same ranks gives every rank other offsets with equal shapes.
    A sub-mesh's root mesh is part of it: which rank writes a box depends on it
    (:func:`root_view`).
    """
    key = (
        mesh.device_type,
        tuple(mesh.mesh.shape),
        tuple(mesh.mesh.reshape(-1).tolist()),
        tuple(mesh.mesh_dim_names or ()),
        tuple(mesh.get_coordinate() or ()),
    )
    get_root = getattr(mesh, "_get_root_mesh", None)
    root = get_root() if get_root is not None else None
    if root is not None and root is not mesh:
        return (*key, _mesh_key(root))
    return key


def layout_key(flat: Mapping[str, Any]) -> tuple[Any, ...]:
    """What this rank's save plan depends on: names, shapes, dtypes, meshes, placements.

    Equal keys on a rank give the same local plan, without the ~0.3 ms per DTensor that
    computing it costs: every input of :func:`save_plans` for a plain DTensor is in it
    (name, global shape, dtype, ``requires_grad``, placements, the mesh's ranks in order and
    this rank's coordinate, the local shape, layout and pinning), so a cached plan is used
    only where computing it again would give the same items. A DTensor subclass that is
    not plain keys on its identity, so its plan is never reused.
    """
    meshes: dict[int, tuple[Any, ...]] = {}
    out: list[tuple[Any, ...]] = []
    with torch.no_grad():  # to_local() without an autograd function (see save_plans)
        for name, t in flat.items():
            mesh = t.device_mesh
            mk = meshes.get(id(mesh))
            if mk is None:
                mk = meshes[id(mesh)] = _mesh_key(mesh)
            local = t.to_local()
            if type(local) is not torch.Tensor:
                out.append((name, next(_NEVER_EQUAL)))  # not plain: no key matches it again
                continue
            out.append(
                (
                    name,
                    tuple(t.shape),
                    t.dtype,
                    t.requires_grad,
                    tuple(t.placements),
                    mk,
                    tuple(local.shape),
                    local.layout,
                    local.is_pinned(),
                )
            )
    return tuple(out)


def _root_of(mesh: Any) -> tuple[Any, tuple[int, ...]] | None:
    """``mesh``'s root mesh and the root dims it keeps, if ``mesh`` is a slice of it by name.

    ``init_device_mesh(...)["tp"]`` is one of the root's sub-meshes along ``"tp"``, one for
    each coordinate of the other dims. A mesh of as many ranks as its root, however it was
    made (torchtitan's ``("dp_replicate", "dp_shard_cp", "tp")``, whose dims are flattened
    from the root's), is its own root: it holds every rank. None where the mesh is a part
    of its root's ranks that is not such a slice (a flattened dim of some ranks, a mesh
    built from a rank list) or this rank is not in it.
    """
    get_root = getattr(mesh, "_get_root_mesh", None)
    root = get_root() if get_root is not None else None
    if root is None or root is mesh or mesh.mesh.numel() == root.mesh.numel():
        return (mesh, tuple(range(len(mesh.shape)))) if mesh.get_coordinate() is not None else None
    names, rnames = mesh.mesh_dim_names, root.mesh_dim_names
    if not names or not rnames or any(n not in rnames for n in names):
        return None
    dims = tuple(rnames.index(n) for n in names)
    at = root.get_coordinate()
    if list(dims) != sorted(set(dims)) or at is None or mesh.get_coordinate() is None:
        return None
    index = tuple(slice(None) if d in dims else at[d] for d in range(root.mesh.dim()))
    if not torch.equal(root.mesh[index], mesh.mesh):
        return None
    return root, dims


def root_view(t: Any, cache: dict[int, Any] | None = None) -> tuple[Any, tuple[Any, ...]] | None:
    """The mesh of every rank that holds the DTensor ``t`` alike, and ``t``'s placements on it.

    A DTensor on a sub-mesh sliced by name (``mesh["tp"]`` of a ``("dp", "tp")`` mesh) is
    held alike by the sub-meshes of the other dims, as under DDP: on the root mesh it is
    ``Replicate`` over them, so its boxes are written once, like those of HSDP's replica
    dim. ``(t.device_mesh, t.placements)`` where the mesh is its own root; None where
    :func:`_root_of` finds no root. ``cache``: by ``id`` of the mesh, for one save's tensors.
    """
    from torch.distributed.tensor import Replicate

    mesh = t.device_mesh
    if cache is not None and id(mesh) in cache:
        found = cache[id(mesh)]
    else:
        found = _root_of(mesh)
        if cache is not None:
            cache[id(mesh)] = found
    if found is None:
        return None
    root, dims = found
    if root is mesh:
        return mesh, tuple(t.placements)
    placements: list[Any] = [Replicate()] * len(root.shape)
    for p, d in zip(t.placements, dims, strict=True):
        placements[d] = p
    return root, tuple(placements)


def writes_here(
    t: Any, name: str, *, split: bool = False, cache: dict[int, Any] | None = None
) -> bool:
    """Whether this rank writes its box of the DTensor ``t`` (flat name ``name``).

    Decided here, by a rule every rank applies alike, instead of by gathering every rank's
    plan: the ranks holding the same box of ``t`` are those whose mesh coordinates differ
    only on ``Replicate`` dims. Among them, the one whose index over those dims equals
    ``(crc32(name) + the box's index over the other dims) % replicas`` writes it, so one
    tensor's boxes, and a model's tensors, spread over the replicas. A DTensor with no
    ``Replicate`` placement has one holder per box: every rank writes its own.

    ``split``: a save with the split index, where a DTensor on a sub-mesh is seen on its
    root mesh (:func:`root_view`), as the index records it: its copies on the other
    sub-meshes are replicas. Otherwise (format 2) each sub-mesh writes its copy and rank 0
    keeps one of each box in the index. ``cache``: :func:`root_view`'s.
    """
    if split:
        view = root_view(t, cache)
        if view is None:  # pragma: no cover - splittable() admits only tensors with a root
            raise ValueError(f"{name!r}: its device mesh is not a named slice of a root mesh")
        mesh, placements = view
    else:
        mesh, placements = t.device_mesh, tuple(t.placements)
    if not any(p.is_replicate() for p in placements):
        return True
    coord = mesh.get_coordinate()
    if coord is None:
        return False
    shape = tuple(mesh.shape)
    replica, replicas, box = 0, 1, 0
    for dim, p in enumerate(placements):
        if p.is_replicate():
            replica = replica * shape[dim] + coord[dim]
            replicas *= shape[dim]
        else:
            box = box * shape[dim] + coord[dim]
    return (zlib.crc32(name.encode()) + box) % replicas == replica


def dedup_local(plan: Any, flat: Mapping[str, Any], *, split: bool = False) -> Any:
    """The items of this rank's local save plan that it writes (see :func:`writes_here`).

    Replaces DCP's ``dedup_save_plans``, which needs every rank's plan on every rank.
    """
    from torch.distributed.checkpoint.planner import SavePlan

    verdict: dict[str, bool] = {}
    roots: dict[int, Any] = {}  # root_view's, by mesh
    items = []
    for item in plan.items:
        name = item.index.fqn
        here = verdict.get(name)
        if here is None:
            t = flat[name]
            here = verdict[name] = (
                writes_here(t, name, split=split, cache=roots) if is_dtensor(t) else True
            )
        if here:
            items.append(item)
    return SavePlan(items)


def tensor_meta(flat: Mapping[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dtype name, global shape)}`` of every DTensor: what rank 0 indexes.

    Every rank holds every DTensor of the state (its own shard, or none), so rank 0 knows
    each one's dtype and shape without asking the others.
    """
    return {n: (dtype_name(t.dtype), tuple(int(x) for x in t.shape)) for n, t in flat.items()}


def state_digest(flat: Mapping[str, Any]) -> tuple[int, str, str]:
    """What every rank of a save must hold alike: its DTensors' names, dtypes and shapes.

    ``(count, first name, digest)``: a rank sends these 3 values to rank 0 whatever the
    number of its DTensors or of the ranks, and rank 0 compares them with its own. Rank 0
    writes ``state.json`` and indexes the tensors it holds (:func:`tensor_meta`), so a
    rank that holds others (a pipeline stage's layers) would have its shards written and
    never indexed: the save must refuse it instead.
    """
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for name in sorted(flat):
        t = flat[name]
        h.update(f"{name}\0{t.dtype}\0{tuple(int(x) for x in t.shape)}\n".encode())
    first = min(flat) if flat else ""
    return len(flat), first[:200], h.hexdigest()


#: ``(name, key in the shard file, offsets, sizes, DCP index)`` of a box (:func:`box_specs`).
BoxSpec = tuple[str, str, tuple[int, ...], tuple[int, ...] | None, Any]


def box_specs(plan: Any) -> list[BoxSpec]:
    """``(name, key in the shard file, offsets, sizes, DCP index)`` of a local plan's items.

    The sizes are those the DTensor's placements give (``None`` where DCP's item has none).
    Computed once per plan: a manager keeps them with its cached plan.
    """
    out = []
    for item in plan.items:
        offsets = tuple(int(o) for o in item.index.offset)
        chunk = getattr(getattr(item, "tensor_data", None), "chunk", None)
        sizes = tuple(int(n) for n in chunk.sizes) if chunk is not None else None
        key = entry_key(item.index.fqn, offsets)
        out.append((item.index.fqn, key, offsets, sizes, item.index))
    return out


def local_boxes(
    plan: Any,
    flat: Mapping[str, Any],
    specs: list[BoxSpec] | None = None,
) -> dict[str, tuple[str, tuple[int, ...], Any]]:
    """The boxes this rank writes: ``{key in its shard file: (name, offsets, local tensor)}``.

    The tensors are the DTensors' local shards, where they live (a device, a view): a
    synchronous save copies them to CPU as it writes, an async save stages them.
    ``specs`` are :func:`box_specs` of ``plan``, where the caller kept them.

    Raises:
        UnsafeCheckpointError: a DTensor's local shard is not the size its placements give
            (``DTensor.from_local(..., run_check=False, shape=...)`` checks nothing): its
            box would be written where its placements put it, overlapping another rank's
            or past the tensor's end, in a step no reader takes.
    """
    from torch.distributed.checkpoint.utils import find_state_dict_object

    out: dict[str, tuple[str, tuple[int, ...], Any]] = {}
    sd = dict(flat)
    with torch.no_grad():  # to_local() without an autograd function (see save_plans)
        for name, key, offsets, sizes, index in specs if specs is not None else box_specs(plan):
            t = sd[name]
            local = t.to_local() if is_dtensor(t) else None
            if local is None or type(local) is not torch.Tensor:
                # Not a plain DTensor: DCP finds the chunk its plan item names.
                local = find_state_dict_object(sd, index)
            elif sizes is not None and tuple(local.shape) != sizes:
                msg = (
                    f"{name}: this rank's local shard is {list(local.shape)}, but the "
                    f"DTensor's placements {list(t.placements)} give it {list(sizes)} of "
                    f"{list(t.shape)} (a DTensor made by from_local(..., run_check=False, "
                    "shape=...) whose shards are not that split); its box would overlap "
                    "another rank's or lie outside the tensor"
                )
                raise UnsafeCheckpointError(msg)
            # A plain DTensor holds one chunk on a rank, the one its own plan item names
            # (``find_state_dict_object`` would compute the layout again to find it).
            out[key] = (name, offsets, local.detach())
    return out


def box_file_offsets(tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Where each tensor's bytes start in the safetensors file the writer makes of them."""
    head, order = safetensors_codec.build_header(tensors)
    starts: dict[str, int] = {}
    pos = len(head)
    for k, t in order:
        starts[k] = pos
        pos += t.numel() * t.element_size()
    return starts


def layouts(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: (mesh shape, mesh dim names, placements)}`` of this rank's DTensors."""
    return {n: placement_names(t) for n, t in flat.items()}


#: Tensors of at least this many bytes are placed in their shard file at an offset congruent
#: to their address modulo the O_DIRECT block, so the writer sends them to the disk straight
#: from their memory (``DirectWriter.write_segment``) instead of copying them through its
#: bounce buffers; the padding costs under 4 KiB each (< 0.4 %). Smaller tensors are packed.
ZERO_COPY_MIN = 1 << 20
#: The O_DIRECT block (``storage.directio.ALIGN``).
_ALIGN = 4096


def shard_layout(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[bytes, list[tuple[str, torch.Tensor]], dict[str, int]]:
    """The safetensors header, file order and data offsets of a shard file of ``tensors``.

    The order is the one :func:`~ckptstore.codec.safetensors.build_header` uses. A tensor of
    at least :data:`ZERO_COPY_MIN` bytes whose memory does not line up with its place in the
    file (``data_ptr() - offset`` not a multiple of 4096: a DTensor's local shard lies
    wherever the allocator put it) is moved up by a padding entry (``_pad.N``, uint8 zeros:
    the format allows no gap, and no chunk key lacks an ``@``, so none collides with one).
    Without it, every byte went through the writer's bounce buffers, a copy that on 2 cores
    made the sharded save 0.54x a raw O_DIRECT write of the same bytes. Tensors that already
    line up (async staging places them so) get no padding, and files of small tensors are
    laid out exactly as :func:`build_header` lays them out.

    Returns:
        ``(header, [(key, tensor)] in file order with the padding, {key: file offset})``.
    """
    order: list[tuple[str, torch.Tensor]] = []
    pos = 0  # offset from the start of the data (which starts on a block boundary when large)
    for key, t in safetensors_codec.file_order(tensors):
        n = t.numel() * t.element_size()
        item = t.element_size()
        want = pos
        if n >= ZERO_COPY_MIN and t.data_ptr() % item == 0:
            want = pos + (t.data_ptr() - pos) % _ALIGN
        elif pos % item:
            want = pos + -pos % item
        if want > pos:
            order.append((f"_pad.{len(order)}", torch.zeros(want - pos, dtype=torch.uint8)))
            pos = want
        order.append((key, t))
        pos += n
    head = safetensors_codec.encode_header(order)
    starts: dict[str, int] = {}
    at = len(head)
    for key, t in order:
        starts[key] = at
        at += t.numel() * t.element_size()
    return head, order, starts


#: A rank writes its boxes into one shard file per this many bytes (at most
#: :data:`MAX_PARTS`), each by its own writer: each writer keeps one request in flight, so
#: the parts keep several in flight. With one, a 2-rank save of 384 MB a rank issued ~300
#: requests of ~2.5 MB (one per tensor, sent zero-copy) one after the other, and a virtual
#: disk ran them at ~0.75 GB/s where 4 in flight reach its 32 MB-request speed.
PART_BYTES = 64 << 20
MAX_PARTS = 4


def split_parts(tensors: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """``tensors`` in ``max(1, min(MAX_PARTS, bytes // PART_BYTES))`` parts of near-equal bytes.

    Largest first into the lightest part; each part keeps the callers' key order.
    """
    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    n = max(1, min(MAX_PARTS, sum(sizes.values()) // PART_BYTES))
    if n == 1:
        return [dict(tensors)]
    load = [0] * n
    where: dict[str, int] = {}
    for k in sorted(sizes, key=lambda k: -sizes[k]):
        i = min(range(n), key=load.__getitem__)
        where[k] = i
        load[i] += sizes[k]
    parts: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    for k, t in tensors.items():
        parts[where[k]][k] = t
    return [p for p in parts if p]


def write_shards(
    pending: Any,
    rank: int,
    boxes: Mapping[str, tuple[str, tuple[int, ...], Any]],
    layout: Mapping[str, Any],
    also: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Write this rank's boxes (see :func:`local_boxes`) into its shard files, durably.

    The boxes go into one or more files (:func:`split_parts`), each laid out by
    :func:`shard_layout` so large tensors are written without a copy; the files are
    written concurrently (the I/O and the CRCs release the GIL), each checksummed once, the
    chunks' per-block CRC32Cs computed in the same pass as the file's.
    ``also`` (rank 0's plain part of the state) runs alongside them.

    Returns:
        ``{"chunks": [(name, offsets, Chunk)], "layout": layout}``, for :func:`build_index`.
    """
    tensors: dict[str, torch.Tensor] = {}
    for key, (_, _, t) in boxes.items():
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        tensors[key] = t.contiguous()
    calls: list[Callable[[], None]] = [also] if also is not None else []
    crcs: dict[str, list[int]] = {}
    placed: dict[str, tuple[str, int]] = {}  # key -> (file, start)
    for part, group in enumerate(split_parts(tensors) if tensors else []):
        fname = shard_file_name(rank, part)
        head, order, starts = shard_layout(group)
        placed.update((k, (fname, starts[k])) for k in group)

        def write(
            fname: str = fname, head: bytes = head, order: Any = order, group: Any = group
        ) -> None:
            with pending.open(fname, codec="safetensors", rank=rank) as w:
                # The chunk CRCs come from the writer's own pass over the bytes, which
                # checksums the file: one CRC pass per byte (every writer of ours can: a
                # writer without ``sub_blocks`` would leave them to a second pass below).
                subs = {k: SubBlocks(BLOCK) for k in group} if getattr(w, "sub_blocks", 0) else None
                safetensors_codec.write_laid_out(w, head, order, subs)
            for k, t in group.items():
                data = safetensors_codec.tensor_bytes(t)
                if subs is not None and subs[k].nbytes == len(data):  # fed every byte
                    crcs[k] = subs[k].close()
                else:
                    crcs[k] = block_crcs(data) if t.numel() else []

        calls.append(write)
    # Files written side by side share one write mode and are measured as one (iomode);
    # a failed file raises inside the block, so a failed save measures nothing.
    alone = len(calls) <= 1
    with contextlib.nullcontext() if alone else iomode.side_by_side():
        errors = run_all(calls, max_workers=len(calls))
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
    chunks = [
        (
            name,
            offsets,
            Chunk(
                offsets=offsets,
                sizes=tuple(tensors[key].shape),
                file=placed[key][0],
                start=placed[key][1],
                nbytes=tensors[key].numel() * tensors[key].element_size(),
                crcs=tuple(crcs[key]),
            ),
        )
        for key, (name, offsets, _) in boxes.items()
    ]
    return {"chunks": chunks, "layout": layout}


def pack_table(table: Mapping[str, Any]) -> bytes:
    """What a rank sends rank 0 of :func:`write_shards`' table: its chunks and layouts as JSON.

    One ``bytes`` object instead of hundreds of tuples and dataclasses: the coordinator
    pickles it at once, and checks it for exceptions to replace without walking it (that
    walk of a 600-chunk table cost more than the pickle).
    """
    doc = {
        "chunks": [[n, list(o), c.to_json()] for n, o, c in table["chunks"]],
        "layout": {n: [list(x) for x in lay] for n, lay in table["layout"].items()},
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _gather(
    tables: Iterable[Mapping[str, Any]],
) -> tuple[dict[tuple[str, tuple[int, ...]], Any], dict[str, Any]]:
    """Every rank's written chunks by (tensor, offsets), and the first layout of each tensor."""
    found: dict[tuple[str, tuple[int, ...]], Any] = {}
    layout: dict[str, Any] = {}
    for table in tables:
        for name, offsets, chunk in table["chunks"]:
            found[(name, tuple(offsets))] = chunk
        for name, lay in table["layout"].items():
            layout.setdefault(name, lay)
    return found, layout


def _by_name(found: Mapping[tuple[str, tuple[int, ...]], Any]) -> dict[str, list[Any]]:
    """Every tensor's chunks, in the order of their offsets."""
    by_name: dict[str, list[tuple[tuple[int, ...], Any]]] = {}
    for (name, offsets), chunk in found.items():
        by_name.setdefault(name, []).append((offsets, chunk))
    return {n: [c for _, c in sorted(v, key=lambda oc: oc[0])] for n, v in by_name.items()}


def index_bytes(meta: Mapping[str, tuple[str, tuple[int, ...]]], packed: Iterable[bytes]) -> bytes:
    """The chunk index file from rank 0's :func:`tensor_meta` and every rank's :func:`pack_table`.

    The chunks of each tensor are listed in the order of their offsets. Whether they cover
    each tensor exactly is checked by :meth:`ChunkIndex.from_bytes` before the save commits
    (:func:`check_cover`): no rank's plan is known to rank 0, so a box no rank wrote shows
    as a gap there.
    """
    found, layout = _gather(json.loads(blob) for blob in packed)
    by_name = _by_name(found)
    tensors: dict[str, Any] = {}
    for name in sorted(meta):
        dtype, shape = meta[name]
        row: dict[str, Any] = {
            "dtype": dtype,
            "shape": list(shape),
            "chunks": by_name.get(name, []),
        }
        mesh, dims, placements = layout.get(name, ((), (), ()))
        if mesh:  # as TensorEntry.to_json writes it
            row.update(mesh=list(mesh), mesh_dims=list(dims), placements=list(placements))
        tensors[name] = row
    doc = {"ckptstore_chunks": INDEX_FORMAT, "block": BLOCK, "tensors": tensors}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def check_cover(index: bytes, files: Mapping[str, Any], where: str) -> ChunkIndex:
    """The index rank 0 built, parsed as a reader will; a box no rank wrote is an error.

    Raises:
        CommitError: a tensor's chunks do not cover it exactly (the save must not commit).
    """
    try:
        return ChunkIndex.from_bytes(index, files, where)
    except IntegrityError as e:
        msg = (
            f"{where}: the shards the ranks wrote do not make a whole checkpoint ({e}); "
            "every rank must save the same state, laid out on the same device meshes"
        )
        raise CommitError(msg) from None


def build_index(
    meta: Mapping[str, tuple[str, tuple[int, ...]]], tables: Iterable[Mapping[str, Any]]
) -> ChunkIndex:
    """The chunk index from rank 0's :func:`tensor_meta` and every rank's written chunks."""
    found, layout = _gather(tables)
    by_name = _by_name(found)
    tensors: dict[str, TensorEntry] = {}
    for name, (dtype, shape) in meta.items():
        chunks = by_name.get(name, [])
        mesh, dims, placements = layout.get(name, ((), (), ()))
        tensors[name] = TensorEntry(
            dtype=dtype,
            shape=tuple(shape),
            chunks=tuple(chunks),
            mesh=tuple(mesh),
            mesh_dims=tuple(dims),
            placements=tuple(placements),
        )
    return ChunkIndex(tensors=tensors, block=BLOCK)

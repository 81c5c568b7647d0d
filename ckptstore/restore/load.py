"""Restore stage 4, load: check the targets against a step and pair their tensors.

In: the state being restored (the targets) and the step's tree. Out: before anything is
read, a ``StateMismatchError`` if the step does not fit the targets, else the targets'
own tensors by payload entry, so that payloads are read straight into them
(:func:`check_targets`); the name-keyed optimizer state of a DTensor save as the target
optimizer numbers it (:func:`indexed_optimizer`). ``apply_state`` (``state.capture``)
then loads the decoded values into the targets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..codec import safetensors as st
from ..codec.tree import TreeDecoder
from ..errors import StateMismatchError, UnsafeCheckpointError
from ..sharded import plan as sharding
from ..sharded.targets import local_of
from ..state.capture import capture, kind_of, precheck
from ..state.modules import EMA
from ..state.redistribute import is_dtensor
from .plan import unwrap

__all__ = ["check_targets", "collect_targets", "indexed_optimizer", "persistent_targets"]

#: For ``isinstance`` once a node (a tuple: ``A | B`` builds a union object every call).
_SEQUENCES = (list, tuple)
_KEY_TYPES = (str, int)


def check_targets(
    targets: Mapping[Any, Any],
    *,
    keys: list[Any],
    vals: list[Any],
    where_state: str,
    strict: bool,
    where: str,
    pair: bool = True,
) -> dict[str, dict[str, torch.Tensor]]:
    """Check ``targets`` against the tree; map payload entries to target tensors.

    Without ``pair`` only the check runs (a read that will not go in place, or a DTensor
    save, whose leaves ``read_sharded`` pairs): no capture of the targets is made for it.
    """
    nodes = dict(zip(keys, vals, strict=True))
    meta = TreeDecoder(None, allow_pickle=False, where=where_state, meta=True)
    shadow: dict[Any, Any] = {}
    kinds: dict[Any, str | None] = {}
    for k, node in nodes.items():
        kind, inner = unwrap(node)
        kinds[k] = kind
        target = targets.get(k) if isinstance(k, str | int) else None
        if isinstance(target, torch.nn.Module | EMA):
            shadow[k] = meta.decode(inner, (k,))
        elif kind == "optimizer" and isinstance(target, torch.optim.Optimizer):
            # Name-keyed optimizer state (a DTensor save), checked as its optimizer
            # numbers it: groups by parameter name here, then shapes like any other.
            shadow[k] = indexed_optimizer(targets, k, node, meta.decode(inner, (k,)), where)
        elif kind_of(target) == "stateful":  # an optimizer's param groups, say
            try:
                shadow[k] = meta.decode(inner, (k,))
            except UnsafeCheckpointError:
                shadow[k] = None  # holds a pickle: checked when loaded
        else:
            shadow[k] = None  # present; checked when loaded
    precheck(targets, shadow, kinds, strict=strict, where=where)
    into: dict[str, dict[str, torch.Tensor]] = {}
    if not pair:
        return into
    for k, target in targets.items():
        if k not in nodes or kind_of(target) in (None, "rng"):
            continue  # plain values are replaced, never written into in place
        _, inner = unwrap(nodes[k])
        collect_targets(inner, capture(target), into)
    return into


def indexed_optimizer(
    targets: Mapping[Any, Any], key: Any, node: Any, value: Any, where: str
) -> Any:
    """Name-keyed optimizer state as the target optimizer numbers its parameters."""
    target = targets.get(key)
    if not isinstance(target, torch.optim.Optimizer):
        return value
    at = f"{where}[{key!r}]"
    owner = node.get("owner") if isinstance(node, dict) else None
    model = targets.get(owner) if isinstance(owner, str | int) else None
    if model is None:
        found = sharding.owner_of(target, targets)
        model = targets.get(found) if found is not None else None
    if isinstance(model, EMA):
        model = model.module
    if not isinstance(model, torch.nn.Module):
        raise StateMismatchError(
            f"{at}: the optimizer state is keyed by parameter name; put the model that "
            f"owns its parameters in the state (it was saved as {owner!r})"
        )
    return sharding.indexed_optimizer_state(target, model, value, at)


def persistent_targets(
    targets: Mapping[Any, Any], keys: list[Any], vals: list[Any]
) -> dict[int, str]:
    """The tensors of modules, optimizers and EMA in ``targets`` this step holds a value for.

    Only those, and of them only the objects' own memory, so what an in-place read writes
    into them stays. Other Stateful objects hand out copies (``state_dict()``), and so do
    parts of these (an EMA's ``n_averaged`` counter): what is written into a copy is gone
    with it, and a copy's address means nothing to the next step's restore (a fallback
    would take it for a tensor it cannot overwrite). A tensor is the object's own when two
    captures, both held alive, hand out the same memory for it.
    """
    nodes = dict(zip(keys, vals, strict=True))
    out: dict[str, dict[str, torch.Tensor]] = {}
    again: dict[str, dict[str, torch.Tensor]] = {}
    for k, target in targets.items():
        if k in nodes and isinstance(target, torch.nn.Module | torch.optim.Optimizer | EMA):
            node = unwrap(nodes[k])[1]
            collect_targets(node, capture(target, keep_vars=True), out, shards=True)
            collect_targets(node, capture(target, keep_vars=True), again, shards=True)
    own = _names_of(again)
    return {p: name for p, name in _names_of(out).items() if own.get(p) == name}


def _names_of(into: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[int, str]:
    """``address -> "group/key"`` of every target tensor of a read.

    By the address of its memory, not ``id``: a module's ``state_dict()`` makes new tensor
    objects (detached views) at every call.
    """
    return {t.data_ptr(): f"{g}/{k}" for g, ts in into.items() for k, t in ts.items() if t.numel()}


def collect_targets(
    node: Any, current: Any, out: dict[str, dict[str, torch.Tensor]], *, shards: bool = False
) -> None:
    """Pair each tensor reference in ``node`` with the tensor at the same place in ``current``.

    ``current`` is a target's present state; the pairs let payloads be read straight into it.
    ``shards``: a DTensor target is paired too, by its local shard (what a restore writes
    of it, later, from the whole stored tensor): for the bookkeeping of what a step writes
    (:func:`persistent_targets`), never for an in-place read.
    """
    if isinstance(node, list):
        if isinstance(current, _SEQUENCES):
            for n, c in zip(node, current, strict=False):
                collect_targets(n, c, out, shards=shards)
        return
    if not isinstance(node, dict):
        return
    t = node.get("t")
    if t == "tensor" and isinstance(current, torch.Tensor):
        group, key = node.get("file"), node.get("key")
        if not isinstance(group, str) or not isinstance(key, str):
            return
        if st.has_own_bytes(current):
            out.setdefault(group, {})[key] = current
        elif shards and is_dtensor(current):
            # A plain stored tensor never goes in place into a DTensor (it holds one shard).
            out.setdefault(group, {})[key] = local_of(current)
    elif t in ("dict", "odict") and (type(current) is dict or isinstance(current, Mapping)):
        keys, vals = node.get("keys"), node.get("vals")
        if isinstance(keys, list) and isinstance(vals, list):
            for k, v in zip(keys, vals, strict=False):
                if isinstance(k, _KEY_TYPES) and k in current:
                    collect_targets(v, current[k], out, shards=shards)
    elif t == "tuple" and isinstance(current, _SEQUENCES):
        collect_targets(node.get("v"), list(current), out, shards=shards)

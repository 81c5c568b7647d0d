"""What a rank's replicated state looks like, in a few bytes: its entries, dtypes and shapes.

A replicated (non-sharded) save writes rank 0's state alone: a rank whose state holds
entries rank 0's lacks or other shapes (a per-rank list, a model built differently) loses
its own without a word. Each rank sends :func:`structure_digest` of its state at the save's
first exchange (``save:enter``) and rank 0 warns, naming the ranks and the entries, where
one holds something rank 0's state does not (:func:`differences`). A warning, not a
refusal: torch's own full state dicts are empty on every rank but 0
(``StateDictOptions(full_state_dict=True, cpu_offload=True)``), and a rank holding less
than rank 0 loses nothing, so an entry a rank lacks or holds empty is not compared. The
digest covers structure only: containers, tensors' dtypes and shapes; never values, and no
leaf's type (``None`` on one rank, a path on another).

Nothing here calls a state's own ``state_dict()``: a module is described by its parameters
and persistent buffers, an optimizer by its ``state`` and ``param_groups``, any other
Stateful object as a leaf. Those calls can be costly, collective (FSDP1's full state dict,
ZeRO's optimizer) or not meant to run twice per save; the save calls them once, on rank 0.
The work is bounded (:data:`_MAX_NODES` nodes, :data:`_MAX_DEPTH` levels): a state past
either is not described, and not compared.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .modules import EMA, RNGState

__all__ = ["differences", "structure_digest"]

#: Bytes of each entry's digest (BLAKE2b): a collision needs 2^64 tries, not an accident.
_DIGEST_BYTES = 8
#: Nesting deeper than this, or more nodes than that, and the state is not described (a
#: hostile or cyclic structure must not hold up the save: every rank waits for the slowest).
_MAX_DEPTH = 64
_MAX_NODES = 50_000
#: A longer list or tuple is described by its length and its first and last items.
_LONG = 64
_ENDS = 8
#: Entries named in the warning.
_SHOWN = 4


class _TooLarge(Exception):
    """The state is past the bounds: not described."""


def structure_digest(state: Mapping[Any, Any]) -> dict[str, bytes] | None:
    """Per top-level entry of ``state`` (by ``repr`` of its key), a digest of its structure.

    Random streams (:class:`RNGState`) are left out (per rank by design), and so are empty
    entries (``None``, an empty mapping or sequence: nothing of this rank's to lose). None
    where the state cannot be described (past the bounds, an attribute that raises); such a
    rank is not compared.
    """
    budget = [_MAX_NODES]
    try:
        out: dict[str, bytes] = {}
        for key, value in state.items():
            if isinstance(value, RNGState) or _empty(value):
                continue
            h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
            _describe(h, value, 0, budget)
            out[repr(key)] = h.digest()
        return out
    except Exception:
        return None


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, Mapping | list | tuple) and not len(value))


def _tensors_of(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's parameters and persistent buffers by name: what its state dict holds."""
    out = []
    for prefix, mod in module.named_modules():
        skip: set[str] = getattr(mod, "_non_persistent_buffers_set", set())
        for name, t in (*mod._parameters.items(), *mod._buffers.items()):
            if t is not None and name not in skip:
                out.append((f"{prefix}.{name}" if prefix else name, t))
    return out


def _describe(h: Any, value: Any, depth: int, budget: list[int]) -> None:
    budget[0] -= 1
    if depth > _MAX_DEPTH or budget[0] < 0:
        raise _TooLarge
    if isinstance(value, torch.Tensor):
        h.update(f"T{value.dtype}{tuple(value.shape)};".encode())
    elif isinstance(value, EMA):
        h.update(b"ema;")
        _describe(h, value.ema, depth + 1, budget)
    elif isinstance(value, nn.Module):
        tensors = _tensors_of(value)
        h.update(f"module{len(tensors)};".encode())
        for name, t in tensors:
            h.update(name.encode())
            _describe(h, t, depth + 1, budget)
    elif isinstance(value, torch.optim.Optimizer):
        h.update(b"optimizer;")
        for group in value.param_groups:
            params = group.get("params", [])
            h.update(f"G{len(params)};".encode())
            for p in params:
                _describe(h, value.state.get(p, {}), depth + 1, budget)
    elif isinstance(value, Mapping):
        if len(value) > budget[0]:
            raise _TooLarge
        h.update(f"D{len(value)};".encode())
        for k in sorted(value, key=repr):
            h.update(repr(k).encode() + b"=")
            _describe(h, value[k], depth + 1, budget)
    elif isinstance(value, list | tuple):
        n = len(value)
        h.update(f"L{n};".encode())
        items = value if n <= _LONG else (*value[:_ENDS], *value[-_ENDS:])
        for item in items:
            _describe(h, item, depth + 1, budget)
    else:
        h.update(b"s;")  # a leaf: its value and type are not compared


def differences(every: list[dict[str, bytes] | None]) -> str | None:
    """What ranks hold that rank 0's state lacks (``every[r]``: rank r's digest), or None.

    An entry rank 0 holds and another rank lacks (or holds empty) loses nothing and is not
    named; ranks without a digest (None) are not compared.
    """
    ref = every[0]
    if ref is None:
        return None

    def lost(d: dict[str, bytes] | None) -> bool:
        return d is not None and any(k not in ref or ref[k] != v for k, v in d.items())

    odd = [r for r, d in enumerate(every) if r and lost(d)]
    if not odd:
        return None
    first = every[odd[0]]
    assert first is not None
    extra = [k for k in first if k not in ref]
    changed = [k for k in first if k in ref and first[k] != ref[k]]
    what = []
    if changed:
        what.append("other entries, dtypes or shapes in " + ", ".join(changed[:_SHOWN]))
    if extra:
        what.append("also " + ", ".join(extra[:_SHOWN]))
    ranks = ", ".join(str(r) for r in odd[:_SHOWN])
    more = f" and {len(odd) - _SHOWN} more" if len(odd) > _SHOWN else ""
    return (
        f"a replicated save writes rank 0's state alone, and rank(s) {ranks}{more} hold state "
        f"it lacks (rank {odd[0]}: {'; '.join(what)}): theirs is not saved. Keep replicated "
        "state alike on every rank; keep per-rank random streams in RNGState, and save other "
        "per-rank state with sharded=True (every rank writes its own)"
    )

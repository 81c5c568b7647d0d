"""What a rank's replicated state looks like, in a few bytes: its entries, dtypes and shapes.

A replicated (non-sharded) save writes rank 0's state alone: a rank whose state has other
entries or other shapes (a per-rank list, a model built differently) would lose its own
without a word. Each rank sends :func:`structure_digest` of its state at the save's first
exchange (``save:enter``) and rank 0 refuses the save on every rank where one differs
(:func:`differences`). The digest covers structure only, never values: ranks whose losses,
positions or random states differ in value but not in shape pass.

Nothing here calls a state's own ``state_dict()``: a module is described by its parameters
and buffers, an optimizer by its ``state`` and ``param_groups``, any other Stateful object
by its type alone. Those calls can be costly, collective (FSDP1's full state dict, ZeRO's
optimizer) or not meant to run twice per save; the save calls them once, on rank 0.
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
#: Nesting deeper than this is described as "deep" (a hostile or cyclic structure).
_MAX_DEPTH = 64
#: A longer list or tuple is described by its length and its first and last items.
_LONG = 64
_ENDS = 8
#: Entries named in the refusal.
_SHOWN = 4


def structure_digest(state: Mapping[Any, Any]) -> dict[str, bytes] | None:
    """Per top-level entry of ``state`` (by ``repr`` of its key), a digest of its structure.

    Random streams (:class:`RNGState`) are left out: they are per rank by design. None where
    the state cannot be described (an attribute that raises); such a rank is not compared.
    """
    try:
        out: dict[str, bytes] = {}
        for key, value in state.items():
            if isinstance(value, RNGState):
                continue
            h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
            _describe(h, value, 0)
            out[repr(key)] = h.digest()
        return out
    except Exception:
        return None


def _describe(h: Any, value: Any, depth: int) -> None:
    if depth > _MAX_DEPTH:
        h.update(b"deep;")
        return
    if isinstance(value, torch.Tensor):
        h.update(f"T{value.dtype}{tuple(value.shape)};".encode())
    elif isinstance(value, EMA):
        h.update(b"ema;")
        _describe(h, value.ema, depth + 1)
    elif isinstance(value, nn.Module):
        h.update(b"module;")
        for name, t in (*value.named_parameters(), *value.named_buffers()):
            h.update(name.encode())
            _describe(h, t, depth + 1)
    elif isinstance(value, torch.optim.Optimizer):
        h.update(b"optimizer;")
        for group in value.param_groups:
            params = group.get("params", [])
            h.update(f"G{len(params)};".encode())
            for p in params:
                _describe(h, value.state.get(p, {}), depth + 1)
    elif isinstance(value, Mapping):
        h.update(f"D{len(value)};".encode())
        for k in sorted(value, key=repr):
            h.update(repr(k).encode() + b"=")
            _describe(h, value[k], depth + 1)
    elif isinstance(value, list | tuple):
        n = len(value)
        h.update(f"L{n};".encode())
        items = value if n <= _LONG else (*value[:_ENDS], *value[-_ENDS:])
        for item in items:
            _describe(h, item, depth + 1)
    else:
        h.update(f"{type(value).__module__}.{type(value).__qualname__};".encode())


def differences(every: list[dict[str, bytes] | None]) -> str | None:
    """What differs from rank 0's digest (``every[r]``: rank r's), or None where nothing does.

    Ranks without a digest (None) are not compared.
    """
    ref = every[0]
    if ref is None:
        return None
    odd = [r for r, d in enumerate(every) if d is not None and d != ref]
    if not odd:
        return None
    first = every[odd[0]]
    assert first is not None
    missing = [k for k in ref if k not in first]
    extra = [k for k in first if k not in ref]
    changed = [k for k in ref if k in first and first[k] != ref[k]]
    what = []
    if changed:
        what.append("other entries, dtypes or shapes in " + ", ".join(changed[:_SHOWN]))
    if missing:
        what.append("no " + ", ".join(missing[:_SHOWN]))
    if extra:
        what.append("also " + ", ".join(extra[:_SHOWN]))
    ranks = ", ".join(str(r) for r in odd[:_SHOWN])
    more = f" and {len(odd) - _SHOWN} more" if len(odd) > _SHOWN else ""
    return (
        f"a replicated save writes rank 0's state alone, and the state of rank(s) {ranks}{more} "
        f"differs from it (rank {odd[0]}: {'; '.join(what)}): theirs would be lost; nothing was "
        "saved. Keep replicated state alike on every rank; keep per-rank random streams in "
        "RNGState, and save other per-rank state with sharded=True (every rank writes its own)"
    )

"""Capturing a training state as plain data, and applying restored data back onto it.

The state handed to ``save`` maps names to objects with ``state_dict()`` /
``load_state_dict()`` (modules, optimizers, schedulers, GradScaler, :class:`EMA`,
:class:`RNGState`, anything Stateful) or to plain data. Capture turns the Stateful ones into
their state dicts (modules de-parallelized); apply checks everything it can before changing
anything, then loads modules, other Stateful objects and plain values, and EMA last (loaded,
or rebuilt from the restored source model).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from torch import nn

from .errors import StateMismatchError
from .modules import EMA, RNGState, load_module_state, module_state

__all__ = ["apply_state", "capture", "kind_of"]


def kind_of(value: Any) -> str | None:
    """``"module"``, ``"ema"``, ``"rng"``, ``"stateful"`` or ``None`` for plain data."""
    if isinstance(value, EMA):
        return "ema"
    if isinstance(value, RNGState):
        return "rng"
    if isinstance(value, nn.Module):
        return "module"
    if callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    ):
        return "stateful"
    return None


def capture(value: Any) -> Any:
    """The data to store for one top-level value of the state."""
    kind = kind_of(value)
    if kind == "module":
        return module_state(value)
    if kind is not None:
        return value.state_dict()
    return value


def apply_state(
    state: MutableMapping[Any, Any],
    stored: Mapping[Any, Any],
    kinds: Mapping[Any, str | None],
    *,
    strict: bool = True,
    where: str = "checkpoint",
) -> None:
    """Load decoded entries ``stored`` into the objects of ``state``.

    Args:
        state: the user's state; plain values in it are replaced, Stateful ones loaded.
        stored: decoded top-level entries of the checkpoint, for the keys of ``state``.
        kinds: the kind each stored entry was saved as (see :func:`kind_of`).
        strict: refuse missing/unexpected keys (shape and dtype mismatches always refuse).
        where: names the checkpoint in messages.

    Raises:
        StateMismatchError: an entry of ``state`` is absent from the checkpoint (except an
            EMA, which is rebuilt), or a module does not fit.
    """
    precheck(state, stored, kinds, strict=strict, where=where)
    emas: list[tuple[Any, EMA]] = []
    for key, target in list(state.items()):
        if isinstance(target, EMA):
            emas.append((key, target))
            continue
        if key not in stored:
            continue
        value = stored[key]
        if isinstance(target, nn.Module):
            load_module_state(target, value, strict=strict, where=f"{where}[{key!r}]")
        elif kind_of(target) is not None:
            try:
                target.load_state_dict(value)
            except (ValueError, KeyError, RuntimeError, TypeError) as e:
                name = type(target).__name__
                msg = f"{where}[{key!r}]: {name}.load_state_dict refused the stored state: {e}"
                raise StateMismatchError(msg) from e
        else:
            state[key] = value
    for key, ema in emas:
        if key in stored and kinds.get(key) == "ema" and not ema.rebuild:
            ema.load_state_dict(stored[key], strict=strict)
        else:
            ema.rebuild_from_source()


def precheck(
    state: Mapping[Any, Any],
    stored: Mapping[Any, Any],
    kinds: Mapping[Any, str | None],
    *,
    strict: bool = True,
    where: str = "checkpoint",
) -> None:
    """Everything :func:`apply_state` checks before it changes anything.

    ``stored`` may hold meta tensors (only names, shapes and dtypes are compared), so the
    checks can run from ``state.json`` alone, before any payload is read.

    Raises:
        StateMismatchError: a missing entry, or a module or EMA that does not fit.
    """
    missing = [k for k, v in state.items() if k not in stored and not isinstance(v, EMA)]
    if missing and strict:
        have = ", ".join(repr(k) for k in stored) or "nothing"
        msg = (
            f"{where} has no entry for {', '.join(repr(k) for k in missing)} (it holds {have}); "
            "restore with strict=False to skip them"
        )
        raise StateMismatchError(msg, missing=[str(k) for k in missing])
    # Check every module before loading any, so a mismatch leaves the state untouched.
    for key, target in state.items():
        if key in stored and isinstance(target, nn.Module):
            _check_module(target, stored[key], strict=strict, where=f"{where}[{key!r}]")
        elif isinstance(target, EMA):  # an EMA loads last: check it first all the same
            at = f"{where}[{key!r}]"
            _check_ema(target, stored.get(key), kinds.get(key), strict=strict, where=at)


def _check_module(target: nn.Module, value: Any, *, strict: bool, where: str) -> None:
    """Raise StateMismatchError if ``value`` would not load into ``target``."""
    if not isinstance(value, Mapping):
        raise StateMismatchError(
            f"{where}: stored entry is a {type(value).__name__}, not a state dict"
        )
    probe = _Probe(target)
    load_module_state(probe, value, strict=strict, where=where)


def _check_ema(ema: EMA, value: Any, kind: str | None, *, strict: bool, where: str) -> None:
    """Raise StateMismatchError if ``ema`` can be neither loaded nor rebuilt as it will be."""
    if kind == "ema" and not ema.rebuild:
        weights = value.get("weights") if isinstance(value, Mapping) else None
        _check_module(ema.module, weights, strict=strict, where=where)
    elif ema.source is not None:  # rebuilt from the source, whose shapes the restore keeps
        _check_module(ema.module, module_state(ema.source), strict=True, where="ema (rebuilt)")
    else:
        ema.rebuild_from_source()  # raises: nothing to rebuild from


class _Probe(nn.Module):
    """Stands in for a module to run the checks of ``load_module_state`` without loading."""

    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        from .modules import de_parallel

        self._sd = de_parallel(target).state_dict()

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._sd

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return None

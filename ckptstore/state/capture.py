"""Capturing a training state as plain data, and applying restored data back onto it.

The state handed to ``save`` maps names to objects with ``state_dict()`` /
``load_state_dict()`` (modules, optimizers, schedulers, GradScaler, :class:`EMA`,
:class:`RNGState`, anything Stateful) or to plain data. Capture turns the Stateful ones into
their state dicts (modules de-parallelized); apply checks everything it can before changing
anything (module keys, shapes and dtypes; an optimizer's parameter groups), then loads the
other Stateful objects first (whose ``load_state_dict`` may still refuse: what they loaded is
put back and nothing else has changed), then modules and plain values, and EMA last (loaded,
or rebuilt from the restored source model).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from .._log import logger as log
from ..errors import CkptStoreError, StateMismatchError
from .modules import EMA, RNGState, de_parallel, load_module_state, module_state
from .redistribute import is_dtensor, laid_out_like, optimizer_state

__all__ = ["apply_state", "capture", "is_ema_state", "kind_of"]


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


def capture(value: Any, *, keep_vars: bool = False) -> Any:
    """The data to store for one top-level value of the state.

    ``keep_vars``: a module's own parameters, not detached views (see :func:`module_state`).
    """
    kind = kind_of(value)
    if kind == "module":
        return module_state(value, keep_vars=keep_vars)
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
    done = _load_stateful(state, stored, where=where)
    replaced: list[tuple[Any, Any]] = []  # plain values: (key, the value before)
    loaded: list[Any] = []  # modules and EMAs whose load began
    at: list[Any] = []  # the keys taken in turn
    try:
        _load_the_rest(
            state,
            stored,
            kinds,
            strict=strict,
            where=where,
            at=at,
            replaced=replaced,
            loaded=loaded,
        )
    except Exception as e:
        # A module's own hook (set_extra_state, a load_state_dict pre-hook) or an EMA
        # refused what no check foresaw: the optimizers, schedulers and plain values go back
        # to their state before the call; the modules cannot (no copy of them is kept).
        for key, old in reversed(replaced):
            state[key] = old
        clean = _put_back(done, where)
        if isinstance(e, CkptStoreError):
            raise
        others = "were put back" if clean else "were put back where they could be (see the log)"
        partly = (
            f", but {', '.join(map(repr, loaded))} may hold part of the checkpoint's values: "
            "restore again, or reinitialise them"
            if loaded
            else ""
        )
        msg = (
            f"{where}[{at[-1] if at else '?'!r}]: loading it raised {type(e).__name__}: {e}; the "
            f"optimizers, schedulers and plain values of the state {others}{partly}"
        )
        raise StateMismatchError(msg) from e


def _load_the_rest(
    state: MutableMapping[Any, Any],
    stored: Mapping[Any, Any],
    kinds: Mapping[Any, str | None],
    *,
    strict: bool,
    where: str,
    at: list[Any],
    replaced: list[tuple[Any, Any]],
    loaded: list[Any],
) -> None:
    """Modules, plain values, then EMAs (:func:`apply_state`, after the Stateful objects).

    ``at`` receives each key as it is taken, ``replaced`` and ``loaded`` what is changed.
    """
    emas: list[tuple[Any, EMA]] = []
    for key, target in list(state.items()):
        if isinstance(target, EMA):
            emas.append((key, target))
            continue
        if key not in stored:
            continue
        at.append(key)
        value = stored[key]
        if isinstance(target, nn.Module):
            loaded.append(key)
            load_module_state(target, value, strict=strict, where=f"{where}[{key!r}]")
        elif kind_of(target) is None:
            # Whole tensors where the caller holds DTensors: this rank's parts of them.
            replaced.append((key, target))
            state[key] = laid_out_like(value, target)
    for key, ema in emas:
        at.append(key)
        loaded.append(key)
        kind = kinds.get(key)
        if key in stored and is_ema_state(stored[key], kind) and not ema.rebuild:
            ema.load_state_dict(stored[key], strict=strict)
        elif key in stored and not ema.rebuild and _holds_weights(stored[key], kind):
            # Saved as a plain module ({"ema": averaged_model}): its weights are the EMA.
            ema.load_weights(stored[key], strict=strict)
        elif not ema.rebuild and not _source_restored(ema, restored_modules(state, stored)):
            if strict:  # precheck refused it already, before anything changed
                raise StateMismatchError(_unrestored_source(ema, f"{where}[{key!r}]"))
            log.warning(
                "%s[%r]: the checkpoint holds no EMA weights and the EMA's source is not "
                "restored by this call; strict=False leaves the EMA as it is",
                where,
                key,
            )
            loaded.remove(key)
        else:
            if key in stored and not ema.rebuild:
                log.warning(
                    "%s[%r] holds a %s, not EMA weights; the EMA is rebuilt from its source",
                    where,
                    key,
                    type(stored[key]).__name__,
                )
            ema.rebuild_from_source()


def _put_back(done: list[tuple[Any, Any, Any]], where: str) -> bool:
    """Give each target of ``done`` (key, target, its state before) its state back.

    Newest first. Returns whether every one took it (a failure is logged).
    """
    clean = True
    for k, t, sd in reversed(done):
        try:
            t.load_state_dict(sd)
        except Exception as undo:  # reported; the refusal is the error
            log.error("%s[%r]: could not put back its previous state: %s", where, k, undo)
            clean = False
    return clean


def _load_stateful(
    state: Mapping[Any, Any], stored: Mapping[Any, Any], *, where: str
) -> list[tuple[Any, Any, Any]]:
    """Load the Stateful objects that are not modules (optimizers, schedulers, RNG, ...).

    They go first: their ``load_state_dict`` may refuse for a reason no check foresaw, and
    then nothing else has changed yet; those already loaded, and the one that refused (its
    load may have changed part of it before it raised), get their previous state back.

    Returns:
        What was loaded: (key, target, its state before), for :func:`_put_back`.
    """
    done: list[tuple[Any, Any, Any]] = []  # (key, target, its state before)
    for key, target in state.items():
        if key not in stored or isinstance(target, nn.Module | EMA) or kind_of(target) is None:
            continue
        began: list[tuple[Any, Any, Any]] = []
        try:
            began.append((key, target, target.state_dict()))
            value = stored[key]
            if isinstance(target, torch.optim.Optimizer):  # full moments, DTensor params
                value = optimizer_state(target, value)
            target.load_state_dict(value)
        except Exception as e:  # any type: torch's schedulers raise IndexError, too
            clean = _put_back(done + began, where)
            if isinstance(e, CkptStoreError):
                raise
            name = type(target).__name__
            left = "nothing was restored" if clean else "not everything could be put back"
            msg = f"{where}[{key!r}]: {name}.load_state_dict refused the stored state: {e}; {left}"
            raise StateMismatchError(msg) from e
        done += began
    return done


def is_ema_state(value: Any, kind: str | None) -> bool:
    """Whether a stored entry is an :class:`EMA`'s state (``{"weights", "counters"}``).

    Saved as an ``EMA``, its kind says so; the same dict with no kind is one that lost it
    on the way (``export OUT.pt`` then ``import OUT.pt``, a DCP export and import), and is
    restored as one instead of rebuilding the averages from the model.
    """
    if kind == "ema":
        return True
    return (
        isinstance(value, Mapping)
        and set(value) == {"weights", "counters"}
        and isinstance(value["weights"], Mapping)
        and isinstance(value["counters"], Mapping)
    )


def _holds_weights(value: Any, kind: str | None) -> bool:
    """Whether a stored entry that is not an EMA is a module's weights (a state dict)."""
    return (
        kind != "ema"
        and isinstance(value, Mapping)
        and any(isinstance(v, torch.Tensor) for v in value.values())
    )


#: The end of :func:`precheck`'s message for missing entries (an integration whose restore
#: takes no ``strict`` replaces it with its own advice).
STRICT_HINT = "; restore with strict=False to skip them"


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
        StateMismatchError: a missing entry, or a module, EMA or optimizer that does not fit.
    """
    missing = [k for k, v in state.items() if k not in stored and not isinstance(v, EMA)]
    if missing and strict:
        have = ", ".join(repr(k) for k in stored) or "nothing"
        msg = (
            f"{where} has no entry for {', '.join(repr(k) for k in missing)} (it holds {have})"
            f"{STRICT_HINT}"
        )
        raise StateMismatchError(msg, missing=[str(k) for k in missing])
    # Check every target before loading any, so a mismatch leaves the state untouched.
    restored = restored_modules(state, stored)
    for key, target in state.items():
        at = f"{where}[{key!r}]"
        if key in stored and isinstance(target, nn.Module):
            _check_module(target, stored[key], strict=strict, where=at)
        elif isinstance(target, EMA):  # an EMA loads last: check it first all the same
            _check_ema(target, stored.get(key), kinds.get(key), restored, strict=strict, where=at)
        elif key in stored and stored[key] is not None and kind_of(target) == "stateful":
            _check_stateful(target, stored[key], where=at)


def _check_module(target: nn.Module, value: Any, *, strict: bool, where: str) -> None:
    """Raise StateMismatchError if ``value`` would not load into ``target``."""
    if not isinstance(value, Mapping):
        raise StateMismatchError(
            f"{where}: stored entry is a {type(value).__name__}, not a state dict"
        )
    probe = _Probe(target)
    load_module_state(probe, value, strict=strict, where=where)


def _check_ema(
    ema: EMA,
    value: Any,
    kind: str | None,
    restored: list[nn.Module],
    *,
    strict: bool,
    where: str,
) -> None:
    """Raise StateMismatchError if ``ema`` can be neither loaded nor rebuilt as it will be.

    ``restored``: the modules this restore loads (a fall-back rebuild copies its source
    only when the source is one of them, or inside one).
    """
    if is_ema_state(value, kind) and not ema.rebuild:
        weights = value.get("weights") if isinstance(value, Mapping) else None
        _check_module(ema.module, weights, strict=strict, where=where)
        counters = value.get("counters") if isinstance(value, Mapping) else None
        _check_counters(ema, counters if isinstance(counters, Mapping) else {}, where=where)
    elif value is not None and not ema.rebuild and _holds_weights(value, kind):
        weights, counters = ema.split_plain(value)
        _check_module(ema.module, weights, strict=strict, where=where)
        _check_counters(ema, counters, where=where)
    elif not ema.rebuild and not _source_restored(ema, restored):
        if strict:
            raise StateMismatchError(_unrestored_source(ema, where))
    elif ema.source is not None:  # rebuilt from the source, whose shapes the restore keeps
        source = module_state(ema.source)
        _refuse_shards_into_whole(ema.module, source)
        _check_module(ema.module, source, strict=True, where="ema (rebuilt)")
    else:
        ema.rebuild_from_source()  # raises: nothing to rebuild from


def _check_counters(ema: EMA, counters: Mapping[str, Any], *, where: str) -> None:
    problems = ema.counter_problems(counters)
    if problems:
        msg = f"{where}: the checkpoint's EMA counters do not fit: {'; '.join(problems)}"
        raise StateMismatchError(msg)


def restored_modules(state: Mapping[Any, Any], stored: Mapping[Any, Any]) -> list[nn.Module]:
    """The de-parallelized modules of ``state`` that ``stored`` holds an entry for."""
    return [de_parallel(t) for k, t in state.items() if isinstance(t, nn.Module) and k in stored]


def _source_restored(ema: EMA, restored: list[nn.Module]) -> bool:
    """Whether the EMA's source is one of ``restored`` or a submodule of one."""
    if ema.source is None:
        return False
    src = de_parallel(ema.source)
    return any(src is m or any(src is sub for sub in m.modules()) for m in restored)


def _unrestored_source(ema: EMA, where: str) -> str:
    """Why a checkpoint without the EMA cannot rebuild it from a source it does not restore."""
    if ema.source is None:
        return (
            f"{where}: the checkpoint holds no EMA weights, and the EMA has no source model to "
            "rebuild from; pass EMA(ema, source=model) with the model in the same restore"
        )
    return (
        f"{where}: the checkpoint holds no EMA weights, and the EMA's source model is not "
        "restored by this call, so a rebuild would copy weights that did not come from the "
        "checkpoint; restore the model in the same call ({'model': model, ...: EMA(ema, "
        "source=model)}), pass EMA(..., rebuild=True) to copy the source as it is, or "
        "restore with strict=False to leave the EMA as it is; nothing was changed"
    )


def _refuse_shards_into_whole(module: nn.Module, source: Mapping[str, Any]) -> None:
    """Refuse an EMA rebuild that would copy a DTensor source into whole tensors.

    A rebuild copies the source's ``state_dict()`` tensor by tensor, with no collective (it
    may run on any subset of ranks), so an FSDP2 or tensor-parallel source cannot fill a
    plain EMA copy: torch raised "got mixed torch.Tensor and DTensor" from inside the
    restore, after the model had been overwritten. Refused here, before anything changes.
    """
    own = module_state(module)
    names = [k for k, v in source.items() if is_dtensor(v) and k in own and not is_dtensor(own[k])]
    if names:
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        msg = (
            f"ema (rebuilt from its source): the source model's {names[0]!r}{more} is a "
            "DTensor (FSDP2, tensor parallel) and the EMA's is a whole tensor; a rebuild "
            "copies shard into shard without a collective. Lay the EMA copy out like the "
            "model (fully_shard it on the same mesh), or restore a checkpoint that holds "
            "the EMA; nothing was changed"
        )
        raise StateMismatchError(msg)


#: Per-parameter optimizer buffers of ``torch.optim`` that have the parameter's shape.
_PARAM_SHAPED = frozenset(
    {
        "exp_avg",
        "exp_avg_sq",
        "max_exp_avg_sq",
        "momentum_buffer",
        "square_avg",
        "acc_delta",
        "sum",
        "grad_avg",
        "exp_inf",
        "prev",
        "step_size",
        "ax",
    }
)


def _check_stateful(target: Any, value: Any, *, where: str) -> None:
    """Raise StateMismatchError if ``value`` visibly would not load into ``target``.

    Optimizers: parameter groups and sizes, and the shapes of ``torch.optim``'s
    per-parameter buffers. Schedulers and GradScaler: what their ``load_state_dict``
    needs. Other Stateful objects cannot be checked; if one refuses while loading,
    :func:`apply_state` puts back what was loaded before it.
    """
    if isinstance(target, torch.optim.Optimizer):
        _check_optimizer(target, value, where=where)
    elif isinstance(target, torch.optim.lr_scheduler.LRScheduler) and not isinstance(
        value, Mapping
    ):
        raise StateMismatchError(
            f"{where}: stored entry is a {type(value).__name__}, not a scheduler state dict"
        )
    elif isinstance(target, torch.amp.GradScaler) and target.is_enabled() and not value:
        raise StateMismatchError(
            f"{where}: the stored GradScaler state is empty (saved from a disabled scaler) and "
            "this one is enabled; restore into a disabled scaler, or leave it out of the state"
        )


def _check_optimizer(opt: torch.optim.Optimizer, value: Any, *, where: str) -> None:
    groups = value.get("param_groups") if isinstance(value, Mapping) else None
    saved_state = value.get("state") if isinstance(value, Mapping) else None
    if not isinstance(groups, list | tuple) or not isinstance(saved_state, Mapping):
        raise StateMismatchError(
            f"{where}: stored entry is not an optimizer state dict (no 'state' and "
            f"'param_groups'), so it cannot load into {type(opt).__name__}"
        )
    saved = [len(g.get("params", ())) if isinstance(g, Mapping) else -1 for g in groups]
    have = [len(g["params"]) for g in opt.param_groups]
    if saved != have:
        raise StateMismatchError(
            f"{where}: the optimizer's parameter groups do not match the checkpoint: it has "
            f"{len(have)} group(s) of {have} parameters, the checkpoint {len(saved)} "
            f"group(s) of {saved}. Build the optimizer with the parameter groups it had when "
            "saved, in the same order",
            mismatched=[f"param_groups: checkpoint {saved}, optimizer {have}"],
        )
    if not type(opt).__module__.startswith("torch.optim"):
        return  # other optimizers' buffers may have any shape (factored, flat, quantized)
    ids = [i for g in groups if isinstance(g, Mapping) for i in g.get("params", ())]
    params = [p for g in opt.param_groups for p in g["params"]]
    by_id = dict(zip(ids, params, strict=False))
    mismatched = []
    for pid, buffers in saved_state.items():
        param = by_id.get(pid)
        if param is None or not isinstance(buffers, Mapping):
            continue
        for name, t in buffers.items():
            if name in _PARAM_SHAPED and isinstance(t, torch.Tensor) and t.shape != param.shape:
                mismatched.append(
                    f"state[{pid}][{name!r}]: checkpoint {tuple(t.shape)}, "
                    f"parameter {tuple(param.shape)}"
                )
    if mismatched:
        raise StateMismatchError(
            f"{where}: the optimizer state does not fit its parameters; mismatched "
            f"({len(mismatched)}): {'; '.join(mismatched[:20])}. Build the optimizer over the "
            "model it was saved with",
            mismatched=mismatched,
        )


class _Probe(nn.Module):
    """Stands in for a module to run the checks of ``load_module_state`` without loading."""

    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        from .modules import de_parallel

        self._sd = de_parallel(target).state_dict(keep_vars=True)  # compared, never written

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._sd

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return None

"""Modules, EMA and RNG: what a training state holds besides plain data.

Modules are saved de-parallelized: the DDP / DataParallel / ``torch.compile`` wrappers are
removed before ``state_dict()``, so stored keys never carry ``module.`` or ``_orig_mod.``.
On load, those prefixes are stripped from stored keys (old checkpoints have them) and the
state goes into the de-parallelized target, so a checkpoint from a DDP+compiled model loads
into a plain model and the other way round.

Calling ``state_dict()`` on the de-parallelized module is also what keeps EMA handling out of
collectives: under DDP, code that touches the wrapper on one rank and not on the others
deadlocks (see the seeds); ckptstore never goes through the wrapper.
"""

from __future__ import annotations

import collections
import hashlib
import random
import sys
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from .._log import logger as log
from ..errors import ConfigTypeError, StateMismatchError
from .redistribute import cuttable, is_dtensor, local_part

try:
    import numpy as _numpy
except ImportError:  # pragma: no cover
    _numpy = None  # type: ignore[assignment]
np: Any = _numpy

__all__ = [
    "EMA",
    "RNGState",
    "Stateful",
    "de_parallel",
    "load_module_state",
    "module_state",
    "rng_for_rank",
]

_PREFIXES = ("module.", "_orig_mod.")


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``."""

    def state_dict(self) -> Any:
        """The object's state as tensors and plain data."""
        ...

    def load_state_dict(self, state_dict: Any, /) -> Any:
        """Restore the object from what :meth:`state_dict` returned."""
        ...


def _wrapper_types() -> tuple[type, ...]:
    types: list[type] = [nn.DataParallel, nn.parallel.DistributedDataParallel]
    # A compiled module exists only once torch._dynamo was imported (torch.compile does).
    # Importing it here made the first save of a process that had not (no optimizer built:
    # torch's optimizers import it) take 0.98 s instead of a few ms on the test VM.
    frame = sys.modules.get("torch._dynamo.eval_frame")
    compiled = getattr(frame, "OptimizedModule", None)
    if isinstance(compiled, type):
        types.append(compiled)
    return tuple(types)


def de_parallel(module: nn.Module) -> nn.Module:
    """Remove every DDP, DataParallel and ``torch.compile`` wrapper, in any nesting."""
    wrappers = _wrapper_types()
    seen = 0
    inner: Any
    while isinstance(module, wrappers) and seen < 16:
        inner = getattr(module, "_orig_mod", None)
        if inner is None:
            inner = module.module
        module = inner
        seen += 1
    return module


def normalize_key(key: str) -> str:
    """Drop ``_orig_mod.`` components (a compiled submodule) anywhere in a key."""
    if "_orig_mod." not in key:
        return key
    return ".".join(p for p in key.split(".") if p != "_orig_mod") if key != "_orig_mod" else key


def module_state(
    module: nn.Module, *, keep_vars: bool = False
) -> collections.OrderedDict[str, Any]:
    """The de-parallelized ``state_dict`` of a module, with normalized keys.

    With ``keep_vars`` the values are the module's own parameters and buffers, not detached
    views of them: for callers that look only at names, shapes and memory, or write into
    them under ``no_grad``. It saves a ``detach`` per tensor, which for a DTensor is a
    dispatch (an FSDP2 model of 196 parameters: 4 ms a capture, 0.5 with ``keep_vars``).
    """
    sd = de_parallel(module).state_dict(keep_vars=keep_vars)
    out: collections.OrderedDict[str, Any] = collections.OrderedDict(
        (normalize_key(k), v) for k, v in sd.items()
    )
    meta = getattr(sd, "_metadata", None)
    if meta is not None:
        out._metadata = {normalize_key(k): v for k, v in meta.items()}  # type: ignore[attr-defined]
    return out


def _strip_leading(keys: list[str], target: set[str]) -> str:
    """The leading wrapper prefix shared by all stored keys and absent from the target."""
    stripped = ""
    changed = True
    while changed and keys:
        changed = False
        for p in _PREFIXES:
            if all(k.startswith(p) for k in keys) and not any(t.startswith(p) for t in target):
                stripped += p
                keys = [k[len(p) :] for k in keys]
                changed = True
    return stripped


def _meta_key(key: str, stripped: str, added: str) -> str:
    """A stored ``_metadata`` key (a module path) as the target names it."""
    if stripped and key.startswith(stripped):
        key = key[len(stripped) :]
    key = normalize_key(key)
    if added:
        return added[:-1] + ("." + key if key else "")
    return key


def load_module_state(
    target: nn.Module, stored: Mapping[str, Any], *, strict: bool = True, where: str = "model"
) -> None:
    """Load ``stored`` into the de-parallelized ``target``, checking everything first.

    Keys are matched after stripping wrapper prefixes on both sides. Nothing is loaded when
    a key is missing or unexpected (with ``strict``) or a shape or dtype differs, so a failed
    restore never leaves a half-loaded model.

    Raises:
        StateMismatchError: listing missing and unexpected keys and mismatched tensors.
    """
    base = de_parallel(target)
    tsd = base.state_dict(keep_vars=True)  # names, shapes and dtypes only
    tmap = {normalize_key(k): k for k in tsd}
    prefix = _strip_leading(list(stored), set(tmap))
    # The other way round: a target whose keys all carry a wrapper prefix its checkpoint's
    # keys lack (a timm ModelEmaV2 or a model holding its network as ``self.module``, whose
    # weights an import stored with that prefix stripped as a DDP model's).
    added = "" if prefix else _strip_leading(list(tmap), {normalize_key(k) for k in stored})
    if added:
        tmap = {k[len(added) :]: v for k, v in tmap.items()}
    mapped: collections.OrderedDict[str, Any] = collections.OrderedDict()
    unexpected: list[str] = []
    for k, v in stored.items():
        nk = normalize_key(k[len(prefix) :] if prefix else k)
        tk = tmap.get(nk)
        if tk is None:
            unexpected.append(k)
        else:
            mapped[tk] = v
    missing = [k for k in tsd if k not in mapped]
    for k, v in mapped.items():  # a full stored tensor into a DTensor: this rank's part
        # (not a check's meta stand-in: its part has the same global shape and dtype, which
        # is all the check compares, and cutting it costs ~0.1 ms a tensor)
        if is_dtensor(tsd[k]) and isinstance(v, torch.Tensor) and not v.is_meta:
            mapped[k] = local_part(v, tsd[k])
    mismatched = []
    for k, v in mapped.items():
        t = tsd[k]
        if isinstance(t, torch.Tensor) and isinstance(v, torch.Tensor):
            if is_dtensor(t) and not is_dtensor(v) and not cuttable(t):
                # Checked here, in the precheck's pass too (meta stand-ins), before any
                # object of the state is loaded.
                placements = ", ".join(str(p) for p in t.placements)  # type: ignore[attr-defined]
                mismatched.append(f"{k}: a whole tensor cannot be laid out as ({placements})")
            elif t.shape != v.shape:
                mismatched.append(f"{k}: checkpoint {tuple(v.shape)}, model {tuple(t.shape)}")
            elif t.dtype != v.dtype:
                mismatched.append(f"{k}: checkpoint {v.dtype}, model {t.dtype}")
    if mismatched or (strict and (missing or unexpected)):
        lines = [f"{where}: the checkpoint does not fit the model"]
        if missing:
            lines.append(f"missing keys ({len(missing)}): {', '.join(missing[:20])}")
        if unexpected:
            lines.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected[:20])}")
        if mismatched:
            lines.append(f"mismatched ({len(mismatched)}): {'; '.join(mismatched[:20])}")
        if mismatched:  # strict=False skips keys, never another shape or dtype
            lines.append(
                "build the model as it was when saved (strict=False skips missing and "
                "unexpected keys, never a shape, dtype or layout that differs)"
            )
        else:
            lines.append(
                "build the model as it was when saved, or restore with strict=False to skip "
                "the missing and unexpected keys"
            )
        raise StateMismatchError(
            "; ".join(lines), missing=missing, unexpected=unexpected, mismatched=mismatched
        )
    meta = getattr(stored, "_metadata", None)
    if isinstance(meta, dict):
        mapped._metadata = {  # type: ignore[attr-defined]
            _meta_key(k, prefix, added): v for k, v in meta.items()
        }
    # Every value the module's own tensor (a sharded restore read each into its memory):
    # loading is the identity. ``assign`` has torch register the same objects again instead
    # of copying each onto itself (a DTensor dispatch each: load_state_dict took 40-66 ms of
    # a rank's CPU for the bench's 196 FSDP2 parameters, 10-12 ms now); the load hooks
    # (FSDP2's, the user's) run as before.
    same = (
        bool(mapped)
        and not torch.__future__.get_swap_module_params_on_conversion()
        and all(v is tsd.get(k) for k, v in mapped.items())
    )
    base.load_state_dict(mapped, strict=strict, assign=same)


_COUNTERS = ("n_averaged", "updates", "num_updates", "decay")


class EMA:
    """Marks an exponential moving average of a model in the training state.

    Args:
        ema: ``torch.optim.swa_utils.AveragedModel``, a timm-style ``ModelEmaV2``/``V3``
            (the averaged model is ``.module``), or a plain module holding the averages.
        source: the model being averaged (plain, DDP or compiled). Needed to rebuild.
        rebuild: on restore, ignore a stored EMA and copy the restored model's weights.

    On restore the stored EMA is loaded if present, also when it was saved as a plain module
    (``{"ema": averaged_model}``, without ``EMA``); if the checkpoint has none (or
    ``rebuild=True``) its weights are rebuilt from the de-parallelized ``source`` after the
    model is restored. Without ``rebuild=True`` the source must be restored by the same call
    (it, or a module holding it, is in the state): a checkpoint without an EMA raises
    ``StateMismatchError`` rather than copy weights it did not give (``strict=False`` leaves
    the EMA as it is). Counters (``n_averaged``, ``updates``, ``decay``) are saved too.
    """

    def __init__(self, ema: Any, source: nn.Module | None = None, *, rebuild: bool = False) -> None:
        if not isinstance(ema, nn.Module) and not isinstance(
            getattr(ema, "module", None), nn.Module
        ):
            msg = f"EMA(ema=...) must be a module or hold one as .module, got {type(ema).__name__}"
            raise ConfigTypeError(msg)
        self.ema = ema
        self.source = source
        self.rebuild = rebuild

    @property
    def module(self) -> nn.Module:
        """The module that holds the averaged weights."""
        from torch.optim.swa_utils import AveragedModel

        obj = de_parallel(self.ema) if isinstance(self.ema, nn.Module) else self.ema
        if isinstance(obj, AveragedModel):
            return de_parallel(obj.module)
        inner = getattr(obj, "module", None)
        if isinstance(inner, nn.Module) and (
            not isinstance(obj, nn.Module)
            or type(obj).__name__.startswith("ModelEma")
            or hasattr(obj, "decay")
        ):
            return de_parallel(inner)  # timm ModelEmaV2/V3 and look-alikes
        return obj

    def _counter_owner(self) -> Any:
        obj = self.ema
        return de_parallel(obj) if isinstance(obj, nn.Module) else obj

    def state_dict(self) -> dict[str, Any]:
        """``{"weights": <averaged module state>, "counters": {...}}``."""
        owner = self._counter_owner()
        counters: dict[str, Any] = {}
        for name in _COUNTERS:
            v = getattr(owner, name, None)
            if isinstance(v, torch.Tensor):
                counters[name] = v.detach().clone()
            elif isinstance(v, int | float) and not isinstance(v, bool):
                counters[name] = v
        return {"weights": module_state(self.module), "counters": counters}

    def load_state_dict(self, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
        """Load stored EMA weights and counters."""
        load_module_state(self.module, state_dict["weights"], strict=strict, where="ema")
        self._load_counters(dict(state_dict.get("counters", {})))

    def _load_counters(self, counters: Mapping[str, Any]) -> None:
        owner = self._counter_owner()
        for name, v in counters.items():
            if name not in _COUNTERS:
                continue
            cur = getattr(owner, name, None)
            if isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor):
                with torch.no_grad():
                    cur.copy_(v)
            elif cur is not None and not isinstance(cur, torch.Tensor):
                setattr(owner, name, v)

    def counter_problems(self, counters: Mapping[str, Any]) -> list[str]:
        """Why stored counters would not load (a tensor counter of another shape), if any."""
        owner = self._counter_owner()
        problems = []
        for name, v in counters.items():
            cur = getattr(owner, name, None) if name in _COUNTERS else None
            fits = not isinstance(v, torch.Tensor) or v.shape == getattr(cur, "shape", v.shape)
            if isinstance(cur, torch.Tensor) and not fits:
                problems.append(f"{name}: checkpoint {tuple(v.shape)}, EMA {tuple(cur.shape)}")
        return problems

    def split_plain(self, stored: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The averaged module's weights and the counters of an EMA saved as a plain module.

        ``{"ema": averaged_model}`` stores the object given as ``ema``: an ``AveragedModel``'s
        ``module.``-prefixed weights (``module.module.`` where it averages a DDP model) and
        its ``n_averaged``, a timm ``ModelEmaV2``'s ``module.`` weights;
        ``{"ema": averaged_model.module}`` the averaged module's own keys. The weights load
        into :attr:`module` (the wrapper prefixes stripped as for any module, so either side
        may have averaged a DDP or compiled model); the top-level counters into their owner.
        """
        own = {normalize_key(k) for k in self.module.state_dict(keep_vars=True)}
        counters = {k: v for k, v in stored.items() if k in _COUNTERS and k not in own}
        weights: collections.OrderedDict[str, Any] = collections.OrderedDict(
            (k, v) for k, v in stored.items() if k not in counters
        )
        meta = getattr(stored, "_metadata", None)
        if isinstance(meta, dict):
            weights._metadata = dict(meta)  # type: ignore[attr-defined]
        return weights, counters

    def load_weights(self, stored: Mapping[str, Any], *, strict: bool = True) -> None:
        """Load an EMA saved as a plain module (see :meth:`split_plain`).

        Raises:
            StateMismatchError: the stored weights do not fit.
        """
        weights, counters = self.split_plain(stored)
        load_module_state(self.module, weights, strict=strict, where="ema")
        self._load_counters(counters)
        self._continue_averaging()

    def _continue_averaging(self) -> None:
        # AveragedModel copies the model over its averages on the next update while
        # n_averaged is 0: the restored averages would be thrown away.
        n = getattr(self._counter_owner(), "n_averaged", None)
        if isinstance(n, torch.Tensor) and int(n) == 0:
            with torch.no_grad():
                n.fill_(1)

    def rebuild_from_source(self) -> None:
        """Copy the de-parallelized source model's weights into the EMA.

        Uses ``state_dict()`` of the unwrapped source, which runs no collective, so it is
        safe on any subset of ranks.
        """
        if self.source is None:
            msg = "EMA has no source model to rebuild from; pass EMA(ema, source=model)"
            raise StateMismatchError(msg)
        src = module_state(self.source)
        load_module_state(self.module, src, strict=True, where="ema (rebuilt from source)")
        self._continue_averaging()  # from the restored model, not a fresh copy


class RNGState:
    """The random generators of this process: Python, NumPy, torch CPU and CUDA.

    Put it in the state (``"rng": RNGState()``) to make a resumed run draw the same numbers
    as an uninterrupted one. Under torch.distributed every rank's generators are saved and
    each rank restores its own.

    Args:
        derive_missing: what a rank restores when the checkpoint holds no stream of its own
            (restoring on more ranks than saved, or a single-process checkpoint on several
            ranks). ``False`` (default): rank 0's stream, so those ranks draw the same numbers
            as rank 0 (a warning says so). ``True``: a distinct stream derived from the saved
            stream of rank ``rank % saved_ranks`` and the rank (see :meth:`derive`): the same
            on every run, different on every rank.
    """

    def __init__(self, *, derive_missing: bool = False) -> None:
        self.derive_missing = bool(derive_missing)

    @staticmethod
    def derive(state: Mapping[str, Any], rank: int) -> dict[str, Any]:
        """A new generator state for ``rank``, seeded from a hash of ``(state, rank)``.

        Deterministic (SHA-256 of the saved generator states and the rank, never Python's
        salted ``hash``), so a rerun derives the same streams, and distinct for each rank.
        Every generator present in ``state`` gets its own seed: Python, NumPy, torch CPU and
        each CUDA device.

        Args:
            state: a saved stream, as :meth:`state_dict` returns it.
            rank: the rank the stream is for.

        Returns:
            A state for :meth:`load_state_dict`.
        """
        h = hashlib.sha256(b"ckptstore.RNGState.derive/1\0%d\0" % rank)
        _hash_into(h, state)
        digest = h.digest()

        def seed(label: str) -> int:
            return int.from_bytes(hashlib.sha256(digest + label.encode()).digest()[:8], "little")

        out: dict[str, Any] = {}
        if "python" in state:
            out["python"] = random.Random(seed("python")).getstate()
        if "torch" in state:
            out["torch"] = torch.Generator().manual_seed(seed("torch")).get_state()
        if "numpy" in state and np is not None:
            out["numpy"] = np.random.RandomState(seed("numpy") % 2**32).get_state()
        cuda = state.get("cuda")
        if cuda is not None:
            out["cuda_seeds"] = [seed(f"cuda{i}") for i in range(len(cuda))]
        return out

    def state_dict(self) -> dict[str, Any]:
        """Capture the generators now."""
        out: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if np is not None:
            out["numpy"] = np.random.get_state()
        cuda_ready = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        if cuda_ready:
            out["cuda"] = torch.cuda.get_rng_state_all()
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Set the generators to a captured state."""
        py = state_dict.get("python")
        if py is not None:
            random.setstate(_as_tuple(py))
        t = state_dict.get("torch")
        if t is not None:
            torch.set_rng_state(t)
        npst = state_dict.get("numpy")
        if npst is not None and np is not None:
            np.random.set_state(tuple(npst))
        seeds = state_dict.get("cuda_seeds")  # from derive(): no CUDA needed to make them
        if seeds is not None and torch.cuda.is_available():
            for i, sd in enumerate(list(seeds)[: torch.cuda.device_count()]):
                torch.cuda.default_generators[i].manual_seed(int(sd))
        cuda = state_dict.get("cuda")
        if cuda is not None and torch.cuda.is_available():
            cuda = list(cuda)
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)
            else:
                for i, s in enumerate(cuda[: torch.cuda.device_count()]):
                    torch.cuda.set_rng_state(s, i)


def _as_tuple(v: Any) -> Any:
    if isinstance(v, list | tuple):
        return tuple(_as_tuple(x) for x in v)
    return v


def _hash_into(h: Any, value: Any) -> None:
    """Feed a saved generator state into a hash, the same bytes in every process."""
    if isinstance(value, torch.Tensor):
        h.update(b"T")
        h.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    elif np is not None and isinstance(value, np.ndarray):
        h.update(b"A" + str(value.dtype).encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, Mapping):
        h.update(b"{")
        for k in sorted(value, key=str):
            h.update(repr(k).encode())
            _hash_into(h, value[k])
        h.update(b"}")
    elif isinstance(value, list | tuple):
        h.update(b"[")
        for v in value:
            _hash_into(h, v)
        h.update(b"]")
    else:
        h.update(repr(value).encode())


def rng_for_rank(
    stored: Mapping[str, Any], rank: int, *, target: Any = None, warn: bool = True
) -> Any:
    """The generator state ``rank`` restores from a stored :class:`RNGState` entry.

    A distributed save stores every rank's stream (``{"per_rank": [...]}``), a single
    process one stream (rank 0's). A rank with no stream of its own gets rank 0's (logged
    as a warning when ``warn``), or, when ``target`` is ``RNGState(derive_missing=True)``, a
    stream derived from that of rank ``rank % saved_ranks`` (:meth:`RNGState.derive`).

    Args:
        stored: the decoded entry.
        rank: the rank restoring it.
        target: the object it is restored into.
        warn: log a warning for a rank that gets another rank's stream (restore does;
            ``load`` returns plain data and does not).

    Returns:
        The state to pass to :meth:`RNGState.load_state_dict`.
    """
    streams = stored.get("per_rank", [stored])
    if not isinstance(streams, list) or not streams:
        return stored  # malformed: RNGState.load_state_dict reports it
    if rank < len(streams):
        return streams[rank]
    if isinstance(target, RNGState) and target.derive_missing:
        src = rank % len(streams)
        log.info(
            "rank %d has no saved RNG stream (the checkpoint holds %d); derived one from "
            "rank %d's stream (RNGState(derive_missing=True))",
            rank,
            len(streams),
            src,
        )
        return RNGState.derive(streams[src], rank)
    if warn:
        log.warning(
            "rank %d has no saved RNG stream (the checkpoint holds %d, saved by %d rank(s)): "
            "it restores rank 0's, so it draws the same random numbers as rank 0 (dropout, "
            "augmentation, sampling). Pass RNGState(derive_missing=True) to derive a distinct, "
            "deterministic stream for each such rank instead",
            rank,
            len(streams),
            len(streams),
        )
    return streams[0]

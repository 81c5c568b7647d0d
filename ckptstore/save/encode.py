"""Save stage 1, capture and encode: the user's state -> a JSON tree plus named tensors.

In: the state mapping (modules, optimizers, EMA, RNG, plain data), the per-rank RNG states
gathered by the pipeline, optionally a DTensor collector (sharded DTensor saves) and a
staging pool (async saves). Out: :class:`Encoded`, the ``state.json`` bytes and the
payload tensors by group (copied into staging buffers when a pool is given).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..codec import safetensors as safetensors_codec
from ..codec.tree import STATE_FORMAT, TreeEncoder, tensor_key
from ..errors import UnsafeCheckpointError
from ..sharded import plan as sharding
from ..state.capture import capture, kind_of
from ..state.modules import EMA
from .staging import StagingPool

__all__ = ["Encoded", "encode", "group_name", "stage_group"]

_GROUP_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


@dataclass(frozen=True)
class Encoded:
    """An encoded state: ``state.json`` bytes and the payload tensors, group -> key -> tensor."""

    tree: bytes
    groups: dict[str, dict[str, torch.Tensor]]


def group_name(key: Any, index: int) -> str:
    """The payload group (file stem) of a top-level key.

    The key itself when it is a safe name, else ``_<index>`` (never a valid key name).
    """
    if isinstance(key, str) and _GROUP_RE.fullmatch(key):
        return key
    return f"_{index}"


def check_state_key(key: Any) -> None:
    """Refuse a top-level state key no store names (only ``str`` and ``int`` keys are).

    Raises:
        UnsafeCheckpointError: naming the key.
    """
    if isinstance(key, bool) or not isinstance(key, str | int):
        raise UnsafeCheckpointError(f"state keys must be str or int, got {key!r}")


def encode(
    state: Mapping[Any, Any],
    rng: Mapping[Any, Any] | None,
    dtensors: sharding.DTensorCollector | None,
    *,
    allow_pickle: bool,
    fmt: str,
    compression: str | None,
    staging: StagingPool | None,
    device_staging: StagingPool | None = None,
) -> Encoded:
    """``state.json`` bytes and the tensor groups of a state (staged with ``staging``).

    ``device_staging``: where a synchronous save copies the state when some of its tensors
    live on a GPU: reused pinned buffers, so the device-to-host copies run at full speed
    (``.cpu()`` copies each tensor into fresh pageable memory: a save of a model and AdamW
    took twice as long on an H200). CPU tensors are then written from where they are.

    With ``dtensors`` (a sharded DTensor save) DTensor leaves are collected there instead
    of becoming payload tensors, and optimizers are stored keyed by parameter name.
    """
    enc = TreeEncoder(allow_pickle=allow_pickle, dtensor=dtensors)
    keys: list[Any] = []
    vals: list[Any] = []
    for i, (key, value) in enumerate(state.items()):
        check_state_key(key)
        kind = kind_of(value)
        owner = None
        if dtensors is not None and isinstance(value, torch.optim.Optimizer):
            owner = sharding.owner_of(value, state)
            if owner is None:
                msg = (
                    f"state[{key!r}]: the optimizer's parameters are not all in one module "
                    "of the state; add the model to the state, so its sharded state can be "
                    "keyed by parameter name"
                )
                raise UnsafeCheckpointError(msg)
            model = state[owner]
            kind = "optimizer"
            data = sharding.named_optimizer_state(
                value, model.module if isinstance(model, EMA) else model
            )
        else:
            data = capture(value)
        if rng and key in rng and rng[key] is not None:
            data = {"per_rank": rng[key]}
        node = enc.encode(data, group=group_name(key, i), path=(key,))
        if kind is not None:
            node = {"t": "stateful", "kind": kind, "v": node}
            if owner is not None:
                node["owner"] = owner
        keys.append(key)
        vals.append(node)
    groups = enc.finish(tensor_key, contiguous=staging is None and device_staging is None)
    if staging is None and device_staging is not None:
        if any(t.device.type == "cuda" for g in groups.values() for t in g.values()):
            staging = device_staging
        else:
            groups = {g: {k: _host(t) for k, t in ts.items()} for g, ts in groups.items()}
    if staging is not None:
        staging.begin()
        groups = {
            g: stage_group(staging, g, tensors, fmt=fmt, compression=compression)
            for g, tensors in groups.items()
        }
        staging.end()
    tree = {"ckptstore_state": STATE_FORMAT, "root": {"t": "dict", "keys": keys, "vals": vals}}
    return Encoded(json.dumps(tree, separators=(",", ":"), allow_nan=False).encode(), groups)


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor (a copy only where it is not one)."""
    if t.device.type != "cpu":
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def stage_group(
    staging: StagingPool,
    group: str,
    tensors: Mapping[str, torch.Tensor],
    *,
    fmt: str,
    compression: str | None,
) -> dict[str, torch.Tensor]:
    """Copy one group into staging buffers.

    For plain safetensors each tensor is placed where its bytes line up with its place
    in the file, so the writer sends it to the disk without a bounce copy.
    """
    offsets: dict[str, int] = {}
    if fmt == "safetensors" and compression is None:
        head, order = safetensors_codec.build_header(tensors)
        pos = len(head)
        for name, t in order:
            offsets[name] = pos
            pos += t.numel() * t.element_size()
    return {k: staging.stage(f"{group}/{k}", t, offsets.get(k)) for k, t in tensors.items()}

"""The typed objects that cross the save pipeline's stage boundaries.

Not a stage. :class:`SaveOptions` (the manager's checked arguments) go into every stage;
the encode stage makes a :class:`SaveJob` (replicated or per-rank state) or the plan stage
a :class:`ShardJob` (this rank's DTensor boxes); the write stage turns a ``SaveJob`` into a
:class:`Written` (a durable pending checkpoint and its manifest) that the commit stage
publishes. What travels between ranks stays plain tuples (``("ok", value)``,
``("error", e)``), since it is pickled by the collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..manifest import Manifest
from ..storage import Pending
from .encode import Encoded

__all__ = ["SaveJob", "SaveOptions", "ShardJob", "Written"]


@dataclass(frozen=True)
class SaveOptions:
    """How a manager saves: its constructor's arguments, checked there."""

    fmt: str
    compression: str | None
    async_save: bool
    allow_pickle: bool
    barrier_timeout: float


@dataclass(frozen=True)
class SaveJob:
    """A state encoded (and staged, if async) by the caller's thread, ready to be written."""

    step: int
    encoded: Encoded
    metrics: dict[str, float]
    metadata: dict[str, Any]
    #: The rank whose files these are (per-rank state), or None (the state of no rank).
    rank: int | None
    #: The save replaces a committed step that does not verify.
    replace: bool = False


@dataclass(frozen=True)
class ShardJob:
    """The part of a DTensor save one rank writes, from the global plan (see :mod:`.plan`)."""

    #: Box key -> (tensor name, offsets, the box's data), as ``sharding.local_boxes``.
    boxes: dict[str, tuple[str, tuple[int, ...], Any]]
    layout: Any
    #: Rank 0: ``{"meta": {name: (dtype, shape)}, "global": the split index's
    #: dtensors.json or None, "strided": bool}`` (it writes the chunk index from them), all
    #: None until ``describe`` ran. Other ranks of a split save: ``{"names": every DTensor's
    #: name, sorted}``; else None.
    md: Any
    #: The rest of the state (written by rank 0 only).
    encoded: Encoded
    #: The save writes the split index (each rank its part; see ``sharded.split_index``).
    split: bool = False
    #: Rank 0, where ``md`` is not filled in yet (the first save of a layout): fills it.
    #: Run beside the shard writes (``write.write_dtensor``), off the save's critical path.
    describe: Callable[[], None] | None = None


@dataclass(frozen=True)
class Written:
    """A checkpoint whose files are durable in its tmp directory, not yet committed."""

    pending: Pending
    manifest: Manifest

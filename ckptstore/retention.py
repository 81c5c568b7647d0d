"""Retention policies and the pure plan of what to delete.

A policy says which checkpoints it wants kept; a union of policies keeps what any of them
keeps. :func:`plan_deletions` then adds the guarantees no policy can override: the newest
committed checkpoint, pinned ones and the newest one that verifies are never deleted. The
plan is a pure function of its inputs, so it is tested without a disk.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

__all__ = [
    "CheckpointInfo",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "RetentionPolicy",
    "Union",
    "as_policy",
    "plan_deletions",
]


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What retention knows of one committed checkpoint."""

    step: int
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)
    pinned: bool = False


@runtime_checkable
class RetentionPolicy(Protocol):
    """Chooses the steps to keep among committed checkpoints."""

    @property
    def needs_metrics(self) -> bool:
        """Whether :meth:`keep` reads ``CheckpointInfo.metrics`` (so manifests are read)."""
        ...

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        """The steps this policy wants kept; ``checkpoints`` are in ascending step order."""
        ...


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        msg = f"{name} must be a positive int, got {value!r}"
        raise ValueError(msg)
    return value


@dataclasses.dataclass(frozen=True)
class KeepLast:
    """Keep the ``n`` newest checkpoints."""

    n: int
    needs_metrics: bool = dataclasses.field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        _positive_int("KeepLast(n)", self.n)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        """The ``n`` highest steps."""
        return {c.step for c in checkpoints[-self.n :]}


@dataclasses.dataclass(frozen=True)
class KeepBest:
    """Keep the ``k`` checkpoints with the best value of ``metric``.

    Checkpoints without the metric, or with NaN, never count as best. Ties go to the newer
    checkpoint.
    """

    k: int
    metric: str
    mode: str = "min"
    needs_metrics: bool = dataclasses.field(default=True, init=False, repr=False)

    def __post_init__(self) -> None:
        _positive_int("KeepBest(k)", self.k)
        if not isinstance(self.metric, str) or not self.metric:
            msg = f"KeepBest(metric) must be a non-empty str, got {self.metric!r}"
            raise ValueError(msg)
        if self.mode not in ("min", "max"):
            msg = f"KeepBest(mode) must be 'min' or 'max', got {self.mode!r}"
            raise ValueError(msg)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        """The ``k`` best by the metric."""
        scored = []
        for c in checkpoints:
            v = c.metrics.get(self.metric)
            if v is None or not isinstance(v, int | float) or math.isnan(v):
                continue
            score = v if self.mode == "min" else -v
            scored.append((score, -c.step))
        scored.sort()
        return {-neg_step for _, neg_step in scored[: self.k]}


@dataclasses.dataclass(frozen=True)
class KeepEvery:
    """Keep every checkpoint whose step is a multiple of ``steps`` (milestones)."""

    steps: int
    needs_metrics: bool = dataclasses.field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        _positive_int("KeepEvery(steps)", self.steps)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        """Steps divisible by ``steps``."""
        return {c.step for c in checkpoints if c.step % self.steps == 0}


@dataclasses.dataclass(frozen=True)
class KeepAll:
    """Keep everything (``keep=None``)."""

    needs_metrics: bool = dataclasses.field(default=False, init=False, repr=False)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        """All steps."""
        return {c.step for c in checkpoints}


@dataclasses.dataclass(frozen=True)
class Union:
    """Keep what any of ``policies`` keeps."""

    policies: tuple[RetentionPolicy, ...]

    @property
    def needs_metrics(self) -> bool:
        """Whether any member reads metrics."""
        return any(p.needs_metrics for p in self.policies)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        """The union of the members' choices."""
        out: set[int] = set()
        for p in self.policies:
            out |= p.keep(checkpoints)
        return out


def as_policy(keep: int | RetentionPolicy | Iterable[RetentionPolicy] | None) -> RetentionPolicy:
    """Normalize the ``keep=`` argument: an int is ``KeepLast``, a list is a union.

    Raises:
        ValueError: ``keep`` is not a positive int, a policy, a list of policies or None.
    """
    if keep is None:
        return KeepAll()
    if isinstance(keep, bool):
        msg = f"keep must be a positive int, a policy or a list of policies, got {keep!r}"
        raise ValueError(msg)
    if isinstance(keep, int):
        return KeepLast(keep)
    # A policy class matches the runtime Protocol too (keep=KeepLast, without the call).
    if isinstance(keep, RetentionPolicy) and not isinstance(keep, type):
        return keep
    if isinstance(keep, Iterable) and not isinstance(keep, str | bytes | type):
        items = list(keep)
        if items and all(isinstance(p, RetentionPolicy) and not isinstance(p, type) for p in items):
            return Union(tuple(items))
    msg = f"keep must be a positive int, a policy or a list of policies, got {keep!r}"
    raise ValueError(msg)


def plan_deletions(
    checkpoints: Sequence[CheckpointInfo],
    policy: RetentionPolicy,
    *,
    last_good: int | None = None,
) -> list[int]:
    """The steps to delete, ascending.

    Never includes the newest checkpoint, a pinned one, or ``last_good`` (the newest one
    known to verify), whatever the policy says.
    """
    ordered = sorted(checkpoints, key=lambda c: c.step)
    if not ordered:
        return []
    keep = set(policy.keep(ordered))
    keep.add(ordered[-1].step)
    keep.update(c.step for c in ordered if c.pinned)
    if last_good is not None:
        keep.add(last_good)
    return [c.step for c in ordered if c.step not in keep]

"""Retention policies and the pure plan of what to delete.

A policy says which checkpoints it wants kept; a union of policies keeps what any of them
keeps. :func:`plan_deletions` then adds the guarantees no policy can override: the newest
committed checkpoint, pinned ones and the newest one that verifies are never deleted. The
plan is a pure function of its inputs, so it is tested without a disk.

:class:`RetentionPlanner` computes the same plan incrementally, for the one writer of a store
that adds and removes steps one at a time: after each save it looks only at the steps whose
fate can have changed (the new one, the one a ``KeepLast`` window or a ``KeepBest`` top-k
pushed out, those kept only as the newest or the last good), so retention after a save costs
the same on a store of ten or ten thousand checkpoints. Policies it does not know are planned
in full, with :func:`plan_deletions`.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Protocol, runtime_checkable

from .errors import ConfigError

__all__ = [
    "CheckpointInfo",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "RetentionPlanner",
    "RetentionPolicy",
    "Union",
    "as_policy",
    "keep_best_policies",
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
        raise ConfigError(msg)
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

    Checkpoints with NaN never count as best. Ties go to the newer checkpoint.

    A save whose ``metrics`` lack ``metric`` (a typo: ``loss`` for ``val_loss``) is refused
    with a ``ValueError`` naming the metrics it got, before anything is written: without the
    metric, retention would keep only the newest steps and delete the best ones. With
    ``missing="keep"`` such a save is allowed, logged as a warning, and this policy keeps
    that step for good (it is never deleted for lacking the metric; ``mgr.delete`` removes
    it). Checkpoints already in the store without the metric never count as best.
    """

    k: int
    metric: str
    mode: str = "min"
    missing: str = "error"
    needs_metrics: bool = dataclasses.field(default=True, init=False, repr=False)

    def __post_init__(self) -> None:
        _positive_int("KeepBest(k)", self.k)
        if not isinstance(self.metric, str) or not self.metric:
            msg = f"KeepBest(metric) must be a non-empty str, got {self.metric!r}"
            raise ConfigError(msg)
        if self.mode not in ("min", "max"):
            msg = f"KeepBest(mode) must be 'min' or 'max', got {self.mode!r}"
            raise ConfigError(msg)
        if self.missing not in ("error", "keep"):
            msg = f"KeepBest(missing) must be 'error' or 'keep', got {self.missing!r}"
            raise ConfigError(msg)

    def score(self, metrics: Mapping[str, float]) -> float | None:
        """The value this policy ranks by (smaller is better), or ``None`` if it has none."""
        v = metrics.get(self.metric)
        if v is None or not isinstance(v, int | float) or math.isnan(v):
            return None
        return float(v) if self.mode == "min" else -float(v)

    def keeps_lacking(self, metrics: Mapping[str, float]) -> bool:
        """Whether a checkpoint is kept for lacking the metric (``missing="keep"``)."""
        return self.missing == "keep" and self.metric not in metrics

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        """The ``k`` best by the metric (and, with ``missing="keep"``, those without it)."""
        scored = []
        lacking = set()
        for c in checkpoints:
            if self.keeps_lacking(c.metrics):
                lacking.add(c.step)
            score = self.score(c.metrics)
            if score is not None:
                scored.append((score, -c.step))
        scored.sort()
        return {-neg_step for _, neg_step in scored[: self.k]} | lacking


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
        raise ConfigError(msg)
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
    raise ConfigError(msg)


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


def keep_best_policies(policy: RetentionPolicy) -> list[KeepBest]:
    """Every :class:`KeepBest` in ``policy`` (itself, or the members of a union)."""
    if isinstance(policy, KeepBest):
        return [policy]
    if isinstance(policy, Union):
        return [b for p in policy.policies for b in keep_best_policies(p)]
    return []


# ---- incremental planning ------------------------------------------------------------------


class _Tracker(Protocol):
    """What one policy keeps, kept up to date as steps come and go."""

    def add(self, step: int, metrics: Mapping[str, float]) -> Iterable[int]:
        """Record a new step (already in the shared step list).

        Returns the steps this policy may have stopped keeping because of it.
        """
        ...

    def remove(self, step: int) -> None:
        """Forget a deleted step (already gone from the shared step list)."""
        ...

    def load(self, items: Iterable[tuple[int, Mapping[str, float]]]) -> None:
        """Record the steps a planner starts with, at once (they are all looked at first)."""
        ...

    def keeps(self, step: int) -> bool:
        """Whether the policy keeps ``step`` now."""
        ...


class _LastTracker:
    # A step enters a KeepLast window only when a newer one leaves it, so removals never
    # make it drop a step; an addition pushes out at most the one now just outside.
    def __init__(self, n: int, steps: list[int]) -> None:
        self.n = n
        self.steps = steps

    def load(self, items: Iterable[tuple[int, Mapping[str, float]]]) -> None:
        pass

    def add(self, step: int, metrics: Mapping[str, float]) -> Iterable[int]:
        return [self.steps[-self.n - 1]] if len(self.steps) > self.n else []

    def remove(self, step: int) -> None:
        pass

    def keeps(self, step: int) -> bool:
        return bisect.bisect_left(self.steps, step) >= len(self.steps) - self.n


class _EveryTracker:
    def __init__(self, every: int) -> None:
        self.every = every

    def load(self, items: Iterable[tuple[int, Mapping[str, float]]]) -> None:
        pass

    def add(self, step: int, metrics: Mapping[str, float]) -> Iterable[int]:
        return ()

    def remove(self, step: int) -> None:
        pass

    def keeps(self, step: int) -> bool:
        return step % self.every == 0


class _AllTracker:
    def load(self, items: Iterable[tuple[int, Mapping[str, float]]]) -> None:
        pass

    def add(self, step: int, metrics: Mapping[str, float]) -> Iterable[int]:
        return ()

    def remove(self, step: int) -> None:
        pass

    def keeps(self, step: int) -> bool:
        return True


class _BestTracker:
    # The scored steps, worst first, best last: (-score, step), so that ties rank the newer
    # step better as KeepBest.keep does, and a new best (training improves) is inserted
    # near the end of the list, where inserting moves little.
    def __init__(self, policy: KeepBest) -> None:
        self.policy = policy
        self.ranked: list[tuple[float, int]] = []
        self.key: dict[int, tuple[float, int]] = {}
        self.lacking: set[int] = set()

    def _key(self, step: int, metrics: Mapping[str, float]) -> tuple[float, int] | None:
        if self.policy.keeps_lacking(metrics):
            self.lacking.add(step)
        score = self.policy.score(metrics)
        return None if score is None else (-score, step)

    def load(self, items: Iterable[tuple[int, Mapping[str, float]]]) -> None:
        for step, metrics in items:
            key = self._key(step, metrics)
            if key is not None:
                self.key[step] = key
        self.ranked = sorted(self.key.values())

    def add(self, step: int, metrics: Mapping[str, float]) -> Iterable[int]:
        key = self._key(step, metrics)
        if key is None:
            return ()
        i = bisect.bisect_left(self.ranked, key)
        self.ranked.insert(i, key)
        self.key[step] = key
        edge = len(self.ranked) - self.policy.k  # the best k are ranked[edge:]
        return [self.ranked[edge - 1][1]] if i >= edge > 0 else []

    def remove(self, step: int) -> None:
        self.lacking.discard(step)
        key = self.key.pop(step, None)
        if key is not None:
            del self.ranked[bisect.bisect_left(self.ranked, key)]

    def keeps(self, step: int) -> bool:
        if step in self.lacking:
            return True
        key = self.key.get(step)
        if key is None:
            return False
        return bisect.bisect_left(self.ranked, key) >= len(self.ranked) - self.policy.k


class _UnionTracker:
    def __init__(self, members: list[_Tracker]) -> None:
        self.members = members

    def load(self, items: Iterable[tuple[int, Mapping[str, float]]]) -> None:
        items = list(items)
        for m in self.members:
            m.load(items)

    def add(self, step: int, metrics: Mapping[str, float]) -> Iterable[int]:
        return [s for m in self.members for s in m.add(step, metrics)]

    def remove(self, step: int) -> None:
        for m in self.members:
            m.remove(step)

    def keeps(self, step: int) -> bool:
        return any(m.keeps(step) for m in self.members)


def _tracker(policy: RetentionPolicy, steps: list[int]) -> _Tracker | None:
    """An incremental tracker of a built-in policy.

    ``None`` for any other policy, subclasses of the built-in ones included (they may keep
    differently).
    """
    t = type(policy)
    if t is KeepLast and isinstance(policy, KeepLast):
        return _LastTracker(policy.n, steps)
    if t is KeepEvery and isinstance(policy, KeepEvery):
        return _EveryTracker(policy.steps)
    if t is KeepAll:
        return _AllTracker()
    if t is KeepBest and isinstance(policy, KeepBest):
        return _BestTracker(policy)
    if t is Union and isinstance(policy, Union):
        members = [_tracker(p, steps) for p in policy.policies]
        if any(m is None for m in members):
            return None
        return _UnionTracker([m for m in members if m is not None])
    return None


class RetentionPlanner:
    """What retention knows of a store's committed steps, and the plan, kept incrementally.

    For the one writer of a store: it tells the planner of each step it commits
    (:meth:`add`), deletes (:meth:`remove`), pins and unpins. :meth:`plan` returns exactly
    what :func:`plan_deletions` returns for :meth:`infos`; for the built-in policies it looks
    only at the steps whose fate can have changed since the last plan, so its cost does not
    grow with the number of steps (a step the policy keeps stays kept until an addition
    pushes it out, which the policy's tracker reports; removals only ever keep more).

    Args:
        policy: the retention policy.
        checkpoints: the committed steps as the writer found them (one listing).
    """

    def __init__(self, policy: RetentionPolicy, checkpoints: Iterable[CheckpointInfo]) -> None:
        self.policy = policy
        ordered = sorted(checkpoints, key=lambda c: c.step)
        self._steps: list[int] = []
        self._set: set[int] = set()
        self._metrics: dict[int, Mapping[str, float]] = {}
        self._pinned: set[int] = set()
        self._metric_counts: dict[str, int] = {}
        self._tracker = _tracker(policy, self._steps)
        for c in ordered:
            if c.step in self._set:
                continue
            self._steps.append(c.step)
            self._set.add(c.step)
            self._metrics[c.step] = dict(c.metrics)
            for name in c.metrics:
                self._metric_counts[name] = self._metric_counts.get(name, 0) + 1
            if c.pinned:
                self._pinned.add(c.step)
        if self._tracker is not None:
            self._tracker.load((s, self._metrics[s]) for s in self._steps)
        # Steps that may be deletable (every step at first); all others the policy keeps.
        self._pending: set[int] = set(self._steps)

    def __contains__(self, step: object) -> bool:
        return step in self._set

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[int]:
        return iter(self._steps)

    def __reversed__(self) -> Iterator[int]:
        return reversed(self._steps)

    @property
    def incremental(self) -> bool:
        """Whether :meth:`plan` is incremental (a built-in policy), not a full plan."""
        return self._tracker is not None

    @property
    def steps(self) -> list[int]:
        """The committed steps, ascending (a copy)."""
        return list(self._steps)

    def metric_count(self, name: str) -> int:
        """How many committed steps have the metric ``name``."""
        return self._metric_counts.get(name, 0)

    def metric_names(self) -> list[str]:
        """The metrics some committed step has, sorted."""
        return sorted(k for k, n in self._metric_counts.items() if n)

    def metrics(self, step: int) -> Mapping[str, float]:
        """The metrics of a committed step (empty when unknown)."""
        return self._metrics.get(step, {})

    def add(self, step: int, metrics: Mapping[str, float], *, pinned: bool = False) -> None:
        """A step was committed (or replaced: its new metrics count)."""
        if step in self._set:
            self.remove(step)
        if not self._steps or step > self._steps[-1]:
            self._steps.append(step)
        else:
            bisect.insort(self._steps, step)
        self._set.add(step)
        self._metrics[step] = dict(metrics)
        for name in metrics:
            self._metric_counts[name] = self._metric_counts.get(name, 0) + 1
        if pinned:
            self._pinned.add(step)
        self._pending.add(step)
        if self._tracker is not None:
            self._pending.update(self._tracker.add(step, metrics))

    def remove(self, step: int) -> None:
        """A step was deleted (a step not known is ignored)."""
        if step not in self._set:
            return
        del self._steps[bisect.bisect_left(self._steps, step)]
        self._set.discard(step)
        for name in self._metrics.pop(step, {}):
            self._metric_counts[name] -= 1
        self._pinned.discard(step)
        self._pending.discard(step)
        if self._tracker is not None:
            self._tracker.remove(step)

    def set_pinned(self, step: int, pinned: bool) -> None:
        """A step was pinned or unpinned (an unpinned step may become deletable)."""
        if step not in self._set:
            return
        if pinned:
            self._pinned.add(step)
        else:
            self._pinned.discard(step)
            self._pending.add(step)

    def pinned_steps(self) -> list[int]:
        """The steps known to be pinned, ascending."""
        return sorted(self._pinned)

    def infos(self) -> list[CheckpointInfo]:
        """Every committed step as :func:`plan_deletions` takes it."""
        return [CheckpointInfo(s, self._metrics[s], s in self._pinned) for s in self._steps]

    def plan(self, *, last_good: int | None = None) -> list[int]:
        """The steps to delete, ascending: ``plan_deletions(self.infos(), ...)``."""
        if self._tracker is None:
            return plan_deletions(self.infos(), self.policy, last_good=last_good)
        if not self._steps:
            return []
        newest = self._steps[-1]
        doomed = []
        still = set()
        for s in sorted(self._pending):
            if self._tracker.keeps(s):
                continue  # kept by the policy until an addition pushes it out
            still.add(s)  # kept only by a guarantee, or doomed: look again next time
            if s not in (newest, last_good) and s not in self._pinned:
                doomed.append(s)
        self._pending = still
        return doomed

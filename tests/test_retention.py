"""ckptstore.retention: policies and the pure deletion plan, tested without a disk."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import pytest

from ckptstore import KeepBest, KeepEvery, KeepLast, RetentionPolicy
from ckptstore.retention import (
    CheckpointInfo,
    KeepAll,
    RetentionPlanner,
    Union,
    as_policy,
    keep_best_policies,
    plan_deletions,
)


def infos(*steps: int, metrics: dict[int, dict[str, float]] | None = None) -> list[CheckpointInfo]:
    metrics = metrics or {}
    return [CheckpointInfo(s, metrics.get(s, {})) for s in steps]


def loss(values: dict[int, float]) -> list[CheckpointInfo]:
    return [CheckpointInfo(s, {"loss": v}) for s, v in sorted(values.items())]


# ---- single policies --------------------------------------------------------------------


def test_keep_last() -> None:
    cps = infos(1, 2, 3, 4, 5)
    assert KeepLast(2).keep(cps) == {4, 5}
    assert KeepLast(1).keep(cps) == {5}
    assert KeepLast(10).keep(cps) == {1, 2, 3, 4, 5}
    assert KeepLast(3).keep([]) == set()
    assert plan_deletions(cps, KeepLast(2)) == [1, 2, 3]


def test_keep_last_orders_by_number() -> None:
    cps = infos(100, 9, 10)  # unsorted input: the plan sorts numerically
    assert plan_deletions(cps, KeepLast(1)) == [9, 10]


def test_keep_best_min_and_max() -> None:
    cps = loss({10: 0.5, 20: 0.1, 30: 0.3, 40: 0.9, 50: 0.2})
    assert KeepBest(2, "loss").keep(cps) == {20, 50}
    assert KeepBest(2, "loss", mode="max").keep(cps) == {40, 10}
    assert KeepBest(1, "loss").keep(cps) == {20}
    assert KeepBest(10, "loss").keep(cps) == {10, 20, 30, 40, 50}
    # the newest (50) is always kept on top of the policy's choice
    assert plan_deletions(cps, KeepBest(1, "loss")) == [10, 30, 40]
    assert plan_deletions(cps, KeepBest(1, "loss", mode="max")) == [10, 20, 30]


def test_keep_best_skips_missing_and_nan_metrics() -> None:
    cps = [
        CheckpointInfo(1, {"loss": 0.9}),
        CheckpointInfo(2, {}),  # no metric
        CheckpointInfo(3, {"loss": math.nan}),
        CheckpointInfo(4, {"acc": 0.0}),  # another metric
        CheckpointInfo(5, {"loss": 0.7}),
        CheckpointInfo(6, {"loss": -math.inf}),
        CheckpointInfo(7, {"loss": math.inf}),
    ]
    assert KeepBest(2, "loss").keep(cps) == {6, 5}
    assert KeepBest(2, "loss", mode="max").keep(cps) == {7, 1}
    assert KeepBest(10, "loss").keep(cps) == {1, 5, 6, 7}  # never 2, 3 or 4
    assert KeepBest(3, "missing").keep(cps) == set()
    assert plan_deletions(cps, KeepBest(1, "loss")) == [1, 2, 3, 4, 5]


def test_keep_best_ties_go_to_the_newer() -> None:
    cps = loss({1: 0.5, 2: 0.5, 3: 0.5, 4: 0.8})
    assert KeepBest(1, "loss").keep(cps) == {3}
    assert KeepBest(2, "loss").keep(cps) == {3, 2}
    assert KeepBest(1, "loss", mode="max").keep(cps) == {4}
    assert KeepBest(2, "loss", mode="max").keep(cps) == {4, 3}


def test_keep_best_missing_keep_keeps_steps_without_the_metric() -> None:
    cps = [
        CheckpointInfo(1, {}),
        CheckpointInfo(2, {"loss": 0.5}),
        CheckpointInfo(3, {"acc": 1.0}),
        CheckpointInfo(4, {"loss": float("nan")}),  # has it: NaN never counts as best
        CheckpointInfo(5, {"loss": 0.7}),
    ]
    assert KeepBest(1, "loss").keep(cps) == {2}
    assert KeepBest(1, "loss", missing="keep").keep(cps) == {1, 2, 3}
    assert plan_deletions(cps, KeepBest(1, "loss", missing="keep")) == [4]
    assert "missing='keep'" in repr(KeepBest(1, "loss", missing="keep"))


def test_keep_best_policies_are_found_in_unions() -> None:
    a, b = KeepBest(1, "loss"), KeepBest(2, "acc", mode="max")
    assert keep_best_policies(a) == [a]
    assert keep_best_policies(KeepLast(3)) == []
    assert keep_best_policies(as_policy([KeepLast(1), a, KeepEvery(5), b])) == [a, b]


def test_keep_every() -> None:
    cps = infos(0, 500, 1000, 1500, 2000, 2001)
    assert KeepEvery(1000).keep(cps) == {0, 1000, 2000}
    assert KeepEvery(1).keep(cps) == {0, 500, 1000, 1500, 2000, 2001}
    assert plan_deletions(cps, KeepEvery(1000)) == [500, 1500]


def test_keep_all() -> None:
    cps = infos(1, 2, 3)
    assert KeepAll().keep(cps) == {1, 2, 3}
    assert plan_deletions(cps, KeepAll()) == []


def test_union_keeps_what_any_member_keeps() -> None:
    cps = [CheckpointInfo(s, {"loss": 1.0 / s}) for s in range(100, 1100, 100)]
    policy = as_policy([KeepLast(2), KeepEvery(500), KeepBest(1, "loss", mode="max")])
    assert isinstance(policy, Union)
    assert policy.keep(cps) == {900, 1000, 500, 100}
    assert plan_deletions(cps, policy) == [200, 300, 400, 600, 700, 800]


def test_needs_metrics() -> None:
    assert not KeepLast(1).needs_metrics
    assert not KeepEvery(1).needs_metrics
    assert not KeepAll().needs_metrics
    assert KeepBest(1, "loss").needs_metrics
    assert not Union((KeepLast(1), KeepEvery(2))).needs_metrics
    assert Union((KeepLast(1), KeepBest(1, "x"))).needs_metrics


def test_policies_satisfy_the_protocol() -> None:
    for p in (KeepLast(1), KeepBest(1, "x"), KeepEvery(1), KeepAll(), Union(())):
        assert isinstance(p, RetentionPolicy)


# ---- guarantees no policy overrides ----------------------------------------------------------


class DeleteEverything:
    """A hostile policy: keeps nothing."""

    needs_metrics = False

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        return set()


def test_never_deletes_the_newest() -> None:
    assert plan_deletions(infos(1, 2, 3), DeleteEverything()) == [1, 2]
    assert plan_deletions(infos(7), DeleteEverything()) == []
    assert plan_deletions([], DeleteEverything()) == []


def test_never_deletes_pinned() -> None:
    cps = [CheckpointInfo(1, pinned=True), CheckpointInfo(2), CheckpointInfo(3, pinned=True)]
    cps.append(CheckpointInfo(4))
    assert plan_deletions(cps, DeleteEverything()) == [2]
    assert plan_deletions(cps, KeepLast(1)) == [2]


def test_never_deletes_last_good() -> None:
    cps = infos(1, 2, 3, 4)
    # 4 and 3 fail to verify: 2 is the newest good one and must survive.
    assert plan_deletions(cps, KeepLast(1), last_good=2) == [1, 3]
    assert plan_deletions(cps, DeleteEverything(), last_good=4) == [1, 2, 3]
    assert plan_deletions(cps, DeleteEverything(), last_good=None) == [1, 2, 3]


def test_plan_is_sorted_and_pure() -> None:
    cps = infos(30, 10, 20, 40)
    before = list(cps)
    assert plan_deletions(cps, KeepLast(1)) == [10, 20, 30]
    assert cps == before  # input untouched


# ---- argument validation --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: KeepLast(0), "KeepLast(n) must be a positive int, got 0"),
        (lambda: KeepLast(-1), "KeepLast(n) must be a positive int, got -1"),
        (lambda: KeepLast(True), "KeepLast(n) must be a positive int, got True"),
        (lambda: KeepLast(2.0), "KeepLast(n) must be a positive int, got 2.0"),
        (lambda: KeepBest(0, "loss"), "KeepBest(k) must be a positive int, got 0"),
        (lambda: KeepBest(1, ""), "KeepBest(metric) must be a non-empty str, got ''"),
        (lambda: KeepBest(1, None), "KeepBest(metric) must be a non-empty str, got None"),
        (lambda: KeepBest(1, "loss", mode="x"), "KeepBest(mode) must be 'min' or 'max', got 'x'"),
        (lambda: KeepBest(1, "loss", mode="MIN"), "KeepBest(mode) must be 'min' or 'max'"),
        (
            lambda: KeepBest(1, "loss", missing="skip"),
            "KeepBest(missing) must be 'error' or 'keep', got 'skip'",
        ),
        (lambda: KeepEvery(0), "KeepEvery(steps) must be a positive int, got 0"),
        (lambda: KeepEvery("10"), "KeepEvery(steps) must be a positive int, got '10'"),
    ],
)
def test_policy_arguments_are_checked(make: Any, message: str) -> None:
    with pytest.raises(ValueError) as ei:
        make()
    assert str(ei.value).startswith(message)


def test_as_policy() -> None:
    assert as_policy(None) == KeepAll()
    assert as_policy(3) == KeepLast(3)
    best = KeepBest(2, "loss")
    assert as_policy(best) is best
    union = as_policy((KeepLast(1), best))
    assert union == Union((KeepLast(1), best))
    assert as_policy(p for p in [KeepEvery(5)]) == Union((KeepEvery(5),))


@pytest.mark.parametrize(
    ("keep", "error"),
    [
        (True, "keep must be a positive int, a policy or a list of policies, got True"),
        (False, "got False"),
        (0, "KeepLast(n) must be a positive int, got 0"),
        (-2, "KeepLast(n) must be a positive int, got -2"),
        (2.5, "keep must be a positive int, a policy or a list of policies, got 2.5"),
        ("3", "got '3'"),
        ([], "got []"),
        ([KeepLast(1), 3], "got [KeepLast(n=1), 3]"),
        (KeepLast, "got <class 'ckptstore.retention.KeepLast'>"),
        ([KeepLast], "got [<class 'ckptstore.retention.KeepLast'>]"),
    ],
)
def test_as_policy_refuses(keep: Any, error: str) -> None:
    with pytest.raises(ValueError) as ei:
        as_policy(keep)
    assert error in str(ei.value)
    assert str(ei.value).startswith(("keep must be", "KeepLast(n)"))


# ---- the incremental planner ------------------------------------------------------------------

POLICIES = [
    KeepAll(),
    KeepLast(1),
    KeepLast(3),
    KeepEvery(4),
    KeepBest(2, "loss"),
    KeepBest(1, "loss", mode="max"),
    KeepBest(2, "loss", missing="keep"),
    as_policy([KeepLast(2), KeepBest(2, "loss")]),
    as_policy([KeepLast(1), KeepEvery(5), KeepBest(1, "acc", mode="max", missing="keep")]),
    as_policy([KeepEvery(3), KeepBest(3, "loss"), KeepBest(1, "acc")]),
]


def _random_metrics(rng: random.Random) -> dict[str, float]:
    out = {}
    if rng.random() < 0.8:
        out["loss"] = rng.choice([0.1, 0.2, 0.3, float("nan"), rng.random()])  # ties too
    if rng.random() < 0.5:
        out["acc"] = rng.choice([0.5, rng.random()])
    return out


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_planner_plans_exactly_what_plan_deletions_plans(policy: Any) -> None:
    # A writer's life in random order: saves (mostly newer steps, sometimes older ones or
    # a replacement), retention applied or only planned, deletions by hand, pins, a newest
    # step that fails to verify. After each event the planner must agree with the pure plan.
    for seed in range(12):
        rng = random.Random(seed)
        start = [CheckpointInfo(s, _random_metrics(rng)) for s in rng.sample(range(40), 6)]
        planner = RetentionPlanner(policy, start)
        ref = {c.step: c for c in start}
        for _ in range(120):
            event = rng.random()
            if event < 0.55 or not ref:
                step = max(ref, default=0) + rng.randint(1, 3)
                if rng.random() < 0.15:
                    step = rng.randint(0, step)  # older, or a replacement of a known one
                metrics = _random_metrics(rng)
                planner.add(step, metrics)
                ref[step] = CheckpointInfo(step, metrics)  # a replacement has no pin marker
            elif event < 0.65:
                victim = rng.choice(sorted(ref))
                planner.remove(victim)
                del ref[victim]
            elif event < 0.75:
                s = rng.choice(sorted(ref))
                pinned = rng.random() < 0.5
                planner.set_pinned(s, pinned)
                ref[s] = CheckpointInfo(s, ref[s].metrics, pinned)
            steps = sorted(ref)
            last_good = rng.choice([steps[-1], steps[0], None]) if steps else None
            want = plan_deletions(list(ref.values()), policy, last_good=last_good)
            got = planner.plan(last_good=last_good)
            assert got == want, (seed, steps)
            assert planner.steps == steps
            if rng.random() < 0.7:  # retention deleted what it planned
                for s in got:
                    planner.remove(s)
                    del ref[s]


def test_planner_looks_only_at_steps_whose_fate_can_change() -> None:
    # 10,000 steps kept by KeepEvery(1): after a new step, the plan examines a handful.
    policy = as_policy([KeepLast(3), KeepEvery(1), KeepBest(3, "loss")])
    planner = RetentionPlanner(
        policy, [CheckpointInfo(s, {"loss": (s * 7919) % 1000 / 1000}) for s in range(10_000)]
    )
    assert planner.incremental
    assert planner.plan(last_good=9_999) == []  # the first plan looks at every step
    planner.add(10_000, {"loss": 0.5})
    assert len(planner._pending) <= 3
    assert planner.plan(last_good=10_000) == []
    assert planner.metric_count("loss") == 10_001
    assert planner.metric_names() == ["loss"]


def test_planner_plans_custom_policies_in_full() -> None:
    planner = RetentionPlanner(DeleteEverything(), infos(1, 2, 3))
    assert not planner.incremental
    planner.set_pinned(2, True)
    assert planner.plan(last_good=3) == [1]
    planner.add(4, {})
    assert planner.plan(last_good=4) == [1, 3]

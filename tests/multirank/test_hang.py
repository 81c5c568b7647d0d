"""A rank that hangs instead of dying: alive, its sockets open, so only the timeout tells."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multirank.launch import describe, launch, timeouts_naming
from tests.timing import healthy

TIMEOUT = 3.0
SLACK = healthy(2.5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("world", "in_barrier"),
    [(2, 0), (3, 0), (2, 1), (3, 2)],
    ids=["2", "3", "2-barrier", "3-barrier"],
)
def test_frozen_rank_is_named_by_every_survivor(
    tmp_path: Path, world: int, in_barrier: int
) -> None:
    # in_barrier: frozen inside a barrier after arriving; the arrival keys cannot tell it from
    # a survivor, its silence does (the plain crash campaign's rank 0 named nobody and waited
    # 9 s for the frozen rank's acknowledgement before).
    args = {"timeout": TIMEOUT, "in_barrier": in_barrier}
    res = launch("rank_freezes_mid_exchange", world, tmp_path, timeout=60, args=args)
    frozen = world - 1
    assert res[frozen].returncode == -9, describe(res)  # killed by its undertaker
    for v in timeouts_naming(res, frozen):
        assert f"rank(s) {frozen} did not arrive" in v["message"]
        assert v["seconds"] < TIMEOUT + SLACK, describe(res)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["exchange", "barrier", "gather"])
def test_a_rank_dying_in_a_reduce_is_named_by_every_survivor(tmp_path: Path, where: str) -> None:
    # Rank 0 fails at once and used to give the others only half a timeout to report their
    # own failure: it counted rank 1 (still waiting on rank 0's verdict) as gone too, and
    # with no survivor left to wait for, exited; rank 1 then found no verdict and blamed
    # rank 0 ("rank(s) 0 did not arrive"), which the sharded crash campaign caught.
    args = {"timeout": TIMEOUT, "where": where}
    res = launch("rank_dies_mid_reduce", 3, tmp_path, timeout=60, args=args)
    assert res[2].returncode == -9, describe(res)
    phase = {"gather": "save:"}.get(where, "save:ready' of step 7")
    for v in timeouts_naming(res, 2):
        assert f"rank(s) 2 did not arrive at '{phase}" in v["message"]
        assert v["seconds"] < 2 * TIMEOUT + SLACK, describe(res)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "late_rank", [1, 0, 2], ids=["survivor-late", "rank0-late", "frozen-rank-late"]
)
def test_a_frozen_rank_is_named_when_the_survivors_arrive_apart(
    tmp_path: Path, late_rank: int
) -> None:
    # Rank 2 freezes inside the save's second barrier; one survivor arrives there 2.5 s after
    # the other. Each times out a timeout after its own arrival, so they fail 2.5 s apart:
    # rank 0 waited for the survivors' reports only half a verdict wait (1.5 s) past its own
    # timeout and named the late rank 1 too (the sharded campaign's "rank 1 blamed [0]"); an
    # early rank 1 gave up on rank 0's verdict before rank 0 had even failed, and blamed it.
    # frozen-rank-late: rank 2 arrives 2.5 s after the others, then freezes. Rank 0 waits
    # for its report until its own arrival plus a timeout; rank 1 must wait that long for
    # the verdict (rank 0 marks itself deciding) instead of blaming rank 0.
    late = 2.5
    args = {"timeout": TIMEOUT, "in_barrier": 2, "late_rank": late_rank, "late": late}
    res = launch("rank_freezes_mid_exchange", 3, tmp_path, timeout=60, args=args)
    assert res[2].returncode == -9, describe(res)  # killed by its undertaker
    for v in timeouts_naming(res, 2):
        assert "rank(s) 2 did not arrive" in v["message"], describe(res)
        assert v["seconds"] < TIMEOUT + late + SLACK, describe(res)

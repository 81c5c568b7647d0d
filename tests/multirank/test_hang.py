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


@pytest.mark.timeout(120)
def test_the_leaders_tree_carries_the_payload_to_its_members_only(tmp_path: Path) -> None:
    # save:prepared on node-local roots: the rank table (O(N)) goes down the tree of node
    # leaders, the outcome (O(1)) to every rank. Rank 2 forwards to rank 3; a rank outside
    # the tree receives only the small object; a member that dies before forwarding is
    # named by every survivor, including the child waiting on it.
    res = launch("tree_exchange", 4, tmp_path, timeout=60, args={"timeout": TIMEOUT})
    assert res[2].returncode == -9, describe(res)
    for r in res:
        if r.rank == 2:
            continue
        assert r.ok, describe(res)
        v = r.value
        assert v["scatter"] == ["slot", r.rank, "x" * r.rank]
        assert v["all"]["small"] == {"small": "all"}
        assert v["all"]["big"] is True  # rank 3 got it from rank 2, byte for byte
        assert v["all"]["links"] == {0: [None, [2, 1]], 1: [0, []], 3: [2, []]}[r.rank]
        assert v["some"]["small"] == {"small": "some"}
        _, op, sent, received, _, _ = v["some"]["record"]
        assert op == "broadcast_tree"
        if r.rank == 1:  # ranks 0, 2 and 3 only: rank 1 is outside
            assert v["some"]["big"] is None
            assert v["some"]["links"] is None
            assert received < 1_000, v["some"]
        else:
            assert v["some"]["big"] is True
        if r.rank == 3:
            assert received > 300_000, v["some"]
        if r.rank == 0:  # one copy per child: ranks 2 and 3
            assert 600_000 < sent < 601_000, v["some"]
        dead = v["dead"]
        assert dead["error_type"] == "BarrierTimeout", describe(res)
        assert dead["missing_ranks"] == [2], describe(res)
        assert dead["seconds"] < 2 * TIMEOUT + SLACK, describe(res)

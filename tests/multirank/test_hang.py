"""A rank that hangs instead of dying: alive, its sockets open, so only the timeout tells."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multirank.launch import describe, launch, timeouts_naming
from tests.timing import healthy

TIMEOUT = 3.0
SLACK = healthy(2.5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_frozen_rank_is_named_by_every_survivor(tmp_path: Path, world: int) -> None:
    res = launch(
        "rank_freezes_mid_exchange", world, tmp_path, timeout=60, args={"timeout": TIMEOUT}
    )
    frozen = world - 1
    assert res[frozen].returncode == -9, describe(res)  # killed by its undertaker
    for v in timeouts_naming(res, frozen):
        assert f"rank(s) {frozen} did not arrive" in v["message"]
        assert v["seconds"] < TIMEOUT + SLACK, describe(res)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["exchange", "barrier"])
def test_a_rank_dying_in_a_reduce_is_named_by_every_survivor(tmp_path: Path, where: str) -> None:
    # Rank 0 fails at once and used to give the others only half a timeout to report their
    # own failure: it counted rank 1 (still waiting on rank 0's verdict) as gone too, and
    # with no survivor left to wait for, exited; rank 1 then found no verdict and blamed
    # rank 0 ("rank(s) 0 did not arrive"), which the sharded crash campaign caught.
    args = {"timeout": TIMEOUT, "where": where}
    res = launch("rank_dies_mid_reduce", 3, tmp_path, timeout=60, args=args)
    assert res[2].returncode == -9, describe(res)
    for v in timeouts_naming(res, 2):
        assert "rank(s) 2 did not arrive at 'save:ready' of step 7" in v["message"]
        assert v["seconds"] < 2 * TIMEOUT + SLACK, describe(res)

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

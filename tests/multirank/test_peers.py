"""Which ranks share a store: found at the manager's start with exchanges that do not grow.

Real gloo ranks (2 to 4), each given a root: one shared directory, or one directory per
"node". What a non-zero rank sends and receives to find its peers is the same on 2 and on 4
ranks (the exchange it replaced gathered every rank's probe name and view on every rank).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptstore.dist import SLOT
from ckptstore.errors import ConfigError
from ckptstore.tiers.nodes import _agreeing
from tests.multirank.launch import launch, values


def _probe(tmp_path: Path, roots: list[str]) -> list[dict[str, object]]:
    return values(
        launch(
            "node_scenarios:peers_probe", len(roots), tmp_path, timeout=120, args={"roots": roots}
        )
    )


@pytest.mark.timeout(300)
def test_one_shared_root_costs_every_rank_the_same_whatever_the_world_size(
    tmp_path: Path,
) -> None:
    two = _probe(tmp_path / "two", ["shared"] * 2)
    four = _probe(tmp_path / "four", ["shared"] * 4)
    # A non-zero rank: the same bytes on 4 ranks as on 2 (the old all-gathers grew with N).
    assert [v["sent"] for v in four[1:]] == [two[1]["sent"]] * 3
    assert [v["received"] for v in four[1:]] == [two[1]["received"]] * 3
    for got, n in ((two, 2), (four, 4)):
        for v in got:
            assert v["peers"] == list(range(n))
            assert v["split"] is False
            assert v["left"] == []  # the probes are gone
            assert v["phases"] == ["init:probe", "init:shared"]


@pytest.mark.timeout(300)
def test_node_local_roots_find_their_node(tmp_path: Path) -> None:
    got = _probe(tmp_path, ["node0", "node0", "node1", "node1"])
    assert [v["peers"] for v in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(v["split"] is True for v in got)
    assert all(v["left"] == [] for v in got)
    assert got[1]["phases"] == ["init:peers", "init:probe", "init:probes", "init:shared"]
    # A non-zero rank sends its node's view in one slot of each of its two reduces, not
    # every rank's probe name.
    assert got[3]["sent"] == 2 * SLOT


def test_views_that_disagree_are_refused() -> None:
    assert _agreeing([[0, 1], [0, 1], [2], [3]]) is None
    with pytest.raises(
        ConfigError,
        match=r"rank 0 sees the store of rank\(s\) \[0, 1\] at its root, "
        r"rank 1 sees \[1\]",
    ):
        _agreeing([[0, 1], [1]])
    with pytest.raises(ConfigError, match="rank 1 does not see its own probe"):
        _agreeing([[0], [0]])

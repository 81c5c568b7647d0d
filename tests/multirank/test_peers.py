"""Which ranks share a store: found at the manager's start with exchanges that do not grow.

Real gloo ranks (2 to 4), each given a root: one shared directory, or one directory per
"node". What a non-zero rank sends and receives to find its peers is the same on 2 and on 4
ranks (the exchange it replaced gathered every rank's probe name and view on every rank).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ckptstore.dist import SLOT
from ckptstore.errors import ConfigError
from ckptstore.tiers.nodes import _agreeing, leader_links
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
    assert got[1]["phases"] == [
        "init:peers",
        "init:probe",
        "init:probes",
        "init:shared",
        "init:tree",
    ]
    # A non-zero rank sends its node's view in one slot of each of its two reduces, not
    # every rank's probe name.
    assert got[3]["sent"] == 2 * SLOT
    # Each node's leader learns its place in the leaders' tree (one slot a rank): rank 0
    # sends the rank table to rank 2 at a save, and nobody else.
    assert [v["links"] for v in got] == [[None, [2]], None, [0, []], None]


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


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 33, 2048])
def test_the_leaders_tree_reaches_every_leader_in_log_rounds(m: int) -> None:
    leaders = [0, *sorted(random.Random(m).sample(range(1, 50 * m), m - 1))]
    links = leader_links(leaders)
    assert set(links) == set(leaders)
    assert links[0][0] is None
    depth = {0: 0}
    for rank in leaders:  # ascending: a parent comes before its children
        parent, kids = links[rank]
        if rank:
            assert parent is not None
            assert rank in links[parent][1]
            depth[rank] = depth[parent] + 1
        for k in kids:
            assert links[k][0] == rank
    rounds = max(m - 1, 0).bit_length()  # ceil(log2 m)
    assert [depth[r] for r in leaders] == [bin(i).count("1") for i in range(m)]
    assert max(depth.values()) <= rounds
    assert len(links[0][1]) == rounds
    assert sum(len(k) for _, k in links.values()) == m - 1  # a tree: each leader sent once

"""Retention on node-local roots (issue 24 #1, #3): 2 gloo ranks, a local root per "node".

Each node's copy of a step holds its own rank's shard. A step counts as good for retention
only if it verifies on every node, and a damaged ``local-ranks`` marker never switches the
checks of a node's files off: in both cases retention used to delete the only step that
still restores on every node.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multirank.launch import launch, values

ROOTS = ["node0", "node1"]
SHARDS = ["_shards.rank00000.safetensors", "_shards.rank00001.safetensors"]


def _damaged(tmp_path: Path, damage: list[str], **more: object) -> list[dict]:
    args = {"roots": ROOTS, "damage": damage, **more}
    return values(launch("node_scenarios:nodes_damaged", 2, tmp_path, timeout=150, args=args))


@pytest.mark.timeout(200)
def test_a_damaged_marker_fails_verify_and_keeps_the_older_step(tmp_path: Path) -> None:
    """Issue 24 #3: step 2's marker torn on both nodes, node 1's shard of it corrupt.

    Before: the torn marker read as "no rank's files here", so verify skipped every shard
    and passed step 2 on both nodes, both deleted step 1, and the restore found nothing.
    """
    got = _damaged(tmp_path, ["marker", "marker shard"])
    for rank, v in enumerate(got):
        rep = v["verify2"]
        assert not rep["ok"]
        marker = [p for p in rep["problems"] if "local-ranks" in p]
        assert marker, rep["problems"]
        assert "node-local marker is corrupt (not valid JSON" in marker[0]
        # Every file is checked: the other node's shard is reported missing, and node 1's
        # own corrupt shard as corrupt.
        assert any(SHARDS[1 - rank] in p and "missing" in p for p in rep["problems"])
        assert any(SHARDS[1] in p and "crc32c" in p for p in rep["problems"]) == (rank == 1)
        assert v["pruned"] == {"ok": True, "value": [], "seconds": v["pruned"]["seconds"]}
        assert v["steps"] == [1, 2]
        assert v["restored"]["ok"], v["restored"]
        assert v["restored"]["value"] == [1, 1, got[0]["digests1"]]
    for node in ROOTS:
        assert (tmp_path / node / "step-000000000001").is_dir()


@pytest.mark.timeout(200)
def test_a_step_bad_on_one_node_is_not_good_for_retention(tmp_path: Path) -> None:
    """Issue 24 #1: step 2's shard rots on node 1 only; new managers with ``keep=1`` prune.

    Before: node 0 judged step 2 good from its own part and deleted step 1, node 1 kept it;
    step 2 then failed on node 1, step 1 was gone from node 0: ``NoCheckpointError``. Now
    the nodes agree that step 2 is not good everywhere, both keep step 1, and the restore
    lands on it. A second prune keeps both (the nodes now agree on step 1); a save of step
    3 makes no exchange for retention (the step every node committed is good everywhere)
    and deletes steps 1 and 2 on both nodes.
    """
    got = _damaged(tmp_path, ["", "shard"], more=True)
    assert got[0]["verify2"]["ok"]  # node 0's part of step 2 is fine
    assert not got[1]["verify2"]["ok"]
    assert any(SHARDS[1] in p and "crc32c" in p for p in got[1]["verify2"]["problems"])
    for v in got:
        assert v["pruned"]["ok"], v["pruned"]
        assert v["pruned"]["value"] == []
        assert v["steps"] == [1, 2]
        assert v["restored"]["ok"], v["restored"]
        assert v["restored"]["value"] == [1, 1, got[0]["digests1"]]
        assert v["pruned_again"]["value"] == []
        assert v["steps_again"] == [1, 2]
        assert not any(p.startswith("prune:") for p in v["phases3"]), v["phases3"]
        assert v["steps3"] == [3]
        assert v["restored3"]["value"] == [3, 3, got[0]["digests3"]]
    for rank, node in enumerate(ROOTS):
        assert sorted(p.name for p in (tmp_path / node).glob("step-*")) == ["step-000000000003"]
        assert (tmp_path / node / "step-000000000003" / SHARDS[rank]).is_file()


@pytest.mark.timeout(120)
def test_a_rank_missing_from_a_node_local_prune_is_named(tmp_path: Path) -> None:
    """prune() on node-local roots is collective: a rank that does not call it is named in
    a ``BarrierTimeout`` within ``barrier_timeout`` (5 s), and nothing is deleted."""
    got = _damaged(tmp_path, ["", "shard"], absent=1)
    pruned = got[0]["pruned"]
    assert not pruned["ok"]
    assert pruned["error_type"] == "BarrierTimeout"
    assert (pruned["phase"], pruned["missing_ranks"]) == ("prune:agree", [1])
    assert pruned["seconds"] < 30
    assert [v["steps"] for v in got] == [[1, 2], [1, 2]]


@pytest.mark.timeout(200)
def test_a_node_local_prune_met_by_a_save_is_refused_on_every_rank(tmp_path: Path) -> None:
    got = _damaged(tmp_path, ["", ""], absent=1, saves=True)
    for v in got:
        assert v["pruned"]["error_type"] == "UsageError", v["pruned"]
        assert "rank 0: prune(); rank 1: save(step=3," in v["pruned"]["message"]
    assert [v["steps"] for v in got] == [[1, 2], [1, 2]]

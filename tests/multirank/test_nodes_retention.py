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


def _damaged(tmp_path: Path, damage: list[str]) -> list[dict]:
    args = {"roots": ROOTS, "damage": damage}
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

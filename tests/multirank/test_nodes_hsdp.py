"""HSDP on node-local roots: a box whose replicas sit on two nodes is refused at save time.

One rank writes each box of a replicated DTensor, into its own node's store; with the
replicate dim across nodes, the other node's copy of the step lacks the box, yet verified
on every node, and retention then deleted the last step that restored (found by review:
every rank's restore of such a step failed with ``NoCheckpointError``). Real gloo ranks,
real FSDP2 ``fully_shard`` on a 2 x 2 mesh, a directory per "node".
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multirank.launch import launch, values


@pytest.mark.timeout(300)
def test_hsdp_replicas_across_nodes_are_refused_and_within_a_node_restore(
    tmp_path: Path,
) -> None:
    args = {"roots": ["n0", "n0", "n1", "n1"], "shared_roots": ["m0", "m1", "m0", "m1"]}
    got = values(launch("node_scenarios:nodes_hsdp", 4, tmp_path, timeout=240, args=args))
    for rank, v in enumerate(got):
        refused = v["refused"]
        assert refused["ok"] is False, (rank, refused)
        assert refused["error_type"] == "UnsafeCheckpointError"
        assert "do not share this rank's node-local root" in refused["message"]
        assert "add a replica" in refused["message"]
        # Nothing was written: no step 1, no half-made directory, on either node; step 0,
        # saved before (by rank 0, on its node: replicated state), still restores on every
        # rank.
        steps = ["step-000000000000"] if rank < 2 else []
        assert [n for n in v["left"] if n.startswith(("step-", ".tmp-"))] == steps, v["left"]
        assert (v["previous"]["ok"], v["previous"].get("value")) == (True, 0), (rank, v)
        assert v["previous_values"] == [0, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]
    # Replicas within a node: each node writes and restores its own boxes.
    for rank, v in enumerate(got):
        assert v["restored"][0] == 1
        assert v["restored"][2] == got[0]["digests"], rank
        assert any(n.startswith("_shards.rank") for n in v["files"])

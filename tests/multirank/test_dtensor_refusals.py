"""Refused DTensor state: the refusal reaches every rank as UnsafeCheckpointError.

A sharded save aborts on every rank when one rank fails; a failure to *write* is a
CommitError, but a state that cannot be saved at all (compression with DTensors, a Partial
placement, an optimizer without its model, ranks that hold other DTensors than rank 0) must
keep its type, as in a replicated save.
"""

from __future__ import annotations

import pytest

from tests.multirank.launch import describe, launch

pytestmark = pytest.mark.timeout(120)


def test_refused_dtensor_state_raises_unsafe_on_every_rank(tmp_path):
    res = launch("dtensor_scenarios:fsdp_refused", 2, tmp_path)
    assert all(r.ok for r in res), describe(res)
    for r in res:
        v = r.value
        for case, words in (
            ("zstd", "compression='zstd' cannot be used with DTensor state"),
            ("partial", "Partial placement"),
            ("orphan", "add the model to the state"),
        ):
            got = v[case]
            assert not got["ok"], (case, got)
            assert got["error_type"] == "UnsafeCheckpointError", (case, got)
            assert words in got["message"], (case, got)
            assert "nothing of it is visible" in got["message"], (case, got)
        assert v["steps"] == []
        assert v["after"] == [2]
        # Ranks that hold other DTensors than rank 0 (pipeline stages) refuse the save
        # together, naming both sides; step 2 stays the newest and restores exactly.
        got = v["stages"]
        assert got["error_type"] == "UnsafeCheckpointError", got
        assert "refused by rank(s) 1 (rank 1: it holds 2 DTensors" in got["message"], got
        assert "'model/layer1.bias'" in got["message"], got
        assert "rank 0 holds 2 (the first 'model/layer0.bias')" in got["message"], got
        assert "pipeline-parallel" in got["message"], got
        assert "nothing of it is visible and step 2 is still the newest" in got["message"]
        assert v["after_stages"] == [2]
        assert v["restored"] == 2
        assert v["exact"] is True
        # Local shards that are not the split their placements give: refused on the rank
        # that holds one (both here), before a byte is written.
        got = v["missized"]
        assert got["error_type"] == "UnsafeCheckpointError", got
        assert "bad: this rank's local shard is [" in got["message"], got
        assert "but the DTensor's placements [Shard(dim=0)] give it [" in got["message"], got
        assert "nothing of it is visible and step 2 is still the newest" in got["message"]
        assert v["after_missized"] == [2]
        assert v["restored_after_missized"] == 2
        assert v["exact_after_missized"] is True
        assert v["leftovers"] == []


def test_a_mesh_whose_ranks_run_downwards_commits_a_step_every_reader_takes(tmp_path):
    """DeviceMesh("cpu", [1, 0]) was written with a mesh stride of -1, which readers
    refuse: the step committed, retention (keep=1) deleted the one before it, and resume()
    found nothing."""
    res = launch("dtensor_scenarios:reversed_mesh", 2, tmp_path)
    assert all(r.ok for r in res), describe(res)
    for r in res:
        v = r.value
        assert v["steps"] == [2]
        assert v["resumed"] == 3
        assert v["rev_exact"] is True
        assert v["restored_fwd"] == 2
        assert v["fwd_exact"] is True
    assert res[0].value["verified"] == [[2, []]]  # (step, problems), through JSON

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
        assert v["leftovers"] == []

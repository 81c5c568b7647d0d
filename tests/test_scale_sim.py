"""tools/scale_sim.py: one simulated rank of an N-rank FSDP2 save on a fake process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _helpers import run_tool_forked


@pytest.mark.timeout(300)
def test_a_non_zero_rank_exchanges_as_much_at_32_ranks_as_at_8(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    run_tool_forked(
        "scale_sim.py",
        "--worlds",
        8,
        32,
        "--json",
        out,
        # Each simulated rank forked from the tool's process, which imported torch and
        # ckptstore once: the same save code, 4 imports of torch fewer (30 s -> 10 s).
        "--fork",
        timeout=280,
    )
    small, large = json.loads(out.read_text())
    assert (small["world"], large["world"]) == (8, 32)
    for key in ("sent", "received", "collectives"):
        a, b = small["rank1"][key], large["rank1"][key]
        assert b <= a * 1.05 + 64, (key, a, b)  # flat in the world size
    # Rank 0 gathers one slot (and one table) a rank: it grows with N, and it alone.
    assert large["rank0"]["received"] > 3 * small["rank0"]["received"]
    # save:enter, save:plan, save:gather, save:commit
    assert large["rank1"]["collectives"] == 4
    assert set(large["rank1"]["by_phase"]) == {
        "save:enter",
        "save:plan",
        "save:gather",
        "save:commit",
    }


@pytest.mark.timeout(300)
def test_fsdp2_over_tp_is_split_and_flat_in_the_world_size(tmp_path: Path) -> None:
    # FSDP2 over TP (column-wise weights (_StridedShard(0, 4), Shard(0))) on (N / 4, 4):
    # format 5, the split index; what rank 1 exchanges and the index parts a restoring rank
    # reads do not grow from 8 to 32 ranks (format 2 sent every chunk to rank 0, and every
    # restoring rank read all of dtensors.json).
    out = tmp_path / "sim.json"
    args = ["--worlds", 8, 32, "--layout", "fsdp-tp", "--tp", 4, "--json", out, "--fork"]
    run_tool_forked("scale_sim.py", *args, timeout=280)
    small, large = json.loads(out.read_text())
    assert (small["format_version"], large["format_version"]) == (5, 5)
    for key in ("sent", "received", "collectives"):
        a, b = small["rank1"][key], large["rank1"][key]
        assert b <= a * 1.05 + 64, (key, a, b)
    assert large["index_bytes"] <= small["index_bytes"] * 1.05  # no row per rank
    for label in ("N/2", "2N"):
        assert large["restore_parts_read"][label] <= 4, large["restore_parts_read"]

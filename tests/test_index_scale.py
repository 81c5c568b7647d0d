"""tools/index_scale.py: the whole split index of an N-rank job, merged as verify checks it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _helpers import run_tool

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_every_rank_row_of_the_index_is_in_the_merged_whole(tmp_path: Path) -> None:
    out = tmp_path / "merge.json"
    proc = run_tool(
        "index_scale.py", "--worlds", 8, 48, "--tensors", 30, "--json", out, timeout=110
    )
    results = json.loads(out.read_text())
    assert [r["world"] for r in results] == [8, 48]
    for r in results:
        world = r["world"]
        # Rows 2 N + i % 7 split as torch.chunk splits them: ceil(rows / per) ranks hold
        # a non-empty box of tensor i, and each wrote one chunk of it.
        want = 0
        for i in range(30):
            rows = 2 * world + i % 7
            want += -(-rows // -(-rows // world))
        assert r["chunks"] == want
        assert r["ckptstore"] == str(ROOT / "ckptstore" / "sharded" / "split_index.py")
        assert f"{world:6} ranks: {want:9,} chunks" in proc.stdout

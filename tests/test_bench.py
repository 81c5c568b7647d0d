"""Smoke test of tools/bench.py: it runs, and its JSON has the promised shape.

No speed is asserted: the numbers depend on the machine and its load.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ONLY = (
    "disk-odirect,disk-buffered,torch,ckpt-st,ckpt-async,copy-prealloc,verify,protocol,scale,ls10k,"
    "ckpt-torch,restore-rss"
)


def test_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "tmp" / "bench.json"
    cmd = [
        sys.executable,
        str(REPO / "tools" / "bench.py"),
        "--size",
        "4MB",
        "--repeats",
        "1",
        "--only",
        ONLY,
        "--out",
        "tmp/bench.json",  # relative to cwd (tmp_path)
        "--dir",
        str(tmp_path / "work"),
        "--ls-count",
        "30",
        "--ls-timeout",
        "60",
        "--scale-count",
        "50",
    ]
    res = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "targets:" in res.stdout
    doc = json.loads(out.read_text())

    for key in ("machine", "config", "state", "results", "targets", "extra", "ls", "odirect"):
        assert key in doc, key
    m = doc["machine"]
    assert m["cpu_count"] >= 1
    assert m["torch"]
    assert m["bench_dir"]["free_bytes"] > 0

    st = doc["state"]
    assert st["param_bytes"] > 3_000_000
    assert st["optimizer_bytes"] > st["param_bytes"]  # exp_avg + exp_avg_sq (+ step)
    assert st["state_bytes"] == st["param_bytes"] + st["optimizer_bytes"]
    assert st["n_tensors"] > 100

    rows = {(r["contender"], r["op"]): r for r in doc["results"]}
    want = [
        ("disk-buffered", "save"),
        ("disk-buffered", "restore"),
        ("torch", "save"),
        ("torch", "restore"),
        ("ckpt-st", "save"),
        ("ckpt-st", "restore"),
        ("ckpt-async", "blocked"),
        ("ckpt-async", "committed"),
        ("copy-prealloc", "copy"),
        ("verify", "verify"),
        ("protocol", "tiny-save"),
        ("scale", "save-empty"),
        ("scale", "save-big"),
    ]
    if doc["odirect"]["available"]:
        want += [("disk-odirect", "save"), ("disk-odirect", "restore")]
    for key in want:
        assert key in rows, key
        r = rows[key]
        assert r["n"] >= 1
        assert r["median_s"] > 0
        assert all(t > 0 for t in r["times_s"])
        if r["gb_s"] is not None:
            assert r["gb_s"] > 0
            assert math.isfinite(r["gb_s"])
    assert rows[("ckpt-st", "save")]["ratio_to_raw"] > 0

    # restore-rss: each flavor's peak RSS, from a child process (at 4 MB the buffers and the
    # interpreter's own allocations dominate: only the shape of the record is checked).
    rss = doc["extra"]["restore_rss"]
    assert set(rss) == {"ckpt-st", "ckpt-st-copy", "safetensors"}
    for got in rss.values():
        assert got["state_bytes"] > 3_000_000
        assert got["peak"] >= got["rss_before"] > 0
    assert ("ckpt-torch", "restore") in rows

    assert doc["extra"]["scale"]["count"] == 50
    assert rows[("scale", "save-big")]["n"] == rows[("scale", "save-empty")]["n"] == 10
    assert doc["ls"]["count"] == 30
    for op in ("steps", "latest_step", "plan_keep_last", "plan_keep_best", "ls"):
        assert doc["ls"]["ops"][op]["median_s"] > 0, op

    targets = {t["target"]: t for t in doc["targets"]}
    assert len(targets) >= 12
    for t in targets.values():
        assert t["pass"] in (True, False, None)
    assert any(t["value"] is not None for t in targets.values())
    assert doc["cold_cache_check"]["checks"] >= 1


@pytest.mark.timeout(400)
def test_bench_sharded_smoke(tmp_path: Path) -> None:
    """--sharded: FSDP2 save on 2 ranks, restore on 1 process and on 3 ranks, vs DCP and raw.

    Every restore is checked by the bench itself (float64 sums of the parameters and both
    AdamW moments against the saved state), so a run that completes restored real data.
    """
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        str(REPO / "tools" / "bench.py"),
        "--sharded",
        "--size",
        "2MB",
        "--repeats",
        "1",
        "--out",
        str(out),
        "--dir",
        str(tmp_path / "work"),
    ]
    res = subprocess.run(
        cmd, capture_output=True, text=True, timeout=380, cwd=tmp_path, check=False
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "sharded targets:" in res.stdout
    sh = json.loads(out.read_text())["sharded"]
    assert sh["state_bytes"] == sum(sh["per_rank_bytes"]) > 2_000_000
    rows = {(r["contender"], r["op"]): r for r in sh["rows"]}
    contenders = ["dcp", "ckpt"] + (["raw"] if ("raw", "save-2") in rows else [])
    for c in contenders:
        for op in ("save-2", "restore-2to1", "restore-2to3"):
            r = rows[(c, op)]
            assert r["n"] == 1
            assert r["median_s"] > 0
            assert r["vs_dcp"] > 0
    assert {t["target"] for t in sh["targets"]} >= {
        "sharded save >= 1.5x DCP",
        "resharded restore 2->1 >= 1.5x DCP",
        "resharded restore 2->3 >= 1.5x DCP",
    }
    assert len(sh["resident_after_drop"]) == 2 * len(contenders)  # before every restore

"""Smoke test of tools/bench.py: it runs, and its JSON has the promised shape.

No speed is asserted: the numbers depend on the machine and its load.

The smoke runs call the bench's ``main`` (what tools/bench.py and tools/bench_s3.py run) in
this process, which has imported torch already: a fresh interpreter spent 5-6 s of CPU on
torch and torch._dynamo before the bench did anything (3 runs: ~16 s of the file's ~66 s,
measured 2026-11-30). What the bench starts itself still runs as its own processes: the
restore-rss child, ``ckptstore ls``, the sharded ranks and their fork server, moto's server.
"""

from __future__ import annotations

import gc
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import benchkit, fork_tool_servers

REPO = Path(__file__).resolve().parent.parent
ONLY = (
    "disk-odirect,disk-buffered,torch,ckpt-st,ckpt-async,copy-prealloc,verify,protocol,scale,ls10k,"
    "ckpt-torch,restore-rss"
)


def run_main(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], module: str, *argv: str
) -> str:
    """``benchkit.<module>.main(argv)`` in this process, with tools/ importable as for
    tools/bench.py (the sharded run imports rankserver and rendezvous from there); its stdout.

    Fails with the tail of its stderr when it returns non-zero (it raises where it fails).
    """
    monkeypatch.syspath_prepend(str(REPO / "tools"))  # undone after the test
    main = benchkit(module).main
    try:
        rc = main(list(argv))
    finally:
        # bench's main freezes what it imported out of the collector (gc.freeze: for its own
        # settle()s); here that is the whole test process, given back to it.
        gc.unfreeze()
        out, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    return out


def test_bench_smoke(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tmp" / "bench.json"
    monkeypatch.chdir(tmp_path)  # --out is relative to it
    stdout = run_main(
        monkeypatch,
        capsys,
        "cli",
        "--size",
        "4MB",
        "--layers",  # 4 blocks: 208 tensors a state, not 784
        "4",
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
        "--rss-flavors",  # each flavour is a child process of its own: one shows the record
        "ckpt-st",
    )
    assert "targets:" in stdout
    doc = json.loads(out.read_text())
    assert doc["config"]["layers"] == 4

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

    # restore-rss: the ckpt-st restore's peak RSS, from a child process (at 4 MB the buffers and the
    # interpreter's own allocations dominate: only the shape of the record is checked).
    rss = doc["extra"]["restore_rss"]
    assert set(rss) == {"ckpt-st"}
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
def test_bench_sharded_smoke(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--sharded: FSDP2 save on 2 ranks, restore on 1 process and on 3 ranks; save on 4, restore
    on 2; vs DCP and raw.

    Every restore is checked by the bench itself (float64 sums of the parameters and both
    AdamW moments against the saved state), so a run that completes restored real data.
    """
    out = tmp_path / "bench.json"
    fork_tool_servers(monkeypatch)  # its rank server
    stdout = run_main(
        monkeypatch,
        capsys,
        "cli",
        "--sharded",
        "--size",
        "2MB",
        "--layers",  # 2 blocks (112 tensors a state, not 784): each FSDP2 build is cheap
        "2",
        "--repeats",
        "1",
        "--out",
        str(out),
        "--dir",
        str(tmp_path / "work"),
    )
    assert "sharded targets:" in stdout
    doc = json.loads(out.read_text())
    assert doc["config"]["layers"] == 2
    sh = doc["sharded"]
    assert sh["state_bytes"] == sum(sh["per_rank_bytes"]) > 2_000_000
    # Every rank ran this repository's ckptstore, and the JSON says which one.
    assert sh["ranks_ckptstore_path"] == [str(REPO / "ckptstore")]
    rows = {(r["contender"], r["op"]): r for r in sh["rows"]}
    contenders = ["dcp", "ckpt", "dcp-ckpt"] + (["raw"] if ("raw", "save-2") in rows else [])
    for c in contenders:
        for op in ("save-2", "save-4", "restore-2to1", "restore-2to3", "restore-4to2"):
            r = rows[(c, op)]
            assert r["n"] == 1
            assert r["median_s"] > 0
            assert r["vs_dcp"] > 0
    assert {t["target"] for t in sh["targets"]} >= {
        "sharded save >= 0.9x raw O_DIRECT write",
        "sharded save >= 3x DCP",
        "resharded restore 2->1 >= 2x DCP",
        "resharded restore 2->3 >= 2x DCP",
        "resharded restore 4->2 >= 2x DCP",
        "resharded restore 2->3 steady: max/min < 1.3",
        "DCP API over ckptstore: save >= 1.0x DCP",
        "DCP API over ckptstore: load 2->3 >= 1.0x DCP",
    }
    # Before every restore: each contender's, the three raw-only ones' where raw runs, and
    # ckpt-live's.
    raw_only = 3 if "raw" in contenders else 0
    assert len(sh["resident_after_drop"]) == 3 * (len(contenders) + raw_only + 1)
    for op in ("restore-2to1", "restore-2to3", "restore-4to2"):  # into live targets
        assert rows[("ckpt-live", op)]["median_s"] > 0
        assert rows[("ckpt-live", op)]["vs_dcp"] > 0
    assert ("ckpt-live", "save-2") not in rows
    if "raw" in contenders:  # the raw reads again, into fresh memory: a restore's floor
        for op in ("restore-2to1", "restore-2to3", "restore-4to2"):
            assert rows[("raw-fresh", op)]["median_s"] > 0
            assert rows[("ckpt", op)]["vs_raw_fresh"] > 0
            # The two ways to the floor of a checked restore into live tensors, and the
            # floor's lines among the targets (the faster way against raw and ckpt-live).
            for way in ("raw-checked", "raw-checked-buffered"):
                assert rows[(way, op)]["median_s"] > 0
                assert (way, "save-2") not in rows
        named = {t["target"]: t for t in sh["targets"]}
        ceiling = named["ceiling: 3x DCP's save within raw's speed"]
        assert ceiling["value"] == pytest.approx(
            rows[("dcp", "save-2")]["median_s"] / (3 * rows[("raw", "save-2")]["median_s"])
        )
        for op in ("2->1", "2->3", "4->2"):
            floor = named[f"floor: checked restore {op} >= 0.8x raw read"]
            key = f"restore-{op.replace('->', 'to')}"
            ways = ("raw-checked", "raw-checked-buffered")
            fastest = min(rows[(w, key)]["median_s"] for w in ways)
            assert floor["value"] == pytest.approx(rows[("raw", key)]["median_s"] / fastest)
            assert floor["pass"] is (floor["value"] >= 0.8)
            live = named[f"ckpt-live {op} vs its floor (info)"]
            assert live["value"] == pytest.approx(fastest / rows[("ckpt-live", key)]["median_s"])
    steady = {t["target"]: t for t in sh["targets"] if "steady" in t["target"]}
    assert len(steady) == 3
    assert all(t["value"] is None and t["pass"] is None for t in steady.values())  # 1 round
    # Where each ckptstore restore's time went, on every restoring rank: planning and reads.
    for op, world in (("restore-2to1", 1), ("restore-2to3", 3), ("restore-4to2", 2)):
        for c in ("ckpt", "ckpt-live"):
            ranks = sh["restore_phases"][op][c]
            assert len(ranks) == world
            assert all({"plan", "read", "apply"} <= set(ph) for ph in ranks), ranks
            assert all(w >= 0 and cpu >= 0 for ph in ranks for w, cpu in ph.values())
    assert "ckpt-live restore-2to3 phases, median ms per rank" in stdout


@pytest.mark.timeout(200)
def test_bench_s3_smoke(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("moto.server")
    # tools/bench_s3.py's main (the same measurement as bench.py --s3)
    stdout = run_main(monkeypatch, capsys, "s3", "--size", "4MB", "--repeats", "1")
    lines = stdout.splitlines()
    for name in ("s3fs-cat", "ckpt-load", "ckpt-restore"):
        assert any(line.split()[:1] == [name] and "GB/s" in line for line in lines), name
    ratios = [line for line in lines if "speed vs s3fs cat" in line]
    assert len(ratios) == 2
    for line in ratios:
        value = float(line.split(": ")[1].split("x")[0])
        assert value > 0


# ---- the in-memory contenders measure what they claim (issue 13) -----------------------------


@pytest.fixture
def ctx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    harness, cli = benchkit("harness"), benchkit("cli")
    # settle() (gc, sync, sleep) only steadies timings; these tests check what is timed.
    monkeypatch.setattr(harness, "settle", lambda: None)
    args = cli.parse_args(["--size", "1MB", "--dir", str(tmp_path / "work")])
    c = harness.Ctx(args, tmp_path / "work", 1 << 20)
    yield c
    c.close()


def _sources(ctx: Any) -> list[Any]:
    return [t for _, t in ctx.tensors()]


def _restore_mapped(ctx: Any) -> None:
    """A safetensors restore without the contender's untimed ``end``: ``load_file`` maps the
    file and the optimizer adopts those tensors, so the AdamW state is left in a private
    mapping of the checkpoint file, the state every contender after it once started from."""
    st = benchkit("plain").SafetensorsSave()
    d = ctx.newdir("mapped")
    st.save(ctx, d)
    st.restore(ctx, d)


def test_copy_contenders_copy_the_state_from_memory_after_a_safetensors_restore(ctx: Any) -> None:
    """The defect: after the safetensors restore, the AdamW state lived in a private mapping of
    the (dropped from cache) checkpoint file; copy-prealloc, the next in each round, timed the
    disk reads of its source, and clone after it read warm pages."""
    state, memory = benchkit("state"), benchkit("memory")
    assert not any(state.file_mapped(_sources(ctx)))
    _restore_mapped(ctx)
    mapped = state.file_mapped(_sources(ctx))
    assert sum(mapped) >= 2 * 100  # exp_avg and exp_avg_sq of every parameter, at least
    want = [t.clone() for t in _sources(ctx)]
    copy, clone = memory.CopyPrealloc(), memory.Clone()
    copy.setup(ctx)
    copy.round(ctx, 0)
    # The source is now the state's own anonymous memory, with the same values.
    assert not any(state.file_mapped(_sources(ctx)))
    assert all(torch.equal(a, b) for a, b in zip(_sources(ctx), want, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(copy.bufs, want, strict=True))
    assert ctx.extra["tensors_moved_out_of_file_mappings"] == sum(mapped)
    clone.round(ctx, 0)
    # Both copied every byte of the state, once.
    assert ctx.extra["copied_bytes"] == {
        "copy-prealloc": [ctx.state_bytes],
        "clone": [ctx.state_bytes],
    }
    copy.teardown(ctx)


def test_async_contender_reads_the_state_from_memory(ctx: Any) -> None:
    state = benchkit("state")
    _restore_mapped(ctx)
    assert any(state.file_mapped(_sources(ctx)))
    benchkit("memory").CkptAsync().round(ctx, 0)
    assert not any(state.file_mapped(_sources(ctx)))


def test_step_timer_times_the_same_work_after_warm_up_in_every_window(
    ctx: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The defect: a ~2 ms step, dominated by thread wake-ups and Python rather than work,
    ran "faster" during a save; the base windows began right after settle()'s sleep."""
    harness, memory, state = benchkit("harness"), benchkit("memory"), benchkit("state")
    events: list[str] = []
    step = memory.StepSlowdown()
    step.setup(ctx)
    _restore_mapped(ctx)
    real_work = step.work
    monkeypatch.setattr(harness, "settle", lambda: events.append("settle"))

    def work() -> None:
        events.append("work")
        real_work()

    def timed() -> float:
        events.append("timed")
        return real_work_timed()

    real_work_timed = step.step
    step.work = work  # type: ignore[method-assign]
    step.step = timed  # type: ignore[method-assign]
    step.WINDOW_S = 0.05  # short windows: this checks what is timed, not how long it takes
    step.round(ctx, 0)
    # Every timed step runs work() (the same callable in every window, with the same
    # tensors), and each window after a settle() starts with WARMUP untimed steps.
    text = " ".join(events)
    assert text.count("timed") == text.count("timed work")
    windows = text.split("settle")[1:]
    assert len(windows) == 3  # before, during (after its settle), after
    for i, w in (0, windows[0]), (2, windows[2]):
        head = w.split()[: memory.StepSlowdown.WARMUP]
        assert head == ["work"] * memory.StepSlowdown.WARMUP, (i, w[:80])
    # The step is real work: about 1.6 GFLOP (forward + backward of two 1024x1024 layers on
    # 128 rows), not two small matmuls.
    assert step.x.shape == (128, 1024)
    assert step.w1.shape == step.w2.shape == (1024, 1024)
    assert not any(state.file_mapped(_sources(ctx)))  # the async save read memory
    info = ctx.extra["step_slowdown"][-1]
    assert info["intra_op_threads"] == torch.get_num_threads()
    # The competition each window saw is kept, and a round where it differed is marked.
    for k in ("others_cpu_share_without", "others_cpu_share_during_save"):
        assert 0.0 <= info[k] <= 1.0, (k, info[k])
    differs = abs(info["others_cpu_share_during_save"] - info["others_cpu_share_without"])
    assert info["confounded"] == (differs > memory.StepSlowdown.CONFOUNDED)


def test_other_processes_cpu_share_is_the_machines_busy_time_less_ours() -> None:
    memory = benchkit("memory")
    # 200 busy ticks of 200, 50 of them ours: others took 75% of the machine.
    assert memory.others_share((100, 1000, 10), (300, 1200, 60)) == 0.75
    assert memory.others_share((100, 1000, 10), (110, 1200, 20)) == 0.0
    assert math.isnan(memory.others_share(None, (1, 2, 3)))
    sample = memory.cpu_ticks()
    assert sample is not None
    busy, total, ours = sample
    assert 0 < ours <= busy <= total

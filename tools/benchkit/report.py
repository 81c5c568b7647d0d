"""What a run reports: rows of medians, the issue's targets, the table on stdout, the
machine it ran on, and the plot of a size sweep."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import ckptstore
from benchkit.disk import df_info
from benchkit.harness import Ctx, log
from benchkit.registry import ALL
from benchkit.units import GB, fmt, human

REPO = Path(__file__).resolve().parent.parent.parent


def summarize(ctx: Ctx) -> list[dict[str, Any]]:
    base_name = "disk-odirect" if ctx.odirect_ok else "disk-buffered"
    medians = {k: statistics.median(v) for k, v in ctx.times.items()}
    baseline_op = {
        "save": "save",
        "restore": "restore",
        "committed": "save",
        "verify": "restore",
    }
    rows = []
    for (name, op), ts in ctx.times.items():
        med = medians[(name, op)]
        per_state = op in ("save", "restore", "blocked", "committed", "copy", "clone", "verify")
        ratio = None
        bop = baseline_op.get(op)
        if bop and (base_name, bop) in medians:
            ratio = medians[(base_name, bop)] / med
        rows.append(
            {
                "contender": name,
                "op": op,
                "n": len(ts),
                "times_s": ts,
                "median_s": med,
                "min_s": min(ts),
                "max_s": max(ts),
                "gb_s": ctx.state_bytes / med / GB if per_state else None,
                "spread": max(ts) / min(ts),
                "ratio_to_raw": ratio,
            }
        )
    return rows


def _row(rows: list[dict[str, Any]], name: str, op: str) -> dict[str, Any] | None:
    for r in rows:
        if r["contender"] == name and r["op"] == op:
            return r
    return None


def evaluate_targets(
    ctx: Ctx, rows: list[dict[str, Any]], ls: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """The issue's targets; ``pass`` is None when a contender needed for it did not run."""
    base = "disk-odirect" if ctx.odirect_ok else "disk-buffered"
    out: list[dict[str, Any]] = []

    def stat(name: str, op: str, key: str = "median_s") -> float | None:
        r = _row(rows, name, op)
        return r[key] if r else None

    def ratio(num: tuple[str, str], den: tuple[str, str], key: str) -> float | None:
        a, b = stat(*num, key), stat(*den, key)
        return a / b if a and b else None

    def speed(name: str, need: float, ours: tuple[str, str], theirs: tuple[str, str]) -> None:
        value = ratio(theirs, ours, "median_s")
        out.append(
            {
                "target": name,
                "value": value,
                "value_min": ratio(theirs, ours, "min_s"),
                "threshold": f">= {need}",
                "pass": None if value is None else value >= need,
                "detail": f"{ours[0]} {ours[1]} vs {theirs[0]} {theirs[1]} (speed ratio)",
            }
        )

    def at_most(name: str, limit: float, num: tuple[str, str], den: tuple[str, str]) -> None:
        value = ratio(num, den, "median_s")
        out.append(
            {
                "target": name,
                "value": value,
                "value_min": ratio(num, den, "min_s"),
                "threshold": f"<= {limit:.3g}",
                "pass": None if value is None else value <= limit,
                "detail": f"{num[0]} {num[1]} / {den[0]} {den[1]} (time ratio)",
            }
        )

    # Issue 13: restore at the disk's best speed, checked before use, no second copy.
    speed(
        "default restore >= 1.0x safetensors load_file+load_state_dict",
        1.0,
        ("ckpt-st", "restore"),
        ("safetensors", "restore"),
    )
    raw_reads = [
        (n, "restore") for n in ("disk-odirect", "disk-buffered") if stat(n, "restore") is not None
    ]
    if raw_reads:
        fastest = min(raw_reads, key=lambda k: stat(*k) or math.inf)
        speed("default restore >= 0.9x the faster raw read", 0.9, ("ckpt-st", "restore"), fastest)
    speed(
        "torch-format restore >= 0.8x safetensors-format restore",
        0.8,
        ("ckpt-torch", "restore"),
        ("ckpt-st", "restore"),
    )
    speed(
        "durable save >= 1.0x safetensors save_file+fsync",
        1.0,
        ("ckpt-st", "save"),
        ("safetensors", "save"),
    )
    rss = ctx.extra.get("restore_rss", {}).get("ckpt-st")
    out.append(
        {
            "target": "peak RSS during default restore <= 1.2x the state",
            "value": None if rss is None else rss["peak_over_state"],
            "threshold": "<= 1.2",
            "pass": None if rss is None else rss["peak_over_state"] <= 1.2,
            "detail": "restore-rss: (state + VmHWM - VmRSS before) / state, child process",
        }
    )
    speed("durable save >= 0.8x raw O_DIRECT write", 0.8, ("ckpt-st", "save"), (base, "save"))
    speed("durable save >= 1.8x torch.save", 1.8, ("ckpt-st", "save"), ("torch", "save"))
    speed("durable save >= 1.5x safetensors", 1.5, ("ckpt-st", "save"), ("safetensors", "save"))
    speed(
        "cold restore >= 0.75x raw O_DIRECT read",
        0.75,
        ("ckpt-st-inplace", "restore"),
        (base, "restore"),
    )
    speed(
        "cold restore >= 1.8x torch.load+load_state_dict",
        1.8,
        ("ckpt-st-inplace", "restore"),
        ("torch", "restore"),
    )
    speed(
        "zstd restore >= 0.5x uncompressed restore (safetensors)",
        0.5,
        ("ckpt-st-zstd", "restore"),
        ("ckpt-st", "restore"),
    )
    speed(
        "zstd restore >= 0.5x uncompressed restore (torch format)",
        0.5,
        ("ckpt-torch-zstd", "restore"),
        ("ckpt-torch", "restore"),
    )
    speed(
        "deep verify >= 0.8x cold read bandwidth (raw O_DIRECT read)",
        0.8,
        ("verify", "verify"),
        (base, "restore"),
    )
    at_most(
        "async blocked <= 1.5x copy into allocated memory",
        1.5,
        ("ckpt-async", "blocked"),
        ("copy-prealloc", "copy"),
    )
    at_most("async blocked <= clone() / 3", 1 / 3, ("ckpt-async", "blocked"), ("clone", "clone"))
    # Rounds whose windows saw different competition from other processes say nothing about
    # the save (see StepSlowdown); with none left the target is n/a, not a pass.
    rounds = ctx.extra.get("step_slowdown", [])
    slows = [s["slowdown"] for s in rounds if not s.get("confounded")]
    v = statistics.median(slows) if slows else None
    out.append(
        {
            "target": "training-step slowdown during an async save < 25%",
            "value": v,
            "value_min": min(slows, default=None),
            "threshold": "< 0.25",
            "pass": None if v is None else v < 0.25,
            "detail": "median over rounds of mean step time during save / without - 1 "
            f"({len(rounds) - len(slows)} of {len(rounds)} rounds confounded by other load)",
        }
    )
    brk = ctx.extra.get("save_breakdown", {}).get("ckpt-st", [])
    v = None
    if brk:
        proto = statistics.median(b["total_s"] - b["payload_s"] for b in brk)
        v = proto / statistics.median(b["total_s"] for b in brk)
    out.append(
        {
            "target": f"protocol cost < 2% of a {human(ctx.param_bytes)}-param save",
            "value": v,
            "threshold": "< 0.02",
            "pass": None if v is None else v < 0.02,
            "detail": "ckpt-st: (save time - time in payload write_group) / save time",
        }
    )
    v = stat("protocol", "tiny-save")
    out.append(
        {
            "target": "few-KB save < 5 ms",
            "value": v,
            "value_min": stat("protocol", "tiny-save", "min_s"),
            "threshold": "< 0.005 s",
            "pass": None if v is None else v < 0.005,
            "detail": "median CheckpointManager.save of a few-KB state, keep=3",
        }
    )
    scale = ctx.extra.get("scale")
    at_most(
        f"few-KB save on {scale['count'] if scale else 10_000:,} steps <= 1.5x on an empty store",
        1.5,
        ("scale", "save-big"),
        ("scale", "save-empty"),
    )
    for op in ("steps", "latest_step", "plan_keep_last", "plan_keep_best", "ls"):
        v = None
        detail = "not run"
        if ls is not None:
            info = ls["ops"].get(op, {})
            v = info.get("median_s")
            detail = f"on {ls['count']} checkpoints"
            if info.get("timed_out"):
                detail += f"; timed out after {info.get('timeout_s')} s"
        count = f"{ls['count']:,}" if ls else "10,000"
        out.append(
            {
                "target": f"{op} on {count} checkpoints < 1 s",
                "value": v,
                "threshold": "< 1 s",
                "pass": (False if ls and ls["ops"].get(op, {}).get("timed_out") else None)
                if v is None
                else v < 1.0,
                "detail": detail,
            }
        )
    return out


def print_report(
    ctx: Ctx, rows: list[dict[str, Any]], targets: list[dict[str, Any]], ls: Any
) -> None:
    base = "disk-odirect" if ctx.odirect_ok else "disk-buffered"
    print()
    print(
        f"state: {human(ctx.param_bytes)} params + {human(ctx.state_bytes - ctx.param_bytes)} "
        f"AdamW = {human(ctx.state_bytes)} in {ctx.n_tensors} tensors; GB/s = state bytes / s; "
        f"ratio = speed vs {base} of the same op"
    )
    head = (
        f"{'contender':<16} {'op':<12} {'median s':>10} {'GB/s':>7} {'x raw':>7} {'n':>3} "
        f"{'max/min':>7}"
    )
    print(head)
    print("-" * len(head))
    order = {n: i for i, n in enumerate(ALL)}
    for r in sorted(rows, key=lambda r: (order.get(r["contender"], 99), r["op"])):
        med = r["median_s"]
        med_s = f"{med * 1e3:.2f}ms" if med < 0.1 else f"{med:.3f}"
        print(
            f"{r['contender']:<16} {r['op']:<12} {med_s:>10} {fmt(r['gb_s'], '.2f'):>7} "
            f"{fmt(r['ratio_to_raw'], '.2f'):>7} {r['n']:>3} {r['spread']:>7.2f}"
        )
    if ctx.resident_after_drop:
        worst = max(ctx.resident_after_drop)
        print(
            f"cold cache: max {worst:.1%} of a checkpoint still resident after "
            "posix_fadvise(DONTNEED)"
        )
        if worst > 0.05:
            print(
                "warning: the page cache could not be dropped (tmpfs?): restores and verify "
                "were NOT cold"
            )
    if ls:
        print(f"ls store: {ls['count']} checkpoints")
    print()
    print("targets:")
    for t in targets:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[t["pass"]]
        v = t["value"]
        val = "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
        vmin = t.get("value_min")
        best = "" if vmin is None else f"; best-of-runs {vmin:.3f}"
        print(f"  {verdict}  {t['target']:<58} {val:>9}  ({t['threshold']}; {t['detail']}{best})")
    load = max(ctx.load_seen)
    cpus = os.cpu_count() or 1
    if load > cpus:
        print(
            f"warning: load average reached {load:.1f} on {cpus} CPUs during this run: other "
            "work shared the CPUs and the disk, so medians are noisy (see max/min and "
            "best-of-runs)"
        )


def library_fingerprint() -> str:
    """A hash of ckptstore's source: others may edit the library while a run goes on."""
    h = hashlib.sha256()
    pkg = Path(ckptstore.__file__).resolve().parent
    for f in sorted(pkg.rglob("*.py")):
        h.update(str(f.relative_to(pkg)).encode() + b"\0")
        with contextlib.suppress(OSError):
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def machine_info(work: Path) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "ckptstore": ckptstore.__version__,
        "ckptstore_path": str(Path(ckptstore.__file__).resolve().parent),
        "library_sha_start": library_fingerprint(),
        "loadavg_start": os.getloadavg(),
        "bench_dir": df_info(work),
        "tmp_dir": df_info(Path("/tmp")),
    }
    for mod in ("safetensors", "zstandard", "crc32c"):
        with contextlib.suppress(Exception):
            info[mod] = __import__(mod).__version__
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("MemTotal", "MemAvailable"):
                info[k] = int(v.split()[0]) * 1024
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        git = ["git", "-C", str(REPO)]
        info["git_commit"] = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=False, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "ckptstore"],
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        ).stdout
        info["library_dirty"] = bool(dirty.strip())
    return info


def plot_sweep(sweep: list[dict[str, Any]], path: Path) -> str | None:
    try:
        import matplotlib as mpl

        mpl.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=False)
    for ax, op in zip(axes, ("save", "restore"), strict=True):
        names = sorted({r["contender"] for s in sweep for r in s["rows"] if r["op"] == op})
        for name in sorted(names, key=lambda n: ALL.index(n) if n in ALL else 99):
            xs, ys = [], []
            for s in sweep:
                r = next((r for r in s["rows"] if r["contender"] == name and r["op"] == op), None)
                if r and r["gb_s"]:
                    xs.append(s["state_bytes"])
                    ys.append(r["gb_s"])
            style = "--" if name.startswith("disk") else "-"
            lw = 2.5 if name == "ckpt-st" else 1.3
            ax.plot(xs, ys, style, marker="o", lw=lw, label=name)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(mpl.ticker.FuncFormatter(lambda x, _: human(x)))
        ax.xaxis.set_minor_formatter(mpl.ticker.NullFormatter())
        ax.set_xticks(sorted({s["state_bytes"] for s in sweep}))
        ax.set_xlabel("state bytes (params + AdamW)")
        ax.set_ylabel("GB/s (state bytes / s)")
        ax.set_title(f"durable {op}" if op == "save" else "cold restore")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)

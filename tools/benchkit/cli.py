"""``tools/bench.py``'s command line: arguments, the run, and its JSON."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import shutil
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

from benchkit.disk import CHUNK, df_info
from benchkit.harness import Ctx, log, run_rounds
from benchkit.protocol import bench_ls
from benchkit.registry import ALL, APART, DESCRIPTIONS, PAIRS, make_contenders
from benchkit.report import (
    evaluate_targets,
    library_fingerprint,
    machine_info,
    plot_sweep,
    print_report,
    summarize,
)
from benchkit.state import N_LAYER
from benchkit.units import human, parse_size

REPO = Path(__file__).resolve().parent.parent.parent
#: --plot: the smaller sizes swept (those below --size).
SWEEP = ("10MB", "30MB", "100MB", "300MB", "1GB")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="ckptstore vs torch.save, safetensors, DCP and the raw disk",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="contenders: " + ", ".join(ALL),
    )
    p.add_argument("--size", type=parse_size, default=parse_size("1GB"), help="param bytes")
    p.add_argument(
        "--layers",
        type=int,
        default=N_LAYER,
        help="blocks of the GPT-2-like state (fewer: fewer, larger tensors at the same --size) "
        "of the rounds, restore-rss and --sharded (not --s3, --replica)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", default="", help="comma list of contenders (default: all but sharded)")
    p.add_argument("--dir", type=Path, default=REPO / "bench-out" / "work")
    p.add_argument("--out", type=Path, default=REPO / "bench-out" / "bench.json")
    p.add_argument("--plot", action="store_true", help=f"also sweep {', '.join(SWEEP)}")
    p.add_argument("--ls-count", type=int, default=10_000)
    p.add_argument(
        "--scale-count", type=int, default=10_000, help="steps in the big store of 'scale'"
    )
    p.add_argument("--ls-timeout", type=float, default=60.0, help="seconds for `ckptstore ls`")
    p.add_argument(
        "--rss-flavors",
        default="ckpt-st,ckpt-st-copy,safetensors",
        help="restores whose peak RSS 'restore-rss' measures, a child process each",
    )
    p.add_argument(
        "--s3",
        action="store_true",
        help="also restore from moto's S3 server on loopback vs s3fs cat of the same objects "
        "(tools/bench_s3.py)",
    )
    p.add_argument(
        "--sharded",
        action="store_true",
        help="run the sharded contender (FSDP2 save on 2 ranks, restore on 1 and 3; minutes "
        "at 1GB, not in the default run): alone, or with those --only names",
    )
    p.add_argument(
        "--replica",
        action="store_true",
        help="run the replica contender (two tiers against moto's S3; not in the default run): "
        "alone, or with those --only names",
    )
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.layers < 1:
        p.error("--layers must be >= 1")
    # The sharded contender starts 6 processes and DCP's resharded loads are slow: minutes
    # at 1 GB, so the default run leaves it out (--sharded or --only sharded runs it).
    default = [n for n in ALL if n not in APART]
    names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else default
    if args.sharded:
        names = [n for n in names if n != "sharded" and args.only] + ["sharded"]
    if args.replica:
        names = [n for n in names if n != "replica" and (args.only or args.sharded)]
        names.append("replica")
    bad = [n for n in names if n not in ALL]
    if bad:
        p.error(f"unknown contender(s) {', '.join(bad)}; choose from {', '.join(ALL)}")
    args.names = names
    return args


def _cached_modes() -> object:
    """The I/O mode cache this run's processes left (their figures per device), or None."""
    from ckptstore.storage import iocache

    iocache.flush()
    return iocache.document()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # What was imported lives to the end of the run: torch, ckptstore, the bench, and the
    # torch._dynamo that building the state imports anyway. Frozen out of the collector, they
    # are no longer walked by the gc.collect() of every settle() before a timed operation
    # (about 0.3 s of CPU each, most of it in those objects).
    import torch._dynamo  # noqa: F401

    gc.freeze()
    warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load).*")
    args.dir.mkdir(parents=True, exist_ok=True)
    work = args.dir / f"run-{os.getpid()}-{int(time.time())}"
    work.mkdir()
    # What io="auto" chooses (ckptstore/storage/iomode.py) is measured in this run, from a
    # cache file of its own that the ranks share: a figure cached by other work on the
    # machine decided for it before (a slow O_DIRECT figure from a busy disk had every
    # sharded save of one run write buffered). CKPTSTORE_IO_CACHE set by the caller wins.
    os.environ.setdefault("CKPTSTORE_IO_CACHE", str(work / "io-modes.json"))
    fs = df_info(args.dir)
    if fs.get("fstype") == "tmpfs":
        log(f"warning: {args.dir} is tmpfs: the disk is not measured and restores cannot be cold")
    result: dict[str, Any] = {"schema": 1, "machine": machine_info(args.dir)}
    try:
        log(f"building a {human(args.size)}-param state (+ AdamW) ...")
        ctx = Ctx(args, work, args.size)
        log(
            f"state: {ctx.n_tensors} tensors, {human(ctx.state_bytes)} "
            f"({ctx.shape}), built in {ctx.build_s:.1f}s; O_DIRECT: {ctx.odirect_why}"
        )
        try:
            run_rounds(ctx, make_contenders(args.names), args.repeats)
        finally:
            ctx.close()
        ls = None
        if "ls10k" in args.names:
            log(f"ls10k: a store of {args.ls_count} checkpoints")
            ls = bench_ls(work, args.ls_count, args.repeats, args.ls_timeout)
        rows = summarize(ctx)
        targets = evaluate_targets(ctx, rows, ls)
        with contextlib.suppress(ImportError, AttributeError):
            from ckptstore.storage import iomode  # what "auto" measured and chose

            ctx.extra["iomode"] = iomode.decisions()
        result.update(
            {
                "config": {
                    "size_param_bytes": args.size,
                    "layers": args.layers,
                    "repeats": args.repeats,
                    "contenders": args.names,
                    "dir": str(args.dir),
                    "order": "round-robin; round r starts at contender r; medians over rounds",
                    "durability": "every file and directory fsynced inside the timed region",
                    "cold_cache": "fsync then posix_fadvise(POSIX_FADV_DONTNEED) on every file "
                    "of the checkpoint before each restore/verify (no root needed)",
                    "gb": "1 GB = 1e9 bytes of state (params + optimizer tensors)",
                    "raw_chunk_bytes": CHUNK,
                },
                "descriptions": {n: DESCRIPTIONS[n] for n in args.names},
                "state": {
                    "param_bytes": ctx.param_bytes,
                    "optimizer_bytes": ctx.state_bytes - ctx.param_bytes,
                    "state_bytes": ctx.state_bytes,
                    "n_tensors": ctx.n_tensors,
                    "shape": dataclasses.asdict(ctx.shape),
                    "build_s": ctx.build_s,
                },
                "odirect": {"available": ctx.odirect_ok, "why": ctx.odirect_why},
                "ratio_baseline": "disk-odirect" if ctx.odirect_ok else "disk-buffered",
                "loadavg_1min_seen": {
                    "min": min(ctx.load_seen),
                    "median": statistics.median(ctx.load_seen),
                    "max": max(ctx.load_seen),
                },
                "cold_cache_check": {
                    "max_resident_fraction": max(ctx.resident_after_drop, default=None),
                    "checks": len(ctx.resident_after_drop),
                },
                "results": rows,
                "disk_bytes": ctx.disk_bytes,
                "extra": ctx.extra,
                "ls": ls,
                "targets": targets,
            }
        )
        result["machine"]["library_sha_end"] = library_fingerprint()
        changed = result["machine"]["library_sha_end"] != result["machine"]["library_sha_start"]
        result["machine"]["library_changed_during_run"] = changed
        if [n for n in args.names if n not in APART]:
            print_report(ctx, rows, targets, ls)
        if changed:
            print("warning: ckptstore's source changed during this run; rerun for clean numbers")
        sweep: list[dict[str, Any]] = [
            {"param_bytes": ctx.param_bytes, "state_bytes": ctx.state_bytes, "rows": rows}
        ]
        odirect = ctx.odirect_ok
        del ctx
        gc.collect()
        if args.s3:
            from benchkit import s3

            result["s3"] = s3.run(args.size, args.repeats)
            s3.print_report(result["s3"])
        if "sharded" in args.names:
            from benchkit import sharded as bench_sharded

            sharded = bench_sharded.run(
                args.size, work, args.repeats, odirect=odirect, n_layer=args.layers
            )
            result["sharded"] = sharded
            bench_sharded.print_report(sharded)
        if "replica" in args.names:
            from benchkit import replica as bench_replica

            replica = bench_replica.run(args.size, work, args.repeats)
            result["replica"] = replica
            bench_replica.print_report(replica)
        if args.plot:
            pairs = [n for n in args.names if n in PAIRS]
            for size_text in SWEEP:
                size = parse_size(size_text)
                if size >= args.size * 0.95:
                    continue
                log(f"sweep: {size_text}")
                sctx = Ctx(args, work, size)
                run_rounds(sctx, make_contenders(pairs), args.repeats)
                sweep.append(
                    {
                        "param_bytes": sctx.param_bytes,
                        "state_bytes": sctx.state_bytes,
                        "rows": summarize(sctx),
                    }
                )
                del sctx
                gc.collect()
            sweep.sort(key=lambda s: s["state_bytes"])
            result["sweep"] = sweep
            result["plot"] = plot_sweep(sweep, args.out.with_suffix(".png"))
            if result["plot"]:
                print(f"plot: {result['plot']}")
        result["machine"]["loadavg_end"] = os.getloadavg()
        # What every process of the run measured (the sharded ranks' too), at its end.
        result["extra"]["iomode_cache"] = _cached_modes()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0

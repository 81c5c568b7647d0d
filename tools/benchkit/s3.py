"""The object-store part of tools/bench.py: restore from S3 vs s3fs ``cat`` of the same objects.

    .venv/bin/python tools/bench.py --s3 --size 256MB          # through bench.py
    .venv/bin/python tools/bench_s3.py --size 256MB --repeats 3   # on its own

The server is moto's S3 server on loopback (``tests/s3server.py``: a child process, requests
over HTTP through s3fs/aiobotocore exactly as against AWS). One checkpoint of the bench's
state (GPT-2-like model of ``--size`` parameter bytes + AdamW, so about 3x that) is saved
once; then, interleaved round-robin, each round with a fresh s3fs instance (no cached
connections or listings):

- ``s3fs-cat``: ``fs.cat([every payload object])``: s3fs fetches the objects concurrently
  (asyncio), into memory, unchecked. The bytes a restore must move, nothing else.
- ``ckpt-load``: ``CheckpointManager(url).load(1)``: manifest, state.json, then every payload
  as concurrent ranged GETs, each block checked against its CRC32C, decoded into tensors.
- ``ckpt-restore``: ``restore`` into a fresh model and optimizer of the same shapes.

Moto serves from one Python process, so absolute speeds say little about a real store; the
ratio says how much of what the server gives ckptstore's reads take.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchkit.state import build_state
from benchkit.units import GB, parse_size

REPO = Path(__file__).resolve().parents[2]


def _paths() -> None:
    for p in (REPO, REPO / "tests"):  # s3server.py: moto's S3 server in a child process
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))


def run(param_bytes: int, repeats: int) -> dict[str, Any]:
    """Save once, then time the contenders ``repeats`` times each, interleaved."""
    _paths()
    from s3server import s3_server

    from ckptstore import CheckpointManager

    model, opt, _ = build_state(param_bytes)
    times: dict[str, list[float]] = {"s3fs-cat": [], "ckpt-load": [], "ckpt-restore": []}
    with s3_server() as ep:
        url = ep.url("bench")
        with CheckpointManager(url, storage_options=ep.storage_options) as mgr:
            mgr.save(1, {"model": model, "optimizer": opt})
            manifest = mgr.manifest(1)
        base = f"{ep.bucket}/bench/step-000000000001"
        payloads = [f"{base}/{n}" for n, e in manifest.files.items() if e.codec != "json"]
        nbytes = sum(e.bytes for e in manifest.files.values() if e.codec != "json")
        fresh_model, fresh_opt, _ = build_state(param_bytes)

        def opts() -> dict[str, Any]:
            o = dict(ep.storage_options)
            o["skip_instance_cache"] = True
            return o

        def cat() -> None:
            fs = ep.fs(fresh=True)
            got = fs.cat(payloads)
            assert sum(len(v) for v in got.values()) == nbytes

        def load() -> None:
            with CheckpointManager(url, storage_options=opts()) as m:
                m.load(1)

        def restore() -> None:
            with CheckpointManager(url, storage_options=opts()) as m:
                m.restore({"model": fresh_model, "optimizer": fresh_opt}, step=1)

        runs = {"s3fs-cat": cat, "ckpt-load": load, "ckpt-restore": restore}
        for _ in range(repeats):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
            assert torch.equal(a, b), "the restore did not load every byte"
    rows = {
        name: {
            "median_s": statistics.median(ts),
            "min_s": min(ts),
            "gb_per_s": nbytes / statistics.median(ts) / GB,
        }
        for name, ts in times.items()
    }
    cat_s = rows["s3fs-cat"]["median_s"]
    return {
        "bytes": nbytes,
        "objects": len(payloads),
        "repeats": repeats,
        "rows": rows,
        "ratios": {n: cat_s / r["median_s"] for n, r in rows.items() if n != "s3fs-cat"},
    }


def print_report(res: dict[str, Any]) -> None:
    """One line per contender, and the ratios to s3fs cat."""
    print(
        f"\nS3 (moto on loopback): {res['bytes'] / GB:.3f} GB in {res['objects']} payload "
        f"objects, {res['repeats']} rounds, interleaved"
    )
    for name, r in res["rows"].items():
        print(
            f"  {name:13s} median {r['median_s']:7.3f} s  min {r['min_s']:7.3f} s  "
            f"{r['gb_per_s']:6.3f} GB/s"
        )
    for name, v in res["ratios"].items():
        verdict = "pass" if v >= 1.0 else "FAIL"
        print(f"  {name} speed vs s3fs cat: {v:.2f}x (target >= 1.0x: {verdict})")


def main(argv: list[str] | None = None) -> int:
    """Run on its own: ``--size`` parameter bytes, ``--repeats`` rounds."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="128MB", help="parameter bytes (state is about 3x)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    print_report(run(parse_size(args.size), args.repeats))
    return 0

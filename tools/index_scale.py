"""The whole chunk index of an N-rank job, as verify, inspect and export check it (issue 21).

``verify``, ``inspect``, ``export`` and consolidation read every rank's part of a split index
and check the whole (``split_index.Layout.merged``). This builds the split index of an
N-rank FSDP2-like job in memory (``--tensors`` DTensors, ``Shard(0)`` on a 1-D mesh of N
ranks, ``2 N + i % 7`` rows of 64 float32 each, so the last third of the ranks hold empty
boxes of most tensors and write no row for them) and runs ``merged`` on it in a fresh
process per world size, printing the chunks, the parts' bytes, the wall and CPU time, and
the process's peak RSS before and after. With ``--baseline REV``, the ckptstore of that
commit does the same, in turn, on the same index.

    .venv/bin/python tools/index_scale.py --worlds 1024 4096 --baseline d49217f
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from baseline import extract

ROOT = Path(__file__).resolve().parents[1]
COLS = 64


def split_index(world: int, tensors: int) -> tuple[bytes, dict[int, bytes], dict[str, Any]]:
    """``dtensors.json``, every rank's part, and the file table (name -> FileEntry fields)."""
    from ckptstore.sharded import split_index as si
    from ckptstore.sharded.chunks import BLOCK

    shapes = {f"layers.{i}.w": (2 * world + i % 7, COLS) for i in range(tensors)}
    layout = {
        "ckptstore_chunks": si.SPLIT_FORMAT,
        "block": BLOCK,
        "meshes": [{"shape": [world], "start": 0, "strides": [1]}],
        "tensors": {
            n: {
                "dtype": "float32",
                "shape": list(s),
                "mesh": [world],
                "mesh_dims": ["dp"],
                "placements": ["S(0)"],
                "mesh_id": 0,
            }
            for n, s in shapes.items()
        },
    }
    files: dict[str, Any] = {}
    parts: dict[int, bytes] = {}
    for r in range(world):
        rows: dict[str, list[dict[str, Any]]] = {}
        at = 0
        shard = f"_shards.rank{r:05d}.safetensors"
        for n, (nrows, ncols) in shapes.items():
            per = -(-nrows // world)  # torch.chunk's rows a rank
            lo, hi = min(nrows, r * per), min(nrows, (r + 1) * per)
            if hi <= lo:
                continue
            nbytes = (hi - lo) * ncols * 4
            crcs = [f"{(r * 7919 + k) & 0xFFFFFFFF:08x}" for k in range(-(-nbytes // BLOCK))]
            rows[n] = [
                {
                    "offsets": [lo, 0],
                    "sizes": [hi - lo, ncols],
                    "file": shard,
                    "start": at,
                    "bytes": nbytes,
                    "crc32c": crcs,
                }
            ]
            at += nbytes
        files[shard] = (at, "safetensors", r)
        part = {"ckptstore_chunk_part": 1, "rank": r, "block": BLOCK, "chunks": rows}
        parts[r] = json.dumps(part).encode()
        files[si.part_file(r)] = (len(parts[r]), "json", r)
    return json.dumps(layout).encode(), parts, files


def one(world: int, tensors: int) -> dict[str, Any]:
    """Build the index and merge it, in this process (the ckptstore on its path)."""
    from ckptstore.manifest import FileEntry
    from ckptstore.sharded import split_index as si

    raw, parts, rows = split_index(world, tensors)
    files = {n: FileEntry(b, 0, codec, rank=r) for n, (b, codec, r) in rows.items()}
    layout = si.Layout.from_bytes(raw, "dtensors.json")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0, c0 = time.perf_counter(), time.process_time()
    index = layout.merged(parts.__getitem__, files, "dtensors.json")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "world": world,
        "tensors": tensors,
        "chunks": sum(len(e.chunks) for e in index.tensors.values()),
        "part_bytes": sum(map(len, parts.values())),
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "rss_before_mb": rss0 // 1024,
        "rss_after_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "ckptstore": si.__file__,
    }


def run(world: int, tensors: int, tree: Path | None, timeout: float) -> dict[str, Any]:
    """:func:`one` in a fresh interpreter: its own peak RSS, and ``tree``'s ckptstore (or
    this tree's) first on its path, as ``scale_sim`` runs a baseline."""
    cmd = [sys.executable, __file__, "--one", str(world), "--tensors", str(tensors)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree or ROOT))
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, check=False, env=env
    )
    if proc.returncode != 0:
        sys.exit(f"index_scale: {world} ranks failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    """Parse arguments; merge each world size's index (and the baseline's); print a table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--tensors", type=int, default=600, help="DTensors a rank")
    p.add_argument("--baseline", metavar="REV", help="also merge with the ckptstore of REV")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a merge")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.tensors)))
        return
    results = []
    with tempfile.TemporaryDirectory(prefix="index-scale-") as work:
        code = extract(args.baseline, Path(work) / "baseline") if args.baseline else None
        for world in args.worlds:
            for label, tree in (("current", None), ("baseline", code)):
                if label == "baseline" and tree is None:
                    continue
                r = run(world, args.tensors, tree, args.timeout)
                r["label"] = label
                results.append(r)
                print(
                    f"{label:8} {world:6} ranks: {r['chunks']:9,} chunks, parts "
                    f"{r['part_bytes'] / 1e6:6.1f} MB; merged in {r['wall_s']:7.2f} s "
                    f"(CPU {r['cpu_s']:.2f} s, {1e6 * r['wall_s'] / max(r['chunks'], 1):.1f} "
                    f"us a chunk), peak RSS {r['rss_before_mb']} -> {r['rss_after_mb']} MB",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

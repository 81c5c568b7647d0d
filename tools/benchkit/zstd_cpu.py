"""Where a zstd restore's CPU goes: wall time and thread CPU of the main thread and the others.

Restores the bench state (``benchkit.state.build_state``) saved four ways (safetensors and torch
format, plain and zstd), rounds interleaved, each file's page cache dropped first. Prints
medians: wall seconds, CPU seconds of the calling thread (parsing, checks, copies into the
tensors) and of every other thread (zstd decode workers, read threads), and the zstd /
uncompressed speed ratio per format. Linux only (``/proc/self/task``).

    PYTHONPATH=$PWD python tools/bench_zstd_cpu.py --size 64MB --rounds 4

The host's other load counts in CPU seconds too (cache misses, migrations): compare runs
made side by side, and say whether the host was shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchkit.state import build_state
from benchkit.units import parse_size
from ckptstore import CheckpointManager

VARIANTS = [("safetensors", None), ("safetensors", "zstd"), ("torch", None), ("torch", "zstd")]


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of every thread of this process, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[tid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def drop_cache(path: Path) -> None:
    """Ask the kernel to drop the page cache of every file under ``path``."""
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main(argv: list[str] | None = None) -> int:
    """Run on its own: ``--size`` parameter bytes, ``--rounds`` interleaved rounds."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--size", default="64MB", help="parameter bytes (state is 3x: AdamW)")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    model, opt, _ = build_state(parse_size(args.size))

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    me = str(os.getpid())
    runs: dict[tuple[str, str | None], list[tuple[float, float, float]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as d:
        for fmt, comp in VARIANTS:
            with CheckpointManager(
                Path(d) / f"{fmt}-{comp}", keep=None, format=fmt, compression=comp
            ) as mgr:
                mgr.save(1, state())
        for r in range(args.rounds):
            for fmt, comp in VARIANTS[r % 4 :] + VARIANTS[: r % 4]:
                root = Path(d) / f"{fmt}-{comp}"
                drop_cache(root)
                with CheckpointManager(root, keep=None, format=fmt, compression=comp) as mgr:
                    before = thread_cpu()
                    t0, c0 = time.perf_counter(), time.thread_time()
                    mgr.restore(state(), step=1)
                    wall, main_cpu = time.perf_counter() - t0, time.thread_time() - c0
                    after = thread_cpu()
                others = sum(c - before.get(t, 0.0) for t, c in after.items() if t != me)
                runs[fmt, comp].append((wall, main_cpu, others))
    med = {v: [statistics.median(x[i] for x in runs[v]) for i in range(3)] for v in VARIANTS}
    print(f"medians of {args.rounds} rounds, state {args.size} params + AdamW")
    for (fmt, comp), (wall, main_cpu, others) in med.items():
        print(
            f"  {fmt:11} {comp or '-':4}  wall {wall:.3f} s  main thread {main_cpu:.3f} "
            f"CPU-s  other threads {others:.3f} CPU-s"
        )
    for fmt in ("safetensors", "torch"):
        ratio = med[fmt, None][0] / med[fmt, "zstd"][0]
        print(f"  {fmt}: zstd restore {ratio:.2f}x the speed of the uncompressed one")
    return 0

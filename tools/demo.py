"""`make demo`: a 2-rank DDP training run is SIGKILLed mid-checkpoint and resumes exactly.

1. a reference run trains 60 steps without interruption;
2. the same job checkpoints every 5 steps; rank 0 is SIGKILLed while writing a checkpoint;
   the surviving rank gets a BarrierTimeout naming rank 0 instead of hanging;
3. the job is relaunched: it resumes from the newest checkpoint that verifies and finishes;
4. the final parameters, optimizer state and EMA are compared bit for bit with the reference;
5. `ckptstore ls` and `ckptstore verify --all` show the store.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rendezvous import reserved_port  # tools/ (this script's directory) is on sys.path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "demo-run"
WORLD = 2
STEPS = 60
KILL_AT = 34  # the save of step 34 (every 5 steps: 4, 9, ..., 34)


def env_for(rank: int, world: int, master_port: int) -> dict[str, str]:
    """The environment of one rank, as torchrun would set it."""
    return dict(
        os.environ,
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        # gloo's C++ logs repeat what BarrierTimeout says, with stack traces
        TORCH_CPP_LOG_LEVEL="FATAL",
    )


def run_ranks(
    cmd: list[str], world: int, results: Path, *, timeout: float, prog: str
) -> list[dict[str, Any]]:
    """Run ``cmd`` as ``world`` ranks; each rank's JSON result (``results.rankN``), by rank."""
    with reserved_port() as p:
        procs = [subprocess.Popen(cmd, env=env_for(r, world, p)) for r in range(world)]
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                sys.exit(f"{prog}: {results.name} hung past {timeout}s — this is a bug")
    out = []
    for rank, proc in enumerate(procs):
        f = results.parent / f"{results.name}.rank{rank}"
        res = json.loads(f.read_text()) if f.exists() else {}
        res["returncode"] = proc.returncode
        out.append(res)
    return out


def launch(store: Path, tag: str, *extra: str, timeout: float = 120) -> list[dict[str, Any]]:
    cmd = [
        sys.executable,
        str(ROOT / "tools" / "demo_train.py"),
        "--store",
        str(store),
        "--steps",
        str(STEPS),
        "--result",
        str(WORK / tag),
        *extra,
    ]
    return run_ranks(cmd, WORLD, WORK / tag, timeout=timeout, prog="demo")


def cli(*args: str) -> None:
    print(f"\n$ ckptstore {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "ckptstore", *args], cwd=ROOT, check=False)


def main() -> int:
    t0 = time.monotonic()
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    ref_store, store = WORK / "reference", WORK / "ckpt"

    print(f"== 1. reference: {WORLD} ranks, {STEPS} steps, no interruption", flush=True)
    ref = launch(ref_store, "reference")
    assert all(r["returncode"] == 0 for r in ref), ref

    print(
        f"\n== 2. the same job, rank 0 SIGKILLed in the middle of saving step {KILL_AT}", flush=True
    )
    crashed = launch(store, "crashed", "--kill-at-save", str(KILL_AT))
    print(f"  exit codes: {[r['returncode'] for r in crashed]} (-9 = SIGKILL)")
    leftovers = sorted(p.name for p in store.iterdir())
    print(f"  store after the crash: {', '.join(leftovers)}")
    assert f"step-{KILL_AT:012d}" not in leftovers, "a half-written checkpoint is visible!"
    cli("ls", str(store))

    print("\n== 3. relaunch: resume from the newest checkpoint that verifies", flush=True)
    resumed = launch(store, "resumed")
    assert all(r["returncode"] == 0 for r in resumed), resumed

    print("\n== 4. compare with the uninterrupted run", flush=True)
    ok = True
    for a, b in zip(ref, resumed, strict=True):
        for key in ("model", "optimizer", "ema"):
            same = a[key] == b[key]
            ok &= same
            print(
                f"  rank {a['rank']} {key:9s} reference {a[key]}  resumed {b[key]}  "
                f"{'IDENTICAL' if same else 'DIFFERENT'}"
            )
    cli("ls", str(store))
    cli("verify", str(store), "--all")
    took = time.monotonic() - t0
    verdict = "bit-identical to the uninterrupted run" if ok else "NOT identical"
    print(f"\ndemo: resumed at step {resumed[0]['start']}, finished {verdict} ({took:.0f}s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

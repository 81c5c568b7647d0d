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

from rankserver import RankServer  # tools/ (this script's directory) is on sys.path
from rendezvous import reserved_port

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "demo-run"
WORLD = 2
STEPS = 60
KILL_AT = 34  # the save of step 34 (every 5 steps: 4, 9, ..., 34)


def rank_server(script: str, *preload: str) -> RankServer:
    """A fork server for the ranks of ``tools/SCRIPT.py`` (``tools/rankserver.py``): it
    imports torch, ckptstore, the script and ``preload`` once (a fresh interpreter a rank
    spent 5-7 s of CPU on that), then forks every rank of every launch, each still its own
    process with its own gloo group, pid and exit status, in the environment torchrun would
    give it."""
    # gloo's C++ logs repeat what BarrierTimeout says, with stack traces; c10 reads the
    # level when torch is imported, in the server.
    return RankServer([script, *preload], dict(os.environ, TORCH_CPP_LOG_LEVEL="FATAL"))


def run_ranks(
    server: RankServer,
    script: str,
    argv: list[str],
    world: int,
    results: Path,
    *,
    timeout: float,
    prog: str,
) -> list[dict[str, Any]]:
    """Run ``main(argv)`` of ``tools/SCRIPT.py`` as ``world`` ranks (1: one process, no
    torchrun variables); each rank's JSON result (``results.rankN``, or ``results.single``
    for one process), by rank, with its exit code. A rank that fails (the demos kill one)
    leaves the others to find out."""
    with reserved_port() as p:
        codes = server.run(f"{script}:main", [argv], world, p, timeout, keep_going=True)
    if any(codes.get(r) is None for r in range(world)):
        sys.exit(f"{prog}: {results.name} hung past {timeout}s — this is a bug")
    out = []
    for rank in range(world):
        f = results.parent / f"{results.name}.rank{rank}"
        if not f.exists():
            f = results.parent / f"{results.name}.single"
        res = json.loads(f.read_text()) if f.exists() else {}
        res["returncode"] = codes[rank]
        out.append(res)
    return out


def launch(
    server: RankServer, store: Path, tag: str, *extra: str, timeout: float = 120
) -> list[dict[str, Any]]:
    argv = ["--store", str(store), "--steps", str(STEPS), "--result", str(WORK / tag), *extra]
    return run_ranks(server, "demo_train", argv, WORLD, WORK / tag, timeout=timeout, prog="demo")


def cli(*args: str) -> None:
    print(f"\n$ ckptstore {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "ckptstore", *args], cwd=ROOT, check=False)


def main() -> int:
    t0 = time.monotonic()
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    ref_store, store = WORK / "reference", WORK / "ckpt"

    server = rank_server("demo_train")
    print(f"== 1. reference: {WORLD} ranks, {STEPS} steps, no interruption", flush=True)
    ref = launch(server, ref_store, "reference")
    assert all(r["returncode"] == 0 for r in ref), ref

    print(
        f"\n== 2. the same job, rank 0 SIGKILLed in the middle of saving step {KILL_AT}", flush=True
    )
    crashed = launch(server, store, "crashed", "--kill-at-save", str(KILL_AT))
    print(f"  exit codes: {[r['returncode'] for r in crashed]} (-9 = SIGKILL)")
    leftovers = sorted(p.name for p in store.iterdir())
    print(f"  store after the crash: {', '.join(leftovers)}")
    assert f"step-{KILL_AT:012d}" not in leftovers, "a half-written checkpoint is visible!"
    cli("ls", str(store))

    print("\n== 3. relaunch: resume from the newest checkpoint that verifies", flush=True)
    resumed = launch(server, store, "resumed")
    server.close()
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

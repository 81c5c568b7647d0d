"""`make demo-fsdp`: an FSDP2 job is SIGKILLed mid-save, then resumes on 3 ranks and on 1.

1. 2 ranks (FSDP2 ``fully_shard`` on gloo/CPU, a small model whose sizes split unevenly)
   train and checkpoint every 4 steps; rank 0 SIGKILLs itself inside the sharded save of
   step 15, right after writing its shard; rank 1 gets a BarrierTimeout naming rank 0. The
   killed step is invisible: ``mgr.steps()`` ends at the last committed step.
2. 3 ranks resume from it into a freshly initialised FSDP2 model and a fresh AdamW: every
   full tensor of the model and the optimizer moments equals what the 2-rank job saved
   (SHA-256 of ``full_tensor()``). They then go on training (same losses as the 2-rank
   run, to float rounding) and checkpoint again, on 3 ranks.
3. One process, no process group: ``CheckpointManager(root).restore`` into a plain model
   and a plain AdamW, for the step saved by 2 ranks and the newest one saved by 3 ranks:
   every tensor equals the one the job had when it saved.

Exits non-zero on any mismatch. Forks its ranks itself (``demo.rank_server``: no torchrun, one
import of torch for every rank of the three launches).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from demo import rank_server, run_ranks  # one launcher for both demos  # noqa: E402
from rankserver import RankServer  # noqa: E402

STEPS = 24
EVERY = 4  # saves at steps 3, 7, 11, 15, 19, 23
KILL_AT = 15
KILL_RANK = 0
CRASH_TIMEOUT = 6.0  # barrier_timeout of the job that is killed: how long rank 1 waits


def launch(
    server: RankServer, world: int, work: Path, tag: str, *extra: str, timeout: float = 120
) -> list[dict[str, Any]]:
    """Run ``world`` ranks of tools/demo_fsdp_train.py; their results, by rank."""
    argv = ["--store", str(work / "ckpt"), "--result", str(work / tag)]
    argv += ["--steps", str(STEPS), "--every", str(EVERY), *extra]
    return run_ranks(
        server, "demo_fsdp_train", argv, world, work / tag, timeout=timeout, prog="demo-fsdp"
    )


def single(
    server: RankServer, work: Path, steps: list[int], timeout: float = 120
) -> dict[str, Any]:
    """One process, no process group (no torchrun variables in its environment)."""
    argv = ["--single", "--store", str(work / "ckpt"), "--result", str(work / "single")]
    argv += ["--check-steps", ",".join(map(str, steps))]
    (res,) = run_ranks(
        server, "demo_fsdp_train", argv, 1, work / "single", timeout=timeout, prog="demo-fsdp"
    )
    return res


class Report:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def check(self, ok: bool, what: str) -> bool:
        if not ok:
            self.failures.append(what)
            print(f"  MISMATCH: {what}", flush=True)
        return ok

    def same(self, want: dict[str, str] | None, got: dict[str, str] | None, what: str) -> None:
        """Compare two digest tables; print one line (and every difference)."""
        want, got = want or {}, got or {}
        moments = [k for k in want if k.endswith(("/exp_avg", "/exp_avg_sq"))]
        keys = sorted(set(want) | set(got))
        bad = [k for k in keys if want.get(k) != got.get(k)]
        n_model = sum(k.startswith("model/") for k in want)
        if self.check(bool(want) and bool(moments) and not bad, what):
            print(
                f"  {what}: {len(keys)}/{len(keys)} IDENTICAL ({n_model} model tensors, "
                f"{len(moments)} AdamW moments, steps and hyper-parameters)",
                flush=True,
            )
        for k in bad[:10]:
            print(f"    {k}: saved {want.get(k)}  restored {got.get(k)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=ROOT / "demo-run-fsdp")
    args = ap.parse_args()
    t0 = time.monotonic()
    work: Path = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    store = work / "ckpt"
    rep = Report()
    committed = [s for s in range(EVERY - 1, KILL_AT, EVERY)]
    last_good = committed[-1]

    print(
        f"== FSDP2 1. 2 ranks train {STEPS} steps, checkpoint every {EVERY}; rank {KILL_RANK} "
        f"is SIGKILLed inside the save of step {KILL_AT}, after writing its shard",
        flush=True,
    )
    # FSDP2's first DTensor imports torch._dynamo (1.2-1.6 s of CPU), and every rank's save
    # or restore torch.distributed.checkpoint (0.2-0.3 s a rank): once, in the server.
    server = rank_server(
        "demo_fsdp_train",
        "torch.distributed.fsdp",
        "torch._dynamo",
        "torch.distributed.checkpoint",
    )
    t = time.monotonic()
    crashed = launch(
        server,
        2,
        work,
        "crashed",
        "--kill-at-save",
        str(KILL_AT),
        "--kill-rank",
        str(KILL_RANK),
        "--timeout",
        str(CRASH_TIMEOUT),
        "--fresh-seed",
        "0",
    )
    codes = [r["returncode"] for r in crashed]
    survivor = crashed[1 - KILL_RANK]
    print(
        f"  exit codes: {codes} (-9 = SIGKILL, 2 = BarrierTimeout)  [{time.monotonic() - t:.0f}s]"
    )
    rep.check(codes[KILL_RANK] == -9, f"rank {KILL_RANK} was not SIGKILLed (exit {codes})")
    rep.check(
        survivor.get("timeout", {}).get("missing") == [KILL_RANK],
        f"rank {1 - KILL_RANK} did not report rank {KILL_RANK} missing: {survivor.get('timeout')}",
    )
    steps = survivor.get("steps_after_timeout")
    entries = sorted(p.name for p in store.iterdir() if not p.name.startswith(".ckptstore"))
    print(f"  store after the crash: {', '.join(entries)}")
    print(f"  rank {1 - KILL_RANK}'s mgr.steps() = {steps}: step {KILL_AT} is invisible")
    rep.check(steps == committed, f"steps after the crash {steps}, expected {committed}")
    saved_2 = {int(k): v for k, v in survivor.get("saved", {}).items()}
    killed_saved = {int(k): v for k, v in crashed[KILL_RANK].get("saved", {}).items()}
    rep.check(
        saved_2.get(last_good) is not None
        and saved_2.get(last_good) == killed_saved.get(last_good),
        f"the two ranks disagree on the full tensors of step {last_good}",
    )

    print(
        "\n== 2. resume on 3 ranks into a fresh FSDP2 model (other seed) and a fresh AdamW",
        flush=True,
    )
    t = time.monotonic()
    resumed = launch(server, 3, work, "resumed", "--fresh-seed", "99")
    print(f"  exit codes: {[r['returncode'] for r in resumed]}  [{time.monotonic() - t:.0f}s]")
    rep.check(all(r["returncode"] == 0 for r in resumed), "the 3-rank job failed")
    r0 = resumed[0]
    rep.check(
        all(r.get("start") == last_good + 1 for r in resumed),
        f"3 ranks resumed at {[r.get('start') for r in resumed]}, expected {last_good + 1}",
    )
    rep.check(
        r0.get("steps_at_start") == committed,
        f"3 ranks saw steps {r0.get('steps_at_start')}",
    )
    for r in resumed:
        if r["rank"] == 0:
            rep.same(
                saved_2.get(last_good),
                r.get("restored", {}).get("digests"),
                f"full tensors restored on 3 ranks vs saved by 2 ranks at step {last_good}",
            )
        else:
            rep.check(
                r.get("restored") == r0.get("restored"),
                f"rank {r['rank']} restored other tensors than rank 0",
            )
    shapes = {r["rank"]: r.get("local_shapes", {}) for r in resumed}
    print(
        "  local shards of head.weight (2 x 5) on 3 ranks: "
        + ", ".join(f"rank {k} {v.get('head.weight')}" for k, v in shapes.items())
    )
    # Training goes on from the restored step: the steps the 2-rank job ran after its last
    # checkpoint give the same losses on 3 ranks (to float rounding: other reduction order).
    redo = range(last_good + 1, KILL_AT + 1)
    l2, l3 = survivor.get("losses", {}), r0.get("losses", {})
    diffs = [
        abs(l3[str(s)] - l2[str(s)]) / max(abs(l2[str(s)]), 1e-12)
        for s in redo
        if str(s) in l2 and str(s) in l3
    ]
    worst = max(diffs, default=float("inf"))
    print(
        f"  loss of steps {redo.start}..{redo.stop - 1}: 2 ranks "
        f"{[round(l2.get(str(s), float('nan')), 6) for s in redo]}, 3 ranks "
        f"{[round(l3.get(str(s), float('nan')), 6) for s in redo]} (max rel. diff {worst:.1e})"
    )
    rep.check(
        len(diffs) == len(redo) and worst < 1e-4, "training did not continue from the restore"
    )
    saved_3 = {int(k): v for k, v in r0.get("saved", {}).items()}
    print(
        f"  3 ranks trained on to step {STEPS - 1} and saved steps {sorted(saved_3)}; "
        f"store: {r0.get('steps_at_end')}"
    )
    rep.check(bool(saved_3), "the 3-rank job saved nothing")

    newest = max(saved_3, default=-1)
    print(
        f"\n== 3. one process, no process group: restore steps {last_good} (saved by 2 ranks) "
        f"and {newest} (saved by 3 ranks) into a plain model + AdamW",
        flush=True,
    )
    t = time.monotonic()
    one = single(server, work, [last_good, newest])
    server.close()
    print(f"  exit code: {one['returncode']}  [{time.monotonic() - t:.0f}s]")
    rep.check(one["returncode"] == 0, "the single-process restore failed")
    got = one.get("restored", {})
    for s in (last_good, newest):
        r = got.get(str(s), {})
        rep.check(r.get("plain") is True, f"step {s}: the model is not plain after restore")
        rep.check(r.get("state_step") == s, f"step {s}: state['step'] is {r.get('state_step')}")
    rep.same(
        saved_2.get(last_good),
        got.get(str(last_good), {}).get("digests"),
        f"step {last_good}: 1 process vs 2 ranks",
    )
    rep.same(
        saved_3.get(newest),
        got.get(str(newest), {}).get("digests"),
        f"step {newest}: 1 process vs 3 ranks",
    )
    took = time.monotonic() - t0
    if rep.failures:
        print(f"\ndemo-fsdp: FAILED, {len(rep.failures)} mismatch(es) ({took:.0f}s)")
        for f in rep.failures:
            print(f"  - {f}")
        return 1
    print(
        f"\ndemo-fsdp: killed mid-save on 2 ranks, step {KILL_AT} invisible; resumed on 3 ranks "
        f"and in 1 process bit-identical to step {last_good} ({took:.0f}s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Two versions of ckptstore side by side: the sharded save and restores, alternating.

    .venv/bin/python tools/bench_ab.py --baseline d3f5b2f                 # 768 MB, 4 rounds
    .venv/bin/python tools/bench_ab.py --baseline HEAD~3 --ops restore-2to3 --live
    .venv/bin/python tools/bench_ab.py --baseline main --size 64MB --rounds 2 --json ab.json

``tools/bench.py --sharded`` compares ckptstore with DCP and the raw disk in one run; two
runs of one code on the 2-core test VM gave figures 13-33% apart, so a change to ckptstore
itself cannot be judged from two bench runs. This tool runs this tree's ckptstore and the
one of commit ``--baseline`` (extracted with ``git archive``) on the bench's FSDP2 state
(``benchkit.sharded.build``: a GPT-2-like model and AdamW), one operation at a time, the two
versions one after the other in every round (which goes first alternates), and reports for
each the median time of the slowest rank, the median CPU seconds summed over the ranks, and
in how many rounds the current tree was the faster. Every rank is forked by a server of its
version (``tools/rankserver.py``) that imported that version's ckptstore (``PYTHONPATH``),
torch and the model's code once; each version restores a store it saved itself (untimed),
so a baseline from before a format change reads its own format. Restores are cold
(``posix_fadvise(DONTNEED)`` on every file first) and checked against the saved values.

Operations: ``save-2`` (a fresh manager's first save on 2 ranks, into a new directory each
time), ``restore-2to1`` (into 1 process, no process group), ``restore-2to3``,
``restore-4to2``. ``--live``: restore into an initialized model and an optimizer that took a
step (the caller's own memory), else into new, untouched targets as the bench does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from baseline import extract
from rankserver import RankServer
from rendezvous import reserved_port

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
OPS = ("save-2", "restore-2to1", "restore-2to3", "restore-4to2")


def parse_op(op: str) -> tuple[str, int, int]:
    """``(kind, saved world, world)`` of an operation's name."""
    if op.startswith("save-"):
        n = int(op.split("-")[1])
        return "save", n, n
    saved, world = op.split("-")[1].split("to")
    return "restore", int(saved), int(world)


def parse_size(text: str) -> int:
    """``256MB`` -> bytes (powers of 1024, as ``tools/bench.py``)."""
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
    for suffix, mult in units.items():
        if text.upper().endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    return int(text)


def sign_test(wins: int, rounds: int) -> float:
    """Two-sided sign test: how likely ``wins`` of ``rounds`` (or a split as lopsided) is
    when neither version is faster. On the 2-core VM one code's rounds spread 0.63-0.99 s of
    CPU for one restore (2026-11-30): a median ratio alone, 1.04x for a tree against
    itself, reads as a difference it is not. 1.0 without rounds."""
    if rounds <= 0:
        return 1.0
    tail = min(wins, rounds - wins)
    p = 2 * sum(math.comb(rounds, k) for k in range(tail + 1)) / (1 << rounds)
    return min(1.0, p)


def verdict(wins: int, rounds: int) -> str:
    """``faster``, ``slower`` or ``noise``: the current tree's, at the 5% level (the sign test
    needs 6 rounds, all one way)."""
    if sign_test(wins, rounds) > 0.05:
        return "noise"
    return "faster" if wins * 2 > rounds else "slower"


def order_of(r: int) -> list[str]:
    """The versions in the order round ``r`` (from 0) runs them: which goes first alternates."""
    return ["current", "baseline"] if r % 2 == 0 else ["baseline", "current"]


# ---- one rank (a fresh interpreter of one version) -----------------------------------------------


def rank_main(spec: dict[str, Any]) -> None:
    """One rank of one operation; writes its result as JSON to ``spec["out"]/rank<R>.json``."""
    import torch

    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world)
    from benchkit.disk import drop_cache
    from benchkit.sharded import barrier, build, sums

    import ckptstore
    from ckptstore import CheckpointManager

    kind = spec["kind"]
    model, opt = build(spec["param_bytes"], world, init=kind == "save" or spec["live"])
    state = {"model": model, "optimizer": opt}
    store = Path(spec["store"])
    out: dict[str, Any] = {"rank": rank, "ckptstore": str(Path(ckptstore.__file__).parent)}
    mgr = CheckpointManager(store, keep=None, barrier_timeout=600)
    if kind == "restore" and rank == 0:
        drop_cache(store)  # a cold restore
    barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    if kind == "save":
        mgr.save(1, state)
    else:
        mgr.restore(state)
    out["seconds"], out["cpu"] = time.perf_counter() - t0, time.process_time() - c0
    mgr.close()
    out["sums"] = sums(model, opt)
    barrier()
    (Path(spec["out"]) / f"rank{rank}.json").write_text(json.dumps(out))
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


# ---- the driver ----------------------------------------------------------------------------------


def rank_server(code: Path) -> RankServer:
    """A fork server (``tools/rankserver.py``) that imported ``code``'s ckptstore (by
    ``PYTHONPATH``), torch, FSDP2 and the bench's model once, for every rank of that version:
    a fresh interpreter a rank spent 5-7 s of CPU on those, outside the timed operation."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(code), str(TOOLS)]))
    preload = ["benchkit.sharded", "benchkit.disk", "torch.distributed.fsdp", "torch._dynamo"]
    return RankServer([*preload, "ckptstore", "ckptstore.manager"], env)


def run_ranks(
    server: RankServer, spec: dict[str, Any], world: int, work: Path, timeout: float
) -> list[dict[str, Any]]:
    """Run one operation on ``world`` ranks forked by ``server`` (one version's)."""
    outs = []
    for rank in range(world):
        out = work / f"rank{rank}.json"
        out.unlink(missing_ok=True)
        outs.append(out)
    with reserved_port() as port:
        codes = server.run("bench_ab:rank_main", [{**spec, "out": str(work)}], world, port, timeout)
    got = [codes.get(r) for r in range(world)]
    if None in got:
        sys.exit(f"bench_ab: {spec['kind']} on {world} rank(s) hung past {timeout}s")
    if any(got):
        sys.exit(f"bench_ab: {spec['kind']} on {world} rank(s) failed: exit codes {got}")
    return [json.loads(o.read_text()) for o in outs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, metavar="REV", help="the commit to compare with")
    p.add_argument("--size", default="256MB", help="parameter bytes (the state is ~3x)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)}")
    p.add_argument("--live", action="store_true", help="restore into initialized targets")
    p.add_argument("--timeout", type=float, default=600.0, help="per operation, seconds")
    p.add_argument("--dir", type=Path, default=None, help="where the stores go (default: tmp)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in ops if o not in OPS]
    if bad:
        p.error(f"unknown operation(s) {bad}; choose from {', '.join(OPS)}")
    param_bytes = parse_size(args.size)
    base = Path(tempfile.mkdtemp(prefix="ckpt-ab-", dir=args.dir))
    stack = contextlib.ExitStack()  # the two versions' rank servers
    try:
        codes = {"current": ROOT, "baseline": extract(args.baseline, base / "code")}
        servers = {v: stack.enter_context(rank_server(code)) for v, code in codes.items()}
        times: dict[tuple[str, str], list[float]] = {}
        cpus: dict[tuple[str, str], list[float]] = {}
        saved_sums: dict[tuple[str, int], list[float]] = {}
        for r in range(args.rounds):
            order = order_of(r)
            for op in ops:
                kind, saved, world = parse_op(op)
                for v in order:
                    work = base / v
                    work.mkdir(exist_ok=True)
                    if kind == "restore" and (v, saved) not in saved_sums:  # untimed, once
                        setup: dict[str, Any] = {"kind": "save", "param_bytes": param_bytes}
                        setup.update(live=True, store=str(work / f"store-{saved}"))
                        res = run_ranks(servers[v], setup, saved, work, args.timeout)
                        saved_sums[(v, saved)] = res[0]["sums"]
                    spec: dict[str, Any] = {"kind": kind, "param_bytes": param_bytes}
                    spec["live"] = args.live
                    if kind == "save":
                        spec["store"] = str(work / f"save-{r}")
                    else:
                        spec["store"] = str(work / f"store-{saved}")
                    res = run_ranks(servers[v], spec, world, work, args.timeout)
                    where = {x["ckptstore"] for x in res}
                    want = str(codes[v] / "ckptstore")
                    if where != {want}:
                        sys.exit(f"bench_ab: {v} ran the ckptstore of {where}, not {want}")
                    if kind == "restore":
                        got, exp = res[0]["sums"], saved_sums[(v, saved)]
                        if any(
                            abs(a - b) > 1e-9 * max(1.0, abs(b))
                            for a, b in zip(got, exp, strict=True)
                        ):
                            sys.exit(f"bench_ab: {v} {op} restored other values: {got} != {exp}")
                    else:
                        shutil.rmtree(spec["store"], ignore_errors=True)
                    seconds = max(x["seconds"] for x in res)
                    cpu = sum(x["cpu"] for x in res)
                    times.setdefault((v, op), []).append(seconds)
                    cpus.setdefault((v, op), []).append(cpu)
                    print(
                        f"round {r + 1} {op:<13} {v:<8} {seconds:7.3f} s  cpu {cpu:6.3f} s",
                        flush=True,
                    )
        rows = []
        for op in ops:
            cur, old = times[("current", op)], times[("baseline", op)]
            wins = sum(c < b for c, b in zip(cur, old, strict=True))
            rows.append(
                {
                    "op": op,
                    "current_s": statistics.median(cur),
                    "baseline_s": statistics.median(old),
                    "current_cpu": statistics.median(cpus[("current", op)]),
                    "baseline_cpu": statistics.median(cpus[("baseline", op)]),
                    "speed_ratio": statistics.median(old) / statistics.median(cur),
                    "current_faster_rounds": wins,
                    "rounds": len(cur),
                    "sign_test_p": sign_test(wins, len(cur)),
                    "verdict": verdict(wins, len(cur)),
                    "spread": {
                        "current": max(cur) / min(cur),
                        "baseline": max(old) / min(old),
                    },
                    "times": {"current": cur, "baseline": old},
                    "cpus": {"current": cpus[("current", op)], "baseline": cpus[("baseline", op)]},
                }
            )
        print(f"\ncurrent tree vs {args.baseline} (medians of {args.rounds} rounds, alternating)")
        print(
            f"{'op':<13} {'current s':>9} {'baseline s':>10} {'speed':>6} {'faster':>6} "
            f"{'p':>5} {'verdict':>7} {'spread':>11} {'cpu cur':>7} {'cpu base':>8}"
        )
        for row in rows:
            spread = f"{row['spread']['current']:.2f}/{row['spread']['baseline']:.2f}"
            print(
                f"{row['op']:<13} {row['current_s']:9.3f} {row['baseline_s']:10.3f} "
                f"{row['speed_ratio']:5.2f}x {row['current_faster_rounds']:>3}/{row['rounds']:<2} "
                f"{row['sign_test_p']:5.2f} {row['verdict']:>7} {spread:>11} "
                f"{row['current_cpu']:7.3f} {row['baseline_cpu']:8.3f}"
            )
        print(
            "p: the sign test's chance of such a split of the rounds with no difference; "
            "spread: max/min of each version's times"
        )
        if args.json is not None:
            doc = {
                "baseline": args.baseline,
                "size": args.size,
                "rounds": args.rounds,
                "live": args.live,
                "loadavg_end": os.getloadavg(),
                "results": rows,
            }
            args.json.write_text(json.dumps(doc, indent=1))
    finally:
        stack.close()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Coordination of sharded saves and restores, measured with real processes (issue 21).

For each world size (``--worlds 2 4 8 16``), forks that many ranks (gloo on CPU, one
machine), each holding a small FSDP2 model (``--layers`` linear layers, ``fully_shard`` on a
1-D mesh, AdamW state, so 3 DTensors a parameter) and:

1. saves it twice (the first save plans; the second reuses the plan), then
2. restores the newest step into a fresh model on the same world size.

Every rank reports what its ``Coordinator`` exchanged (``Coordinator.stats``: collectives,
torch calls, bytes sent and received) and the CPU seconds of each save phase (the save
pipeline's phase clock), for the first save, the second, and the restore. The summary
prints rank 0 and the largest non-zero figure (the worst non-zero rank) per world size;
``--json`` keeps every rank's numbers and ``--plot`` draws received bytes and coordination
CPU against the world size (matplotlib).

What to expect (the design, docs/design.md#what-each-rank-exchanges): a non-zero rank's
bytes and collectives stay flat as the world grows; rank 0 receives one slot per rank.
Timings on a 2-core machine running 16 processes measure contention, not the protocol:
read the bytes and counts, and the CPU seconds only as a trend.

    .venv/bin/python tools/scale_real.py --worlds 2 4 8 16 --json out.json --plot docs/scale.png

``--tp T`` builds FSDP2 over tensor parallelism instead (torchtitan's 2-D layout): a
``(world / T, T)`` mesh, the layers column- and row-wise parallel on ``"tp"``, FSDP2 on
``"dp"``; its column-wise weights are ``(_StridedShard(0, T), Shard(0))``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from baseline import extract  # noqa: E402
from benchkit.units import binary as _b  # noqa: E402
from rankserver import RankServer  # noqa: E402
from rendezvous import reserved_port  # noqa: E402


def rank_entry(store: str, result: str, layers: int, tp: int = 1) -> None:
    """One rank, forked by ``measure``'s ``RankServer``: see ``rank_main``."""
    rank_main(argparse.Namespace(store=store, result=result, layers=layers, tp=tp))


def rank_main(args: argparse.Namespace) -> None:
    """One rank: build, save twice, restore; write what its coordinator exchanged."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from ckptstore import CheckpointManager

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    tp = int(getattr(args, "tp", 1) or 1)

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        # Odd sizes: FSDP2's shards of dim 0 are uneven on most world sizes.
        model = nn.Sequential(*(nn.Linear(24, 24) for _ in range(args.layers)))
        if tp > 1:  # FSDP2 over TP on (world / tp, tp): layers column- then row-wise
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )

            mesh2 = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
            plan: dict[str, Any] = {
                str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
                for i in range(args.layers)
            }
            parallelize_module(model, mesh2["tp"], plan)
            mesh = mesh2["dp"]
        else:
            mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, 24)).sum().backward()
        opt.step()
        return model, opt

    model, opt = build()
    wire = Wire()
    out: dict[str, Any] = {"rank": rank, "world": world}
    with CheckpointManager(args.store, keep=None, barrier_timeout=120) as mgr:
        stats = getattr(mgr.coord, "stats", None)  # the baseline's coordinator has none

        def timed(tag: str, call: Any) -> None:
            if stats is not None:
                stats.clear()
            wire.take()
            wire.on = True
            t0, c0 = time.perf_counter(), time.process_time()
            call()
            out[tag] = {
                **wire.take(),
                "wall": time.perf_counter() - t0,
                "cpu": time.process_time() - c0,
                "collectives": len(stats.records) if stats is not None else None,
                "by_phase": _by_phase(stats.records) if stats is not None else {},
            }
            wire.on = False

        timed("save1", lambda: mgr.save(1, {"model": model, "optimizer": opt}))
        timed("save2", lambda: mgr.save(2, {"model": model, "optimizer": opt}))
        fresh, fresh_opt = build()
        timed("restore", lambda: mgr.restore({"model": fresh, "optimizer": fresh_opt}))

        def full(p: torch.Tensor) -> torch.Tensor:
            assert isinstance(p, DTensor)  # fully_shard's parameters
            return p.full_tensor()

        same = all(
            torch.equal(full(a), full(b))
            for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
        )
        out["restored_equal"] = bool(same)
        out["format_version"] = mgr.manifest().format_version
    Path(f"{args.result}.rank{rank}").write_text(json.dumps(out))
    dist.destroy_process_group()


class Wire:
    """Bytes and calls through ``torch.distributed`` while ``on``: what a rank put on the wire.

    Counted at torch.distributed's functions (patched there and in ``distributed_c10d``, where
    its own object collectives look them up), so the same count applies to any version of ckptstore,
    the baseline included. Logical payloads, as ``ckptstore.dist.CollectiveStats`` counts
    them: an all-gather brings a rank every other rank's tensor, a gather brings ``dst``
    every other rank's, a broadcast brings its tensor to every rank but ``src``.
    """

    def __init__(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.on = False
        self.sent = self.received = self.calls = 0
        me = c10d.get_rank

        def wrap(name: str, count: Any) -> None:
            real = getattr(c10d, name)

            def patched(*a: Any, **k: Any) -> Any:
                if self.on:
                    self.calls += 1
                    sent, received = count(me(), *a, **k)
                    self.sent += sent
                    self.received += received
                return real(*a, **k)

            setattr(c10d, name, patched)  # torch's object collectives call these
            setattr(dist, name, patched)  # ckptstore calls these

        def nb(t: Any) -> int:
            return int(t.numel() * t.element_size())

        def all_gather(rank: int, out: list[Any], t: Any, *a: Any, **k: Any) -> tuple[int, int]:
            return nb(t), sum(nb(x) for x in out) - nb(t)

        def gather(rank: int, t: Any, gather_list: Any = None, *a: Any, **k: Any) -> Any:
            if gather_list:
                return 0, sum(nb(x) for x in gather_list) - nb(t)
            return nb(t), 0

        def broadcast(rank: int, t: Any, src: int = 0, *a: Any, **k: Any) -> tuple[int, int]:
            return (nb(t), 0) if rank == k.get("src", src) else (0, nb(t))

        def send(rank: int, t: Any, *a: Any, **k: Any) -> tuple[int, int]:
            return nb(t), 0

        def recv(rank: int, t: Any, *a: Any, **k: Any) -> tuple[int, int]:
            return 0, nb(t)

        def nothing(rank: int, *a: Any, **k: Any) -> tuple[int, int]:
            return 0, 0

        wrap("all_gather", all_gather)
        wrap("gather", gather)
        wrap("broadcast", broadcast)
        wrap("send", send)
        wrap("recv", recv)
        for name in ("barrier", "monitored_barrier", "all_reduce"):
            wrap(name, nothing)

    def take(self) -> dict[str, int]:
        """The counts so far, and start again from zero."""
        out = {"sent": self.sent, "received": self.received, "calls": self.calls}
        self.sent = self.received = self.calls = 0
        return out


def _by_phase(records: list[tuple[str, str, int, int, int, float]]) -> dict[str, list[Any]]:
    """``{phase: [op, sent, received, calls]}`` summed over the phase's records."""
    out: dict[str, list[Any]] = {}
    for phase, op, sent, received, calls, _ in records:
        row = out.setdefault(phase, [op, 0, 0, 0])
        if op != "barrier":
            row[0] = op
        row[1] += sent
        row[2] += received
        row[3] += calls
    return out


def measure(
    worlds: list[int], layers: int, timeout: float, code: Path | None = None, tp: int = 1
) -> list[dict[str, Any]]:
    """Every world size's per-rank results; ``code``: a tree whose ckptstore the ranks run.

    The ranks are forked by a server (``tools/rankserver.py``) that imported, once, what a
    rank imports before its first timed operation (torch, FSDP2 and the torch._dynamo its
    first DTensor pulls in, ckptstore): a fresh interpreter a rank spent 5-7 s of CPU there.
    """
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = str(code)
    preload = [
        "scale_real",
        "torch.distributed.device_mesh",
        "torch.distributed.fsdp",
        "torch._dynamo",
        "ckptstore",
    ]
    runs = []
    with RankServer(preload, env) as server:
        for world in worlds:
            with tempfile.TemporaryDirectory(prefix="ckpt-scale-") as tmp:
                work = Path(tmp)
                args = [str(work / "store"), str(work / "result"), layers, tp]
                with reserved_port() as port:
                    codes = server.run("scale_real:rank_entry", args, world, port, timeout)
                if None in codes.values():
                    sys.exit(f"scale_real: world {world} hung past {timeout}s — this is a bug")
                ranks = []
                for rank in range(world):
                    f = work / f"result.rank{rank}"
                    res = json.loads(f.read_text()) if f.exists() else {}
                    res["returncode"] = codes[rank]
                    ranks.append(res)
                bad = [r for r in ranks if r.get("returncode") != 0 or not r.get("restored_equal")]
                if bad:
                    sys.exit(f"scale_real: world {world}: a rank failed: {bad[:2]}")
                runs.append({"world": world, "ranks": ranks})
    return runs


def summary(runs: list[dict[str, Any]]) -> str:
    """A table: rank 0 and the worst non-zero rank, per world size and operation."""
    head = (
        f"{'ranks':>5} {'op':<8} {'coll':>4} {'calls':>5} | {'rank 0 recv':>11} "
        f"{'sent':>8} {'cpu s':>6} | {'max other recv':>14} {'sent':>8} {'cpu s':>6} {'fmt':>3}"
    )
    lines = [head, "-" * len(head)]
    for run in runs:
        ranks = run["ranks"]
        for op in ("save1", "save2", "restore"):
            r0 = ranks[0][op]
            others = [r[op] for r in ranks[1:]] or [r0]
            lines.append(
                f"{run['world']:>5} {op:<8} {r0['collectives'] or '-':>4} {r0['calls']:>5} | "
                f"{_b(r0['received']):>11} {_b(r0['sent']):>8} {r0['cpu']:>6.2f} | "
                f"{_b(max(o['received'] for o in others)):>14} "
                f"{_b(max(o['sent'] for o in others)):>8} {max(o['cpu'] for o in others):>6.2f} "
                f"{ranks[0].get('format_version', '-'):>3}"
            )
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Received bytes and CPU seconds against the world size: this tree, and the baseline
    (dashed) when it was measured. Rank 0 and the worst other rank, first save and restore."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    worlds: list[int] = []
    for label, style in (("current", "-"), ("baseline", ":")):
        runs = doc.get(label)
        if not runs:
            continue
        worlds = [r["world"] for r in runs]
        for op, mark in (("save1", "o"), ("restore", "s")):
            for who, pick in (("rank 0", 0), ("worst other rank", 1)):

                def fig_of(r: dict[str, Any], key: str, op: str = op, pick: int = pick) -> float:
                    if pick == 0:
                        return float(r["ranks"][0][op][key])
                    return float(max(x[op][key] for x in r["ranks"][1:]))

                name = f"{label}: {who}, {op}"
                ax1.plot(
                    worlds, [fig_of(r, "received") / 1024 for r in runs], style + mark, label=name
                )
                ax2.plot(worlds, [fig_of(r, "cpu") for r in runs], style + mark, label=name)
    ax1.set(
        xlabel="ranks", ylabel="KB received by ckptstore's collectives", xscale="log", yscale="log"
    )
    ax2.set(xlabel="ranks", ylabel="CPU seconds (whole save / restore)", xscale="log")
    for ax in (ax1, ax2):
        ax.set_xticks(worlds, [str(w) for w in worlds])
        ax.minorticks_off()
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    fig.suptitle("sharded save/restore coordination, real gloo processes (dotted: baseline)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--layers", type=int, default=60)
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="FSDP2 over tensor parallelism of this size on (world / TP, TP) (1: FSDP2 alone)",
    )
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument(
        "--baseline",
        metavar="REV",
        help="also measure the ckptstore of this commit, side by side (e.g. 2f0f77c: before "
        "issue 21's protocol)",
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    p.add_argument("--replot", type=Path, metavar="JSON", help="draw --plot from a saved --json")
    args = p.parse_args()
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.plot)
        return
    runs = measure(args.worlds, args.layers, args.timeout, tp=args.tp)
    print("this tree:\n" + summary(runs))
    doc: dict[str, Any] = {"current": runs}
    if args.baseline:
        with tempfile.TemporaryDirectory(prefix="ckpt-baseline-") as tmp:
            code = extract(args.baseline, Path(tmp))
            doc["baseline"] = measure(args.worlds, args.layers, args.timeout, code, tp=args.tp)
        print(f"\nbaseline {args.baseline}:\n" + summary(doc["baseline"]))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    if args.plot:
        plot(doc, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()

"""What each ckptstore save and restore of the sharded bench shows besides its time
(``benchkit.sharded``).

A save's phases, wall and CPU seconds per rank (``CheckpointManager.last_save_phases`` and
``last_save_cpu``), and the write modes ``io="auto"`` measured in it (``iomode``'s figures:
one per group of part files a rank wrote side by side), so a slow round can be told apart
from a round that tried the other mode. A restore's phases (``last_restore_phases`` and
``last_restore_cpu``): its planning apart from its reads.
"""

from __future__ import annotations

import statistics
from typing import Any


def decided() -> int:
    """How many figures ``iomode`` holds so far in this process (before a save)."""
    from ckptstore.storage import iomode

    return len(iomode.decisions())


def record(out: dict[str, Any], c: str, op: Any, seen: int) -> None:
    """Keep the phases of the save ``op`` just made (ckptstore's only) and the write modes
    measured since ``seen`` (:func:`decided` before it), under contender ``c``."""
    from ckptstore.storage import iomode

    made = [h["mode"] for h in iomode.decisions()[seen:] if h["op"] == "write"]
    out.setdefault("write_modes", {}).setdefault(c, []).append(made)
    mgr = getattr(op, "manager", None)
    if mgr is not None:
        phases = {k: [v, mgr.last_save_cpu.get(k, 0.0)] for k, v in mgr.last_save_phases.items()}
        out.setdefault("phases", {}).setdefault(c, []).append(phases)


def record_restore(out: dict[str, Any], c: str, op: Any) -> None:
    """Keep the phases of the restore ``op`` just made (ckptstore's only), under ``c``."""
    mgr = getattr(op, "manager", None)
    if mgr is not None:
        ph = {k: [v, mgr.last_restore_cpu.get(k, 0.0)] for k, v in mgr.last_restore_phases.items()}
        out.setdefault("restore_phases", {}).setdefault(c, []).append(ph)


def phase_medians(ranks: list[dict[str, Any]], key: str) -> dict[str, list[dict[str, list[float]]]]:
    """By contender, by rank: the median of each phase over the rounds, wall and CPU."""
    out: dict[str, list[dict[str, list[float]]]] = {}
    for r in ranks:
        for c, runs in r.get(key, {}).items():
            names = list(dict.fromkeys(k for run in runs for k in run))
            zero = [0.0, 0.0]
            out.setdefault(c, []).append(
                {
                    k: [statistics.median(x.get(k, zero)[i] for x in runs) for i in (0, 1)]
                    for k in names
                }
            )
    return out


def print_phases(res: dict[str, Any]) -> None:
    """The saves' and the restores' phases, median ms per rank."""
    how = "median ms per rank (wall/cpu; x: = waiting in an exchange)"
    shown = [(f"{c} save", ranks) for c, ranks in res.get("phases", {}).items()]
    for op, by_c in res.get("restore_phases", {}).items():
        shown += [(f"{c} {op}", ranks) for c, ranks in by_c.items()]
    for what, ranks in shown:
        print(f"{what} phases, {how}:")
        for rank, ph in enumerate(ranks):
            cells = [f"{k} {w * 1e3:.0f}/{u * 1e3:.0f}" for k, (w, u) in ph.items() if w >= 0.001]
            print(f"  rank {rank}: " + ", ".join(cells))

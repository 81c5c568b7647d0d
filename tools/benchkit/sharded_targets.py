"""Issue 21's sharded targets, from the rows of the sharded bench (``benchkit.sharded``).

Speed ratios against raw and DCP (median, and best run against best run), the floor of a
checked restore into live tensors (``raw-checked``, ``raw-checked-buffered``: can a restore
that checks every byte reach the goal on this machine at all, and how near ``ckpt-live``
comes), whether 3x DCP's save is within the raw disk's write speed, and the steadiness of
each resharded restore (max/min of its rounds).
"""

from __future__ import annotations

from typing import Any

__all__ = ["targets"]


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 21's sharded targets: speed ratios (median; and best run against best run), and
    the steadiness of each resharded restore (max/min of its rounds)."""

    def get(c: str, op: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["contender"] == c and r["op"] == op), None)

    out = []
    ratios: list[tuple[str, float, str, str, str]] = [
        ("sharded save >= 0.9x raw O_DIRECT write", 0.9, "save-2", "ckpt", "raw"),
        ("sharded save >= 3x DCP", 3.0, "save-2", "ckpt", "dcp"),
    ]
    for op in ("2->1", "2->3", "4->2"):
        key = f"restore-{op.replace('->', 'to')}"
        ratios += [
            (f"resharded restore {op} >= 0.8x raw O_DIRECT read", 0.8, key, "ckpt", "raw"),
            (f"resharded restore {op} >= 2x DCP", 2.0, key, "ckpt", "dcp"),
        ]
    ratios += [
        ("repeated sharded save >= 0.9x raw (2nd save)", 0.9, "save-2", "ckpt-again", "raw"),
        ("DCP API over ckptstore: save >= 1.0x DCP", 1.0, "save-2", "dcp-ckpt", "dcp"),
        ("DCP API over ckptstore: load 2->1 >= 1.0x DCP", 1.0, "restore-2to1", "dcp-ckpt", "dcp"),
        ("DCP API over ckptstore: load 2->3 >= 1.0x DCP", 1.0, "restore-2to3", "dcp-ckpt", "dcp"),
    ]
    for name, need, op, mine, theirs in ratios:
        ours, them = get(mine, op), get(theirs, op)
        if ours is None:
            continue
        value = them["median_s"] / ours["median_s"] if ours and them else None
        best = them["min_s"] / ours["min_s"] if ours and them else None
        out.append(
            {
                "target": name,
                "value": value,
                "value_min": best,
                "threshold": f">= {need}",
                "pass": None if value is None else value >= need,
                "detail": f"{mine} {op} vs {theirs} {op} (speed ratio)",
            }
        )
    # Whether "3x DCP" is a speed the disk has at all: raw is the disk's best (O_DIRECT from
    # one aligned buffer), so where DCP's save already runs at more than a third of raw's
    # speed, no save can be 3x DCP here.
    raw, dcp = get("raw", "save-2"), get("dcp", "save-2")
    if raw is not None and dcp is not None:
        room = dcp["median_s"] / (3.0 * raw["median_s"])
        out.append(
            {
                "target": "ceiling: 3x DCP's save within raw's speed",
                "value": room,
                "value_min": dcp["min_s"] / (3.0 * raw["min_s"]),
                "threshold": ">= 1.0",
                "pass": room >= 1.0,
                "detail": "raw save-2 speed / (3 x dcp save-2 speed): under 1, a save 3x DCP "
                "would outrun the disk's raw write on this machine",
            }
        )
    for op in ("2->1", "2->3", "4->2"):
        # The floor of a checked restore into live tensors (the faster of the two ways):
        # whether this machine lets any restore that checks every byte reach the goal, and
        # how near ckpt-live comes to it.
        key = f"restore-{op.replace('->', 'to')}"
        ways = [r for c in ("raw-checked", "raw-checked-buffered") if (r := get(c, key))]
        raw, live = get("raw", key), get("ckpt-live", key)
        if not ways or raw is None:
            continue
        floor = min(ways, key=lambda r: r["median_s"])
        out.append(
            {
                "target": f"floor: checked restore {op} >= 0.8x raw read",
                "value": raw["median_s"] / floor["median_s"],
                "value_min": raw["min_s"] / min(r["min_s"] for r in ways),
                "threshold": ">= 0.8",
                "pass": raw["median_s"] / floor["median_s"] >= 0.8,
                "detail": f"{floor['contender']} {key} vs raw {key} (speed ratio): can any "
                "restore that checks every byte reach the goal on this machine",
            }
        )
        if live is not None:
            out.append(
                {
                    "target": f"ckpt-live {op} vs its floor (info)",
                    "value": floor["median_s"] / live["median_s"],
                    "value_min": min(r["min_s"] for r in ways) / live["min_s"],
                    "threshold": "info",
                    "pass": None,
                    "detail": f"ckpt-live {key} vs {floor['contender']} {key} (speed ratio)",
                }
            )
    for op in ("2->1", "2->3", "4->2"):
        r = get("ckpt", f"restore-{op.replace('->', 'to')}")
        if r is None:
            continue
        steady = r["n"] > 1  # one round says nothing of the spread between rounds
        out.append(
            {
                "target": f"resharded restore {op} steady: max/min < 1.3",
                "value": r["spread"] if steady else None,
                "value_min": None,
                "threshold": "< 1.3",
                "pass": r["spread"] < 1.3 if steady else None,
                "detail": f"ckpt restore-{op.replace('->', 'to')}: slowest / fastest of "
                f"{r['n']} rounds",
            }
        )
    return out

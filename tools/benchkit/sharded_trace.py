"""What each ckptstore save of the sharded bench shows besides its time (``benchkit.sharded``).

Its phases, wall and CPU seconds per rank (``CheckpointManager.last_save_phases`` and
``last_save_cpu``), and the write modes ``io="auto"`` measured in it (``iomode``'s figures:
one per group of part files a rank wrote side by side), so a slow round can be told apart
from a round that tried the other mode.
"""

from __future__ import annotations

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

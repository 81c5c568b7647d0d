"""Bounded collectives for ckptstore's own coordination; no-ops in one process.

When ``torch.distributed`` is initialized with more than one rank, the coordinator creates
its own gloo group whose timeout is ``barrier_timeout``, whatever backend training uses, so
every wait ckptstore makes is bounded and, when it expires, raises :class:`BarrierTimeout`
naming the ranks that did not arrive (from ``monitored_barrier``) and the phase. Without a
process group every method returns at once, so the manager is written once and has no
``if distributed:`` branches.
"""

from __future__ import annotations

import contextlib
import datetime
import re
from typing import Any

import torch.distributed as dist

from .errors import BarrierTimeout

__all__ = ["Coordinator"]

_RANKS_RE = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")
_FROM_RANK_RE = re.compile(r"from rank (\d+)")


class Coordinator:
    """Barrier, broadcast and gather over a private gloo group, bounded by ``timeout``.

    Constructing it is collective when a process group exists (every rank must construct
    it, as every rank constructs the manager).
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = float(timeout)
        self.enabled = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.enabled else 0
        self.world_size = dist.get_world_size() if self.enabled else 1
        self.group: Any = None
        if self.enabled:
            self.group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=self.timeout)
            )

    @property
    def is_leader(self) -> bool:
        """Rank 0 (or the only process)."""
        return self.rank == 0

    def _timeout(self, e: BaseException, phase: str, step: int | None) -> BarrierTimeout:
        text = str(e)
        missing: list[int] = []
        m = _RANKS_RE.search(text)
        if m:
            missing = [int(x) for x in re.findall(r"\d+", m.group(1))]
        else:
            m2 = _FROM_RANK_RE.search(text)
            if m2:
                missing = [int(m2.group(1))]
            elif self.rank != 0:
                missing = [0]
        who = f"rank(s) {', '.join(map(str, missing))}" if missing else "some rank"
        at = f" of step {step}" if step is not None else ""
        msg = (
            f"rank {self.rank}: {who} did not arrive at '{phase}'{at} within "
            f"{self.timeout:g}s. Every rank must call save/restore (not only rank 0), and no "
            f"rank may have died. ({text.splitlines()[0] if text else type(e).__name__})"
        )
        return BarrierTimeout(msg, missing_ranks=missing, phase=phase, step=step)

    def barrier(self, phase: str, step: int | None = None) -> None:
        """Wait for every rank; on timeout raise BarrierTimeout naming the absent ranks."""
        if not self.enabled:
            return
        try:
            dist.monitored_barrier(
                group=self.group,
                timeout=datetime.timedelta(seconds=self.timeout),
                wait_all_ranks=True,
            )
        except RuntimeError as e:
            raise self._timeout(e, phase, step) from None

    def broadcast(self, obj: Any, phase: str, step: int | None = None, src: int = 0) -> Any:
        """Send a small picklable object from ``src`` to every rank; returns it everywhere."""
        if not self.enabled:
            return obj
        box = [obj if self.rank == src else None]
        try:
            dist.broadcast_object_list(box, src=src, group=self.group)
        except RuntimeError as e:
            raise self._timeout(e, phase, step) from None
        return box[0]

    def gather(
        self, obj: Any, phase: str, step: int | None = None, dst: int = 0
    ) -> list[Any] | None:
        """Collect one small object per rank on ``dst`` (a list by rank); ``None`` elsewhere."""
        if not self.enabled:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        try:
            dist.gather_object(obj, out, dst=dst, group=self.group)
        except RuntimeError as e:
            raise self._timeout(e, phase, step) from None
        return out

    def all_gather(self, obj: Any, phase: str, step: int | None = None) -> list[Any]:
        """Every rank's object, on every rank."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as e:
            raise self._timeout(e, phase, step) from None
        return out

    def close(self) -> None:
        """Release the private group."""
        if self.enabled and self.group is not None:
            with contextlib.suppress(RuntimeError, ValueError):
                dist.destroy_process_group(self.group)
            self.group = None

"""Where the time of one save or restore goes, phase by phase, on each rank.

A :class:`PhaseClock` is started when a save (a restore) starts; the code marks the end of
each phase (``clock.mark("encode")``), and the seconds since the previous mark are added to
that phase. The manager keeps the last save's clock as ``CheckpointManager.last_save_phases``
(the last restore's as ``last_restore_phases``) and logs it at DEBUG
(``logging.getLogger("ckptstore").setLevel(logging.DEBUG)``), so a slow save or restore can
be taken apart on every rank without a profiler: ``tools/bench.py --sharded`` prints both
beside the timings.
"""

from __future__ import annotations

import time

__all__ = ["PhaseClock", "mark"]


class PhaseClock:
    """Seconds per named phase, measured between consecutive :meth:`mark` calls."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._start = self._last
        self._cpu_last = time.process_time()
        #: Phase name -> seconds, in the order the phases were first marked.
        self.phases: dict[str, float] = {}
        #: Phase name -> CPU seconds of this process (all its threads) in that phase: on a
        #: shared host the wall-clock seconds of a phase depend on the load, these do not.
        self.cpu: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """End ``phase`` now: the time since the previous mark (or the start) is added to it."""
        now = time.perf_counter()
        cpu = time.process_time()
        self.phases[phase] = self.phases.get(phase, 0.0) + (now - self._last)
        self.cpu[phase] = self.cpu.get(phase, 0.0) + (cpu - self._cpu_last)
        self._last = now
        self._cpu_last = cpu

    def total(self) -> float:
        """Seconds from the start to the last mark."""
        return self._last - self._start

    def describe(self) -> str:
        """``"encode 95.0 ms (cpu 20.1), ..."``, for the log."""
        return ", ".join(
            f"{k} {v * 1e3:.1f} ms (cpu {self.cpu[k] * 1e3:.1f})" for k, v in self.phases.items()
        )


def mark(clock: PhaseClock | None, phase: str) -> None:
    """End ``phase`` on ``clock``: the save or restore in progress, if any (None: no-op)."""
    if clock is not None:
        clock.mark(phase)

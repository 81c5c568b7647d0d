"""A child process the tools talk to in lines: JSON jobs on its stdin, answers on its stdout.

The fork servers of the tools (``rankserver.py``, ``crash_sharded.py --serve``,
``crashkit/server.py``) are such children. :class:`LineChild` is their parent's end: it
starts the child, reads its stdout on a thread into a queue (each line with the time it
arrived, which the crash campaigns need to date a kill against a rank's report), and hands
the lines out with a timeout, so a child that hangs or dies never hangs the tool.
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["SPAWN", "LineChild"]

#: Where set, starts the child in place of ``subprocess.Popen``: ``SPAWN(cmd, env,
#: merge_stderr)`` returns an object with what a ``Popen(stdin=PIPE, stdout=PIPE,
#: text=True)`` has that :class:`LineChild` uses (``stdin``, ``stdout``, ``wait``,
#: ``kill``), or None (then ``Popen``). The test suite sets it to fork the servers from a
#: process that imported torch and ckptstore already (``tests/multirank/launch.py``,
#: ``spawn_piped``): each is still a process of its own, with its own children.
SPAWN: Callable[[list[str], dict[str, str], bool], Any] | None = None


class LineChild:
    """A started child process: :meth:`submit` a job, :meth:`next` or :meth:`until` reads.

    ``merge_stderr``: the child's stderr goes into the lines too (else it is inherited).
    """

    def __init__(self, cmd: list[str], env: dict[str, str], *, merge_stderr: bool) -> None:
        spawned = SPAWN(cmd, env, merge_stderr) if SPAWN is not None else None
        self.proc: subprocess.Popen[str] = spawned or subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else None,
            text=True,
            env=env,
        )
        self._q: queue.Queue[tuple[float, str | None]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._q.put((time.time(), line.rstrip("\n")))
        self._q.put((time.time(), None))

    def next(self, timeout: float) -> tuple[float, str]:
        """The next line and when it arrived.

        Raises:
            TimeoutError: no line within ``timeout`` seconds.
            EOFError: the child closed its stdout (it died, or exited).
        """
        try:
            t, line = self._q.get(timeout=max(timeout, 0.001))
        except queue.Empty:
            raise TimeoutError(f"no output for {timeout:.0f}s") from None
        if line is None:
            self._q.put((t, None))  # every later call sees the end too
            raise EOFError("the fork server died")
        return t, line

    def until(
        self, prefix: str, timeout: float, into: list[tuple[float, str]] | None = None
    ) -> str:
        """Skip lines (keeping them, and when they came, in ``into``) until one starts with
        ``prefix``; return it. Raises as :meth:`next` does, ``timeout`` counting for all."""
        deadline = time.monotonic() + timeout
        while True:
            t, line = self.next(deadline - time.monotonic())
            if into is not None:
                into.append((t, line))
            if line.startswith(prefix):
                return line

    def drain(self) -> list[tuple[float, str]]:
        """The lines already received (and when), without waiting."""
        out: list[tuple[float, str]] = []
        while True:
            try:
                t, line = self._q.get_nowait()
            except queue.Empty:
                return out
            if line is None:
                self._q.put((t, None))
                return out
            out.append((t, line))

    def submit(self, job: dict[str, Any]) -> None:
        """Send ``job`` as one JSON line."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()

    def close(self, timeout: float = 30) -> None:
        """Close the child's stdin (it exits when it reads the end) and wait for it; kill it
        after ``timeout`` seconds."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

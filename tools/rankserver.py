"""A fork server for the multi-rank tools: import torch once, fork every rank of every job.

A fresh interpreter spends about 5 s of CPU importing torch, torch.distributed, FSDP2 and
ckptstore, and FSDP2's first DTensor imports torch._dynamo (1.6 s more) before a rank does
any work. ``RankServer`` starts one process (``python tools/rankserver.py MODULE...``) that
imports the modules it is given, without running a tensor op, starting a thread or joining
a process group, freezes what they made out of the garbage collector (``gc.freeze``), and
then forks the ranks of each job it is sent. Each rank is still a
separate process with its own gloo group over TCP, its own pid and its own exit status, and
the environment torchrun would give it (``rendezvous.env_for``; none of those variables for a
1-process job).

Protocol (one line each): the tool writes ``{"call": "module:function", "args": [...],
"world": N, "port": P}`` on stdin; the server forks N ranks, each running
``function(*args)`` (exit status 0 if it returns), answers ``pid RANK PID`` for each and
``exit RANK CODE`` as each ends (``os.waitstatus_to_exitcode``), then ``jobdone``. When a rank
fails, the server kills the others, which would wait for it in a collective, unless the job
says ``"keep_going": true``. Ranks write
their output to the server's stderr; its stdout carries only the protocol.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from forkchild import finish, freeze
from linechild import LineChild
from rendezvous import env_for

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class RankServer(LineChild):
    """The tool's handle on a fork server that imported ``preload``.

    ``env`` is the server's environment (and so every rank's before torchrun's variables);
    ``OMP_NUM_THREADS=1`` is added, as torchrun sets it.
    """

    def __init__(self, preload: list[str], env: dict[str, str], timeout: float = 300) -> None:
        env = dict(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, str(Path(__file__).resolve()), *preload]
        super().__init__(cmd, env, merge_stderr=False)
        deadline = time.monotonic() + timeout
        if self._next(deadline) != "serving":  # pragma: no cover - a broken preload
            raise RuntimeError("the rank server did not start")

    def _next(self, deadline: float) -> str:
        try:
            return self.next(deadline - time.monotonic())[1]
        except EOFError:
            raise RuntimeError("the rank server died") from None

    def run(
        self,
        call: str,
        args: list[Any],
        world: int,
        port: int,
        timeout: float,
        *,
        keep_going: bool = False,
    ) -> dict[int, int | None]:
        """Run ``call(*args)`` on ``world`` forked ranks; each rank's exit code (None: it was
        still running at the deadline, and was killed).

        ``keep_going``: a rank that fails leaves the others running (the demos kill a rank
        to show that the others name it and exit on their own), else they are killed.
        """
        job = {"call": call, "args": args, "world": world, "port": port}
        self.submit({**job, "keep_going": keep_going})
        deadline = time.monotonic() + timeout
        pids: dict[int, int] = {}
        codes: dict[int, int | None] = {}
        try:
            while True:
                line = self._next(deadline)
                if line == "jobdone":
                    return codes
                word, who, value = line.split()
                if word == "pid":
                    pids[int(who)] = int(value)
                elif word == "exit":
                    codes[int(who)] = int(value)
        except TimeoutError:
            for rank, pid in pids.items():
                if rank not in codes:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    codes[rank] = None
            with contextlib.suppress(TimeoutError):
                while self._next(time.monotonic() + 30) != "jobdone":
                    pass
            return codes

    def __enter__(self) -> RankServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rank(job: dict[str, Any], rank: int) -> NoReturn:
    """Become rank ``rank`` of ``job``: its environment, fresh seeds, its call; exit."""

    def body() -> None:
        os.dup2(2, 1)  # the server's stdout carries the protocol

        if job["world"] > 1:
            env = env_for(rank, job["world"], job["port"])
        else:
            env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
        os.environ.clear()
        os.environ.update(env)
        random.seed()  # a fresh interpreter seeds it from the OS: so must a fork
        module, _, name = job["call"].partition(":")
        getattr(importlib.import_module(module), name)(*job["args"])

    finish(body)


def serve(preload: list[str]) -> int:
    """Import ``preload``, then fork the ranks of each job read from stdin."""
    import torch

    torch.set_num_threads(1)  # before any op: no thread pool for the ranks to inherit
    for name in preload:
        importlib.import_module(name)
    freeze()  # everything imported, out of the ranks' collections
    replies = sys.stdout
    print("serving", file=replies, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        pids: dict[int, int] = {}
        for rank in range(job["world"]):
            pid = os.fork()
            if pid == 0:
                _rank(job, rank)
            pids[pid] = rank
            print(f"pid {rank} {pid}", file=replies, flush=True)
        while pids:
            pid, status = os.wait()
            rank = pids.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            print(f"exit {rank} {code}", file=replies, flush=True)
            if code != 0 and not job.get("keep_going"):
                for other in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(other, signal.SIGKILL)
        print("jobdone", file=replies, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:]))

"""The fork server and its children: writers, uploaders and the ranks of distributed jobs.

The server (``python -m crashkit.server``) imports torch (unless it forks uploaders only)
and warms up once, then forks a child for every JSON job it reads on stdin, so a trial costs
milliseconds, not an interpreter start; ``Server`` is the campaign's handle on it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, NoReturn

from forkchild import emit, finish, freeze
from linechild import LineChild
from rendezvous import init_group

from crashkit.common import DIST_SLACK, DIST_TIMEOUT, REPO, TOOLS


def run_writer(
    root: str,
    *,
    storage_options: dict[str, Any] | None = None,
    format: str = "safetensors",
    async_save: bool = False,
    keep: int = 2,
    steps: int = 1_000_000,
) -> int:
    """Resume from ``root`` and save steps until killed: crash_writer.py's loop, any URL."""
    import crash_writer as cw

    return cw.run(
        root,
        storage_options=storage_options,
        format=format,
        async_save=async_save,
        keep=keep,
        steps=steps,
    )


def run_uploader(local: str, url: str, storage_options: dict[str, Any]) -> int:
    """Upload the local store to ``url`` until done (or killed): the replica tier's uploader.

    Prints ``safe N`` once step N is committed and verified on the replica: a crash from
    then on must not lose it there.
    """
    from ckptstore.storage import open_storage
    from ckptstore.tiers.replica import Replicator

    emit(f"pid {os.getpid()}")
    up = Replicator(
        open_storage(local),
        open_storage(url, storage_options),
        on_safe=lambda s: emit(f"safe {s}"),
        retention=False,
    )
    emit(f"queued {' '.join(str(s) for s in up.recover())}")
    up.close()
    emit("done")
    return 0


def run_rank(
    rank: int,
    *,
    port_file: str,
    root: str,
    victim: int,
    kill_at: int,
    kill_when: str,
    fmt: str,
    async_save: bool,
    seed: int,
    freeze: bool = False,
) -> int:
    """One rank of a 2-rank job that saves and restores until a rank dies (or freezes)."""
    import faulthandler

    import torch
    from torch import nn

    from ckptstore import BarrierTimeout, CheckpointManager
    from ckptstore.dist import Coordinator

    init_group(rank, 2, port_file)
    emit(f"rank {rank} pid {os.getpid()}")
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
    mgr = CheckpointManager(
        root, keep=2, format=fmt, async_save=async_save, barrier_timeout=DIST_TIMEOUT
    )
    if rank == victim and kill_at:
        calls = 0
        real = Coordinator.barrier

        sig = signal.SIGSTOP if freeze else signal.SIGKILL

        def barrier(self: Coordinator, phase: str, step: int | None = None) -> None:
            nonlocal calls
            calls += 1
            if calls == kill_at and kill_when == "before":
                emit(f"dying {time.time():.6f} before {phase}")
                os.kill(os.getpid(), sig)
            real(self, phase, step)
            if calls == kill_at and kill_when == "after":
                emit(f"dying {time.time():.6f} after {phase}")
                os.kill(os.getpid(), sig)

        Coordinator.barrier = barrier  # type: ignore[method-assign]
    # A watchdog: a rank still running this long after the start is stuck; its stacks go
    # to the campaign's output (and the trial is reported), then it exits.
    faulthandler.dump_traceback_later(DIST_TIMEOUT + DIST_SLACK + 15, exit=True)
    emit(f"ready {rank}")
    step = 0
    try:
        for i in range(1_000_000):
            if i % 3 == 2:
                emit(f"op {rank} restore")
                mgr.restore(state)
            else:
                emit(f"op {rank} save {step}")
                state["step"] = step
                mgr.save(step, state)
                step += 1
    except BarrierTimeout as e:
        raised = time.time()
        out = {"rank": rank, "error": "BarrierTimeout", "phase": e.phase, "at": raised}
        out.update(missing=e.missing_ranks, message=str(e))
        emit("outcome " + json.dumps(out))
        mgr.close()  # after a dead peer: must not hang either
        emit(f"closed {rank} {time.time():.6f}")
        return 2
    except BaseException as e:
        out = {"rank": rank, "error": type(e).__name__, "message": str(e), "at": time.time()}
        emit("outcome " + json.dumps(out))
        emit(traceback.format_exc().replace("\n", " | "))
        return 1
    return 0


def _child(fn: Any, kwargs: dict[str, Any]) -> NoReturn:
    # A survivor of a dead peer exits without destroying the default process group: its
    # collectives would wait for the dead rank (torch, not ckptstore).
    finish(lambda: fn(**kwargs), lambda tb: emit("error " + tb.replace("\n", " | ")))


def _warm_up(writers: bool) -> None:
    """Run once what imports lazily, so that each forked child starts in milliseconds.

    Without ``writers`` (a campaign of upload trials only) the children save nothing: the
    writers' state, its optimizer (which imports torch._dynamo) and their saves are skipped.
    """
    with contextlib.suppress(ImportError):
        import s3fs  # noqa: F401
    import ckptstore.tiers.replica  # noqa: F401

    if not writers:
        return
    import crash_writer as cw

    from ckptstore import CheckpointManager

    state = cw.make_state()
    with tempfile.TemporaryDirectory() as d:
        for fmt in ("safetensors", "torch"):
            with CheckpointManager(os.path.join(d, fmt), format=fmt, keep=1) as mgr:
                mgr.save(0, state)
                mgr.save(1, state)
                mgr.restore(state)
    import torch.distributed  # noqa: F401


def serve(writers: bool = True) -> int:
    """Fork children for the JSON jobs read from stdin; report how each ended.

    Without ``writers`` (uploaders only) torch is not imported: the replica tier's uploader
    never uses it (3.5 s of CPU an interpreter spends on the import).
    """
    if writers:
        import torch

        torch.set_num_threads(1)  # before any op: no thread pool for the children to inherit
    _warm_up(writers)
    freeze()  # what the server made, out of the children's collections
    emit("serving")
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        kind = job.pop("kind")
        pids = []
        if kind == "writer":
            jobs: list[tuple[Any, dict[str, Any]]] = [(run_writer, job)]
        elif kind == "uploader":
            jobs = [(run_uploader, job)]
        else:
            jobs = [(run_rank, dict(job, rank=r)) for r in (0, 1)]
        for fn, kwargs in jobs:
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _child(fn, kwargs)
            pids.append(pid)
        for _ in pids:
            pid, status = os.wait()
            if os.WIFSIGNALED(status):
                emit(f"exit {pid} signal {os.WTERMSIG(status)}")
            else:
                emit(f"exit {pid} code {os.WEXITSTATUS(status)}")
        emit("jobdone")
    return 0


class Server(LineChild):
    """The fork server, seen from the campaign."""

    def __init__(self, *, writers: bool = True) -> None:
        """``writers``: writers or ranks of distributed jobs will be forked (not only
        uploaders), so the server warms their path up."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TOOLS), env.get("PYTHONPATH", "")])
        cmd = [sys.executable, "-m", "crashkit.server", *([] if writers else ["--uploads-only"])]
        super().__init__(cmd, env, merge_stderr=True)
        self.line("serving", timeout=120)
        self.children: list[int] = []

    def line(self, prefix: str, timeout: float, into: list[str] | None = None) -> str:
        """:meth:`until`, keeping the lines in ``into`` without when they came."""
        seen: list[tuple[float, str]] = []
        try:
            return self.until(prefix, timeout, seen)
        finally:
            if into is not None:
                into.extend(line for _, line in seen)

    def kill_children(self) -> None:
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def close(self, timeout: float = 20) -> None:
        self.kill_children()
        super().close(timeout)


if __name__ == "__main__":
    sys.exit(serve(writers="--uploads-only" not in sys.argv[1:]))

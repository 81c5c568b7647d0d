"""Crash-test writer: saves checkpoints in a loop until it is killed.

tests/test_crash.py kills it (SIGKILL) at random moments and at every protocol point, then
checks that the store still holds a whole, verifying checkpoint and that no save that
returned was lost.

Every parameter tensor and every Adam moment of step N holds the value N, and the state's
``"step"`` is N, so a checker can tell a whole checkpoint from a mix of two.

Output, one line each, flushed at once:

    pid P          the writer's process id
    start S        resumed; S is the first step it will save
    returned N     ``save(N)`` returned (for an async save: staged, not yet committed)
    saved N        step N is committed: a crash from now on must not lose it
    call I OP ARG  (trace mode) the I-th ``os.fsync``/``os.rename`` of the armed save
    done           every step saved and the manager closed

Usage:

    python tools/crash_writer.py ROOT [--format torch] [--async] [--keep 2] [--steps N]

With ``CRASH_AT=n`` in the environment the writer saves one step, then arms: during the
next save it kills itself with SIGKILL at the n-th call of ``os.fsync`` or ``os.rename``
(``CRASH_WHEN=before``, the default, skips the call; ``after`` lets it complete). With
``CRASH_AT=0`` it prints every such call of that save instead and does not die, so a test
can learn how many kill points one save has and which one is the commit rename.

``--serve`` turns it into a fork server, so a test pays for importing torch once: it reads
one JSON object per line on stdin (the keyword arguments of :func:`run`), forks a writer
for each, and prints ``exit PID signal K`` or ``exit PID code K`` when that writer ends.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckptstore import CheckpointManager
from ckptstore.storage import wait_for_deletions

if str(Path(__file__).resolve().parent) not in sys.path:  # a test loads this file by its path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from forkchild import emit, finish, freeze

WIDTH = 192  # 4 layers of 192x192: 0.6 MB of weights, 1.8 MB with Adam's moments


def make_state() -> dict[str, Any]:
    """The writer's training state; the checker builds the same one."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, WIDTH)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "step": -1}


def fill(state: dict[str, Any], step: int) -> None:
    """Make every tensor of the state hold ``step``."""
    with torch.no_grad():
        for p in state["model"].parameters():
            p.fill_(float(step))
        for s in state["optimizer"].state.values():
            s["exp_avg"].fill_(float(step))
            s["exp_avg_sq"].fill_(float(step))
    state["step"] = step


def check_loaded(data: dict[str, Any], step: int) -> None:
    """Raise AssertionError unless ``data`` (from ``load()``) is exactly step ``step``."""
    assert data["step"] == step, f"state.json says step {data['step']}, expected {step}"
    for k, t in data["model"].items():
        assert bool((t == step).all()), f"model[{k!r}] does not hold {step}"
    for i, s in data["optimizer"]["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert bool((s[name] == step).all()), f"optimizer state {i} {name} is not {step}"


def _describe(op: str, args: tuple[Any, ...]) -> str:
    if op == "rename":
        return f"{os.path.basename(str(args[0]))} {os.path.basename(str(args[1]))}"
    try:
        return os.path.basename(os.readlink(f"/proc/self/fd/{args[0]}"))
    except OSError:
        return str(args[0])


def arm(crash_at: int, when: str) -> None:
    """Die at the ``crash_at``-th os.fsync/os.rename from now on (0: trace every call)."""
    count = 0

    def hook(op: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal count
            count += 1
            if crash_at == 0:
                emit(f"call {count} {op} {_describe(op, args)}")
            elif count == crash_at and when == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            result = real(*args, **kwargs)
            if count == crash_at and when == "after":
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        return call

    os.fsync = hook("fsync", os.fsync)
    os.rename = hook("rename", os.rename)


def run(
    root: str,
    *,
    format: str = "safetensors",
    async_save: bool = False,
    keep: int = 2,
    steps: int = 1_000_000,
    crash_at: int | None = None,
    crash_when: str = "before",
    resume: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> int:
    """Resume from ``root`` and save ``steps`` steps (one more than the resumed one).

    Without ``resume`` the newest checkpoint is not loaded, only its step number is used.
    """
    emit(f"pid {os.getpid()}")
    torch.set_num_threads(1)
    state = make_state()
    mgr = CheckpointManager(
        root, keep=keep, format=format, async_save=async_save, storage_options=storage_options
    )
    if resume:
        start = mgr.resume(state)
    else:
        latest = mgr.latest_step()
        start = 0 if latest is None else latest + 1
    emit(f"start {start}")
    pending = None
    for i, step in enumerate(range(start, start + steps)):
        fill(state, step)  # in place, while an async save of the previous step may run
        if i == 1 and crash_at is not None:
            if pending is not None:
                pending.wait()
                emit(f"saved {pending.step}")
                pending = None
            wait_for_deletions()  # the previous save's retention is not counted
            arm(crash_at, crash_when)
        handle = mgr.save(step, state)
        if pending is not None:
            pending.wait()  # done already: save() waits for the save in flight
            emit(f"saved {pending.step}")
        emit(f"returned {step}")
        if async_save:
            pending = handle
        else:
            emit(f"saved {step}")
    if pending is not None:
        pending.wait()
        emit(f"saved {pending.step}")
    # Retention's trash is made durable (root fsync) and removed by a background thread:
    # wait for it, so a trace ends with that fsync and the kill points include it.
    wait_for_deletions()
    mgr.close()
    emit("done")
    return 0


def _warm_up() -> None:
    """Run once what imports lazily (torch._dynamo on the first optimizer step, the codecs),
    so each forked writer starts in milliseconds."""
    import tempfile

    state = make_state()
    with tempfile.TemporaryDirectory() as d:
        for fmt in ("safetensors", "torch"):
            with CheckpointManager(os.path.join(d, fmt), format=fmt) as mgr:
                mgr.save(0, state)
                mgr.restore(state)


def serve() -> int:
    """Fork one writer per JSON line on stdin; report how each ended."""
    torch.set_num_threads(1)  # before any op: no thread pool for the children to inherit
    _warm_up()
    freeze()  # what the server made, out of the children's collections
    for line in sys.stdin:
        if not line.strip():
            continue
        opts = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            finish(partial(run, **opts), lambda tb: print(tb, end="", flush=True))
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            emit(f"exit {pid} signal {os.WTERMSIG(status)}")
        else:
            emit(f"exit {pid} code {os.WEXITSTATUS(status)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("root", nargs="?")
    p.add_argument("--format", default="safetensors", choices=["safetensors", "torch"])
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--serve", action="store_true", help="fork server mode (see above)")
    args = p.parse_args(argv)
    if args.serve:
        return serve()
    if args.root is None:
        p.error("ROOT is required unless --serve")
    crash_at = os.environ.get("CRASH_AT")
    return run(
        args.root,
        format=args.format,
        async_save=args.async_save,
        keep=args.keep,
        steps=args.steps,
        crash_at=int(crash_at) if crash_at else None,
        crash_when=os.environ.get("CRASH_WHEN", "before"),
    )


if __name__ == "__main__":
    sys.exit(main())

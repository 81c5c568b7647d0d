"""Fork server for the multi-rank tests: pays for ``import torch`` once, forks every rank.

A rank used to be a fresh ``python worker.py`` that spent 2-5 s of CPU importing torch,
torch.distributed and ckptstore before it did anything; on the two cores CI has, the suite's
~150 rank processes spent most of their time there. This process imports all of that once
(without running a tensor op, starting a thread or joining a process group) and forks a
child per rank. Each child is still a real, separate process: it joins its own gloo group over
TCP, writes its own files, can be killed by pid, and its exit status is what ``waitpid`` says.

Protocol (one JSON object a line): the launcher writes ``{"id", "argv", "log", "cwd", "set"}``
on stdin (``set``: the launcher's values of the few variables a rank may differ in, None for
unset); the server answers ``{"id", "pid"}`` when the child is forked and
``{"pid", "status"}`` (``os.waitstatus_to_exitcode``) when it ends. EOF on stdin ends the
server (children it has forked keep running until they finish or are killed). A request
with ``"run": SCRIPT``, ``"module": NAME`` or ``"code": CODE`` (and ``"args"``, ``"env"``,
optionally ``"stdin"``/``"stdout"`` FIFOs and ``"preload"``) forks ``python SCRIPT``,
``python -m NAME`` or ``python -c CODE`` instead of a rank
(``launch._ForkServer.spawn_script``, ``launch.spawn_piped``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import random
import runpy
import select
import sys
import traceback
import types
from collections.abc import Callable
from typing import Any

# The heavy imports every rank needs, done once here. No tensor is created, no thread
# started: a fork of this process is as clean as a fresh interpreter that imported them.
import numpy as np
import torch
import torch.distributed
import torch.distributed.checkpoint
import torch.distributed.fsdp
import torch.distributed.tensor  # noqa: F401

import ckptstore
import ckptstore.manager  # noqa: F401
from tests.multirank import (  # noqa: F401
    dcp_scenarios,
    dtensor_scenarios,
    export_scenarios,
    scenarios,
    worker,
)
from tools.forkchild import freeze

# torchtitan's checkpointer: 2.5 s of CPU a rank to import; optional (tests skip without it).
with contextlib.suppress(ImportError):
    from tests.multirank import torchtitan_scenarios  # noqa: F401

# s3fs (with aiobotocore and aiohttp: 1 to 2 s of CPU a rank) for the ranks whose replica is
# moto's S3 server, and the docs snippets that use one; optional like torchtitan. An import
# starts no thread and no event loop (fsspec makes its loop on first use, in the child).
with contextlib.suppress(ImportError):
    import s3fs  # noqa: F401


def _forked(
    fds: tuple[int, ...],
    log: str,
    cwd: str,
    body: Callable[[], None],
    *,
    env: dict[str, str] | None = None,
    exit_none: int = 1,
    stdin: str | None = None,
    stdout: str | None = None,
) -> None:
    """Become a child: stdio onto ``log``, ``env`` (whole, if given), ``cwd``, fresh RNG
    seeds; run ``body``; exit with its status (``exit_none`` for ``sys.exit(None)``).

    ``stdin``, ``stdout``: FIFOs the launcher holds the other ends of (a tool's fork server
    it talks to in lines), in place of ``/dev/null`` and ``log``; stderr still goes to
    ``log`` (which may be ``stdout`` itself)."""
    code = 1
    try:
        for fd in fds:
            os.close(fd)
        fd_in = os.open(stdin or os.devnull, os.O_RDONLY)
        if fd_in != 0:  # 0 itself where it was the requests' (closed above): kept open
            os.dup2(fd_in, 0)
            os.close(fd_in)
        err = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        out = os.open(stdout, os.O_WRONLY) if stdout else err
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(err)
        if out != err:
            os.close(out)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        os.chdir(cwd)
        # A fresh interpreter seeds these from the OS: so must a fork, or every rank of every
        # launch would draw the same "random" numbers.
        random.seed()
        np.random.seed()
        body()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (exit_none if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _child(
    argv: list[str], log: str, cwd: str, fds: tuple[int, ...], passed: dict[str, str | None]
) -> None:
    """Become one rank: the worker's main() with ``argv``, and the launcher's values of the
    variables in ``passed`` (None: unset; see ``launch._ForkServer.PASSED``)."""

    def rank() -> None:
        for key, value in passed.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        sys.argv = argv
        worker.main()  # ends with os._exit(0)

    _forked(fds, log, cwd, rank)


def _run_script(req: dict[str, Any], fds: tuple[int, ...]) -> None:
    """Become ``python SCRIPT ARGS...``, ``python -m MODULE ARGS...`` or ``python -c CODE
    ARGS...`` (a docs snippet, a rank of a Lightning job, a tool's fork server, a test's
    second process): its environment, directory and stdio.

    The entries of its ``PYTHONPATH`` that this process's ``sys.path`` lacks are put in
    front, as a fresh interpreter would have them."""
    script = req.get("run")
    module = req.get("module")
    code = req.get("code")

    def run() -> None:
        paths = req["env"].get("PYTHONPATH", "").split(os.pathsep)
        sys.path[:0] = [p for p in paths if p and p not in sys.path]
        if code is not None:
            sys.argv = ["-c", *req.get("args", ())]
            sys.path.insert(0, "")  # as `python -c`
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(code, "<string>", "exec"), main.__dict__)
            return
        if module is not None:
            sys.argv = [module, *req.get("args", ())]
            sys.path.insert(0, req["cwd"])  # as `python -m MODULE`
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            return
        sys.argv = [script, *req.get("args", ())]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT`
        runpy.run_path(script, run_name="__main__")

    pipes = {"stdin": req.get("stdin"), "stdout": req.get("stdout")}
    _forked(fds, req["log"], req["cwd"], run, env=req["env"], exit_none=0, **pipes)


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when child ``pid`` exits (Linux 5.3+), or None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def main() -> None:
    """Serve fork requests until stdin closes.

    Waits in ``poll`` on the requests and on a pidfd of each child, so an idle server costs
    no CPU (it looked every 20 ms before: 0.7% of a core for each pytest worker's server,
    ~4 s of CPU over a run of the suite). Where a child has no pidfd, it looks every 20 ms.
    """
    freeze()  # what the imports made, out of the children's collections
    requests = sys.stdin.fileno()
    replies = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not reach the pipe
    buf = b""
    children: dict[int, int | None] = {}  # pid -> its pidfd
    poller = select.poll()
    poller.register(requests, select.POLLIN)
    while True:
        polled = all(fd is not None for fd in children.values())
        ready = {fd for fd, _ in poller.poll(None if polled else 20)}
        eof = False
        if requests in ready:
            data = os.read(requests, 1 << 16)
            eof = not data
            buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            # Modules a script's children need beyond the ones above (Lightning: 6-9 s of
            # CPU a process), imported here once, on the first request that names them
            # (importing Lightning starts no thread), and frozen like the rest.
            new = [name for name in req.get("preload", ()) if name not in sys.modules]
            for name in new:
                importlib.import_module(name)
            if new:
                freeze()
            pid = os.fork()
            if pid == 0:
                inherited = (requests, replies, *(fd for fd in children.values() if fd is not None))
                if "run" in req or "module" in req or "code" in req:
                    _run_script(req, inherited)
                _child(req["argv"], req["log"], req["cwd"], inherited, req["set"])
            fd = children[pid] = _pidfd(pid)
            if fd is not None:
                poller.register(fd, select.POLLIN)
            os.write(replies, json.dumps({"id": req["id"], "pid": pid}).encode() + b"\n")
        for pid, fd in list(children.items()):
            if fd is not None and fd not in ready:
                continue  # still running: its pidfd would have said
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del children[pid]
                if fd is not None:
                    poller.unregister(fd)
                    os.close(fd)
                code = os.waitstatus_to_exitcode(status)
                os.write(replies, json.dumps({"pid": pid, "status": code}).encode() + b"\n")
        if eof:
            return


if __name__ == "__main__":
    main()

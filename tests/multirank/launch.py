"""One launch helper for every multi-rank test: real processes, gloo on CPU, a hard timeout.

Each rank is a fresh ``python tests/multirank/worker.py`` process that joins a gloo process group
over TCP on loopback and runs one scenario function from ``tests/multirank/scenarios.py``.
Rank 0 hosts the group's store on a port the kernel picks and publishes it in a file of the
workdir (``tools/rendezvous.py``): no port is chosen here and bound later, where another test
could take it in between. The worker writes its outcome (result or exception, with
``BarrierTimeout`` attributes) as JSON. The parent kills every rank when the deadline passes,
so a hang fails the test instead of stalling CI.

Ranks are forked by ``zygote.py``, a server that imported torch and ckptstore once (a fresh
interpreter spends 2-5 s of CPU on those imports, most of the suite's time on two cores); each
rank is still its own process with its own gloo group, pid and exit status. When the test's
environment differs from the server's (a test that sets a variable), or with
``CKPTSTORE_TEST_FORK=0``, ranks are started as fresh interpreters as before.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


@dataclass
class RankResult:
    rank: int
    returncode: int | None
    ok: bool = False
    value: Any = None
    error_type: str | None = None
    message: str = ""
    missing_ranks: list[int] = field(default_factory=list)
    phase: str | None = None
    step: int | None = None
    elapsed: float = 0.0
    output: str = ""


class _ForkServer:
    """The launcher's end of ``zygote.py``: fork requests out, pids and exit statuses in."""

    # Variables pytest changes between tests; the ranks do not read them.
    VOLATILE = frozenset({"PYTEST_CURRENT_TEST"})
    # Variables read only when they are used, never on import, that the test process sets
    # as it goes: the inductor's cache directory (torch writes its default into os.environ
    # the first time anything asks for it: a DTensor op in the test process is enough),
    # MASTER_ADDR (conftest's ``mesh``), the proxy exemption of moto's server
    # (s3server.py) and PYTORCH_NVML_BASED_CUDA_CHECK (set by importing Lightning, which the
    # tests that use it do as they run; torch.cuda.is_available reads it on each call). A
    # forked rank is given the launcher's values of these (or has them unset), as a fresh
    # interpreter would, so they need not match the server's. Compared, they made every
    # later launch of that pytest process start fresh interpreters, each importing torch
    # again.
    PASSED = frozenset(
        {
            "TORCHINDUCTOR_CACHE_DIR",
            "MASTER_ADDR",
            "NO_PROXY",
            "no_proxy",
            "PYTORCH_NVML_BASED_CUDA_CHECK",
        }
    )

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix="ckptstore-zygote-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "zygote.py")],
            env=env,
            cwd=str(REPO),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        self._cond = threading.Condition()
        self._pids: dict[int, int] = {}
        self._status: dict[int, int] = {}
        self._next = 0
        self.dead = False
        threading.Thread(target=self._read, daemon=True, name="zygote-replies").start()
        atexit.register(self.close)

    def fits(self, env: dict[str, str]) -> bool:
        def strip(e: dict[str, str]) -> dict[str, str]:
            return {k: v for k, v in e.items() if k not in self.VOLATILE | self.PASSED}

        return not self.dead and strip(env) == strip(self.env)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self._cond:
                if "id" in msg:
                    # A new child: an exit status kept under its pid is an older child's
                    # (pids are reused: 32768 of them here, and a campaign forks thousands),
                    # which wait() would have returned at once, before the new one wrote
                    # anything. The zygote reports a child's pid before its exit, and an
                    # older child's exit before the pid can be reused, so in order here.
                    self._status.pop(msg["pid"], None)
                    self._pids[msg["id"]] = msg["pid"]
                else:
                    self._status[msg["pid"]] = msg["status"]
                self._cond.notify_all()
        with self._cond:
            self.dead = True
            self._cond.notify_all()

    def spawn(self, argv: list[str], log: Path, env: dict[str, str]) -> int | None:
        """Fork one rank with ``env``'s values of :attr:`PASSED`; its pid, or None when the
        server is gone (start it fresh instead)."""
        passed = {k: env.get(k) for k in sorted(self.PASSED)}
        return self._request({"argv": argv, "log": str(log), "cwd": os.getcwd(), "set": passed})

    def spawn_script(
        self,
        script: Path,
        env: dict[str, str],
        log: Path,
        cwd: Path,
        *,
        args: list[str] | None = None,
        preload: tuple[str, ...] = (),
        module: bool = False,
        code: str | None = None,
        pipes: tuple[str, str] | None = None,
    ) -> int | None:
        """Fork ``python SCRIPT ARGS...`` with ``env`` (all of it) in ``cwd``; its pid, or None.

        ``preload``: modules the server imports before it forks (once: its later children
        have them too). ``module``: ``script`` names a module, run as ``python -m``;
        ``code``: ``python -c CODE`` (``script`` unused).
        ``pipes``: FIFOs for its stdin and stdout (``spawn_piped``), stderr still to ``log``.
        """
        req: dict[str, Any] = {"env": env, "log": str(log), "cwd": str(cwd)}
        req["module" if module else "run"] = str(script)
        if code is not None:
            del req["run"]
            req["code"] = code
        if pipes is not None:
            req["stdin"], req["stdout"] = pipes
        return self._request({**req, "args": args or [], "preload": list(preload)})

    def _request(self, req: dict[str, Any]) -> int | None:
        with self._cond:
            if self.dead:
                return None
            self._next += 1
            rid = self._next
        req = {"id": rid, **req}
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            self.dead = True
            return None
        with self._cond:
            # The first request waits for the server's imports.
            self._cond.wait_for(lambda: rid in self._pids or self.dead, timeout=300)
            return self._pids.pop(rid, None)

    def wait(self, pid: int, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._status or self.dead, timeout=timeout)
            return self._status.get(pid)

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class _Forked:
    """The part of :class:`subprocess.Popen` the launcher uses, for a forked rank."""

    def __init__(self, server: _ForkServer, pid: int) -> None:
        self.server = server
        self.pid = pid
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        code = self.server.wait(self.pid, timeout)
        if code is None:
            if self.server.dead:
                raise AssertionError(f"the fork server died; rank pid {self.pid} is lost")
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
        self.returncode = code
        return code

    def poll(self) -> int | None:
        code = self.server.wait(self.pid, 0)
        if code is not None:
            self.returncode = code
        return code

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


class _FifoOut(io.RawIOBase):
    """The read end of a forked child's stdout FIFO.

    Opened before the child exists (without blocking), it reads as EOF until the child
    opens its end: the first read waits until the child has written or gone (``poll``), or
    has exited without opening it (then EOF), and calls ``connected`` once.
    """

    def __init__(self, fd: int, gone: Any, connected: Any) -> None:
        super().__init__()
        self.fd = fd
        self._gone = gone
        self._connected = connected
        self._open = False

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def readinto(self, buf: Any) -> int:
        if not self._open:
            poller = select.poll()
            poller.register(self.fd, select.POLLIN)
            while not poller.poll(100):
                if self._gone() and not poller.poll(0):
                    return 0  # it exited before it opened its stdout
            os.set_blocking(self.fd, True)
            self._open = True
            self._connected()
        data = os.read(self.fd, len(buf))
        buf[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            os.close(self.fd)
        super().close()


class _Piped(_Forked):
    """What :class:`subprocess.Popen` (``stdin=PIPE, stdout=PIPE, text=True``) gives of a
    child, for one forked by the fork server with FIFOs for its stdin and stdout
    (:func:`spawn_piped`). Its stderr, when not merged into stdout, is written to this
    process's stderr once it has exited."""

    def __init__(self, server: _ForkServer, cmd: list[str], env: dict[str, str], merge: bool):
        self._dir = tempfile.mkdtemp(prefix="ckptstore-piped-")
        self._fifo_in = os.path.join(self._dir, "stdin")
        fifo_out = os.path.join(self._dir, "stdout")
        os.mkfifo(self._fifo_in)
        os.mkfifo(fifo_out)
        # Neither open blocks: a FIFO opened for reading and writing has a reader (the
        # child's open for reading does not wait either), and one opened for reading
        # without blocking waits for no writer. Both are closed on exec (PEP 446).
        self._in_fd = os.open(self._fifo_in, os.O_RDWR)
        out_fd = os.open(fifo_out, os.O_RDONLY | os.O_NONBLOCK)
        self._err = None if merge else os.path.join(self._dir, "stderr")
        module, code = cmd[1] == "-m", cmd[2] if cmd[1] == "-c" else None
        target, args = (cmd[2], cmd[3:]) if module or code else (cmd[1], cmd[2:])
        pid = server.spawn_script(
            Path(target),
            env,
            Path(self._err or fifo_out),
            Path.cwd(),
            args=args,
            module=module,
            code=code,
            pipes=(self._fifo_in, fifo_out),
        )
        if pid is None:
            os.close(self._in_fd)
            os.close(out_fd)
            shutil.rmtree(self._dir, ignore_errors=True)
            raise OSError("the fork server is gone")
        super().__init__(server, pid)
        writer = io.BufferedWriter(io.FileIO(self._in_fd, "w"))
        self.stdin = io.TextIOWrapper(writer, encoding="utf-8")
        raw = _FifoOut(out_fd, lambda: self.poll() is not None, self._connected)
        self.stdout = io.TextIOWrapper(io.BufferedReader(raw), encoding="utf-8")

    def _connected(self) -> None:
        """The child has opened both ends (stdin first): from now on this process is no
        reader of its stdin, so a write after the child has gone fails (EPIPE) as it does on
        a pipe. The FIFOs' names are no longer needed."""
        fd = os.open(self._fifo_in, os.O_WRONLY | os.O_NONBLOCK)
        os.set_blocking(fd, True)
        os.dup2(fd, self._in_fd, inheritable=False)
        os.close(fd)
        for name in ("stdin", "stdout"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._dir, name))

    def wait(self, timeout: float | None = None) -> int:
        code = super().wait(timeout)
        if self._err is not None and os.path.exists(self._err):
            with open(self._err, errors="replace") as f:
                sys.stderr.write(f.read())
            os.unlink(self._err)
        shutil.rmtree(self._dir, ignore_errors=True)
        return code


def spawn_piped(cmd: list[str], env: dict[str, str], merge_stderr: bool) -> _Piped | None:
    """``subprocess.Popen(cmd, env=env, stdin=PIPE, stdout=PIPE, text=True, stderr=STDOUT
    if merge_stderr)`` for ``cmd`` = ``[python, SCRIPT, ...]``, ``[python, -m, MODULE,
    ...]`` or ``[python, -c, CODE, ...]``, forked from this process's fork server instead of
    a fresh interpreter (the tools' fork servers import torch and ckptstore: 4-6 s of CPU
    each, see ``tools/linechild.py``). None where it cannot be (no fork server running,
    another command): start it as before.

    Nor where its ``PYTHONPATH`` names another tree's ckptstore. It never starts a fork
    server itself: a test that changed the environment would start one that fits no later
    launch (:meth:`_ForkServer.fits`), whose ranks would all start fresh;
    :func:`piped_spawner` starts it first.
    """
    server = _server
    if server is None or server.dead or len(cmd) < 2 or cmd[0] != sys.executable:
        return None
    # Another tree's ckptstore on its PYTHONPATH (bench_ab's baseline): a fresh interpreter
    # imports that one, a fork would keep this tree's.
    for entry in env.get("PYTHONPATH", "").split(os.pathsep):
        if entry and (Path(entry) / "ckptstore").is_dir() and Path(entry).resolve() != REPO:
            return None
    if cmd[1] in ("-m", "-c") and len(cmd) < 3:
        return None
    if cmd[1].startswith("-") and cmd[1] not in ("-m", "-c"):
        return None
    try:
        return _Piped(server, cmd, env, merge_stderr)
    except OSError:
        return None


def piped_spawner() -> Any:
    """:func:`spawn_piped`, with this process's fork server started (in the environment as
    it is now: call it before the test changes it); None where there is none to fork from.
    For ``linechild.SPAWN``."""
    return spawn_piped if script_server() is not None else None


_server: _ForkServer | None = None


def _fork_server(env: dict[str, str]) -> _ForkServer | None:
    """The server for ``env``, started on first use; None where ranks must start fresh."""
    global _server
    if os.environ.get("CKPTSTORE_TEST_FORK", "1") == "0" or not hasattr(os, "fork"):
        return None
    if _server is None or _server.dead:
        _server = _ForkServer(env)
    return _server if _server.fits(env) else None


def _launch_env() -> dict[str, str]:
    env = dict(os.environ)
    path = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=path, PYTHONUNBUFFERED="1")
    return env


def script_server() -> _ForkServer | None:
    """The fork server (torch and ckptstore imported once), for ``python SCRIPT`` children
    (``_ForkServer.spawn_script``: the docs snippets); None where they must start fresh."""
    return _fork_server(_launch_env())


def run_script(
    script: Path,
    args: list[str],
    ranks: int,
    *,
    env: dict[str, str],
    logs: list[Path],
    cwd: Path,
    timeout: float,
    preload: tuple[str, ...] = (),
) -> tuple[bool, list[int | None]]:
    """Run ``python SCRIPT ARGS...`` as ``ranks`` processes in ``cwd``, rank r logging to
    ``logs[r]``: whether the job hung past ``timeout`` (every rank left is then killed), and
    each rank's exit code.

    Each takes ``env`` whole, plus, for more than one rank, what torchrun sets (``RANK``,
    ``LOCAL_RANK``, ``GROUP_RANK``, ``WORLD_SIZE``, ...) and a store hosted here, as
    torchrun's agent hosts it, that the ranks join as clients (no port is chosen here and
    bound later by someone else). The ranks are forked from the fork server, which imports
    ``preload`` once first (Lightning: 6-9 s of CPU a fresh interpreter), and runs the
    script as ``__main__``, as ``python SCRIPT`` would; fresh interpreters without one.
    """
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if ranks > 1 else None
    server = script_server()
    procs: list[Any] = []
    try:
        for rank in range(ranks):
            renv = dict(env)
            if store is not None:
                renv.update(
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    GROUP_RANK="0",
                    WORLD_SIZE=str(ranks),
                    LOCAL_WORLD_SIZE=str(ranks),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(store.port),
                    TORCHELASTIC_USE_AGENT_STORE="True",
                )
            pid = None
            if server is not None:
                pid = server.spawn_script(script, renv, logs[rank], cwd, args=args, preload=preload)
            if pid is not None:
                procs.append(_Forked(server, pid))  # type: ignore[arg-type]
            else:
                with open(logs[rank], "w") as f:
                    cmd = [sys.executable, str(script), *args]
                    procs.append(subprocess.Popen(cmd, cwd=cwd, env=renv, stdout=f, stderr=f))
        deadline = time.monotonic() + timeout
        hung = False
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                hung = True
                break
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return hung, [p.returncode for p in procs]


def launch(
    scenario: str,
    world_size: int,
    workdir: Path,
    *,
    timeout: float = 60.0,
    args: dict[str, Any] | None = None,
) -> list[RankResult]:
    """Run ``scenario`` on ``world_size`` ranks; return one result per rank (by rank)."""
    workdir.mkdir(parents=True, exist_ok=True)
    # Rank 0 binds port 0 and publishes the port here (tools/rendezvous.py): never a stale one.
    port_file = workdir / "store.port"
    port_file.unlink(missing_ok=True)
    procs: list[tuple[subprocess.Popen[bytes] | _Forked, Any]] = []
    env = _launch_env()
    server = _fork_server(env)
    for rank in range(world_size):
        out = workdir / f"rank{rank}.json"
        if out.exists():
            out.unlink()
        log = open(workdir / f"rank{rank}.log", "w")  # noqa: SIM115
        cmd = [
            sys.executable,
            str(HERE / "worker.py"),
            scenario,
            str(rank),
            str(world_size),
            str(port_file),
            str(workdir),
            json.dumps(args or {}),
        ]
        pid = server.spawn(cmd[1:], workdir / f"rank{rank}.log", env) if server else None
        if pid is not None:
            procs.append((_Forked(server, pid), log))  # type: ignore[arg-type]
        else:
            procs.append(
                (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log)
            )
    deadline = time.monotonic() + timeout
    hung = False
    for p, _ in procs:
        left = deadline - time.monotonic()
        try:
            p.wait(timeout=max(left, 0.1))
        except subprocess.TimeoutExpired:
            hung = True
            break
    if hung:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for rank, (p, log) in enumerate(procs):
        log.close()
        output = (workdir / f"rank{rank}.log").read_text()
        r = RankResult(rank, p.returncode, output=output)
        out = workdir / f"rank{rank}.json"
        if out.exists():
            data = json.loads(out.read_text())
            r.ok = data["ok"]
            r.value = data.get("value")
            r.error_type = data.get("error_type")
            r.message = data.get("message", "")
            r.missing_ranks = data.get("missing_ranks") or []
            r.phase = data.get("phase")
            r.step = data.get("step")
            r.elapsed = data.get("elapsed", 0.0)
        results.append(r)
    if hung:
        logs = "\n".join(f"--- rank {r.rank} ---\n{r.output[-3000:]}" for r in results)
        msg = f"scenario {scenario!r} hung past {timeout}s and was killed\n{logs}"
        raise AssertionError(msg)
    return results


def values(results: list[RankResult]) -> list[Any]:
    """What each rank's scenario returned (by rank); fails, with every rank's log, unless all
    of them returned."""
    assert all(r.ok for r in results), describe(results)
    return [r.value for r in results]


def timeouts_naming(results: list[RankResult], missing: int) -> list[Any]:
    """What the survivors of rank ``missing`` returned (by rank): each a ``BarrierTimeout``
    outcome (``scenarios.outcome``) that names that rank alone; fails otherwise."""
    survivors = [r for r in results if r.rank != missing]
    for r in survivors:
        assert r.ok, describe(results)
        assert r.value["error_type"] == "BarrierTimeout", describe(results)
        assert r.value["missing_ranks"] == [missing], describe(results)
    return [r.value for r in survivors]


def describe(results: list[RankResult]) -> str:
    """Everything about a run, for assertion messages."""
    return "\n".join(
        f"rank {r.rank}: rc={r.returncode} ok={r.ok} {r.error_type}: {r.message}\n"
        f"{r.output[-2000:]}"
        for r in results
    )

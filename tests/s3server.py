"""A real S3 HTTP endpoint on loopback for tests: moto's threaded server, one bucket.

``s3_server()`` runs :class:`moto.server.ThreadedMotoServer` on ``127.0.0.1`` on a free port
(the kernel picks it: port 0), creates a bucket through the S3 API and yields an
:class:`S3Endpoint`. Every request the tests make goes over HTTP to that server, through
s3fs/aiobotocore exactly as against AWS; nothing is patched in the test process.

The server runs in a process of its own: in the test process it would share one GIL with
the client, and each request would cost about a third more. It is forked by a fork server
(this file is its ``__main__``), started once per test process, that imported moto and
warmed its S3 app: a fresh interpreter doing that costs ~1.4 s of CPU, a fork ~0.07 s. The
server appends every request it receives to a log file *before* serving it, so by the time a
client has its answer the request is in :attr:`S3Endpoint.requests`. It exits when the test
process closes its end of a pipe, which also happens when the test process dies.

:meth:`S3Endpoint.refusing` makes the server answer some requests with an S3 error status
(a 403 ``AccessDenied``, a 503 ``SlowDown``) instead of serving them: the faults a real
store gives, on the wire, for the client's own retries and error mapping to meet.

The option names are the ones ``s3fs.S3FileSystem.__init__`` takes (s3fs 2026.x,
``s3fs/core.py``): ``key``/``secret`` for the credentials, ``client_kwargs`` forwarded to
aiobotocore's ``create_client`` (``endpoint_url``, ``region_name``). ``endpoint_url`` is also
accepted at the top level ("Takes precedence over `endpoint_url` in client_kwargs"), which is
the form ``--storage-option endpoint_url=...`` on the command line produces.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs

#: Credentials moto accepts (it checks nothing; they only have to be present).
KEY = "testing"
SECRET = "testing"
REGION = "us-east-1"
#: Seconds to wait for the server process to say its port.
START_TIMEOUT = 60.0


@dataclasses.dataclass(frozen=True)
class Request:
    """One HTTP request the server received."""

    method: str
    path: str  # decoded, e.g. ``/bucket/run1/step-000000000001/manifest.json``
    query: dict[str, str]

    @property
    def is_list(self) -> bool:
        """A ListObjectsV2 request on a bucket."""
        return self.method == "GET" and self.path.count("/") == 1 and "list-type" in self.query

    @property
    def is_bulk_delete(self) -> bool:
        """A DeleteObjects request (``POST /bucket?delete``)."""
        return self.method == "POST" and "delete" in self.query


class RequestLog:
    """The requests the server received, in arrival order; ``log()`` returns them."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._start = 0

    def clear(self) -> None:
        """Forget the requests received so far."""
        self._start = os.path.getsize(self._path)

    def __call__(self) -> list[Request]:
        with open(self._path, encoding="utf-8") as f:
            f.seek(self._start)
            lines = f.read().splitlines()
        out = []
        for line in lines:
            method, path, query = json.loads(line)
            q = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
            out.append(Request(method, path, q))
        return out


@dataclasses.dataclass(frozen=True)
class S3Endpoint:
    """A running S3 server with one bucket, and the log of the requests it received."""

    endpoint: str
    bucket: str
    requests: RequestLog
    #: The server process's id (a bench lowers its priority: it stands in for a remote host).
    pid: int = 0
    #: The file of the requests the server refuses (see :meth:`refusing`).
    faults: str = ""

    @contextlib.contextmanager
    def refusing(self, method: str, path_end: str, status: int) -> Iterator[None]:
        """Answer every ``method`` request whose path ends with ``path_end`` with ``status``.

        403 comes as ``AccessDenied``, 503 as ``SlowDown``, anything else as
        ``InternalError``: what S3 sends, so the client retries and maps it as it would.
        Until the block ends.
        """
        rule = [method, path_end, status]
        with open(self.faults, encoding="utf-8") as f:
            rules = json.load(f)
        _write_json(self.faults, [*rules, rule])
        try:
            yield
        finally:
            with open(self.faults, encoding="utf-8") as f:
                rules = json.load(f)
            _write_json(self.faults, [r for r in rules if r != rule])

    @property
    def storage_options(self) -> dict[str, Any]:
        """``storage_options`` for ``CheckpointManager``/fsspec (a fresh dict each time)."""
        return {
            "key": KEY,
            "secret": SECRET,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": REGION},
        }

    @property
    def cli_options(self) -> list[str]:
        """The same as ``--storage-option KEY=VALUE`` arguments: flat strings, no region."""
        return [
            f"--storage-option=key={KEY}",
            f"--storage-option=secret={SECRET}",
            f"--storage-option=endpoint_url={self.endpoint}",
        ]

    def url(self, prefix: str) -> str:
        """``s3://BUCKET/PREFIX``."""
        return f"s3://{self.bucket}/{prefix}"

    def fs(self, *, fresh: bool = False) -> Any:
        """An s3fs filesystem on this server.

        ``fresh=True`` bypasses fsspec's instance cache: a filesystem with its own listing
        cache and connections, as another process would have (see :attr:`other_options`).
        """
        import s3fs

        if fresh:
            return s3fs.S3FileSystem(**self.other_options)
        return s3fs.S3FileSystem(**self.storage_options)

    @property
    def other_options(self) -> dict[str, Any]:
        """``storage_options`` of a client of its own: another process's listing cache and
        connection pool (fsspec's instance cache bypassed).

        It shares :attr:`session` with the other clients made so: botocore's service models,
        which a client loads from its session (~0.3 s of CPU for a session of its own), are
        static data; no request, listing or connection is shared through it.
        """
        return {**self.storage_options, "skip_instance_cache": True, "session": self.session}

    @functools.cached_property
    def session(self) -> Any:
        """One aiobotocore session for the clients of :attr:`other_options`."""
        from aiobotocore.session import AioSession

        return AioSession()

    @functools.cached_property
    def client(self) -> Any:
        """An s3fs client of its own, made once: another process's view, to inspect and damage
        stores behind ckptstore's back.
        """
        return self.fs(fresh=True)

    def unique_prefix(self, stem: str = "run") -> str:
        """A prefix no other test uses."""
        return f"{stem}-{uuid.uuid4().hex[:12]}"

    def new_bucket(self) -> str:
        """Create a bucket of its own for one test; returns its name."""
        name = f"ckptstore-{uuid.uuid4().hex[:16]}"
        _create_bucket(self.endpoint, name)
        return name


def _write_json(path: str, value: Any) -> None:
    """Replace ``path`` with ``value`` as JSON in one rename (the server reads it meanwhile)."""
    tmp = f"{path}.{uuid.uuid4().hex}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def _create_bucket(endpoint: str, name: str) -> None:
    # Through boto3, not ``fs.mkdir``: s3fs sends ``LocationConstraint=<region_name>``,
    # which S3 (and moto) reject for us-east-1, the one region that takes none.
    import boto3

    boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=KEY,
        aws_secret_access_key=SECRET,
    ).create_bucket(Bucket=name)


class _ForkServer:
    """This process's fork server: a child that imported moto once and forks each S3 server.

    A fresh interpreter importing moto and warming its S3 app costs about 1.4 s of CPU; a
    fork of one that did costs a few milliseconds. Started on first use, and again when the
    environment changed since (moto reads settings from it, such as
    ``INITIAL_NO_AUTH_ACTION_COUNT``: a server gets the environment it is started in, as a
    process of its own would). It exits when this process closes its end of the socket (or
    dies). Each server it forks is a process of its own: its pid can be stopped (``SIGSTOP``)
    or killed alone.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner = 0  # the pid of the process that started it (a forked child starts its own)
        self._env: dict[str, str] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None

    @staticmethod
    def _environment() -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PYTEST_CURRENT_TEST", None)  # pytest's, changed at every test
        return env

    def _ensure(self) -> socket.socket:
        env = self._environment()
        if self._sock is not None and self._owner == os.getpid() and self._env == env:
            assert self._proc is not None
            if self._proc.poll() is None:
                return self._sock
        if self._owner == os.getpid():
            self.close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, __file__, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        self._sock, self._owner, self._env = ours, os.getpid(), env
        return ours

    def close(self) -> None:
        """Stop the fork server (the servers it forked run on until their tests end)."""
        sock, proc, self._sock, self._proc = self._sock, self._proc, None, None
        if sock is not None:
            sock.close()
        if proc is not None:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def spawn(self, log_path: str, faults: str) -> tuple[int, int, int]:
        """Fork a server; returns its pid, its port and the fd whose closing stops it."""
        alive_r, alive_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            with self._lock:
                sock = self._ensure()
                socket.send_fds(sock, [json.dumps([log_path, faults]).encode()], [alive_r, out_w])
        except BaseException:
            os.close(alive_w)
            raise
        finally:
            os.close(alive_r)
            os.close(out_w)
        with os.fdopen(out_r, "rb") as out:
            ready, _, _ = select.select([out], [], [], START_TIMEOUT)
            line = out.readline() if ready else b""
        parts = line.split()
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            os.close(alive_w)
            code = self._proc.poll() if self._proc is not None else None
            raise RuntimeError(f"the moto server did not start (fork server exit code {code})")
        return int(parts[0]), int(parts[1]), alive_w


_FORK_SERVER = _ForkServer()
atexit.register(lambda: _FORK_SERVER.close() if _FORK_SERVER._owner == os.getpid() else None)


def _gone(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``pid`` to exit (the fork server reaps it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)


@contextlib.contextmanager
def s3_server(bucket: str = "ckptstore-test") -> Iterator[S3Endpoint]:
    """Start moto's S3 server on a free loopback port, create ``bucket``, stop on exit."""
    # botocore honours proxy variables; a developer's proxy must never see these requests.
    saved = {k: os.environ.get(k) for k in ("NO_PROXY", "no_proxy")}
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    tmp = tempfile.mkdtemp(prefix="ckptstore-s3-")
    log_path = os.path.join(tmp, "requests.jsonl")
    open(log_path, "w").close()
    faults = os.path.join(tmp, "faults.json")
    _write_json(faults, [])
    alive = -1
    pid = 0
    try:
        pid, port, alive = _FORK_SERVER.spawn(log_path, faults)
        ep = S3Endpoint(
            f"http://127.0.0.1:{port}",
            bucket,
            RequestLog(log_path),
            pid=pid,
            faults=faults,
        )
        _create_bucket(ep.endpoint, bucket)
        yield ep
    finally:
        if alive >= 0:
            os.close(alive)  # the server exits on its end's EOF
            if not _gone(pid, 10):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                _gone(pid, 10)
        shutil.rmtree(tmp, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: The S3 error code of each status a test makes the server answer with (``refusing``).
_CODES = {403: ("AccessDenied", "Forbidden"), 503: ("SlowDown", "Slow Down")}


def _refused(faults: str, method: str, path: str) -> int | None:
    """The status ``method path`` is answered with instead of being served, or None."""
    try:
        with open(faults, encoding="utf-8") as f:
            rules = json.load(f)
    except (OSError, ValueError):
        return None
    for m, end, status in rules:
        if m == method and path.endswith(end):
            return int(status)
    return None


def _preload() -> tuple[Any, Any]:
    """Import moto's server and warm its S3 app (in the fork server, once): the S3 app, and
    the dispatcher of every other request, which already holds it.

    Two requests that change nothing (a listing of the buckets, a look-up of one that does
    not exist) make moto load what its first S3 request would, in every server otherwise.
    """
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.test import Client

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    s3_app = create_backend_app("s3")
    dispatcher = DomainDispatcherApplication(create_backend_app)
    dispatcher.app_instances["s3"] = s3_app
    signed = {
        "Authorization": f"AWS4-HMAC-SHA256 Credential={KEY}/20260101/{REGION}/s3/aws4_request, "
        "SignedHeaders=host, Signature=0"
    }
    client = Client(s3_app)
    with contextlib.suppress(Exception):  # a cold server is slower, not wrong
        client.get("/", headers=signed)
        client.head(f"/ckptstore-warm-up-{uuid.uuid4().hex[:8]}", headers=signed)
    return s3_app, dispatcher


def _serve(log_path: str, faults: str, out: int, alive: int, apps: tuple[Any, Any]) -> None:
    """A forked server process: moto's threaded server, every request appended to ``log_path``.

    Requests that match a rule of ``faults`` (see ``S3Endpoint.refusing``) are answered with
    its error status. Writes its pid and port to ``out``, then serves until ``alive`` ends.
    A request signed for S3 goes to moto's S3 app; the rest to moto's dispatcher, which looks
    up the service of each request among all of moto's (what it found for S3 requests too,
    at a cost of its own on each).
    """
    from moto.core.authorization import ActionAuthenticatorMixin
    from moto.moto_server.werkzeug_app import MotoRequestHandler
    from moto.server import ThreadedMotoServer
    from werkzeug.serving import make_server

    # moto checks credentials once INITIAL_NO_AUTH_ACTION_COUNT requests are done: counted
    # from this server's first, as in a process of its own (not from the warm-up's).
    ActionAuthenticatorMixin.request_count = 0
    s3_app, dispatcher = apps
    lock = threading.Lock()
    log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 - open for the process's life

    class RecordingServer(ThreadedMotoServer):
        def _server_entry(self) -> None:  # upstream's, with the app wrapped
            def recording(environ: dict[str, Any], start_response: Any) -> Any:
                entry = [environ["REQUEST_METHOD"], environ["PATH_INFO"], environ["QUERY_STRING"]]
                with lock:  # logged before it is served, so before it is answered
                    log.write(json.dumps(entry) + "\n")
                    log.flush()
                status = _refused(faults, entry[0], entry[1])
                if status is not None:
                    code, reason = _CODES.get(status, ("InternalError", "Internal Server Error"))
                    body = (
                        f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                        f"<Message>refused by the test</Message></Error>"
                    ).encode()
                    if entry[0] == "HEAD":
                        body = b""
                    start_response(
                        f"{status} {reason}",
                        [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
                    )
                    return [body]
                auth = environ.get("HTTP_AUTHORIZATION", "")
                s3 = "/s3/aws4_request" in auth and not entry[1].startswith("/moto-api")
                return (s3_app if s3 else dispatcher)(environ, start_response)

            self._server = make_server(
                self._ip_address, self._port, recording, True, request_handler=MotoRequestHandler
            )
            self._server_ready_event.set()
            self._server.serve_forever()

    server = RecordingServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    os.write(out, f"{os.getpid()} {server.get_host_and_port()[1]}\n".encode())
    os.close(out)
    while os.read(alive, 1):  # until the test process closes its end, or dies
        pass


def _fork_server(fd: int) -> None:
    """The fork server (this file's ``__main__``): moto imported once, a server forked for
    each request on the socket ``fd`` until it closes."""
    apps = _preload()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the servers
    sock = socket.socket(fileno=fd)
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 2)
        except OSError:
            return
        if not msg:
            return  # the test process closed its end, or died
        log_path, faults = json.loads(msg)
        alive, out = fds
        if os.fork() == 0:
            code = 0
            try:
                sock.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _serve(log_path, faults, out, alive, apps)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)  # no interpreter shutdown: the server threads just end
        os.close(alive)
        os.close(out)


if __name__ == "__main__":
    _fork_server(int(sys.argv[1]))

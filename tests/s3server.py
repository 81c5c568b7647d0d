"""A real S3 HTTP endpoint on loopback for tests: moto's threaded server, one bucket.

``s3_server()`` runs :class:`moto.server.ThreadedMotoServer` on ``127.0.0.1`` on a free port
(the kernel picks it: port 0), creates a bucket through the S3 API and yields an
:class:`S3Endpoint`. Every request the tests make goes over HTTP to that server, through
s3fs/aiobotocore exactly as against AWS; nothing is patched in the test process.

The server runs in a child process (this file is its ``__main__``): in the test process it
would share one GIL with the client, and each request would cost about a third more. The
child appends every request it receives to a log file *before* serving it, so by the time a
client has its answer the request is in :attr:`S3Endpoint.requests`. It exits when its stdin
closes, which also happens when the test process dies.

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

import contextlib
import dataclasses
import functools
import json
import logging
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
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
        cache, as another process would have.
        """
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=fresh, **self.storage_options)

    @functools.cached_property
    def client(self) -> Any:
        """An s3fs client of its own, made once: another process's view, to inspect and damage
        stores behind ckptstore's back (a new client costs ~0.4 s: botocore loads its models).
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
    server = subprocess.Popen(
        [sys.executable, __file__, log_path, faults],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdin is not None
    assert server.stdout is not None
    try:
        ready, _, _ = select.select([server.stdout], [], [], START_TIMEOUT)
        line = server.stdout.readline() if ready else ""
        if not line.strip().isdigit():
            raise RuntimeError(f"the moto server did not start (exit code {server.poll()})")
        ep = S3Endpoint(
            f"http://127.0.0.1:{int(line)}",
            bucket,
            RequestLog(log_path),
            pid=server.pid,
            faults=faults,
        )
        _create_bucket(ep.endpoint, bucket)
        yield ep
    finally:
        server.stdin.close()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        server.stdout.close()
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


def _serve(log_path: str, faults: str) -> None:
    """The server process: moto's threaded server, every request appended to ``log_path``.

    Requests that match a rule of ``faults`` (see ``S3Endpoint.refusing``) are answered with
    its error status. Prints the port, then serves until its stdin closes.
    """
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from moto.server import ThreadedMotoServer
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    lock = threading.Lock()
    log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 - open for the process's life

    class RecordingServer(ThreadedMotoServer):
        def _server_entry(self) -> None:  # upstream's, with the app wrapped
            app = DomainDispatcherApplication(create_backend_app)

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
                return app(environ, start_response)

            self._server = make_server(
                self._ip_address, self._port, recording, True, request_handler=MotoRequestHandler
            )
            self._server_ready_event.set()
            self._server.serve_forever()

    server = RecordingServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    print(server.get_host_and_port()[1], flush=True)
    sys.stdin.read()  # until the test process closes it, or dies
    server.stop()


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2])

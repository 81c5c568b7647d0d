"""A real S3 HTTP endpoint on loopback for tests: moto's threaded server, one bucket.

``s3_server()`` starts :class:`moto.server.ThreadedMotoServer` on ``127.0.0.1`` on a free
port (the kernel picks it: port 0), creates a bucket through the S3 API and yields an
:class:`S3Endpoint`. Every request the tests make goes over HTTP to that server, through
s3fs/aiobotocore exactly as against AWS; nothing is patched in-process.

The option names are the ones ``s3fs.S3FileSystem.__init__`` takes (s3fs 2026.x,
``s3fs/core.py``): ``key``/``secret`` for the credentials, ``client_kwargs`` forwarded to
``aiobotocore``'s ``create_client`` (``endpoint_url``, ``region_name``). ``endpoint_url`` is
also accepted at the top level ("Takes precedence over `endpoint_url` in client_kwargs"),
which is the form a ``--storage-option endpoint_url=...`` on the command line produces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, unquote

from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from moto.server import ThreadedMotoServer
from werkzeug.serving import make_server

#: Credentials moto accepts (it checks nothing; they only have to be present).
KEY = "testing"
SECRET = "testing"
REGION = "us-east-1"


@dataclasses.dataclass(frozen=True)
class Request:
    """One HTTP request the server received."""

    method: str
    path: str  # URL-decoded, e.g. ``/bucket/run1/step-000000000001/manifest.json``
    query: dict[str, str]

    @property
    def is_list(self) -> bool:
        """A ListObjects(V2) request on a bucket."""
        return self.method == "GET" and self.path.count("/") == 1 and "list-type" in self.query

    @property
    def is_bulk_delete(self) -> bool:
        """A DeleteObjects (``POST /bucket?delete``)."""
        return self.method == "POST" and "delete" in self.query


class RequestLog:
    """What reached the server, in arrival order; thread-safe (werkzeug serves in threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[Request] = []

    def add(self, environ: dict[str, Any]) -> None:
        query = {
            k: v[-1] for k, v in parse_qs(environ.get("QUERY_STRING", ""), True).items()
        }
        req = Request(environ["REQUEST_METHOD"], unquote(environ.get("PATH_INFO", "")), query)
        with self._lock:
            self._items.append(req)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __call__(self) -> list[Request]:
        with self._lock:
            return list(self._items)


@dataclasses.dataclass(frozen=True)
class S3Endpoint:
    """A running S3 server with one bucket, and the log of the requests it received."""

    endpoint: str
    bucket: str
    requests: RequestLog

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
        """The same as ``--storage-option KEY=VALUE`` arguments (flat: no nested dicts)."""
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

    def unique_prefix(self, stem: str = "run") -> str:
        """A prefix no other test uses."""
        return f"{stem}-{uuid.uuid4().hex[:12]}"


class _RecordingServer(ThreadedMotoServer):
    """moto's threaded server with every request appended to a :class:`RequestLog`."""

    def __init__(self, log: RequestLog) -> None:
        super().__init__(ip_address="127.0.0.1", port=0, verbose=False)
        self._log = log

    def _server_entry(self) -> None:  # as upstream, with the app wrapped
        app = DomainDispatcherApplication(create_backend_app)
        log = self._log

        def recording(environ: dict[str, Any], start_response: Any) -> Any:
            log.add(environ)
            return app(environ, start_response)

        self._server = make_server(
            self._ip_address, self._port, recording, True, request_handler=MotoRequestHandler
        )
        self._server_ready_event.set()
        self._server.serve_forever()


@contextlib.contextmanager
def s3_server(bucket: str = "ckptstore-test") -> Iterator[S3Endpoint]:
    """Start moto's S3 server on a free loopback port, create ``bucket``, stop on exit."""
    import boto3

    # One line per request at INFO; the tests make thousands.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)

    # botocore reads credentials and proxies from the environment; make sure a developer's
    # AWS profile or proxy can never send a test request anywhere but to this server.
    saved = {k: os.environ.get(k) for k in ("NO_PROXY", "no_proxy")}
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    log = RequestLog()
    server = _RecordingServer(log)
    server.start()
    try:
        host, port = server.get_host_and_port()
        ep = S3Endpoint(f"http://{host}:{port}", bucket, log)
        # Through boto3, not ``fs.mkdir``: s3fs sends ``LocationConstraint=<region_name>``,
        # which S3 (and moto) reject for us-east-1, the one region that takes none.
        boto3.client(
            "s3",
            endpoint_url=ep.endpoint,
            region_name=REGION,
            aws_access_key_id=KEY,
            aws_secret_access_key=SECRET,
        ).create_bucket(Bucket=bucket)
        yield ep
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

"""The S3 clients uploads go through: their own event loop, thread and botocore settings.

Not a stage. In: the s3fs filesystem a store was opened with. Out: an s3fs instance with
the same options bound to :func:`upload_loop` (one daemon thread per process at the
lowest CPU priority), whose ``PutObject`` and ``UploadPart`` requests ask the store for
the body's CRC32C when :mod:`.s3upload` sets ``_asking_crc32c`` (see its docstring).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import os
import threading
from typing import Any

__all__ = ["is_s3", "upload_fs", "upload_loop"]

#: Set in the task of a request whose body's CRC32C the store is asked to compute.
_asking_crc32c: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "ckptstore_asking_crc32c", default=False
)


def _lowest_priority() -> None:
    """The calling thread at nice 19 (Linux: per thread); elsewhere nothing."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


@functools.cache
def upload_loop() -> asyncio.AbstractEventLoop:
    """The event loop uploads run on: one daemon thread per process, at nice 19."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def run() -> None:
        _lowest_priority()
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        loop.run_forever()

    threading.Thread(target=run, name="ckptstore-upload-loop", daemon=True).start()
    ready.wait()
    return loop


_clones: dict[tuple[int, str], Any] = {}
_clones_lock = threading.Lock()


def _forget_after_fork() -> None:
    # A forked child has neither the loop's thread nor the clones' connections, and the
    # lock may have been held by another thread at the fork.
    global _clones_lock
    upload_loop.cache_clear()
    _clones.clear()
    _clones_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def is_s3(fs: Any) -> bool:
    """Whether ``fs`` is an s3fs filesystem used synchronously (this writer's case)."""
    try:
        import s3fs
    except ImportError:
        return False
    return isinstance(fs, s3fs.S3FileSystem) and not getattr(fs, "asynchronous", False)


def upload_fs(fs: Any) -> Any:
    """An s3fs instance with ``fs``'s options bound to :func:`upload_loop` (made once)."""
    key = (os.getpid(), str(getattr(fs, "_fs_token", id(fs))))
    with _clones_lock:
        clone = _clones.get(key)
        if clone is None:
            options = dict(getattr(fs, "storage_options", {}))
            options.pop("loop", None)
            options.pop("asynchronous", None)
            options["skip_instance_cache"] = True
            options["config_kwargs"] = _upload_config(options.get("config_kwargs"))
            if getattr(fs, "session", None) is not None and "session" not in options:
                # botocore's loaded service models come with the session: a client of
                # our own then costs milliseconds, not a second of CPU.
                options["session"] = fs.session
            clone = type(fs)(**options, loop=upload_loop(), asynchronous=False)
            if isinstance(getattr(fs, "retries", None), int):
                # s3fs's own retries (an attribute, not an option) come on top of botocore's
                # attempts (3 in standard mode, with back-off, throttling included): the clone
                # kept s3fs's 5, and an endpoint that took requests and answered none held an
                # upload for 5 x 3 read timeouts a request. One s3fs try: botocore retries.
                clone.retries = min(fs.retries, 1)
            clone.connect()  # its botocore client, made now on the upload loop
            for op in ("PutObject", "UploadPart"):
                clone.s3.meta.events.register(f"before-call.s3.{op}", _ask_for_crc32c)
            _no_expect_continue(clone.s3)
            _clones[key] = clone
    return clone


def _no_expect_continue(client: Any) -> None:
    """Send request bodies without waiting for ``100 Continue`` first.

    botocore asks for it on every S3 request with a body (``Expect: 100-continue``), and
    aiohttp starts the response's ``read_timeout`` only once the body is sent: an endpoint
    that accepts the connection and then answers nothing (a hung server, a stalled proxy)
    held an upload, and ``close()``, for good (found by review). Sent at once, a body the
    endpoint does not take stalls in the socket instead, where
    :attr:`~ckptstore.storage.s3upload.S3Upload.stall` ends it, and a body it takes is
    answered within ``read_timeout``.
    """
    from botocore.handlers import add_expect_header

    client.meta.events.unregister("before-call.s3", add_expect_header)


def _ask_for_crc32c(params: Any, **_: Any) -> None:
    """The botocore ``before-call`` hook of the upload clients: ask for the body's CRC32C.

    The ``x-amz-sdk-checksum-algorithm`` header alone (no checksum value, which botocore
    would compute itself from the body) asks a store that computes checksums (moto) to
    compute the CRC32C of the bytes it received and answer it.
    """
    if _asking_crc32c.get():
        params["headers"]["x-amz-sdk-checksum-algorithm"] = "CRC32C"


def _upload_config(given: Any) -> dict[str, Any]:
    """The botocore config of the upload client: ``given`` with two settings of ours.

    - ``s3.payload_signing_enabled=False``: the body is not hashed with SHA256 for the
      signature (``UNSIGNED-PAYLOAD``; botocore already does so over https whenever a
      Content-MD5 or checksum header is present, as every request of ours has). Over plain
      http the signature then covers the body's Content-MD5 and CRC32C headers, not the
      body itself: the bytes are checked by those (see the module docstring). It is also
      what lets a body be streamed (:class:`_Body`) instead of read whole to be hashed.
    - ``request_checksum_calculation="when_required"``: botocore adds no CRC32 of its own
      to a body (each request carries our CRC32C, or where the store refuses those, our
      Content-MD5).
    """
    config = dict(given) if isinstance(given, dict) else {}
    s3 = dict(config.get("s3") or {})
    s3.setdefault("payload_signing_enabled", False)
    config["s3"] = s3
    config.setdefault("request_checksum_calculation", "when_required")
    return config

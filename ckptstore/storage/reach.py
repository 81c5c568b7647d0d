"""Errors of talking to an object store, as one line that says what to check.

No credentials, an endpoint that does not answer, access denied: botocore, aiohttp and the
other clients raise their own exceptions (chained, often 100+ lines). :func:`remote_error`
turns one into a :class:`~ckptstore.errors.CkptStoreError` naming the store and what to
check, the command line's wording, used by the command line (``ops.stores``) and by the
object-store backend (``storage.remote``) alike. Nothing here imports the clients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..errors import CkptStoreError, StoreUnreachableError

__all__ = ["is_unreachable", "reaching", "remote_error", "unanswered"]


_NO_CREDENTIALS = {
    "NoCredentialsError",
    "PartialCredentialsError",
    "CredentialRetrievalError",
    "NoAuthTokenError",
    "DefaultCredentialsError",
}
_UNREACHABLE = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ConnectionClosedError",
    "ReadTimeoutError",
    "ProxyConnectionError",
    "ClientConnectorError",
    "ClientConnectionError",
    "ServerDisconnectedError",
    "ServerTimeoutError",
}
#: Modules whose exceptions can only come from talking to an object store.
_REMOTE_MODULES = (
    "botocore",
    "aiobotocore",
    "aiohttp",
    "s3fs",
    "gcsfs",
    "google",
    "adlfs",
    "azure",
)


def is_unreachable(e: BaseException) -> bool:
    """Whether ``e``, or an error it was raised from, says the endpoint did not answer.

    No connection, or no answer within the client's timeouts.
    """
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if _no_answer(cur) or isinstance(cur, StoreUnreachableError):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _no_answer(e: BaseException) -> bool:
    """Whether the client's error ``e`` itself says: no connection, or no answer in time."""
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & _UNREACHABLE) or isinstance(e, ConnectionError | TimeoutError)


def remote_error(
    e: BaseException, where: str, cls: type[CkptStoreError] = CkptStoreError
) -> CkptStoreError | None:
    """One line saying what to check, for an error that reaching an object store raised.

    Only for errors raised while talking to an object store: a local ``PermissionError``
    is not a credentials problem. The error is a ``cls`` (the command line's plain
    ``CkptStoreError``; the storage backend's :class:`~ckptstore.errors.StoreUnreachableError`).

    Returns:
        The error to raise instead, or ``None`` when ``e`` is not such an error.
    """
    names = {c.__name__ for c in type(e).__mro__}
    text = " ".join(str(e).split()) or type(e).__name__
    if names & _NO_CREDENTIALS:
        return cls(
            f"{where}: no credentials found ({text}); set them in the environment "
            "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) or pass them as "
            "storage options (key=..., secret=...)"
        )
    if _no_answer(e):
        return cls(
            f"{where}: cannot reach the storage endpoint ({text}); check the endpoint_url "
            "storage option, the network, and that the service is up"
        )
    if isinstance(e, PermissionError) or "AccessDenied" in text:
        return cls(
            f"{where}: access denied ({text}); check the credentials (key and secret, "
            "AWS_PROFILE) and that they may read this bucket"
        )
    if type(e).__module__.split(".")[0] in _REMOTE_MODULES:
        return cls(f"{where}: the object store refused the request ({text})")
    return None


@contextlib.contextmanager
def reaching(where: str, cls: type[CkptStoreError] = CkptStoreError) -> Iterator[None]:
    """Turn the errors of talking to an object store into one-line ``cls`` errors."""
    try:
        yield
    except CkptStoreError:
        raise
    except FileNotFoundError:
        raise
    except Exception as e:
        err = remote_error(e, where, cls)
        if err is None:
            raise
        raise err from e


def unanswered(storage: object, e: BaseException, rel: str) -> BaseException | None:
    """The error to raise where an object store refused or failed a request on ``rel``.

    ``None`` where ``e`` says something of the checkpoint instead: a key that does not
    exist, or any error of a local store (an EIO there is a damaged file). A 403, or a 5xx
    still failing after the client's retries, is the object store's
    (``FsspecStorage._no_answer``: a ``StoreUnreachableError``), never a bad step: taken for
    one, it made resume skip the step and restore an older one (design rule 1).
    """
    if isinstance(e, StoreUnreachableError):
        return e
    if isinstance(e, FileNotFoundError | NotADirectoryError) or not isinstance(e, OSError):
        return None
    no_answer = getattr(storage, "_no_answer", None)
    return no_answer(e, rel) if callable(no_answer) else None

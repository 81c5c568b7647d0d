"""Storage backends, chosen by URL through one registry."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError, MissingDependencyError
from .base import Pending, Storage, wait_for_deletions
from .local import LocalStorage

__all__ = ["LocalStorage", "Pending", "Storage", "open_storage", "wait_for_deletions"]

#: Protocols served by the POSIX backend (atomic rename, fsync, writer lock).
_LOCAL_PROTOCOLS = ("", "file", "local")
#: Install hints for fsspec protocols whose package is optional.
_HINTS = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
}


def open_storage(
    url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> Storage:
    """The backend for ``url``: a local path or ``file://`` URL, or any fsspec URL.

    Raises:
        ImportError: the fsspec implementation for the URL's protocol is not installed; the
            message names the package to install.
    """
    url = os.fspath(url)
    protocol, sep, rest = url.partition("://")
    if not sep:
        protocol, rest = "", url
    if protocol in _LOCAL_PROTOCOLS:
        extra = set(storage_options or {}) - {"io"}
        if extra:
            msg = (
                "storage_options are for fsspec URLs; a local path takes only "
                f"{{'io': 'auto' | 'direct' | 'buffered'}}, not {sorted(extra)}"
            )
            raise ConfigError(msg)
        return LocalStorage(rest, io=(storage_options or {}).get("io", "auto"))
    import fsspec

    from .remote import FsspecStorage

    try:
        fs, path = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    except ImportError as e:
        pkg = _HINTS.get(protocol)
        hint = f" Install it with: pip install {pkg}" if pkg else ""
        raise MissingDependencyError(f"no filesystem for {protocol}:// URLs ({e}).{hint}") from e
    if getattr(fs, "protocol", None) in ("file", ("file", "local")):
        return LocalStorage(path)
    return FsspecStorage(fs, path, url)

"""Functions of the C library that Python's ``os`` lacks (Linux only), each looked up once.

``madvise`` and ``mincore`` (``_prefault``), and ``renameat2`` (``storage.local``).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["libc_function"]


@functools.cache
def libc_function(name: str, argtypes: tuple[Any, ...]) -> Callable[..., int] | None:
    """The C library's ``name``, taking ``argtypes`` and returning an ``int``, or None.

    ``errno`` is kept for ``ctypes.get_errno``. None: not Linux, or a C library without it.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]

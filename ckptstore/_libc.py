"""Functions of the C library that Python's ``os`` lacks (Linux only), each looked up once.

``madvise`` and ``mincore`` (``_prefault``), ``renameat2`` (``storage.local``), and
``memmove`` called without releasing the GIL (:func:`memmove_held`).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["libc_function", "memmove_held"]


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


@functools.cache
def _held_memmove() -> Callable[[int, int, int], Any]:
    try:
        fn = ctypes.PyDLL(None).memmove  # a PyDLL function keeps the GIL while it runs
    except (OSError, AttributeError, TypeError):
        return ctypes.memmove
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = ctypes.c_void_p
    return fn


def memmove_held(dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``src`` to ``dst`` without releasing the GIL.

    ``ctypes.memmove`` releases it for the copy and takes it back after: for a thread that
    copies block after block among several such threads, each of those hand-overs is a
    wait (see ``integrity.crc32c_held``). Where the C library cannot be loaded this way,
    ``ctypes.memmove`` itself.
    """
    _held_memmove()(dst, src, nbytes)

"""Pausing Python's cyclic garbage collector around bulk object work."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (objects are still freed by reference count).

    Building or unpickling tens of thousands of acyclic objects (manifests in a listing,
    the save plans of a DTensor state) triggers collection after collection, each walking
    every live object: a pause makes that work linear again.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()

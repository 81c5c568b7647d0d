"""JSON as ckptstore writes it: no ``NaN``, ``Infinity`` or ``-Infinity``.

Every JSON file of a checkpoint is written with ``allow_nan=False`` (a non-finite float of
the state is a typed node, ``{"t": "float", "bits": ...}``), so such a literal in one is
damage or forgery. ``json.loads`` accepts them, and an ``Infinity`` where an int belongs (a
tensor's shape in ``state.json``) then escaped every reader as a raw ``OverflowError``: a
restore stopped there instead of falling back to the step before, and ``verify`` passed the
step. :func:`loads` refuses them with a ``ValueError``, which each reader already turns into
its own error naming the file ("not valid JSON").
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["deeper_than", "loads"]


def _refuse(name: str) -> Any:
    msg = f"non-finite number {name} (ckptstore writes none)"
    raise ValueError(msg)


def loads(data: bytes | bytearray | memoryview | str, **kwargs: Any) -> Any:
    """``json.loads`` of UTF-8 ``data`` that refuses ``NaN`` and the infinities.

    Raises:
        ValueError: not JSON, or a non-finite literal in it.
        UnicodeDecodeError: not UTF-8.
        RecursionError: nested too deeply.
    """
    text = data if isinstance(data, str) else bytes(data).decode("utf-8")
    return json.loads(text, parse_constant=_refuse, **kwargs)


def deeper_than(obj: Any, limit: int) -> bool:
    """Whether decoded JSON ``obj`` nests lists and objects more than ``limit`` levels deep.

    Iterative: what ``json.loads`` built just under the interpreter's recursion limit made a
    later ``json.dumps`` of it (a checksum, a broadcast) raise ``RecursionError`` a few
    frames deeper.
    """
    todo: list[tuple[Any, int]] = [(obj, 1)]
    while todo:
        node, level = todo.pop()
        if isinstance(node, dict):
            items: Any = node.values()
        elif isinstance(node, list | tuple):
            items = node
        else:
            continue
        if level > limit:
            return True
        todo.extend((v, level + 1) for v in items if isinstance(v, dict | list | tuple))
    return False

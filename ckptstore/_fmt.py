"""How results spell times, metrics and the keys of a path in a state.

Times and metrics in their JSON form (``--json`` of the commands); keys as ``diff`` and
``inspect`` print paths.
"""

from __future__ import annotations

import datetime as _dt
import math

from .manifest import Manifest

__all__ = ["created_json", "created_utc", "key_text", "metric_json"]


def created_utc(manifest: Manifest) -> _dt.datetime | None:
    """The manifest's creation time as an aware UTC datetime (``None`` when unparsable)."""
    dt = manifest.created_datetime
    if dt is None:
        return None
    if dt.tzinfo is None:  # the manifest always writes UTC; a naive time is UTC too
        dt = dt.replace(tzinfo=_dt.timezone.utc)
    return dt.astimezone(_dt.timezone.utc)


def created_json(manifest: Manifest) -> str:
    """``2024-05-01T12:00:00Z``, or the manifest's own text when it does not parse."""
    dt = created_utc(manifest)
    return dt.strftime("%Y-%m-%dT%H:%M:%SZ") if dt is not None else manifest.created


def metric_json(v: float) -> float | str:
    """A metric for JSON, which has no NaN or infinity: spelled as the manifest spells them."""
    if math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def key_text(key: object, sep: str) -> str:
    """One key of a path in a state, as the commands print paths joined with ``sep``.

    A state's dict keys are strings and ints. A string prints as itself unless it reads as
    an int (``"1"`` beside the key ``1``), is empty, or holds ``sep`` or a quote: then
    quoted (``repr``); an int prints as its digits. Printed with ``str``, the int 1 and the
    string "1", or ``{"a/b": x}`` and ``{"a": {"b": y}}``, were one path.
    """
    if not isinstance(key, str):
        return str(key) if type(key) is int else repr(key)
    if not key or sep in key or "'" in key or '"' in key or _reads_as_int(key):
        return repr(key)
    return key


def _reads_as_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True

"""How results spell times and metrics in their JSON form (``--json`` of the commands)."""

from __future__ import annotations

import datetime as _dt
import math

from .manifest import Manifest

__all__ = ["created_json", "created_utc", "metric_json"]


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

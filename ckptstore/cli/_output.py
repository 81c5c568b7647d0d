"""Output helpers shared by the commands: sizes, tables, times, metrics, JSON, progress."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from .._fmt import created_utc
from ..manifest import Manifest

__all__ = [
    "Bar",
    "created_text",
    "human_bytes",
    "metrics_text",
    "one_line",
    "plural",
    "print_json",
    "steps_text",
    "table",
]


def human_bytes(n: int) -> str:
    """A size for people, in SI units: ``160 B``, ``1.2 kB``, ``3.4 GB``."""
    if n < 1000:
        return f"{n} B"
    value = float(n)
    for unit in ("kB", "MB", "GB", "TB", "PB"):
        value /= 1000.0
        if value < 999.95 or unit == "PB":
            return f"{value:.1f} {unit}"
    return f"{n} B"  # pragma: no cover - unreachable


def plural(n: int, word: str) -> str:
    """``1 step``, ``2 steps``."""
    return f"{n} {word}{'s' * (n != 1)}"


def steps_text(steps: Sequence[int]) -> str:
    """``9, 10, 100``."""
    return ", ".join(str(s) for s in steps)


def created_text(manifest: Manifest) -> str:
    """``2024-05-01 12:00:00`` (UTC), or the manifest's own text when it does not parse."""
    dt = created_utc(manifest)
    return dt.strftime("%Y-%m-%d %H:%M:%S") if dt is not None else (manifest.created or "-")


def metrics_text(metrics: Mapping[str, float]) -> str:
    """``loss=0.31,val_loss=0.4``."""
    return ",".join(f"{k}={v:.6g}" for k, v in sorted(metrics.items()))


def table(rows: Sequence[Sequence[str]], *, right: Sequence[int] = (), indent: str = "") -> str:
    """Align ``rows`` (the first is the header) in columns; ``right`` columns right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append((indent + "  ".join(cells)).rstrip())
    return "\n".join(lines)


def one_line(message: str) -> str:
    """A message on one line: its lines joined with `` | ``."""
    parts = [p.strip() for p in message.splitlines() if p.strip()]
    return " | ".join(parts) if parts else message


def print_json(doc: Any, out: TextIO | None = None) -> None:
    """``doc`` as indented JSON on stdout."""
    print(json.dumps(doc, indent=2, default=str), file=out or sys.stdout)


class Bar:
    """A progress callback (see ``ckptstore._progress``) drawn as a tqdm bar on stderr.

    Only when stderr is a terminal: piped output and logs stay clean. The bar is made on the
    first call, when the total is known.
    """

    def __init__(self, desc: str, unit: str = "it") -> None:
        self.desc = desc
        self.unit = unit
        self._bar: Any = None

    def __call__(self, done: int, total: int | None, what: str) -> None:
        """Show ``done`` of ``total``, and ``what`` is being done."""
        if self._bar is None:
            if not sys.stderr.isatty():
                return
            from tqdm import tqdm

            self._bar = tqdm(
                total=total,
                desc=self.desc,
                unit=self.unit,
                file=sys.stderr,
                leave=False,
                dynamic_ncols=True,
            )
        self._bar.update(done - self._bar.n)
        self._bar.set_postfix_str(what)

    def close(self) -> None:
        """Remove the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The progress callback long operations take (the command line draws a bar with it)."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Progress"]

#: Called as long work advances: ``(done, total, what)``; ``total`` is ``None`` when unknown
#: and ``what`` says what is being done (``"step 1000"``, ``"writing model.safetensors"``).
Progress = Callable[[int, "int | None", str], None]

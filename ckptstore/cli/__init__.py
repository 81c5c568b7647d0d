"""The ``ckptstore`` command line.

One module per command, each of which parses its arguments, calls one typed library function
(``ckptstore.list_stores``, ``verify_path``, ``prune_store``, ``inspect_step``,
``export_step``, ...) and prints its result: a table for people, JSON for programs.
:func:`main` (``cli/main.py``) is the one place errors become exit codes.

Commands that only read JSON and bytes (``--version``, ``ls``, ``verify``, ``prune``, ``gc``,
``rm``, ``pin``, ``inspect``) never import torch; ``diff``, ``import`` and ``export`` import
it when they run.
"""

from __future__ import annotations

from ._common import parse_storage_options
from ._output import human_bytes
from .main import main

__all__ = ["human_bytes", "main", "parse_storage_options"]

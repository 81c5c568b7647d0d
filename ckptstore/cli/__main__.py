"""``python -m ckptstore.cli``: the same command line as the ``ckptstore`` script."""

from __future__ import annotations

import sys

from .main import main

if __name__ == "__main__":
    sys.exit(main())

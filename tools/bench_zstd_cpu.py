"""Where a zstd restore's CPU goes: wall time and thread CPU, main thread and the others.

    PYTHONPATH=$PWD python tools/bench_zstd_cpu.py --size 64MB --rounds 4

See tools/benchkit/zstd_cpu.py.
"""

from __future__ import annotations

import sys

from benchkit.zstd_cpu import main

if __name__ == "__main__":
    sys.exit(main())

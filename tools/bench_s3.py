"""Restore from S3 (moto's server on loopback) vs s3fs ``cat`` of the same objects, on its own.

    .venv/bin/python tools/bench_s3.py --size 256MB --repeats 3

The same measurement as ``tools/bench.py --s3``; see tools/benchkit/s3.py.
"""

from __future__ import annotations

import sys

from benchkit.s3 import main

if __name__ == "__main__":
    sys.exit(main())

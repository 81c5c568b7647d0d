"""What every part of the crash campaign shares: the configurations, the kill windows and
the distributed timeouts and moto's S3 server.

Importing it puts the checkout, tools/ (crash_writer.py) and tests/ (s3server.py) on
``sys.path``, for the campaign and for the fork server's children alike.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools"
sys.path[:0] = [str(REPO), str(TOOLS), str(REPO / "tests")]

#: Every writer configuration: (format, async_save, keep).
CONFIGS = [
    (fmt, a, keep) for fmt in ("safetensors", "torch") for a in (False, True) for keep in (1, 2)
]
#: Upper bound of the random delay before a kill, seconds, per store.
KILL_WITHIN = {"local": 0.25, "s3": 1.5}
#: barrier_timeout of the distributed jobs, and the slack allowed on top of it: an idle host's
#: 5 s times CKPTSTORE_TEST_SLOWDOWN (1 unless set; the test suite sets it, see tests/timing.py),
#: since on a busy host a survivor takes longer to report and exit once its wait ran out.
DIST_TIMEOUT = 3.0
DIST_SLACK = 5.0 * float(os.environ.get("CKPTSTORE_TEST_SLOWDOWN", "1"))


@contextlib.contextmanager
def s3() -> Iterator[Any]:
    """Moto's S3 server on loopback (tests/s3server.py), with the campaign's bucket."""
    from s3server import s3_server

    with s3_server(bucket="ckptstore-crashtest") as ep:
        yield ep


def numbers_of(lines: list[str], word: str) -> list[int]:
    """The numbers N of a child's lines ``"<word> N ..."``."""
    return [int(x.split()[1]) for x in lines if x.startswith(word + " ")]

"""The two ends every forked child of the tools shares: one-write output lines, and an exit.

The tools' fork servers (``rankserver.py``, ``crash_sharded.py --serve``, ``crash_writer.py
--serve``, ``crashkit/server.py``) and ``scale_sim.py --fork`` fork children from a process
that imported torch once. A child must never return into its server's loop, and must leave
with the code its body meant: :func:`finish` runs the body and ends the process with
``os._exit``, without the interpreter's shutdown (whose atexit handlers belong to the server,
and whose process-group teardown would wait for a dead peer).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

__all__ = ["emit", "finish", "freeze"]


def emit(line: str) -> None:
    """One line on stdout in one write(2), so the lines of concurrent children never mix.

    What ``print`` left in ``sys.stdout``'s buffer goes first, to keep the order.
    """
    sys.stdout.flush()
    os.write(1, (line + "\n").encode())


def finish(
    body: Callable[[], int | None], on_error: Callable[[str], None] | None = None
) -> NoReturn:
    """Run ``body`` in a forked child, then end the child: never returns.

    The exit code is what ``body`` returned (0 for None), a ``SystemExit``'s code as the
    interpreter would give it, or 1 for any other exception, whose traceback goes to
    ``on_error`` (default: printed on stderr).
    """
    code = 1
    try:
        got = body()
        code = 0 if got is None else got
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        if on_error is None:
            traceback.print_exc()
        else:
            on_error(traceback.format_exc())
    finally:
        # os._exit skips atexit: the one exit handler of ckptstore's that keeps something
        # (the I/O mode cache's pending write, storage/iocache.py) runs here, as it would at
        # a rank's normal exit; the others inherited from the server stay out of the child.
        iocache = sys.modules.get("ckptstore.storage.iocache")
        if iocache is not None:
            with contextlib.suppress(Exception):
                iocache.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def freeze() -> None:
    """In a fork server, before it forks: what it imported and made lives as long as every
    child, so it goes out of the garbage collector's reach (``gc.freeze``).

    A child then neither walks those objects in its collections (a rank's ``gc.collect()``:
    the bench calls one before each timed operation) nor copies their pages on write doing
    so: 0.4 s of CPU and ~90 MB a child without it, measured in a child of the test fork
    server (2026-11-29). Garbage is collected first, not frozen.
    """
    gc.collect()
    gc.freeze()

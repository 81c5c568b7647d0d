"""How long a test may wait for work that is healthy, on a host that may be busy.

A test waits for two kinds of things. Some waits are the behaviour under test: a rank that
never arrives must be timed out after ``barrier_timeout``, and the test fails if nothing times
out; those keep their short, fixed values. The others only wait for a healthy peer or child
to get on with its work (a rank that is still writing step 1, a fork server importing torch,
the survivors' error reaching them): on a shared CI host they take several times longer than
on an idle one, and a test that fails there is a defect. Those waits go through
:func:`healthy`, which multiplies them by :data:`FACTOR`.

The hard timeouts that catch a hang (the launcher's ``timeout``, pytest-timeout) are not
scaled: a scaled healthy wait always stays below them.
"""

from __future__ import annotations

import os


def _factor() -> float:
    raw = os.environ.get("CKPTSTORE_TEST_SLOWDOWN", "4")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value >= 1.0 and value < 100.0):  # also rejects nan
        msg = f"CKPTSTORE_TEST_SLOWDOWN must be a number from 1 to 100, got {raw!r}"
        raise ValueError(msg)
    return value


#: How many times slower than an idle host the tests allow healthy work to be
#: (``CKPTSTORE_TEST_SLOWDOWN``; 4 by default, generous: a wait that is long enough ends
#: early, so only a failing test pays for it).
FACTOR = _factor()


def healthy(seconds: float) -> float:
    """``seconds`` on an idle host, scaled for a busy one: for waits on healthy work only."""
    return seconds * FACTOR

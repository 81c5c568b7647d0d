"""The launcher itself: how the ranks of a test find each other (launch.py, worker.py)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.multirank.launch import launch, values

pytestmark = pytest.mark.timeout(120)


def test_ranks_meet_on_the_port_rank0_bound_never_a_stale_one(tmp_path: Path) -> None:
    # A port file left by an earlier launch in the same workdir names a port that another
    # process holds now (it accepts, never answers): a rank that read it would hang until the
    # launcher's timeout. The launcher removes it; the ranks meet where rank 0 bound port 0.
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    (tmp_path / "store.port").write_text(str(taken))
    try:
        vals = values(launch("rng_sharded", 2, tmp_path))
    finally:
        squatter.close()
    assert [v["restored"] == v["saved"] for v in vals] == [True, True]
    assert int((tmp_path / "store.port").read_text()) != taken  # rank 0's own, published

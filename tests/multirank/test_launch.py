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


def test_a_reused_pid_is_not_taken_for_done_by_an_older_childs_exit() -> None:
    # The fork server's replies, as its reader thread takes them: a child with pid 4242
    # exits (status 0), and later a new child gets the same pid (32768 pids here, and a
    # fuzz campaign forks thousands). wait() returned the old status at once, before the
    # new rank had written its outcome: "rc=0 ok=False" for a rank that went on to succeed.
    import io
    import json
    import threading
    from types import SimpleNamespace

    from tests.multirank.launch import _ForkServer

    replies = [{"id": 1, "pid": 4242}, {"pid": 4242, "status": 0}, {"id": 2, "pid": 4242}]
    server = object.__new__(_ForkServer)
    server.proc = SimpleNamespace(  # type: ignore[assignment]
        stdout=io.BytesIO(b"".join(json.dumps(r).encode() + b"\n" for r in replies))
    )
    server._cond = threading.Condition()
    server._pids, server._status, server.dead = {}, {}, False
    server._read()  # every reply, then EOF (the server marks itself dead)
    server.dead = False
    assert server._pids == {1: 4242, 2: 4242}
    assert server.wait(4242, 0) is None  # the new child has not exited

"""tools/rendezvous.py: the port a torchrun-style job's store binds is held for the job."""

from __future__ import annotations

import datetime
import socket
import sys

import pytest
from _helpers import REPO
from torch.distributed import TCPStore  # type: ignore[attr-defined]

sys.path.insert(0, str(REPO / "tools"))

from rendezvous import reserved_port  # tools/ is not a package


def _bind(port: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_reserved_port_is_refused_to_others_and_taken_by_the_jobs_store() -> None:
    """The launchers (demo, bench, scale_real) held nothing between choosing MASTER_PORT
    and rank 0 binding it: another process could take it meanwhile."""
    timeout = datetime.timedelta(seconds=10)
    with reserved_port() as port:
        with pytest.raises(OSError) as e:
            _bind(port)  # any other process's bind, while the job runs
        assert e.value.errno == 98  # EADDRINUSE
        # Rank 0's store binds it beside the reservation; a rank connects and is served.
        master = TCPStore("127.0.0.1", port, 2, True, timeout=timeout, wait_for_workers=False)
        client = TCPStore("127.0.0.1", port, 2, False, timeout=timeout)
        client.set("rank1", "up")
        assert master.get("rank1") == b"up"
        del client, master

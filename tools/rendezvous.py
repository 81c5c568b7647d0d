"""The tools' rendezvous: a job's TCPStore on a port no other process can take.

Rank 0 hosts the store on a port the kernel picks (port 0) and publishes it in a file
(written, then renamed: never half a number); the other ranks wait for that file and
connect. A port the launcher found free, closed and had rank 0 bind later could be taken in
between by any process of the host that binds or connects (gloo binds its pairs' ports by
the dozen): rank 0 then failed with ``EADDRINUSE`` and the others waited for a store that
never came. The suite's launcher does the same (``tests/multirank/worker.py``).

Launchers whose ranks rendezvous as torchrun's do (``MASTER_PORT``, ``init_method="env://"``:
the demos, the benches' rank servers) hold the port instead (:func:`reserved_port`): bound,
not listening, for the whole job, so only rank 0's store can bind it beside them.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["env_for", "init_group", "reserved_port"]


def env_for(rank: int, world: int, master_port: int) -> dict[str, str]:
    """The environment of one rank, as torchrun would set it."""
    return dict(
        os.environ,
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        # gloo's C++ logs repeat what BarrierTimeout says, with stack traces
        TORCH_CPP_LOG_LEVEL="FATAL",
    )


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A loopback port held for a job's ``MASTER_PORT`` while the block runs.

    The socket is bound with ``SO_REUSEADDR`` and never listens: rank 0's ``TCPStore``
    (which sets ``SO_REUSEADDR`` too) binds the port beside it, while any other process's
    bind is refused and the kernel's choice of a port (``bind`` to 0, ``connect``) passes it
    over. A port found free and closed, as before, could be taken by anyone in the seconds
    rank 0 spent importing torch.
    """
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


def _store(rank: int, world: int, port_file: Path, timeout_s: float) -> Any:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        # wait_for_workers=False: the others learn the port only from the file written next.
        store = TCPStore("127.0.0.1", 0, world, True, timeout=timeout, wait_for_workers=False)
        tmp = port_file.with_name(port_file.name + ".tmp")
        tmp.write_text(str(store.port))
        os.replace(tmp, port_file)
        return store
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not publish its store's port in {port_file}")
        time.sleep(0.01)
    return TCPStore("127.0.0.1", int(port_file.read_text()), world, False, timeout=timeout)


def init_group(rank: int, world: int, port_file: str | Path, timeout_s: float = 60.0) -> None:
    """``torch.distributed.init_process_group("gloo")`` for rank ``rank`` of ``world``, its
    store found through ``port_file`` (a path no other job uses); ``timeout_s`` bounds the
    rendezvous and is the default group's timeout."""
    import torch.distributed as dist

    store = _store(rank, world, Path(port_file), timeout_s)
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )

"""Entry point of one rank: join the gloo group, run a scenario, write the outcome as JSON."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


#: How long a rank waits for the others to join (the launcher's hard timeout ends a hang sooner).
RENDEZVOUS_S = 120.0


def rendezvous(rank: int, world: int, port_file: Path) -> Any:
    """The job's TCPStore, on a port no other test can take.

    Rank 0 hosts the store on a port the kernel picks (port 0) and publishes it in
    ``port_file`` (write, then rename: never half a number); the other ranks wait for that
    file and connect. A port chosen by the launcher, closed and bound later by rank 0 could be
    taken by another test in between (issue: the ``free_port`` race).
    """
    from torch.distributed import TCPStore

    timeout = datetime.timedelta(seconds=RENDEZVOUS_S)
    if rank == 0:
        # wait_for_workers=False: the others learn the port only from the file written next.
        store = TCPStore("127.0.0.1", 0, world, True, timeout=timeout, wait_for_workers=False)
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(store.port))
        os.replace(tmp, port_file)
        return store
    deadline = time.monotonic() + RENDEZVOUS_S
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not publish its store's port in {port_file}")
        time.sleep(0.01)
    port = int(port_file.read_text())
    return TCPStore("127.0.0.1", port, world, False, timeout=timeout)


def main() -> None:
    scenario, rank, world, port_file, workdir, args = sys.argv[1:7]
    rank_i, world_i = int(rank), int(world)
    import torch.distributed as dist

    from tests.multirank import scenarios

    store = rendezvous(rank_i, world_i, Path(port_file))
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank_i,
        world_size=world_i,
        timeout=datetime.timedelta(seconds=RENDEZVOUS_S),
    )
    out = Path(workdir) / f"rank{rank_i}.json"
    t0 = time.monotonic()
    # "module:function" runs a scenario of another module of this package.
    module, _, name = scenario.rpartition(":")
    if module:
        import importlib

        fn = getattr(importlib.import_module(f"tests.multirank.{module}"), name)
    else:
        fn = getattr(scenarios, scenario)
    ctx = scenarios.Ctx(rank=rank_i, world=world_i, workdir=Path(workdir), args=json.loads(args))
    try:
        value = fn(ctx)
        data = {"ok": True, "value": value}
    except BaseException as e:
        traceback.print_exc()
        data = scenarios.failure(e)
    data["elapsed"] = time.monotonic() - t0
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, out)
    sys.stdout.flush()
    # Skip destroy_process_group: after a timeout the group is broken by design, and a
    # survivor must not wait on dead peers at exit.
    os._exit(0)


if __name__ == "__main__":
    main()

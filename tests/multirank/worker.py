"""Entry point of one rank: join the gloo group, run a scenario, write the outcome as JSON."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


#: How long a rank waits for the others to join (the launcher's hard timeout ends a hang sooner).
RENDEZVOUS_S = 120.0


def main() -> None:
    scenario, rank, world, port_file, workdir, args = sys.argv[1:7]
    rank_i, world_i = int(rank), int(world)

    from tests.multirank import scenarios
    from tools.rendezvous import init_group

    # Rank 0 binds port 0 and publishes it in port_file: no port is chosen by the launcher
    # and bound later, where another test could take it in between.
    init_group(rank_i, world_i, port_file, RENDEZVOUS_S)
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

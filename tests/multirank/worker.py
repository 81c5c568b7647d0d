"""Entry point of one rank: join the gloo group, run a scenario, write the outcome as JSON."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    scenario, rank, world, port, workdir, args = sys.argv[1:7]
    rank_i, world_i = int(rank), int(world)
    import torch.distributed as dist

    from tests.multirank import scenarios

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank_i,
        world_size=world_i,
        timeout=datetime.timedelta(seconds=120),
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
        data = {
            "ok": False,
            "error_type": type(e).__name__,
            "message": str(e),
            "missing_ranks": list(getattr(e, "missing_ranks", []) or []),
            "phase": getattr(e, "phase", None),
            "step": getattr(e, "step", None),
        }
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

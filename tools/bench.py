#!/usr/bin/env python3
"""Benchmark ckptstore against its peers and the raw disk, interleaved, in one run.

    .venv/bin/python tools/bench.py                      # 1 GB of params + 2 GB of AdamW state
    .venv/bin/python tools/bench.py --size 100MB --repeats 5
    .venv/bin/python tools/bench.py --only disk-odirect,ckpt-st,torch --size 300MB
    .venv/bin/python tools/bench.py --only scale --size 1MB --repeats 5   # save vs step count
    .venv/bin/python tools/bench.py --plot               # also sweep 10MB..--size, write a PNG
    .venv/bin/python tools/bench.py --sharded --size 256MB  # FSDP2: 2 ranks -> 1, 3; 4 -> 2
    .venv/bin/python tools/bench.py --replica --size 64MB   # two tiers: local + S3 (moto)
    .venv/bin/python tools/bench.py --s3 --only ckpt-st --size 64MB  # S3 (moto) vs s3fs cat

The state is shaped like GPT-2-medium (embedding, 16 blocks of attention/MLP/layernorm
tensors, about 200 fp32 tensors), scaled so the parameters weigh ``--size``, plus the AdamW
state of one real optimizer step (``exp_avg``, ``exp_avg_sq``, ``step`` for every parameter):
the state is about 3x ``--size`` and every GB/s figure is state bytes / seconds (1 GB = 1e9 B).

Every contender runs ``--repeats`` times, round-robin (round r starts at contender r), and
the medians are reported. Saves are durable (every file and directory fsynced), each into a
new directory. Restores are cold: every file of the checkpoint is fsynced and then dropped
from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (no root needed); the
fraction still resident afterwards is checked with ``mincore`` and reported. Results go to
``--out`` (JSON) and a table on stdout; no number here is asserted by any test.

The ``sharded`` contender (``--sharded``; not in the default run) measures FSDP2 state in
real processes: a save on 2 ranks and a resharded restore on 1 process and on 3 ranks, and
a save on 4 ranks restored on 2, for ckptstore, DCP and raw O_DIRECT side by side (see
tools/benchkit/sharded.py).

This file is the entry point; the bench lives in tools/benchkit/: ``cli`` (arguments, the
run, its JSON), ``harness`` (one size's context, the contender protocol, the rounds),
``state``, ``disk`` and ``units`` (what every contender builds on), ``report`` (medians,
targets, the table, the plot), ``registry`` (every contender's name and description), and a
module per contender group: ``plain`` (raw disk, torch.save, safetensors, DCP, ckptstore;
restore RSS), ``memory`` (async save, copies, the training step), ``protocol`` (verify,
few-KB saves, big stores, listing), ``sharded`` (FSDP2 vs DCP; ``sharded_raw``, its raw
disk contender; ``sharded_trace``, each save's phases and write modes), ``replica`` (two
tiers on S3), ``s3`` (restore from S3) and ``zstd_cpu``.
"""

from __future__ import annotations

import sys

from benchkit.cli import main

if __name__ == "__main__":
    sys.exit(main())

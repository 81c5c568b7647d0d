"""Crash campaign: SIGKILL checkpoint writers at random moments and check every invariant.

    python tools/crashtest.py [--store local|s3|both] [--trials N] [--s3-trials N3] [--seed S]
                              [--dist-trials M] [--upload-trials U] [--json OUT] [--verbose]

**Writers.** A writer process resumes from its store and saves step after step (sync or
async, safetensors or torch payloads, retention ``keep=1`` or ``2`` pruning after every
commit: 8 configurations, each with its own store, taken in turn). The campaign kills it
with SIGKILL after a random delay (every other trial counts it from the first save that
returned, so returned saves are checked however slow the host), then checks the store from
this process:

1. the newest visible checkpoint verifies deeply and loads, holding exactly its own data
   (every tensor of step N holds N);
2. it is the last one whose save returned (sync) or was waited for (async), or the one in
   flight if its commit completed, never older and never newer;
3. nothing committed was lost except by retention: the ``keep`` newest steps are all there,
   and at most the one retention was deleting besides; every visible step verifies;
4. ``gc`` leaves no ``.tmp-``/``.trash-`` entry and no manifest-less step;
5. a new manager on the store saves the next step and loads it back.

Stores: a local directory, and S3 (moto's server on loopback, tests/s3server.py).

**Uploads.** ``--upload-trials`` kills (SIGKILL) an uploader of the replica tier
(``ckptstore.tiers.replica.Replicator``) at a random moment of uploading a local store of two
steps (6 MB payloads, multipart, and small ones) to a fresh S3 prefix. After each kill:
every step visible on the replica verifies deeply and its manifest is the local one byte
for byte, and every step the uploader reported safe is there; then a new uploader on the
same roots must leave the replica with every step, no manifest-less step and no incomplete
multipart upload.

**Distributed.** ``--dist-trials`` runs 2-rank jobs (gloo on loopback) that save and restore
in a loop; one rank is killed (SIGKILL) or, a third of the time, frozen (SIGSTOP: a hung
rank whose sockets stay open, so only the timeout can tell), either after a random delay or
at a random one of its protocol waits (before or after it). The survivor must raise
``BarrierTimeout`` naming that rank and exit within ``barrier_timeout`` plus a few seconds,
never hang; the store must still hold a checkpoint that verifies.

Writers are forked by a fork server (``python -m crashkit.server``) that imported torch once,
so a trial costs milliseconds, not an interpreter start. Prints a summary table; exits 1 on
any violation (each is listed), 0 otherwise. ``--json`` writes every figure.

This file is the entry point; the campaign lives in tools/crashkit/: ``campaign`` (the
command line, the table, the JSON), ``server`` (the fork server and its children),
``writers``, ``dist`` and ``uploads`` (each kind of trial and its checks) and ``common``.
"""

from __future__ import annotations

import sys

from crashkit.campaign import main

if __name__ == "__main__":
    sys.exit(main())

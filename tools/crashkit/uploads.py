"""Upload trials: SIGKILL the replica tier's uploader mid-upload to S3; every visible replica
step must verify and match the local one, and a new uploader must finish the job."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import time
from typing import Any

from crashkit.common import numbers_of, s3
from crashkit.server import Server

#: The local store every upload trial replicates: steps whose model payload is above the
#: multipart threshold (so kills land in multipart uploads too) and a small optimizer.
UPLOAD_STEPS = (1, 2)
UPLOAD_BLOCK = 5 << 20


@dataclasses.dataclass
class UploadStats:
    """Figures of the upload campaign."""

    trials: int = 0
    kills: int = 0
    killed_mid_upload: int = 0  # the kill left a manifest-less step or a multipart upload
    multipart_left: int = 0  # ... of which an incomplete multipart upload
    complete_at_kill: int = 0  # replica steps committed when the kill came (all verified)
    safe_reported: int = 0
    violations: list[str] = dataclasses.field(default_factory=list)
    elapsed: float = 0.0
    upload_s: float = 0.0  # one whole upload, measured before the trials


def _upload_template(base: str) -> str:
    """A local store with UPLOAD_STEPS, each step's tensors holding its number."""
    import torch

    from ckptstore import CheckpointManager

    root = os.path.join(base, "upload-template")
    with CheckpointManager(root, keep=None) as mgr:
        for s in UPLOAD_STEPS:
            state = {
                "model": {"w": torch.full((3 << 19,), float(s))},  # 6 MB: multipart
                "optimizer": {"m": torch.full((1 << 16,), float(s))},  # 256 kB: one PUT
                "step": s,
            }
            mgr.save(s, state)
    return root


def _clone(template: str, dst: str) -> None:
    """A copy of the template store whose files are hard links (the uploader only reads)."""
    import shutil

    shutil.copytree(template, dst, copy_function=os.link)


def _replica_problems(replica: Any, local: Any, stats: UploadStats | None) -> list[str]:
    """Every committed replica step verifies deeply and is the local step, byte for byte."""
    from ckptstore.ops.verify import verify_checkpoint

    bad = []
    for s in replica.list_steps():
        if stats is not None:
            stats.complete_at_kill += 1
        report = verify_checkpoint(replica, s, deep=True)
        if not report.ok:
            bad.append(f"replica step {s} is visible but does not verify: {report.problems}")
        elif replica.read_manifest(s).to_bytes() != local.read_manifest(s).to_bytes():
            bad.append(f"replica step {s} differs from the local one")
    return bad


def upload_trials(
    n: int, rng: random.Random, server: Server, base: str, verbose: bool
) -> UploadStats:
    """Kill an uploader at random moments; check the replica; let a new one finish."""
    from ckptstore.storage import open_storage
    from ckptstore.tiers.replica import Replicator

    stats = UploadStats()
    t0 = time.monotonic()
    template = _upload_template(base)
    with s3() as ep:
        opts = dict(ep.storage_options, default_block_size=UPLOAD_BLOCK)
        fs = ep.fs(fresh=True)
        bucket = ep.bucket

        def run(local: str, url: str, delay: float | None) -> tuple[list[str], float]:
            lines: list[str] = []
            server.submit({"kind": "uploader", "local": local, "url": url, "storage_options": opts})
            pid = int(server.line("pid ", 60, lines).split()[1])
            # The clock starts once the uploader has recovered and queued its steps (its
            # start, s3fs's client and the first listings come before): the kills land in
            # the uploads themselves.
            server.line("queued", 120, lines)
            start = time.monotonic()
            if delay is None:
                server.line("jobdone", timeout=300, into=lines)
                return lines, time.monotonic() - start
            deadline = start + delay
            while time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    _, line = server.next(deadline - time.monotonic())
                    lines.append(line)
                    if line == "jobdone":
                        return lines, time.monotonic() - start
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            server.line("jobdone", timeout=60, into=lines)
            return lines, delay

        # One whole upload, to spread the kills over its length.
        local0 = os.path.join(base, "upload-0")
        _clone(template, local0)
        _, stats.upload_s = run(local0, ep.url(ep.unique_prefix("upload")), None)
        for i in range(n):
            local = os.path.join(base, f"upload-{i + 1}")
            _clone(template, local)
            prefix = ep.unique_prefix("upload")
            url = ep.url(prefix)
            delay = rng.uniform(0.0, stats.upload_s * 1.1)
            lines, took = run(local, url, delay)
            if took < delay:  # it finished first: uploads got faster (a quieter host)
                stats.upload_s = min(stats.upload_s, took)
            stats.trials += 1
            killed = any(ln.startswith("exit ") and " signal 9" in ln for ln in lines)
            stats.kills += killed
            safe = numbers_of(lines, "safe")
            stats.safe_reported += len(safe)
            lstore = open_storage(local)
            replica = open_storage(url, dict(opts, skip_instance_cache=True))
            problems = _replica_problems(replica, lstore, stats)
            have = set(replica.list_steps())
            lost = sorted(set(safe) - have)
            if lost:
                problems.append(f"step(s) {lost} were reported safe but are not on the replica")
            uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=f"{prefix}/")
            mpu = len(uploads.get("Uploads", []))
            garbage = replica.list_garbage()
            stats.multipart_left += mpu > 0
            stats.killed_mid_upload += bool(garbage or mpu)
            # The next uploader on the same roots finishes the job and cleans up.
            up = Replicator(lstore, open_storage(url, dict(opts, skip_instance_cache=True)))
            up.recover()
            up.close()
            after = open_storage(url, dict(opts, skip_instance_cache=True))
            problems += _replica_problems(after, lstore, None)
            if after.list_steps() != list(UPLOAD_STEPS):
                problems.append(f"after recovery the replica has {after.list_steps()}")
            if after.list_garbage():
                problems.append(f"after recovery the replica has garbage {after.list_garbage()}")
            # A killed upload's multipart uploads stay until nothing was written to their step
            # for a day (replica.STALE_UPLOAD_S: another process may be sending them); they
            # are invisible. A day later (the margin set to 0 here), a cleaning aborts them.
            from ckptstore.tiers import replica as replica_mod

            margin, replica_mod.STALE_UPLOAD_S = replica_mod.STALE_UPLOAD_S, 0.0
            try:
                later = Replicator(lstore, open_storage(url, dict(opts, skip_instance_cache=True)))
                later.clean()
                later.close(wait=False)
            finally:
                replica_mod.STALE_UPLOAD_S = margin
            left = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=f"{prefix}/")
            if left.get("Uploads"):
                problems.append("incomplete multipart uploads are left after a stale cleaning")
            if after.list_steps() != list(UPLOAD_STEPS):
                problems.append(f"a stale cleaning left the replica with {after.list_steps()}")
            stats.violations += [f"upload trial {i}: {p}" for p in problems]
            if verbose:
                print(
                    f"  upload trial {i:3d} kill at {delay:5.2f}s: safe {safe}, committed "
                    f"{sorted(have)}, garbage {garbage}, multipart {mpu}  "
                    + ("OK" if not problems else "VIOLATION: " + "; ".join(problems)),
                    flush=True,
                )
            import shutil

            shutil.rmtree(local, ignore_errors=True)
    stats.elapsed = time.monotonic() - t0
    return stats

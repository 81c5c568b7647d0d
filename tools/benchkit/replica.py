"""The ``replica`` contender of tools/bench.py: the two-tier manager against moto's S3.

    .venv/bin/python tools/bench.py --replica --size 64MB --repeats 5

Three figures, each measured side by side in one run (moto's S3 server on loopback,
``tests/s3server.py``, in its own process):

1. **save blocking time** with a replica vs without: ``save`` of the same state, durable,
   alternating between a local-only manager and one with ``replica=`` (whose uploads of the
   previous steps run meanwhile, and also during the local-only saves); medians and their
   ratio (goal: <= 1.1x); again with the S3 server's process niced (see 2). ``isolated``:
   each timed save right after an untimed save of the same manager, the local-only one
   with no upload running (the tiered manager's uploads waited for), the tiered one while
   the upload of the step before is in flight.
2. **training-step slowdown** while an upload runs: a CPU-bound step (matmuls) timed with no
   upload, then while the uploader sends a step; medians and their ratio (goal: < 1.05x);
   again with the S3 server's process at nice 19 (it stands in for a remote store, whose
   CPU is not the training host's).
3. **upload throughput**: one step uploaded by the uploader (checked by the server on
   receipt, its default; and with ``read_back=True``) vs ``s3fs`` ``put`` of the same files
   (its default concurrency), interleaved, the server back at normal priority; bytes of the
   step / seconds, and the CPU seconds of this process and of the server during each. The
   uploader runs at nice 19 by design (its copy threads and its event loop); ``put`` runs at
   normal priority, so on a busy host it also gets more CPU: ``put_nice19`` is the same put
   with its requests on a loop thread at nice 19, the comparison of the mechanisms alone.
   ``legacy`` is the path before S3Upload (s3fs's buffered file, then read back).

Nothing here is asserted by a test; a shared host makes every figure noisy.
"""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchkit.state import build_state

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tests")]  # s3server.py: moto's S3 server in a child process


def _state(param_bytes: int) -> dict[str, Any]:
    model, opt, _ = build_state(param_bytes)
    return {"model": model, "optimizer": opt}


def _train_step(a: torch.Tensor, b: torch.Tensor) -> float:
    t0 = time.perf_counter()
    for _ in range(4):
        a = torch.tanh(a @ b)
    return time.perf_counter() - t0


def run(param_bytes: int, work: Path, repeats: int) -> dict[str, Any]:
    """Run the three measurements; returns their figures (JSON-ready)."""
    from s3server import s3_server

    from ckptstore import CheckpointManager
    from ckptstore.storage import open_storage, wait_for_deletions

    out: dict[str, Any] = {"param_bytes": param_bytes, "repeats": repeats}
    state = _state(param_bytes)
    with s3_server(bucket="ckptstore-bench") as ep, tempfile.TemporaryDirectory(dir=work) as d:
        opts = ep.storage_options
        # ---- 1. save blocking time ----

        def saves(name: str, isolated: bool = False) -> dict[str, Any]:
            plain = CheckpointManager(os.path.join(d, f"plain-{name}"), keep=2)
            tiered = CheckpointManager(
                os.path.join(d, f"tiered-{name}"),
                keep=2,
                replica=ep.url(f"save-{name}"),
                replica_options=opts,
            )
            for m in (plain, tiered):  # warm up: first writes, first requests
                m.save(0, state)
            tiered.wait()
            t_plain, t_tiered = [], []
            for r in range(1, repeats + 1):
                if isolated:
                    # Each timed save right after an untimed one of the same manager: the
                    # local-only one with no upload running (the tiered manager's are
                    # waited for), the tiered one while the upload of the step before is
                    # in flight.
                    tiered.wait()
                    plain.save(2 * r - 1, state)
                    t0 = time.perf_counter()
                    plain.save(2 * r, state)
                    t_plain.append(time.perf_counter() - t0)
                    tiered.save(2 * r - 1, state)
                    t0 = time.perf_counter()
                    tiered.save(2 * r, state)
                    t_tiered.append(time.perf_counter() - t0)
                    continue
                order = [(plain, t_plain), (tiered, t_tiered)]
                for m, sink in order if r % 2 else reversed(order):
                    t0 = time.perf_counter()
                    m.save(r, state)  # the uploads of the previous steps run meanwhile
                    sink.append(time.perf_counter() - t0)
            tiered.wait()
            state_bytes = tiered.manifest(max(tiered.steps())).total_bytes
            plain.close()
            tiered.close()
            return {
                "state_bytes": state_bytes,
                "local_s": statistics.median(t_plain),
                "tiered_s": statistics.median(t_tiered),
                "ratio": statistics.median(t_tiered) / statistics.median(t_plain),
            }

        out["save"] = saves("as-is")
        out["save_isolated"] = saves("isolated", isolated=True)
        # ---- 2. training-step slowdown while an upload runs ----
        local = open_storage(os.path.join(d, "tiered-as-is"))
        step = local.list_steps()[-1]
        torch.manual_seed(0)
        a, b = torch.randn(512, 512), torch.randn(512, 512) / 512**0.5
        for _ in range(5):
            _train_step(a, b)

        def slowdown(prefix: str, legacy: bool = False, rounds: int = 2) -> dict[str, Any]:
            # Idle steps before, between and after the uploads, so a change of the host's
            # load (a shared host) reaches both sides alike.
            idle: list[float] = []
            busy: list[float] = []
            t_up = 0.0
            for r in range(rounds):
                idle += [_train_step(a, b) for _ in range(12)]
                replica = open_storage(ep.url(f"{prefix}-{r}"), opts)
                up = _uploader(local, replica, legacy=legacy)
                done = threading.Event()
                uploader = threading.Thread(
                    target=lambda up=up, done=done: (up.upload_step(step), done.set())
                )
                t0 = time.perf_counter()
                uploader.start()
                while not done.is_set():
                    busy.append(_train_step(a, b))
                uploader.join()
                t_up += time.perf_counter() - t0
            idle += [_train_step(a, b) for _ in range(12)]
            return {
                "idle_s": statistics.median(idle),
                "during_upload_s": statistics.median(busy) if busy else None,
                "steps_during_upload": len(busy),
                "upload_s": t_up / rounds,
                "ratio": statistics.median(busy) / statistics.median(idle) if busy else None,
                "torch_threads": torch.get_num_threads(),
            }

        out["train_step"] = slowdown("slowdown")
        out["train_step_legacy"] = slowdown("slowdown-legacy", legacy=True)
        # The same with the S3 server's process at the lowest priority: it stands in for a
        # remote store, whose CPU is not the training host's.
        server_niced = False
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, ep.pid, 19)
            server_niced = True
        out["train_step_server_niced"] = slowdown("slowdown-niced") if server_niced else None
        out["train_step_server_niced_legacy"] = (
            slowdown("slowdown-niced-legacy", legacy=True) if server_niced else None
        )
        out["save_server_niced"] = saves("niced") if server_niced else None
        # ---- 3. upload throughput: uploader vs s3fs put, interleaved ----
        # The server back at normal priority: both contenders against the same server.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, ep.pid, 0)
        out["upload"] = throughput(ep, local, step, os.path.join(d, "tiered-as-is"), repeats)
        with contextlib.suppress(Exception):
            wait_for_deletions()
    return out


def _server_cpu(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` has used (Linux; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _uploader(
    local: Any, replica: Any, *, legacy: bool = False, read_back: bool | None = None
) -> Any:
    """A Replicator; ``legacy``: as before S3Upload (s3fs's buffered file, then read back)."""
    from ckptstore.tiers.replica import Replicator

    if legacy:
        replica._s3 = False  # FsspecStorage writes through s3fs's own file object
        read_back = True
    return Replicator(local, replica, retention=False, read_back=read_back)


def throughput(ep: Any, local: Any, step: int, root: str, repeats: int) -> dict[str, Any]:
    """One step uploaded by the uploader (server-checked; with read-back; as before S3Upload)
    vs s3fs put.

    The same files, the same server, interleaved; besides the wall time, the CPU seconds of
    this process and of the server process during each (medians): on a host of two cores
    the server's CPU bounds both contenders.
    """
    from ckptstore.storage import open_storage
    from ckptstore.storage.s3upload import upload_fs

    opts = ep.storage_options
    fs = ep.fs(fresh=True)
    src = os.path.join(root, f"step-{step:012d}")
    files = [f for f in os.listdir(src) if f not in ("replicated", "pinned")]
    kinds = ["ours", "read_back", "legacy", "put", "put_nice19"]
    runs: dict[str, list[tuple[float, float, float]]] = {k: [] for k in kinds}
    for r in range(repeats + 1):
        for kind in kinds if r % 2 == 0 else reversed(kinds):
            prefix = ep.unique_prefix(kind)
            s0, c0, t0 = _server_cpu(ep.pid), _own_cpu(), time.perf_counter()
            if kind.startswith("put"):
                # put_nice19: the same put, its requests on a loop thread at nice 19 (the
                # uploader's priority), through the uploader's own s3fs client.
                via = upload_fs(fs) if kind == "put_nice19" else fs
                via.put([os.path.join(src, f) for f in files], f"{ep.bucket}/{prefix}/")
            else:
                rep = _uploader(
                    local,
                    open_storage(ep.url(prefix), opts),
                    legacy=kind == "legacy",
                    read_back=True if kind == "read_back" else None,
                )
                rep.upload_step(step)
            if r:  # the first round warms up (connections, the uploader's own client)
                sample = (time.perf_counter() - t0, _own_cpu() - c0, _server_cpu(ep.pid) - s0)
                runs[kind].append(sample)
    nbytes = sum(os.path.getsize(os.path.join(src, f)) for f in files)
    med = {k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in runs.items()}
    return {
        "bytes": nbytes,
        "uploader_MBps": nbytes / med["ours"][0] / 1e6,
        "uploader_read_back_MBps": nbytes / med["read_back"][0] / 1e6,
        "legacy_MBps": nbytes / med["legacy"][0] / 1e6,
        "s3fs_put_MBps": nbytes / med["put"][0] / 1e6,
        "ratio_legacy": med["put"][0] / med["legacy"][0],
        "s3fs_put_nice19_MBps": nbytes / med["put_nice19"][0] / 1e6,
        "ratio_put_nice19": med["put_nice19"][0] / med["ours"][0],
        "ratio": med["put"][0] / med["ours"][0],
        "ratio_read_back": med["put"][0] / med["read_back"][0],
        "cpu_s": {k: {"client": v[1], "server": v[2]} for k, v in med.items()},
    }


def print_report(res: dict[str, Any]) -> None:
    """The figures as a few lines."""
    u = res["upload"]
    rows = (
        ("", res["save"]),
        (" (local-only saves with no upload running)", res.get("save_isolated")),
        (" (S3 server niced)", res["save_server_niced"]),
    )
    for label, s in rows:
        if s is None:
            continue
        print(
            f"replica: save blocks {s['tiered_s'] * 1e3:.1f} ms with a replica vs "
            f"{s['local_s'] * 1e3:.1f} ms without{label}: {s['ratio']:.2f}x (goal <= 1.1x; "
            f"{s['state_bytes'] / 1e6:.0f} MB state, median of {res['repeats']})"
        )
    step_rows = (
        ("", res["train_step"]),
        (" before S3Upload", res["train_step_legacy"]),
        (" (S3 server niced)", res["train_step_server_niced"]),
        (" (S3 server niced) before S3Upload", res["train_step_server_niced_legacy"]),
    )
    for label, t in step_rows:
        if t is None or t["ratio"] is None:
            continue
        print(
            f"replica: training step {t['during_upload_s'] * 1e3:.2f} ms during an upload vs "
            f"{t['idle_s'] * 1e3:.2f} ms idle{label}: {t['ratio']:.3f}x (goal < 1.05x; "
            f"{t['steps_during_upload']} steps over a {t['upload_s']:.1f}s upload, "
            f"{t['torch_threads']} torch threads)"
        )
    cpu = u["cpu_s"]
    print(
        f"replica: upload {u['uploader_MBps']:.0f} MB/s (checked by the server), "
        f"{u['uploader_read_back_MBps']:.0f} MB/s with read-back, s3fs put "
        f"{u['s3fs_put_MBps']:.0f} MB/s: {u['ratio']:.2f}x / {u['ratio_read_back']:.2f}x of "
        f"put (goal >= 1x); CPU s client/server: {cpu['ours']['client']:.2f}/"
        f"{cpu['ours']['server']:.2f}, {cpu['read_back']['client']:.2f}/"
        f"{cpu['read_back']['server']:.2f}, put {cpu['put']['client']:.2f}/"
        f"{cpu['put']['server']:.2f}"
    )
    print(
        f"replica: s3fs put with its requests at nice 19 as the uploader's "
        f"{u['s3fs_put_nice19_MBps']:.0f} MB/s: the uploader {u['ratio_put_nice19']:.2f}x of it; "
        f"CPU s client/server {cpu['put_nice19']['client']:.2f}/{cpu['put_nice19']['server']:.2f}"
    )
    print(
        f"replica: before S3Upload (s3fs file + read-back, same run) {u['legacy_MBps']:.0f} "
        f"MB/s: {u['ratio_legacy']:.2f}x of put; CPU s client/server "
        f"{cpu['legacy']['client']:.2f}/{cpu['legacy']['server']:.2f}"
    )

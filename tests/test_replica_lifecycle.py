"""The replica uploader's lifecycle: a Ctrl-C in ``close()``, an exit without ``close()``,
``ckptstore replicate`` stopped by a signal, and an endpoint that stops answering.

Review s41 (findings 4 to 8). Each test runs moto's S3 server in a process of its own
(``tests/s3server.py``) and makes it hang with SIGSTOP (connections are accepted, nothing is
answered: a hung server or a stalled proxy); the signals and exits are real. The bounds
("within N s") are for a hang: before the fixes each of these waited on the client's read
timeouts for minutes, or until every queued upload was done.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

import torch
from _helpers import REPO, step_dir
from s3server import S3Endpoint, s3_server
from timing import healthy

from ckptstore import CheckpointManager
from ckptstore.layout import REPLICATED_NAME
from ckptstore.storage.remote import FsspecStorage

pytestmark = pytest.mark.timeout(120)

#: The client's read timeout in these tests: long, so that a wait on it (what the bugs did)
#: is far past every bound asserted.
READ_TIMEOUT = 60


def replica_steps(ep: S3Endpoint, url: str) -> list[int]:
    return FsspecStorage(ep.client, url.removeprefix("s3://"), url).list_steps()


def replicated(root: Path, step: int) -> bool:
    return (root / step_dir(step) / REPLICATED_NAME).exists()


@pytest.fixture
def ep() -> Iterator[S3Endpoint]:
    """A server of the test's own: it is stopped (SIGSTOP) and let go again."""
    with s3_server() as ep:
        try:
            yield ep
        finally:
            os.kill(ep.pid, signal.SIGCONT)


def slow_options(ep: S3Endpoint) -> dict[str, Any]:
    return {**ep.storage_options, "config_kwargs": {"read_timeout": READ_TIMEOUT}}


def in_flight(ep: S3Endpoint, step: int) -> None:
    """Wait until the server received a PUT of a file of ``step``: its copy is under way
    (a 32 MB file: it goes on for a while, and a SIGSTOP of the server now catches it)."""
    deadline = time.monotonic() + healthy(15.0)
    while not any(r.method == "PUT" and step_dir(step) in r.path for r in ep.requests()):
        assert time.monotonic() < deadline, f"step {step}'s upload never began"
        time.sleep(0.005)


def uploaded_after_the_interrupt(root: Path, ep: S3Endpoint, url: str) -> None:
    """After a Ctrl-C that dropped the uploads of steps 2-4 (step 1 was uploaded): none of
    them is recorded safe; once the endpoint answers again, the next manager uploads them."""
    assert replicated(root, 1)
    assert not any(replicated(root, s) for s in (2, 3, 4))  # nothing falsely safe
    os.kill(ep.pid, signal.SIGCONT)
    with CheckpointManager(root, keep=None, replica=url, replica_options=ep.storage_options):
        pass  # close() waits for the uploads the interrupt dropped
    assert replica_steps(ep, url) == [1, 2, 3, 4]
    assert all(replicated(root, s) for s in (1, 2, 3, 4))


def test_ctrl_c_in_close_stops_the_uploads_at_once(tmp_path: Path, ep: S3Endpoint) -> None:
    """Finding 5: a Ctrl-C while close() waited for the uploads did not stop them: the
    step in flight went on to its end (here: the client's read timeouts) and every queued
    step after it. Now the interrupt drops the queue and abandons the step in flight; no
    step is recorded safe that is not on the replica, and the next manager uploads them."""
    root = tmp_path / "a"
    url = ep.url("run")
    mgr = CheckpointManager(
        root, keep=None, replica=url, replica_options=slow_options(ep), replica_timeout=60
    )
    mgr.save(1, {"w": torch.rand(1 << 16)})
    mgr.wait()
    os.kill(ep.pid, signal.SIGSTOP)  # the endpoint hangs from here on
    for s in (2, 3, 4):
        mgr.save(s, {"w": torch.rand(1 << 18)})
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
        t0 = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            mgr.close()
        took = time.monotonic() - t0
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, old)
    assert took < healthy(5.0), f"close() went on {took:.1f}s after the Ctrl-C"
    uploaded_after_the_interrupt(root, ep, url)


def test_a_ctrl_c_in_a_with_block_does_not_wait_for_the_uploads(
    tmp_path: Path, ep: S3Endpoint
) -> None:
    """A Ctrl-C in the training loop inside ``with CheckpointManager(...)``: ``__exit__``
    waited for every queued upload (here: the hung endpoint's read timeouts), and a second
    Ctrl-C was needed. The local saves are committed, the uploads dropped; no step is
    recorded safe that is not on the replica, and the next manager uploads them."""
    root = tmp_path / "a"
    url = ep.url("run")
    t0 = time.monotonic()
    options = slow_options(ep)
    with (  # noqa: PT012 - the with block is the subject
        pytest.raises(KeyboardInterrupt),
        CheckpointManager(
            root, keep=None, replica=url, replica_options=options, replica_timeout=60
        ) as mgr,
    ):
        mgr.save(1, {"w": torch.rand(1 << 16)})
        mgr.wait()
        os.kill(ep.pid, signal.SIGSTOP)  # the endpoint hangs from here on
        for s in (2, 3, 4):
            mgr.save(s, {"w": torch.rand(1 << 18)})
        t0 = time.monotonic()
        raise KeyboardInterrupt  # what a Ctrl-C raises in the main thread
    took = time.monotonic() - t0
    assert took < healthy(5.0), f"__exit__ went on {took:.1f}s after the Ctrl-C"
    assert sorted(int(p.name.split("-")[1]) for p in root.glob("step-*")) == [1, 2, 3, 4]
    uploaded_after_the_interrupt(root, ep, url)


_EXIT_JOB = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from ckptstore import CheckpointManager

    root, url, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    mgr = CheckpointManager(root, keep=None, replica=url, replica_options=opts,
                            replica_timeout=60)
    mgr.save(1, {"w": torch.rand(1 << 16)})
    mgr.wait()
    mgr.save(2, {"w": torch.rand(8 << 20)})
    print("saved", flush=True)
    sys.stdin.readline()  # its upload is in flight, and the endpoint hangs
    print("exiting", flush=True)
    # no close(): the script ends here
    """
)


def test_an_exit_without_close_does_not_wait_for_the_upload_in_flight(
    tmp_path: Path, ep: S3Endpoint
) -> None:
    """Finding 4: a process that ended without close() was held at the interpreter's exit
    until the files in flight were sent (the upload's thread pool is joined there), then
    dropped the upload anyway: 94 s on a hung endpoint. It exits at once now; the step is
    not recorded safe, and the next manager uploads it."""
    root = tmp_path / "a"
    url = ep.url("run")
    proc = subprocess.Popen(
        [sys.executable, "-c", _EXIT_JOB, str(root), url, json.dumps(slow_options(ep))],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdin is not None
        assert proc.stdout.readline().strip() == "saved"
        in_flight(ep, 2)
        os.kill(ep.pid, signal.SIGSTOP)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "exiting"
        t0 = time.monotonic()
        try:
            proc.wait(healthy(5.0))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the process still runs {time.monotonic() - t0:.1f}s after its end")
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate()
    assert proc.returncode == 0, err
    assert replicated(root, 1)
    assert not replicated(root, 2)
    os.kill(ep.pid, signal.SIGCONT)
    assert replica_steps(ep, url) == [1]
    with CheckpointManager(root, keep=None, replica=url, replica_options=ep.storage_options):
        pass
    assert replica_steps(ep, url) == [1, 2]
    assert replicated(root, 2)


def _store(root: Path, steps: tuple[int, ...], numel: int = 1 << 18) -> None:
    """A local store that knows nothing of replicas, holding ``steps``."""
    with CheckpointManager(root, keep=None) as plain:
        for s in steps:
            plain.save(s, {"w": torch.rand(numel)})


def test_replicate_watch_stops_on_sigint_with_an_upload_in_flight(
    tmp_path: Path, ep: S3Endpoint
) -> None:
    """Finding 6: ``ckptstore replicate --watch`` looked at its stop flag only once every
    queued upload was done: SIGINT and SIGTERM were ignored for as long as that took (here:
    a hung endpoint's read timeouts). It stops within about a second now, abandoning the
    upload in flight, with no step recorded safe that is not on the replica."""
    root = tmp_path / "a"
    url = ep.url("run")
    _store(root, (1, 2))
    _store(root, (3,), numel=8 << 20)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ckptstore.cli",
            "replicate",
            str(root),
            url,
            "--watch",
            "--interval",
            "0.2",
            *ep.cli_options,
            f"--storage-option=config_kwargs.read_timeout={READ_TIMEOUT}",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        in_flight(ep, 3)  # the newest step goes first
        os.kill(ep.pid, signal.SIGSTOP)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        try:
            out, err = proc.communicate(timeout=healthy(5.0))
        except subprocess.TimeoutExpired:
            pytest.fail(f"replicate --watch still runs {time.monotonic() - t0:.1f}s after SIGINT")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert f"safe on {url}:" in out
    os.kill(ep.pid, signal.SIGCONT)
    there = replica_steps(ep, url)
    for s in (1, 2, 3):
        assert replicated(root, s) == (s in there), s  # nothing falsely recorded safe
    assert 3 not in there  # its upload was abandoned


def test_a_second_signal_interrupts_a_stopping_watch() -> None:
    """Finding 6: the handler swallowed every signal; a second one now interrupts."""
    from ckptstore.cli.replicate import stopper

    stop = threading.Event()
    handler = stopper(stop)
    handler(signal.SIGTERM, None)
    assert stop.is_set()
    with pytest.raises(KeyboardInterrupt):
        handler(signal.SIGINT, None)


def test_replicate_on_a_hung_endpoint_fails_within_its_timeout(
    tmp_path: Path, ep: S3Endpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    """Finding 8: ``ckptstore replicate`` opened the replica with the client's defaults
    (retries of 60 s read timeouts, no probe): on an endpoint that accepts connections and
    never answers it was still silent after 300 s. It is opened as the manager opens it now,
    probed within ``--timeout``, and fails with one line saying what to check."""
    from ckptstore.cli import main

    root = tmp_path / "a"
    _store(root, (1,), numel=1 << 10)
    url = ep.url("run")
    main(["replicate", str(root), url, *ep.cli_options])  # the client is made: healthy work
    capsys.readouterr()
    os.kill(ep.pid, signal.SIGSTOP)
    box: list[int] = []
    t = threading.Thread(
        target=lambda: box.append(
            main(["replicate", str(root), ep.url("other"), *ep.cli_options, "--timeout", "2"])
        ),
        daemon=True,
    )
    t0 = time.monotonic()
    t.start()
    t.join(2 + healthy(5.0))
    assert box, f"replicate still runs {time.monotonic() - t0:.1f}s in, with --timeout 2"
    assert box[0] == 1
    err = capsys.readouterr().err
    assert f"replica {ep.url('other')}: no answer within 2s (replica_timeout)" in err, err
    assert "nothing was uploaded; fix it and run `ckptstore replicate` again" in err


def test_a_hung_endpoint_holds_resume_and_close_only_about_replica_timeout(
    tmp_path: Path, ep: S3Endpoint, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding 7: listings of the replica were bounded only by the client's read timeouts
    and attempts: a resume whose steps were all local listed a hung replica twice and took
    3 minutes, and close() 93 s, with ``replica_timeout=10``. Each listing is given up after
    ``replica_timeout`` now (the replica is then taken to hold what the uploader last saw
    there), a resume lists it once, and close() raises within about the timeout."""
    import logging

    from ckptstore.errors import ReplicaUnavailableError

    timeout = healthy(1.0)
    root = tmp_path / "a"
    mgr = CheckpointManager(
        root, keep=None, replica=ep.url("run"), replica_options=slow_options(ep),
        replica_timeout=timeout,
    )  # fmt: skip
    for s in (1, 2):
        mgr.save(s, {"w": torch.rand(1 << 10)})
    mgr.wait()
    os.kill(ep.pid, signal.SIGSTOP)

    def bounded(call: Any, bound: float) -> Any:
        box: list[tuple[bool, Any]] = []

        def run() -> None:
            try:
                box.append((True, call()))
            except BaseException as e:
                box.append((False, e))

        t = threading.Thread(target=run, daemon=True)
        t0 = time.monotonic()
        t.start()
        t.join(bound)
        assert box, f"{call} still waits {time.monotonic() - t0:.1f}s in"
        return box[0]

    fresh = {"w": torch.zeros(1 << 10)}
    with caplog.at_level(logging.WARNING, "ckptstore"):
        ok, got = bounded(lambda: mgr.resume(fresh), timeout + healthy(3.0))
    assert ok, got
    assert got == 3
    said = "taking it to hold the steps it was last seen to ([1, 2])"
    assert caplog.text.count(said) == 1, caplog.text  # listed once, not twice
    mgr.save(3, {"w": torch.rand(1 << 10)})
    ok, got = bounded(mgr.close, timeout + healthy(3.0))
    assert not ok
    assert isinstance(got, ReplicaUnavailableError), got
    assert f"no answer within {timeout:g}s (replica_timeout)" in str(got)
    assert not replicated(root, 3)

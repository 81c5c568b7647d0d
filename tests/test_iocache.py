"""ckptstore.storage.iocache: the measured I/O modes outlive the process, as a hint only."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptstore.storage import directio, iocache, iomode
from ckptstore.storage.local import LocalStorage

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A cache file of this test's own (the suite runs with the cache off)."""
    path = tmp_path / "cache" / "io-modes.json"
    monkeypatch.setenv("CKPTSTORE_IO_CACHE", str(path))
    iomode.forget()
    yield path
    iomode.forget()


def _cached(  # noqa: PLR0917 - a test helper
    path: Path, dev: int, op: str, direct: float, buffered: float, age: float | None = 60.0
) -> None:
    """A cache file whose two figures were measured ``age`` seconds ago (None: no times, as
    a file of an older version has)."""
    entry: dict[str, Any] = {op: {"direct": direct, "buffered": buffered}, "t": 1.0}
    if age is not None:
        at = time.time() - age
        entry[f"{op}_at"] = {"direct": at, "buffered": at}
    doc = {"version": 1, "devices": {iocache.device_key(dev): entry}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def _child(code: str, cache: Path) -> str:
    """Run ``code`` in a new Python process using ``cache``; its stdout."""
    env = {**os.environ, "CKPTSTORE_IO_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_device_key_names_the_filesystem(tmp_path: Path) -> None:
    dev = os.stat(tmp_path).st_dev
    key = iocache.device_key(dev)
    assert key.startswith(f"{os.major(dev)}:{os.minor(dev)}")
    if Path("/proc/self/mountinfo").exists():
        assert key.count(":") >= 3, key  # major:minor:fstype:source


def test_measurements_are_written_and_a_new_process_starts_from_them(
    tmp_path: Path, cache: Path
) -> None:
    dev = os.stat(tmp_path).st_dev
    # This process measures both modes: the file holds both speeds for the device.
    assert iomode.read_mode(dev) == "direct"
    # (direct at 2/3 of buffered's speed: close enough to be re-tried every 8th file)
    iomode.record_read(dev, "direct", 1 << 30, 1.5)
    assert iomode.read_mode(dev) == "buffered"
    iomode.record_read(dev, "buffered", 1 << 30, 1.0)
    iocache.flush()  # written by the process's background thread
    doc = json.loads(cache.read_text())
    entry = doc["devices"][iocache.device_key(dev)]
    assert entry["read"] == {"direct": (1 << 30) / 1.5, "buffered": float(1 << 30)}
    assert not list(cache.parent.glob("*.tmp"))  # replaced by a rename, nothing left over
    # A new process (a real one) starts with buffered, the faster, not with a try of
    # direct; the 8th large file re-validates direct.
    out = _child(
        f"""
        from ckptstore.storage import iomode
        print(",".join(iomode.read_mode({dev}) for _ in range(8)))
        print(iomode.write_mode({str(tmp_path)!r}))
        """,
        cache,
    )
    reads, write = out.split()
    assert reads.split(",") == ["buffered"] * 7 + ["direct"]
    assert write == "direct"  # nothing cached for writes: tried as before


def test_explorations_keep_the_cached_verdict_current(tmp_path: Path, cache: Path) -> None:
    dev = os.stat(tmp_path).st_dev
    _cached(cache, dev, "write", direct=3e9, buffered=4e9)
    picks = [iomode.write_mode(str(tmp_path)) for _ in range(8)]
    assert picks == ["buffered"] * 7 + ["direct"]
    # The exploration finds direct much faster now: the next process starts with it.
    for _ in range(3):
        iomode.record_write(str(tmp_path), "direct", 1 << 30, 0.05)
    iocache.flush()
    assert (
        json.loads(cache.read_text())["devices"][iocache.device_key(dev)]["write"]["direct"] > 4e9
    )
    iomode.forget()
    assert iomode.write_mode(str(tmp_path)) == "direct"


@pytest.mark.parametrize("age", [None, iomode.REFRESH_S + 60])
def test_a_stale_cached_figure_is_tried_again_and_replaced(
    tmp_path: Path, cache: Path, age: float | None
) -> None:
    """A figure measured once under load (O_DIRECT writes at 88 MB/s while another job
    wrote, as a cache on the test VM held) made every later process write buffered at
    0.4 GB/s where O_DIRECT ran at 0.6: a process saving fewer than 64 files never re-tried
    it. A cached figure older than REFRESH_S, or without a time (an older version's file),
    is tried at the next large file, and what that measures replaces it."""
    dev = os.stat(tmp_path).st_dev
    d = str(tmp_path)
    _cached(cache, dev, "write", direct=88e6, buffered=400e6, age=age)
    assert iomode.write_mode(d) == "direct"  # the stale figure, once
    assert iomode.write_mode(d) == "buffered"  # not by every file until it reports
    iomode.record_write(d, "direct", 600 << 20, 1.0)  # ~0.63 GB/s
    # Replaced, not averaged with the stale figure (that would give 0.36, still behind);
    # buffered's figure is as old: it is tried once too.
    assert iomode.write_mode(d) == "buffered"
    iomode.record_write(d, "buffered", 250 << 20, 1.0)  # far behind
    assert [iomode.write_mode(d) for _ in range(7)] == ["direct"] * 7
    iocache.flush()
    entry = json.loads(cache.read_text())["devices"][iocache.device_key(dev)]
    assert entry["write"] == {"direct": float(600 << 20), "buffered": float(250 << 20)}
    assert all(time.time() - at < 60 for at in entry["write_at"].values())
    # A new process finds both figures fresh enough: direct, with no trial of buffered.
    out = _child(
        f"""
        from ckptstore.storage import iomode
        print(",".join(iomode.write_mode({d!r}) for _ in range(7)))
        """,
        cache,
    )
    assert out.strip().split(",") == ["direct"] * 7


def test_a_stale_figure_whose_trial_never_reported_keeps_its_age(
    tmp_path: Path, cache: Path
) -> None:
    """The trial of a stale figure is handed out once; where it never reports (a file under
    64 MiB, a failed save), the figure keeps its old time: before, the time was set when the
    trial was handed out, and the next record wrote the old 88 MB/s to the cache as fresh
    (found by review). A stale figure re-measured by ordinary use is replaced too."""
    dev = os.stat(tmp_path).st_dev
    d = str(tmp_path)
    _cached(cache, dev, "write", direct=88e6, buffered=400e6, age=None)
    assert iomode.write_mode(d) == "direct"  # the trial of the stale figure: never reports
    assert iomode.write_mode(d) == "buffered"  # buffered's figure is stale too: its trial
    assert iomode.write_mode(d) == "buffered"  # each once
    iomode.record_write(d, "buffered", 500 << 20, 1.0)  # replaced: 524 MB/s, not averaged
    iocache.flush()
    entry = json.loads(cache.read_text())["devices"][iocache.device_key(dev)]
    assert entry["write"] == {"direct": 88e6, "buffered": float(500 << 20)}
    assert set(entry["write_at"]) == {"buffered"}  # direct's figure has no time still
    # The next process tries direct again, as its figure is as old as ever.
    out = _child(
        f"""
        from ckptstore.storage import iomode
        print(iomode.write_mode({d!r}))
        """,
        cache,
    )
    assert out.strip() == "direct"


def test_a_forked_tool_child_leaves_its_figures_in_the_cache(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tools/forkchild.finish ends a child with os._exit, which skips atexit: the cache's
    pending write was lost with every rank the bench and the demos fork (found in the
    bench: its ranks' figures never reached the file)."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import forkchild
    finally:
        sys.path.remove(str(REPO / "tools"))
    dev = os.stat(tmp_path).st_dev
    real = iocache._write

    def slow(path: str, updates: dict[tuple[str, str], Any]) -> None:
        time.sleep(0.5)  # the write is still under way when the child's body returns
        real(path, updates)

    monkeypatch.setattr(iocache, "_write", slow)
    pid = os.fork()
    if pid == 0:
        forkchild.finish(lambda: iomode.record_read(dev, "direct", 1 << 30, 1.0))
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    entry = json.loads(cache.read_text())["devices"][iocache.device_key(dev)]
    assert entry["read"] == {"direct": float(1 << 30)}


def test_a_fresh_cached_figure_is_not_tried_again_before_its_count(
    tmp_path: Path, cache: Path
) -> None:
    """The refresh is for old figures only: a verdict younger than its limit is kept for the
    count (a day for a close figure, an hour for a far-behind one)."""
    dev = os.stat(tmp_path).st_dev
    _cached(cache, dev, "write", direct=88e6, buffered=400e6, age=iomode.FAR_REFRESH_S - 600)
    picks = [iomode.write_mode(str(tmp_path)) for _ in range(63)]
    assert picks == ["buffered"] * 63  # direct is far behind: the 64th file re-tries it
    iomode.forget()
    _cached(cache, dev, "write", direct=300e6, buffered=400e6, age=iomode.REFRESH_S - 600)
    picks = [iomode.write_mode(str(tmp_path)) for _ in range(8)]
    assert picks == ["buffered"] * 7 + ["direct"]  # close: the 8th file re-tries it


def test_a_far_behind_figure_an_hour_old_is_tried_again_and_replaced(
    tmp_path: Path, cache: Path
) -> None:
    """One read measured while the disk was busy (O_DIRECT at 0.24 GB/s, buffered at 0.66)
    kept every process on this VM reading buffered for a day, every sharded restore's read
    at twice O_DIRECT's time: a process reads a few large files and never reached the 64th.
    A far-behind figure is re-tried once it is an hour old, and its new figure replaces
    it (averaged, the old one would keep O_DIRECT behind)."""
    dev = os.stat(tmp_path).st_dev
    _cached(cache, dev, "read", direct=240e6, buffered=660e6, age=iomode.FAR_REFRESH_S + 60)
    assert iomode.read_mode(dev) == "direct"  # the far-behind figure, once
    assert iomode.read_mode(dev) == "buffered"  # not by every file until it reports
    iomode.record_read(dev, "direct", 768 << 20, 0.6)  # 1.34 GB/s
    # Buffered's figure is as old, and now the far-behind one: it is tried once too.
    assert iomode.read_mode(dev) == "buffered"
    iomode.record_read(dev, "buffered", 768 << 20, 1.5)  # still far behind
    assert [iomode.read_mode(dev) for _ in range(7)] == ["direct"] * 7
    iocache.flush()
    entry = json.loads(cache.read_text())["devices"][iocache.device_key(dev)]
    assert entry["read"] == {"direct": (768 << 20) / 0.6, "buffered": (768 << 20) / 1.5}
    assert all(time.time() - at < 60 for at in entry["read_at"].values())
    # The next process starts with O_DIRECT and tries neither figure again (both fresh).
    out = _child(
        f"""
        from ckptstore.storage import iomode
        print(",".join(iomode.read_mode({dev}) for _ in range(7)))
        """,
        cache,
    )
    assert out.strip().split(",") == ["direct"] * 7


HOSTILE = {
    "not-json": b"\x00\xffnot json",
    "deep": b"[" * 200_000,
    "too-large": b" " * (iocache.MAX_BYTES + 1) + b"{}",
    "wrong-version": json.dumps({"version": 99, "devices": {}}).encode(),
    "negative": json.dumps({"version": 1, "devices": {"k": {"read": {"direct": -1.0}}}}).encode(),
    "nan": b'{"version": 1, "devices": {"k": {"read": {"buffered": NaN}}}}',
    "unknown-mode": json.dumps({"version": 1, "devices": {"k": {"read": {"mmap": 1e9}}}}).encode(),
    # issue 24 #8: math.isfinite raised OverflowError on this, out of every large save/load
    "huge-int": b'{"version": 1, "devices": {"k": {"read": {"direct": 1' + b"0" * 400 + b"}}}}",
    "huge-int-t": b'{"version": 1, "devices": {"k": {"t": 1' + b"0" * 400 + b', "read": {}}}}',
    "bad-time": json.dumps(
        {"version": 1, "devices": {"k": {"read": {"direct": 1e9}, "read_at": {"direct": "x"}}}}
    ).encode(),
    "bad-time-mode": json.dumps(
        {"version": 1, "devices": {"k": {"read": {"direct": 1e9}, "read_at": {"mmap": 1.0}}}}
    ).encode(),
    "many-devices": json.dumps(
        {"version": 1, "devices": {str(i): {} for i in range(iocache.MAX_DEVICES + 1)}}
    ).encode(),
}


@pytest.mark.parametrize("kind", [*HOSTILE, "fifo", "directory"])
def test_a_corrupt_or_hostile_cache_is_ignored_with_a_warning(
    tmp_path: Path, cache: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    dev = os.stat(tmp_path).st_dev
    cache.parent.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(cache)  # opened without blocking: a reader never hangs on it
    elif kind == "directory":
        cache.mkdir()
    else:
        cache.write_bytes(HOSTILE[kind])
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        assert iomode.read_mode(dev) == "direct"  # as with no cache: each mode tried
        # The measurement replaces a bad regular file with a good one.
        iomode.record_read(dev, "direct", 1 << 30, 1.0)
        assert iomode.read_mode(dev) == "buffered"
    warned = [r.getMessage() for r in caplog.records if "I/O mode cache" in r.getMessage()]
    assert len(warned) == 1, warned  # once, not at every file
    assert warned[0].startswith(f"ignoring the I/O mode cache {cache}: ")
    if kind in HOSTILE:
        iocache.flush()
        doc = json.loads(cache.read_text())
        assert doc["devices"][iocache.device_key(dev)]["read"] == {"direct": float(1 << 30)}


def test_the_document_is_the_checked_cache_or_none(tmp_path: Path, cache: Path) -> None:
    """What the bench reports of the cache (``iocache.document``): the file as a reader
    takes it, never a hostile or corrupt one."""
    assert iocache.document() is None  # no file yet
    dev = os.stat(tmp_path).st_dev
    _cached(cache, dev, "read", 2e9, 1e9)
    doc = iocache.document()
    assert doc is not None
    assert doc["devices"][iocache.device_key(dev)]["read"] == {"direct": 2e9, "buffered": 1e9}
    for bad in HOSTILE.values():
        cache.write_bytes(bad)
        assert iocache.document() is None


def test_the_cache_can_be_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTSTORE_IO_CACHE", "off")
    assert iocache.cache_path() is None
    monkeypatch.delenv("CKPTSTORE_IO_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert iocache.cache_path() == str(tmp_path / "ckptstore" / "io-modes.json")
    monkeypatch.setenv("CKPTSTORE_IO_CACHE", "off")
    iomode.forget()
    iomode.record_read(os.stat(tmp_path).st_dev, "direct", 1 << 30, 1.0)
    assert not (tmp_path / "ckptstore").exists()
    iomode.forget()


@pytest.mark.parametrize("forced", ["direct", "buffered"])
def test_a_forced_mode_wins_over_the_cache(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, forced: str
) -> None:
    monkeypatch.setattr(directio, "BUFFER", 1 << 20)
    monkeypatch.setattr(iomode, "MEASURED_BYTES", 1 << 20)
    data = os.urandom(3 << 20)
    (tmp_path / "f").write_bytes(data)
    dev = os.stat(tmp_path).st_dev
    other = "buffered" if forced == "direct" else "direct"
    speeds = {forced: 1e8, other: 1e10}  # the cache says the other mode is 100x faster
    _cached(cache, dev, "read", **speeds)
    before = cache.read_bytes()
    twins: list[str] = []
    real = LocalStorage._open_direct_twin

    def spy(self: LocalStorage, head: str, name: str, st: os.stat_result) -> int | None:
        twins.append(name)  # the O_DIRECT descriptor: opened only for a direct read
        return real(self, head, name, st)

    monkeypatch.setattr(LocalStorage, "_open_direct_twin", spy)
    seen = bytearray()
    LocalStorage(str(tmp_path), io=forced)._stream("f", lambda o, v: seen.extend(v))
    assert bytes(seen) == data
    assert twins == (["f"] if forced == "direct" else [])
    iocache.flush()
    assert cache.read_bytes() == before  # a forced read is not a measurement
    assert iomode.decisions() == []
    # "auto" follows the cache instead.
    LocalStorage(str(tmp_path))._stream("f", lambda o, v: None)
    assert iomode.decisions()[0]["mode"] == other
    assert twins == ["f"]  # one O_DIRECT read in all: the forced one or the cached one


def test_a_planted_link_at_the_temp_path_is_neither_followed_nor_overwritten(
    tmp_path: Path, cache: Path
) -> None:
    """issue 24 #8: the temp file is opened O_EXCL | O_NOFOLLOW."""
    dev = os.stat(tmp_path).st_dev
    cache.parent.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    tmp = f"{cache}.{os.getpid()}.tmp"
    os.symlink(victim, tmp)
    iocache.store(dev, "read", {"direct": 1e9})
    iocache.flush()
    assert victim.read_text() == "precious"
    assert os.path.islink(tmp)  # left where it is
    assert not cache.exists()  # this update was skipped, nothing else happened
    os.unlink(tmp)
    iocache.store(dev, "read", {"direct": 1e9})
    assert iocache.load(dev, "read") == {"direct": 1e9}


def test_the_file_is_written_off_the_callers_path_and_before_exit(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The update (read, merge, write, fsync, rename) runs on a thread of its own."""
    import threading

    dev = os.stat(tmp_path).st_dev
    gate = threading.Event()
    real = iocache._write

    def held(path: str, updates: dict[tuple[str, str], Any]) -> None:
        gate.wait(30)
        real(path, updates)

    monkeypatch.setattr(iocache, "_write", held)
    iomode.record_read(dev, "direct", 1 << 30, 1.0)  # returns with the write held
    iomode.record_read(dev, "buffered", 1 << 30, 2.0)
    assert not cache.exists()
    gate.set()
    iocache.flush()
    entry = json.loads(cache.read_text())["devices"][iocache.device_key(dev)]
    assert entry["read"] == {"direct": float(1 << 30), "buffered": (1 << 30) / 2.0}
    # A process that measures and exits at once still leaves its measurement (atexit).
    _child(
        f"""
        from ckptstore.storage import iomode
        iomode.record_write({str(tmp_path)!r}, "direct", 1 << 30, 0.5)
        """,
        cache,
    )
    entry = json.loads(cache.read_text())["devices"][iocache.device_key(dev)]
    assert entry["write"] == {"direct": float(1 << 31)}
    assert entry["read"] == {"direct": float(1 << 30), "buffered": (1 << 30) / 2.0}

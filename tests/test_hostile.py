"""Stores in hostile places: a read-only filesystem, a path that is a file.

The broken and hostile *contents* of stores are the corpus in tests/adversarial
(test_adversarial.py); a full disk is in test_manager.py and, at every operation,
test_faults.py.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _helpers import assert_same, fresh_like, make_state

from ckptstore import CheckpointManager, CommitError, NoCheckpointError
from ckptstore import cli as cli_mod
from ckptstore.storage import wait_for_deletions


def tree(root: Path) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs:
            out[os.path.relpath(os.path.join(dirpath, n), root)] = None
        for n in files:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, root)] = Path(p).read_bytes()
    return out


@contextlib.contextmanager
def simulated_read_only(root: Path, mp: pytest.MonkeyPatch) -> Iterator[None]:
    """Every call that would change something under ``root`` fails with EROFS."""
    top = str(root)

    def inside(p: Any, dir_fd: int | None = None) -> bool:
        if not isinstance(p, str | bytes | os.PathLike):
            return False
        p = os.fsdecode(p)
        if dir_fd is not None:  # relative to an open directory: where that one is
            p = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), p)
        p = os.path.abspath(p)
        return p == top or p.startswith(top + os.sep)

    def erofs(p: Any) -> OSError:
        return OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(p))

    real = {n: getattr(os, n) for n in ("open", "mkdir", "rename", "unlink", "rmdir")}
    real_bopen = builtins.open
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC

    def os_open(path: Any, flags: int, *a: Any, **k: Any) -> int:
        if flags & writing and inside(path, k.get("dir_fd")):
            raise erofs(path)
        return int(real["open"](path, flags, *a, **k))

    def guard(name: str) -> Any:
        def call(path: Any, *a: Any, **k: Any) -> Any:
            if inside(path, k.get("dir_fd")) or (a and inside(a[0])):
                raise erofs(path)
            return real[name](path, *a, **k)

        return call

    def b_open(file: Any, mode: str = "r", *a: Any, **k: Any) -> Any:
        if any(c in mode for c in "wxa+") and inside(file):
            raise erofs(file)
        return real_bopen(file, mode, *a, **k)

    mp.setattr(os, "open", os_open)
    for n in ("mkdir", "rename", "unlink", "rmdir"):
        mp.setattr(os, n, guard(n))
    mp.setattr(builtins, "open", b_open)
    yield
    mp.undo()


@contextlib.contextmanager
def mounted_read_only(src: Path, dst: Path) -> Iterator[None]:
    dst.mkdir()
    try:
        subprocess.run(
            ["mount", "--bind", "-o", "ro", str(src), str(dst)],
            check=True,
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        pytest.skip("cannot mount a read-only filesystem here (needs root and mount)")
    try:
        # A bind mount may ignore "ro" on old kernels: check it is really read-only.
        with pytest.raises(OSError) as ei:  # noqa: PT012 - a skip inside is intended
            (dst / "probe").write_bytes(b"")
            pytest.skip("this kernel ignores read-only bind mounts")  # pragma: no cover
        assert ei.value.errno == errno.EROFS
        yield
    finally:
        subprocess.run(["umount", str(dst)], check=False, capture_output=True, timeout=10)


@pytest.fixture(params=["mounted", "simulated"])
def read_only(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Path, dict[int, Any]]]:
    src = tmp_path / "src"
    states = {s: make_state(s) for s in (1, 2)}
    with CheckpointManager(src) as mgr:
        for s, st in states.items():
            mgr.save(s, st)
    (src / (".tmp-step-000000000003-" + "a" * 32)).mkdir()  # garbage gc would remove
    if request.param == "mounted":
        ro = tmp_path / "ro"
        with mounted_read_only(src, ro):
            yield ro, states
    else:
        with simulated_read_only(src, monkeypatch):
            yield src, states


def test_read_only_store(
    read_only: tuple[Path, dict[int, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    root, states = read_only
    before = tree(root)
    with CheckpointManager(root, keep=1) as mgr:
        # Readers take no lock and write nothing: everything that reads works.
        assert mgr.steps() == [1, 2]
        assert mgr.verify().ok
        target = fresh_like(states[2])
        assert mgr.restore(target) == 2
        assert_same(dict(target["model"].state_dict()), dict(states[2]["model"].state_dict()))
        assert mgr.load(1)["step"] == 1
        assert mgr.plan_prune() == [1]
        # Writers get one clear error, naming the store and the reason.
        for call in (
            lambda: mgr.save(3, make_state(3)),
            mgr.prune,
            mgr.gc,
            lambda: mgr.pin(1),
        ):
            with pytest.raises(CommitError) as ei:
                call()
            msg = str(ei.value)
            assert "read-only" in msg.lower(), msg
            assert str(root) in msg, msg
        assert mgr.steps() == [1, 2]
    assert cli_mod.main(["verify", str(root), "--all"]) == 0
    assert cli_mod.main(["ls", str(root)]) == 0
    assert cli_mod.main(["prune", str(root), "--keep-last", "1", "--dry-run"]) == 0
    capsys.readouterr()
    for argv in (["prune", str(root), "--keep-last", "1"], ["gc", str(root)]):
        assert cli_mod.main(argv) == 1
        err = capsys.readouterr().err
        assert "read-only" in err.lower(), err
        assert "Traceback" not in err
    wait_for_deletions()
    assert tree(root) == before, "nothing changed"


@pytest.mark.parametrize("where", ["file", "under-a-file"])
def test_store_path_that_is_a_file(tmp_path: Path, where: str) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"not a directory")
    root = f if where == "file" else f / "ckpt"
    # Refused when the manager is made, before it could start training from scratch.
    want = (
        f"{f} is a file, not a checkpoint store .*; did you mean the store {tmp_path}\\?"
        if where == "file"
        else f"{root} cannot be a checkpoint store: part of its path is a file"
    )
    for create in (True, False):
        with pytest.raises(NoCheckpointError, match=want):
            CheckpointManager(root, create=create)
    assert f.read_bytes() == b"not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.bin"], "nothing created"
    shutil.rmtree(tmp_path / "nothing", ignore_errors=True)

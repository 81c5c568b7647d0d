"""The adversarial corpus (tests/adversarial, made by tools/make_adversarial.py).

For every case, as index.json says:

- ``ckptstore verify CASE`` (``cli.main`` in process) exits as documented and says why;
- ``restore()`` and ``load()`` of the newest fall back to the good step or raise the
  documented error, and ``restore(step=2)`` raises the documented error;
- none of it opens anything under ``outside/`` (every file descriptor the process opens is
  checked), runs the hostile pickle, calls ``torch.load`` without ``weights_only=True``, or
  changes a byte of the corpus;
- on a copy, ``gc`` and a new save work and touch nothing outside the store.

The corpus is rebuilt into a scratch directory and compared with the checked-in one, so it
stays reproducible.
"""

from __future__ import annotations

import builtins
import contextlib
import filecmp
import importlib.util
import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import REPO
from torch import nn

import ckptstore
from ckptstore import CheckpointManager, CkptStoreError
from ckptstore import cli as cli_mod
from ckptstore.storage import wait_for_deletions

CORPUS = REPO / "tests" / "adversarial"
MAKER = REPO / "tools" / "make_adversarial.py"
INDEX = json.loads((CORPUS / "index.json").read_text())["cases"]
SENTINEL_ENV = "CKPTSTORE_ADVERSARIAL_SENTINEL"


def snapshot(root: Path) -> dict[str, Any]:
    """Every entry under ``root``: link targets, file bytes, and mtimes."""
    out: dict[str, Any] = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            st = p.lstat()
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_file():
                out[rel] = ("file", p.read_bytes(), st.st_mtime_ns)
            else:
                out[rel] = ("dir",)
    return out


class Guard:
    """Records every path the process opens and every torch.load call."""

    def __init__(self, outside: Path) -> None:
        self.outside = str(outside.resolve())
        self.opened_outside: list[str] = []
        self.unsafe_loads: list[Any] = []

    def _seen(self, path: str) -> None:
        if path == self.outside or path.startswith(self.outside + os.sep):
            self.opened_outside.append(path)

    @contextlib.contextmanager
    def installed(self, mp: pytest.MonkeyPatch) -> Iterator[Guard]:
        real_open, real_bopen, real_load = os.open, builtins.open, torch.load

        def os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            fd = real_open(path, flags, *args, **kwargs)
            with contextlib.suppress(OSError):
                self._seen(os.readlink(f"/proc/self/fd/{fd}"))
            return fd

        def b_open(file: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(file, str | bytes | os.PathLike):
                self._seen(os.path.realpath(os.fsdecode(file)))
            return real_bopen(file, *args, **kwargs)

        def load(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("weights_only") is not True:
                self.unsafe_loads.append(kwargs)
            return real_load(*args, **kwargs)

        mp.setattr(os, "open", os_open)
        mp.setattr(builtins, "open", b_open)
        mp.setattr(torch, "load", load)
        yield self


def fresh() -> dict[str, Any]:
    return {"model": nn.Linear(2, 2), "step": -1}


def expect(outcome: dict[str, Any] | None, call: Any, what: str) -> None:
    assert outcome is not None
    if "step" in outcome:
        result = call()
        assert result == outcome["step"], f"{what}: got {result}"
        return
    with pytest.raises(CkptStoreError) as ei:
        call()
    assert type(ei.value).__name__ == outcome["error"], f"{what}: {ei.value!r}"
    assert outcome["says"] in str(ei.value), f"{what}: {ei.value}"


@pytest.fixture
def sentinel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    p = tmp_path / "the-pickle-ran"
    monkeypatch.setenv(SENTINEL_ENV, str(p))
    return p


def test_corpus_is_small_and_indexed() -> None:
    names = sorted(p.name for p in CORPUS.iterdir() if p.is_dir() and p.name != "outside")
    assert names == sorted(c["name"] for c in INDEX)
    size = sum(f.stat().st_size for f in CORPUS.rglob("*") if f.is_file() and not f.is_symlink())
    assert size < 300 * 1024
    readme = (CORPUS / "README.md").read_text()
    assert all(f"`{c['name']}`" in readme for c in INDEX)
    # Links are relative and stay inside the corpus (a git checkout anywhere keeps them).
    for link in (p for p in CORPUS.rglob("*") if p.is_symlink()):
        target = os.readlink(link)
        assert not os.path.isabs(target)
        assert "outside" in target
        assert (link.parent / target).resolve().is_relative_to(CORPUS.resolve())


@pytest.mark.parametrize("case", INDEX, ids=[c["name"] for c in INDEX])
def test_case(
    case: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    sentinel: Path,
) -> None:
    root = CORPUS / case["name"]
    before = snapshot(CORPUS)
    guard = Guard(CORPUS / "outside")
    with guard.installed(monkeypatch), caplog.at_level(logging.WARNING, "ckptstore"):
        rc = cli_mod.main(["verify", str(root)])
        out, err = capsys.readouterr()
        assert rc == case["verify"]["exit"], out + err
        assert case["verify"]["says"] in out + err, out + err
        assert "Traceback" not in out + err

        mgr = CheckpointManager(root)
        expect(case["restore"], lambda: mgr.restore(fresh()), "restore()")
        expect(
            case["restore"],
            lambda: mgr.load()["step"] if "step" in case["restore"] else mgr.load(),
            "load()",
        )
        if case["restore_step2"] is not None:
            expect(case["restore_step2"], lambda: mgr.restore(fresh(), step=2), "restore(2)")
            expect(case["restore_step2"], lambda: mgr.load(2), "load(2)")
        mgr.close()
    assert guard.opened_outside == [], "opened outside the store"
    assert guard.unsafe_loads == [], "torch.load without weights_only=True"
    assert not sentinel.exists(), "the hostile pickle ran"
    assert snapshot(CORPUS) == before, "the corpus changed"


@pytest.mark.parametrize("case", INDEX, ids=[c["name"] for c in INDEX])
def test_writing_into_a_copy_touches_nothing_outside(
    case: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sentinel: Path
) -> None:
    # gc and a new save on a broken store: the store heals (or stays as broken as it was),
    # and nothing outside it is read, changed or deleted.
    copy = tmp_path / "corpus"
    shutil.copytree(CORPUS / "outside", copy / "outside", symlinks=True)
    shutil.copytree(CORPUS / case["name"], copy / "case", symlinks=True)
    outside = snapshot(copy / "outside")
    guard = Guard(copy / "outside")
    root = copy / "case"
    with guard.installed(monkeypatch):
        with CheckpointManager(root, keep=1) as mgr:
            mgr.gc()
            mgr.save(3, {"model": nn.Linear(2, 2), "step": 3})
        wait_for_deletions()
        with CheckpointManager(root) as mgr:
            assert mgr.latest_step() == 3
            assert mgr.verify(3).ok
            assert mgr.load()["step"] == 3
    assert guard.opened_outside == []
    assert not sentinel.exists()
    assert snapshot(copy / "outside") == outside


def test_lone_file_verify_never_unpickles(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], sentinel: Path
) -> None:
    # ckptstore.verify_file / `ckptstore verify FILE` on the hostile .pt itself.
    pt = CORPUS / "pt-pickle-runs-code" / "step-000000000002" / "model.pt"
    guard = Guard(CORPUS / "outside")
    with guard.installed(monkeypatch):
        assert ckptstore.verify_file(pt).ok  # a sound zip: verify reads, never unpickles
        assert cli_mod.main(["verify", str(pt)]) == 0
        rc = cli_mod.main(["import", str(pt), str(sentinel.parent / "imported"), "--step", "1"])
    assert rc == 1
    assert "weights_only=True" in capsys.readouterr().err
    assert guard.unsafe_loads == []
    assert not sentinel.exists()


def test_corpus_is_reproducible(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_adversarial", MAKER)
    assert spec is not None
    assert spec.loader is not None
    maker = importlib.util.module_from_spec(spec)
    sys.modules["make_adversarial"] = maker  # its dataclasses look their module up
    spec.loader.exec_module(maker)
    out = tmp_path / "rebuilt"
    maker.build(out)
    a, b = snapshot(CORPUS), snapshot(out)
    assert sorted(a) == sorted(b)
    for rel, entry in a.items():
        if rel.endswith(".pt"):  # torch.save's bytes may change with torch
            continue
        assert entry[:2] == b[rel][:2], rel
    assert filecmp.cmp(CORPUS / "index.json", out / "index.json", shallow=False)
    assert filecmp.cmp(CORPUS / "README.md", out / "README.md", shallow=False)

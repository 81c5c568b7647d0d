"""What the command line tells a user to run is what works (found by review, s39 docs).

- ``ckptstore ls`` of an object store named ``ckptstore gc`` for every stale entry, though
  ``gc`` keeps the pending steps at or above the newest committed step (an uploader may
  still finish them) and only ``gc --pending`` removes those.
- ``ckptstore export --help`` said ``--force`` overwrites OUT, though ``--hf`` and ``--dcp``
  never overwrite a directory and refuse ``--force``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
from _helpers import run_cli
from torch import nn

from ckptstore import CheckpointManager
from ckptstore.layout import step_dirname


def make_model() -> nn.Linear:
    return nn.Linear(4, 3)


@pytest.fixture
def memory_url() -> Iterator[str]:
    """A fresh store on fsspec's in-memory filesystem (an object store: no atomic rename)."""
    name = f"ckptstore-docs-review-{uuid.uuid4().hex}"
    yield f"memory://{name}"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


def _crashed_save(url: str, step: int) -> str:
    """A manifest-less step, as a save killed before its manifest PUT leaves it."""
    name = step_dirname(step)
    fsspec.filesystem("memory").pipe(
        f"/{url.removeprefix('memory://')}/{name}/model.safetensors", b"x" * 10
    )
    return name


def test_ls_names_gc_pending_for_an_object_stores_pending_steps(
    memory_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with CheckpointManager(memory_url, keep=None) as mgr:
        mgr.save(1, {"model": make_model()})
        mgr.save(3, {"model": make_model()})
    older = _crashed_save(memory_url, 2)  # below the newest committed step: gc removes it
    pending = _crashed_save(memory_url, 4)  # above it: gc keeps it, gc --pending removes it

    rc, out, err = run_cli(capsys, "ls", memory_url)
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert lines[-2] == (
        f"1 stale entry (interrupted saves or deletions): {older}; `ckptstore gc` removes them"
    )
    assert lines[-1] == (
        "1 pending entry (manifest-less, at or above the newest committed step: an upload may "
        f"still finish it): {pending}; `ckptstore gc --pending` removes it (only for a prefix "
        "no job uploads to any more)"
    )

    # What ls says is what gc does.
    rc, out, _ = run_cli(capsys, "gc", memory_url)
    assert rc == 0
    assert out.splitlines()[0] == f"removed {older}"
    rc, out, _ = run_cli(capsys, "ls", memory_url)
    assert "stale entr" not in out
    assert out.splitlines()[-1].startswith("1 pending entry (")
    assert "`ckptstore gc --pending` removes it" in out
    rc, out, _ = run_cli(capsys, "gc", "--pending", memory_url)
    assert (rc, out) == (0, f"removed {pending}\n")
    rc, out, _ = run_cli(capsys, "ls", memory_url)
    assert "stale" not in out
    assert "pending" not in out


def test_ls_of_a_local_store_says_gc_removes_every_stale_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    with CheckpointManager(root, keep=None) as mgr:
        mgr.save(1, {"model": make_model()})
    tmp = root / (".tmp-" + step_dirname(5) + "-" + "ab" * 16)
    tmp.mkdir()
    (root / step_dirname(7)).mkdir()  # a manifest-less step above the newest: still garbage
    rc, out, _ = run_cli(capsys, "ls", root)
    assert rc == 0
    assert out.splitlines()[-1] == (
        f"2 stale entries (interrupted saves or deletions): {tmp.name}, {step_dirname(7)}; "
        "`ckptstore gc` removes them"
    )
    assert "pending" not in out


def test_export_help_says_force_overwrites_files_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, out, _ = run_cli(capsys, "export", "--help")
    assert rc == 0
    out = " ".join(out.split())  # argparse wraps the help text
    assert "--force overwrite OUT (a .safetensors or .pt file) if it exists; --hf and --dcp " in out
    assert "never overwrite a directory" in out


@pytest.mark.parametrize("flag", ["--hf", "--dcp"])
def test_export_force_with_a_directory_format_is_a_usage_error(
    tmp_path: Path, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": make_model()})
    out_dir = tmp_path / "out"
    rc, _, err = run_cli(capsys, "export", root, "--step", "1", flag, out_dir, "--force")
    assert rc == 2
    assert f"{flag} never overwrites: OUT_DIR must not exist (or be empty)" in err
    assert not out_dir.exists()

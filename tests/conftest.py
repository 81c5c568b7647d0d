"""Shared fixtures: keep this small; module-specific helpers live in their test file."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointManager

# The I/O modes measured by one test (or one developer's earlier runs) must not decide the
# modes of another through the cross-process cache (storage/iocache.py): off for the
# suite and the processes it starts; the cache's own tests point it at a file of theirs.
os.environ["CKPTSTORE_IO_CACHE"] = "off"

#: Every payload format x compression the manager writes.
CODECS = [
    ("safetensors", None),
    ("safetensors", "zstd"),
    ("torch", None),
    ("torch", "zstd"),
]


@pytest.fixture(params=CODECS, ids=[f"{f}-{c or 'raw'}" for f, c in CODECS])
def codec(request: pytest.FixtureRequest) -> dict[str, Any]:
    """``format=`` and ``compression=`` keyword arguments for ``CheckpointManager``."""
    fmt, comp = request.param
    return {"format": fmt, "compression": comp}


@pytest.fixture
def roundtrip(tmp_path: Path, codec: dict[str, Any]) -> Callable[..., dict[Any, Any]]:
    """``roundtrip(state, **manager_kwargs)``: save as step 1 in a fresh store, ``load()`` it."""
    calls = iter(range(1_000_000))

    def run(state: dict[Any, Any], **kwargs: Any) -> dict[Any, Any]:
        root = tmp_path / f"store{next(calls)}"
        with CheckpointManager(root, **codec, **kwargs) as mgr:
            mgr.save(1, state)
            return mgr.load()

    return run


@pytest.fixture(scope="session")
def mixed_store_master(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Made once per pytest run (see ``_helpers.make_mixed_store``; ``_once.made_once``: not
    once for each xdist worker that runs a test of it, 3 of 4 in a run of the suite, each
    running its two jobs); never modify it: copy it."""
    from _helpers import make_mixed_store
    from _once import made_once

    made, digests = made_once(tmp_path_factory, "mixed-store", lambda d: make_mixed_store(d)[1])
    return made / "store", digests


@pytest.fixture
def mixed_store(
    mixed_store_master: tuple[Path, dict[str, Any]], tmp_path: Path
) -> tuple[Path, dict[str, Any]]:
    """A private copy of the mixed store: steps 3 (DTensor, 2 ranks), 4 (DTensor, 1 rank),
    5 (replicated), 6 (per-rank state); and the digests of its full tensors."""
    import shutil

    master, digests = mixed_store_master
    root = tmp_path / "mixed"
    shutil.copytree(master, root)
    return root, digests


@pytest.fixture(autouse=True)
def _fresh_io_modes() -> None:
    """Each test starts with no measured I/O modes: what one test's large saves and reads
    measured (storage/iomode.py) must not decide how the next one writes."""
    from ckptstore.storage import iomode

    iomode.forget()


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    """One moto S3 server on loopback for the module (it starts in well under a second).

    Skips where s3fs or moto's server is not installed.
    """
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from s3server import s3_server

    from ckptstore.storage import wait_for_deletions

    with s3_server() as ep:
        yield ep
        wait_for_deletions()  # background deletions must not outlive the server


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A one-rank CPU mesh on a gloo group of this process (for DTensors in-process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():  # pragma: no cover - another module left one behind
        yield init_device_mesh("cpu", (1,))
        return
    init = tmp_path_factory.mktemp("pg") / "rendezvous"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def runs_read(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The file of every run a restore read by extent (``sharded/extents.py``)."""
    from ckptstore.sharded import extents

    seen: list[str] = []
    real = extents.read_run

    def read_run(run: extents.Run, *a: Any, **kw: Any) -> int:
        seen.append(run.file)
        return real(run, *a, **kw)

    monkeypatch.setattr(extents, "read_run", read_run)
    return seen

"""accelerate FSDP2, Lightning ``FSDPStrategy`` and the transformers ``Trainer`` with FSDP2
checkpointing through ckptstore on a real GPU (issue 23).

These frameworks run FSDP only on an accelerator (accelerate sets FSDP only for GPU kinds,
Lightning's ``FSDPStrategy`` and FSDP1 refuse the CPU), so this file needs CUDA and is
skipped without it (CI has no GPU). Each run is a process of
``tests/gpu_frameworks_worker.py`` in a one-process NCCL group on one GPU; its checkpoint is
then restored on other world sizes on the CPU (2 gloo ranks, or one process). With
``CKPTSTORE_GPU_PLAIN=1`` the same flows run without FSDP on the CPU, which checks only the
harness.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import REPO, run_rank0_job, subprocess_env

from ckptstore import CheckpointManager
from tests.multirank.launch import describe, launch

PLAIN = os.environ.get("CKPTSTORE_GPU_PLAIN") == "1"
WORKER = REPO / "tests" / "gpu_frameworks_worker.py"

pytestmark = [
    pytest.mark.skipif(not PLAIN and not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(600),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one_process_torchrun() -> dict[str, str]:
    """The variables torchrun sets for a job of one process (accelerate reads them)."""
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}  # fmt: skip


def run(mode: str, out: Path, *, torchrun_env: bool, timeout: float = 240) -> dict[str, Any]:
    """One worker process; its JSON record. A hang kills its whole session and fails."""
    env = subprocess_env()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "NODE_RANK"):  # fmt: skip
        env.pop(key, None)
    if torchrun_env:
        env.update(_one_process_torchrun())
    argv = [str(WORKER), mode, str(out), *(["--plain"] if PLAIN else [])]
    run_rank0_job(argv, out / f"{mode}.log", timeout, mode, env=env)
    return dict(json.loads((out / f"{mode}.json").read_text()))


def on_2_cpu_ranks(scenario: str, store: Path, step: int, tmp_path: Path) -> list[Any]:
    """What each of 2 CPU ranks (gloo) returns from ``gpu_scenarios:SCENARIO`` (a restore)."""
    res = launch(
        f"gpu_scenarios:{scenario}",
        2,
        tmp_path / "cpu2",
        timeout=180,
        args={"root": str(store), "step": step},
    )
    assert all(r.ok for r in res), describe(res)
    return [r.value for r in res]


def test_accelerate_fsdp2_resumes_bit_identical_and_restores_on_2_cpu_ranks(
    tmp_path: Path,
) -> None:
    a = run("accelerate", tmp_path, torchrun_env=True)
    if not PLAIN:
        assert a["distributed_type"] == "DistributedType.FSDP"
        assert a["is_fsdp2"], a
        assert a["dtensor_params"], a
        assert a["device"].startswith("cuda"), a
    store = tmp_path / "acc-store"
    with CheckpointManager(store) as mgr:
        assert mgr.steps() == [1, 3]
        m = mgr.manifest(3)
        assert mgr.verify(3, deep=True).ok
    if not PLAIN:  # every process wrote its own DTensor shards: a sharded step
        assert m.dtensor, m
        assert m.sharded, m
        assert [p.name for p in (store / m_dir(store, 3)).glob("_shards.rank*")]
    # A fresh process (other initial weights) resumes from step 3: the restored state is the
    # saved one, and its next steps are those of the uninterrupted run, bit for bit.
    b = run("accelerate_resume", tmp_path, torchrun_env=True)
    assert b["start"] == 4
    assert b["restored"] == a["saved3"]
    assert b["final"] == a["final"]
    assert b["lr"] == a["lr"]
    # Another world size: 2 CPU ranks (gloo) restore the GPU's step into their FSDP2 shards.
    for value in on_2_cpu_ranks("restore_accelerate", store, 3, tmp_path):
        assert value == {"step": 3, **a["saved3"]}


def m_dir(store: Path, step: int) -> str:
    (found,) = [p.name for p in store.glob("step-*") if int(p.name.split("-")[1]) == step]
    return found


def test_lightning_fsdp_strategy_saves_through_ckptstore_and_resumes(tmp_path: Path) -> None:
    from ckptstore.integrations.lightning import CkptStoreIO

    a = run("lightning", tmp_path, torchrun_env=False)
    assert a["strategy"] == ("SingleDeviceStrategy" if PLAIN else "FSDPStrategy")
    assert a["checkpoints"] == [
        "epoch=0-step=2.ckpt",
        "epoch=1-step=4.ckpt",
        "epoch=2-step=6.ckpt",
        "last.ckpt",
    ]
    ckpt = tmp_path / "lightning" / "epoch=0-step=2.ckpt"
    # A ckptstore store, not DCP's files: a manifest, and the rank's shards under FSDP.
    assert not list(ckpt.rglob("*.distcp"))
    assert not list(ckpt.rglob("meta.pt"))
    with CheckpointManager(ckpt) as mgr:
        (step,) = mgr.steps()
        assert mgr.verify(step, deep=True).ok
        # On one GPU, FSDP1 shards nothing (it switches to NO_SHARD): the step holds whole
        # tensors. Its ShardedTensors on several ranks: tests/test_sharded_tensor.py.
    # One CPU process reads it whole: the full tensors saved at the end of epoch 0.
    loaded = CkptStoreIO().load_checkpoint(ckpt)
    from tests.gpu_frameworks_worker import sha

    full = {k: sha(v) for k, v in sorted(loaded["state_dict"].items())}
    assert full == a["epoch0"]["model"]
    # A fresh process (other initial weights) resumes from epoch 0 and ends where the first
    # run ended, bit for bit.
    b = run("lightning_resume", tmp_path, torchrun_env=False)
    assert b["start"]["global_step"] == 2
    assert b["start"]["model"] == a["epoch0"]["model"]
    assert b["start"]["optim"] == a["epoch0"]["optim"]
    assert b["final"] == a["final"]


def test_trainer_fsdp2_resumes_bit_identical(tmp_path: Path) -> None:
    a = run("trainer", tmp_path, torchrun_env=True)
    assert a["is_fsdp2"] is not PLAIN, a
    assert a["dtensor_params"] is not PLAIN, a
    assert a["global_step"] == 6
    assert a["resumed_step"] is None
    assert a["hf_dirs"] == []  # each checkpoint-N removed once its step committed
    store = tmp_path / "hf-store"
    with CheckpointManager(store) as mgr:
        assert mgr.steps() == [2, 4, 6]
        assert all(mgr.verify(s, deep=True).ok for s in mgr.steps())
        if not PLAIN:
            assert mgr.manifest(6).dtensor
        mgr.delete(6)  # as if the job had died after step 5
    b = run("trainer_resume", tmp_path, torchrun_env=True)
    assert b["resumed_step"] == 4
    assert b["global_step"] == 6
    assert b["final"] == a["final"]
    assert b["losses"] == a["losses"]  # the log history of steps 1-4 came back with it
    # Another world size: 2 CPU ranks (gloo) restore the GPU's last step into FSDP2 GPT-2.
    for value in on_2_cpu_ranks("restore_trainer", store, 6, tmp_path):
        assert value == {"step": 6, "model": a["final"]["model"]}
    shutil.rmtree(tmp_path / "hf-a", ignore_errors=True)


def test_the_docs_gpu_snippets_run(tmp_path: Path) -> None:
    """The docs blocks marked ``skip needs a CUDA device`` run here, one process each."""
    from tests.test_docs import SKIPPED

    gpu = [s for s in SKIPPED if s.skip is not None and s.skip.startswith("needs a CUDA")]
    assert len(gpu) == 2, [s.id for s in gpu]
    if PLAIN:
        pytest.skip("the snippets use FSDP, which needs the GPU")
    for i, snippet in enumerate(gpu):
        work = tmp_path / f"s{i}"
        work.mkdir()
        (work / "snippet.py").write_text(snippet.code)
        env = {**subprocess_env(), **_one_process_torchrun()}
        proc = subprocess.run(
            [sys.executable, "snippet.py"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert proc.returncode == 0, f"{snippet.id}:\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}"

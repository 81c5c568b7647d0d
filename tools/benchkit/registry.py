"""Every contender's name, its description (kept in the JSON) and how it is made."""

from __future__ import annotations

from collections.abc import Callable

from benchkit.disk import CHUNK
from benchkit.harness import Contender
from benchkit.memory import CkptAsync, Clone, CopyPrealloc, StepSlowdown
from benchkit.plain import (
    CkptSync,
    DCPSave,
    DiskBuffered,
    DiskODirect,
    RestoreRSS,
    SafetensorsSave,
    TorchSave,
)
from benchkit.protocol import Protocol, Scale, Verify

PAIRS = (
    "disk-odirect",
    "disk-buffered",
    "torch",
    "safetensors",
    "dcp",
    "ckpt-st",
    "ckpt-st-inplace",
    "ckpt-st-copy",
    "ckpt-st-direct",
    "ckpt-st-buffered",
    "ckpt-torch",
    "ckpt-st-zstd",
    "ckpt-torch-zstd",
)
OTHERS = (
    "restore-rss",
    "ckpt-async",
    "copy-prealloc",
    "clone",
    "step-slowdown",
    "verify",
    "protocol",
    "scale",
    "ls10k",
    "sharded",
    "replica",
)
ALL = PAIRS + OTHERS
#: Contenders run on their own, outside the rounds, and only when asked for.
APART = ("sharded", "replica")

DESCRIPTIONS = {
    "disk-odirect": "raw O_DIRECT write/read of state-bytes from one aligned buffer on huge "
    "pages where the kernel gives them "
    f"({CHUNK >> 20} MB syscalls), fsync: the disk's ceiling",
    "disk-buffered": "raw buffered write of every tensor's bytes into one file + fsync; read "
    f"back into a reused {CHUNK >> 20} MB buffer",
    "torch": "torch.save({'model': sd, 'optimizer': opt_sd}, path) + fsync; "
    "torch.load(weights_only=True, map_location='cpu') + model/opt.load_state_dict",
    "safetensors": "safetensors.torch.save_file of the flattened model+optimizer tensors "
    "(param_groups in its metadata) + fsync; load_file + model/opt.load_state_dict",
    "dcp": "torch.distributed.checkpoint.save with FileSystemWriter(sync_files=True), single "
    "process; dcp.load in place into model/optimizer state dicts",
    "ckpt-st": "CheckpointManager(format='safetensors').save / .restore (default: payloads "
    "stream into the model's and optimizer's tensors, each 4 MiB block checked before it is "
    "copied; I/O mode measured per device)",
    "ckpt-st-inplace": "the same, .restore(in_place=True) (also streams manifests without "
    "block CRCs; identical to the default on new checkpoints)",
    "ckpt-st-copy": "the same, .restore(in_place=False): the whole step read and checked into "
    "fresh tensors before the model changes (a second copy of the state)",
    "ckpt-st-direct": "ckpt-st with storage_options={'io': 'direct'}: O_DIRECT forced",
    "ckpt-st-buffered": "ckpt-st with storage_options={'io': 'buffered'}: page cache forced",
    "restore-rss": "peak RSS (VmHWM, reset by /proc/self/clear_refs) of a child process "
    "restoring the state it built, saved and dropped from the cache: ckpt-st default, "
    "in_place=False, and safetensors load_file + load_state_dict",
    "ckpt-torch": "CheckpointManager(format='torch').save / .restore",
    "ckpt-st-zstd": "CheckpointManager(format='safetensors', compression='zstd')",
    "ckpt-torch-zstd": "CheckpointManager(format='torch', compression='zstd')",
    "ckpt-async": "CheckpointManager(async_save=True): 'blocked' = time save() held the "
    "caller, 'committed' = until the handle's wait() returned; staging buffers reused",
    "copy-prealloc": "copy_ of every state tensor into buffers allocated (and touched) once; "
    "the state in anonymous memory, as for clone",
    "clone": "clone() of every state tensor (fresh memory, what Lightning/torchtitan do), "
    "from the same source as copy-prealloc",
    "step-slowdown": "mean time of a training-like step (2-layer MLP forward+backward, ~1.6 "
    "GFLOP) while an async save is in flight vs without one (1 s before and 1 s after, each "
    "after untimed warm-up steps; the blocked part of save() excluded)",
    "verify": "CheckpointManager.verify(deep=True) of a cold safetensors checkpoint",
    "protocol": "median save of a few-KB state (keep=3, so retention runs too), and the "
    "fsync floor: write 1 KB + fsync file + fsync directory",
    "scale": "median few-KB save on a store of --scale-count steps vs the same save on an "
    "empty store, interleaved, one manager each, keep=[KeepLast(3), KeepEvery(100), "
    "KeepBest(3)] (so retention plans and deletes a step per save on both)",
    "ls10k": "steps/latest_step/plan_prune/`ckptstore ls` on a store of --ls-count "
    "checkpoints (metadata only, warm cache)",
    "sharded": "FSDP2 state of --size params + AdamW: ckptstore vs DCP vs raw O_DIRECT, save on "
    "2 ranks, cold resharded restore on 1 process (no process group) and on 3 ranks "
    "(tools/benchkit/sharded.py)",
    "replica": "two tiers against moto's S3 on loopback: save blocking time with replica= vs "
    "without, a CPU training step during an upload vs idle, upload throughput vs s3fs put "
    "(tools/benchkit/replica.py)",
}


def make_contenders(names: list[str]) -> list[Contender]:
    """The contenders of ``names`` that run in rounds, in that order (see ``APART``)."""
    table: dict[str, Callable[[], Contender]] = {
        "disk-odirect": DiskODirect,
        "disk-buffered": DiskBuffered,
        "torch": TorchSave,
        "safetensors": SafetensorsSave,
        "dcp": DCPSave,
        "ckpt-st": lambda: CkptSync("ckpt-st", "safetensors", None),
        "ckpt-st-inplace": lambda: CkptSync("ckpt-st-inplace", "safetensors", None, in_place=True),
        "ckpt-st-copy": lambda: CkptSync("ckpt-st-copy", "safetensors", None, in_place=False),
        "ckpt-st-direct": lambda: CkptSync("ckpt-st-direct", "safetensors", None, io="direct"),
        "ckpt-st-buffered": lambda: CkptSync(
            "ckpt-st-buffered", "safetensors", None, io="buffered"
        ),
        "restore-rss": RestoreRSS,
        "ckpt-torch": lambda: CkptSync("ckpt-torch", "torch", None),
        "ckpt-st-zstd": lambda: CkptSync("ckpt-st-zstd", "safetensors", "zstd"),
        "ckpt-torch-zstd": lambda: CkptSync("ckpt-torch-zstd", "torch", "zstd"),
        "ckpt-async": CkptAsync,
        "copy-prealloc": CopyPrealloc,
        "clone": Clone,
        "step-slowdown": StepSlowdown,
        "verify": Verify,
        "protocol": Protocol,
        "scale": Scale,
    }
    return [table[n]() for n in names if n in table]

"""The bench's state: a GPT-2-like model scaled to a parameter budget and one AdamW step.

Also where a tensor's memory lives (``file_mapped``, ``own_memory``): every contender group
builds on these.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from torch import nn

#: Blocks of the state (``--layers`` of tools/bench.py): 196 parameter tensors at 16.
N_LAYER = 16


@dataclasses.dataclass(frozen=True)
class Shape:
    """A GPT-2-like model scaled to a parameter budget."""

    d_model: int
    n_layer: int
    vocab: int
    n_ctx: int

    @classmethod
    def for_bytes(cls, param_bytes: int, n_layer: int = N_LAYER) -> Shape:
        """Width from the budget (GPT-2's vocab:width ratio), then the vocab hits it exactly."""
        p = param_bytes / 4
        per_d2 = 50257 / 1024 + 1 + 12 * n_layer  # embedding + positions + blocks, in d^2
        d_est = math.sqrt(p / per_d2)
        q = 64 if d_est >= 256 else 8
        d = max(8, round(d_est / q) * q)
        rest = d * d + n_layer * (12 * d * d + 13 * d) + 2 * d
        vocab = max(8, round((p - rest) / d))
        return cls(d_model=d, n_layer=n_layer, vocab=vocab, n_ctx=d)


class Conv1D(nn.Module):
    """GPT-2's Conv1D: weight (in, out), bias (out)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.Module()
        self.attn.c_attn = Conv1D(d, 3 * d)
        self.attn.c_proj = Conv1D(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Module()
        self.mlp.c_fc = Conv1D(d, 4 * d)
        self.mlp.c_proj = Conv1D(4 * d, d)


class GPT2Like(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.wte = nn.Embedding(shape.vocab, shape.d_model)
        self.wpe = nn.Embedding(shape.n_ctx, shape.d_model)
        self.h = nn.ModuleList(Block(shape.d_model) for _ in range(shape.n_layer))
        self.ln_f = nn.LayerNorm(shape.d_model)


def build_state(
    param_bytes: int, n_layer: int = N_LAYER
) -> tuple[nn.Module, torch.optim.Optimizer, Shape]:
    """The model (random weights) and an AdamW after one real step on random gradients."""
    shape = Shape.for_bytes(param_bytes, n_layer)
    with torch.device("meta"):
        model = GPT2Like(shape)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_ln_weight = ".ln_" in f".{name}" and name.endswith("weight")
            p.normal_(1.0 if is_ln_weight else 0.0, 0.02, generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).mul_(1e-3)
    opt.step()
    for p in model.parameters():
        p.grad = None
    return model, opt, shape


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the state, in a stable order: model params, then AdamW state."""
    out = [(f"model.{k}", v) for k, v in model.state_dict().items()]
    st = opt.state_dict()["state"]
    for i in sorted(st):
        for k in sorted(st[i]):
            v = st[i][k]
            if isinstance(v, torch.Tensor):
                out.append((f"optimizer.{i}.{k}", v))
    return out


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return t.detach().reshape(-1).view(torch.uint8).numpy().data


def file_mapped(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor's memory lies in a file-backed mapping (Linux ``/proc/self/maps``).

    ``safetensors.torch.load_file`` returns tensors in a private mapping of the file, and
    ``Optimizer.load_state_dict`` keeps them: after the safetensors restore the AdamW state
    lived in a mapping of a checkpoint whose pages the bench had just dropped from the page
    cache, so the next contender to read it read the disk (issue 13: "copy into allocated
    memory" at 1.15-2.46 GB/s, ``clone()`` right after it at 5.7-21 GB/s from warm pages).
    All False where ``/proc`` is missing.
    """
    try:
        text = Path("/proc/self/maps").read_text()
    except OSError:
        return [False] * len(tensors)
    spans = []
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 5 and f[4] != "0":  # an inode: the mapping is backed by a file
            lo, hi = (int(x, 16) for x in f[0].split("-"))
            spans.append((lo, hi))
    return [t.numel() > 0 and any(lo <= t.data_ptr() < hi for lo, hi in spans) for t in tensors]


def own_memory(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Give every state tensor that lives in a file mapping its own anonymous memory.

    Untimed, before the contenders that copy the state in memory (``copy-prealloc``,
    ``clone``, ``ckpt-async``, ``step-slowdown``): they measure memory, not the disk, and a
    training job's state is in anonymous memory. Returns the number of tensors moved.
    """
    moved = 0
    with torch.no_grad():
        params = [p for p in model.parameters()]
        for p, mapped in zip(params, file_mapped([p.data for p in params]), strict=True):
            if mapped:
                p.data = p.data.clone()
                moved += 1
        for st in opt.state.values():
            keys = [k for k, v in st.items() if isinstance(v, torch.Tensor)]
            for k, mapped in zip(keys, file_mapped([st[k] for k in keys]), strict=True):
                if mapped:
                    st[k] = st[k].clone()
                    moved += 1
    return moved

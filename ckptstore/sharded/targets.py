"""Where a restoring rank's DTensors go: templates, boxes, fresh tensors, reads into them.

Restore stages 2 and 3 for DTensor leaves (``restore/read.py: read_sharded``): the boxes
of the templates its targets give come first (integers only), then the chunks of the index
parts that overlap them are resolved and checked, and only then are the tensors made and
read into.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import math
import threading
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import nn

from .._log import logger as log
from .._prefault import Prefaulter
from ..codec.dtypes import ITEMSIZE
from ..errors import IntegrityError, StateMismatchError
from ..state.modules import EMA, de_parallel, module_state
from ..state.redistribute import shard_is_box
from . import extents
from .chunks import (
    Chunk,
    ChunkIndex,
    TensorEntry,
    read_box,
    read_box_into,
)
from .plan import is_dtensor, named_optimizer_state

__all__ = [
    "BATCH_BYTES",
    "PREFAULT",
    "READ_THREADS",
    "STAGE_MAX",
    "Box",
    "Item",
    "batches",
    "chunks_read",
    "files_read",
    "fresh_targets",
    "live_targets",
    "local_of",
    "read_into",
    "read_items",
    "restore_templates",
    "run_reads",
    "run_tasks",
    "target_box",
    "template_box",
]

#: Tasks (boxes, small ones together) a restoring rank reads at once (see :func:`read_into`).
READ_THREADS = 4
#: Whether :func:`read_into` faults the targets' pages in on a thread of its own first
#: (``_prefault.Prefaulter``).
PREFAULT = True
#: The largest CRC block a read thread stages in a buffer of its own (:func:`read_into`);
#: an index with bigger blocks (saves write 256 KiB; older ones 4 MiB) reads live targets
#: through ``read_box``'s buffer instead.
STAGE_MAX = 64 << 20


#: For ``isinstance`` once a leaf (a tuple: ``A | B`` builds a union object every call).
_SEQUENCES = (list, tuple)


def _lookup(value: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        if ((type(value) is dict or isinstance(value, Mapping)) and p in value) or (
            isinstance(value, _SEQUENCES) and isinstance(p, int) and 0 <= p < len(value)
        ):
            value = value[p]
        else:
            return None
    return value


def _fresh_like(template: Any, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor to read a stored tensor of ``shape`` into, laid out like ``template``.

    A DTensor template gives a DTensor of the same mesh and placements (so each rank reads
    only its part); a plain tensor a full tensor on its device; nothing a full CPU tensor.
    Always of the stored ``dtype``: a target of another dtype (a bf16 value of a plain dict
    where float32 was saved) is not a reason to round what was saved. A module's tensors of
    another dtype are refused before anything is read (``precheck``), and an optimizer's
    ``load_state_dict`` casts its moments to its parameters' dtype as it always does.
    """
    if is_dtensor(template) and tuple(template.shape) == shape:
        from torch.distributed.tensor import DTensor

        if template.is_contiguous():
            # The same mesh, placements, shapes and strides, a fresh local tensor: a sixth
            # of what ``from_local`` costs (~15 us against ~90 for a DTensor, in one restore
            # per stored leaf).
            return torch.empty_like(template, dtype=dtype, requires_grad=False)
        local = template.to_local()
        buf = torch.empty(local.shape, dtype=dtype, device=local.device)
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        return DTensor.from_local(
            buf,
            template.device_mesh,
            template.placements,
            run_check=False,
            shape=torch.Size(shape),
            stride=stride,
        )
    if isinstance(template, torch.Tensor) and tuple(template.shape) == shape:
        return torch.empty(shape, dtype=dtype, device=template.device)
    return torch.empty(shape, dtype=dtype)


def restore_templates(
    leaves: Mapping[str, tuple[tuple[Any, ...], TensorEntry]],
    targets: Mapping[Any, Any] | None,
    kinds: Mapping[Any, str | None],
    owners: Mapping[Any, Any],
    *,
    own: set[str] | None = None,
) -> dict[str, Any]:
    """The target each stored DTensor leaf is to be laid out like (``None``: a full tensor).

    Nothing is allocated: see :func:`template_box` and :func:`fresh_targets`.

    Args:
        leaves: flat name -> (path in the state, index entry), for the leaves to read.
        targets: the state being restored, or ``None`` to load full tensors.
        kinds: the kind each top-level entry was saved as.
        owners: for ``optimizer`` entries, the key of the module that owns the parameters.
        own: if given, receives the names whose template is a tensor of a module, EMA or
            optimizer of ``targets``, at the leaf's own place (not a stand-in such as a
            parameter for a moment not created yet), that is the object's own memory: two
            captures of the object, both held alive, hand out the same memory for it (as
            ``restore.load.persistent_targets`` decides for plain tensors). Only those may
            be read into in place (:func:`live_targets`): what is written into a copy is
            gone with it, and plain values are replaced only when a restore succeeds.
    """
    current: dict[Any, Any] = {}
    again: dict[Any, Any] = {}
    out: dict[str, Any] = {}
    for name, (path, _) in leaves.items():
        template: Any = None
        if targets is not None and path and path[0] in targets:
            key = path[0]
            if key not in current:
                current[key] = _current(targets, key, kinds.get(key), owners.get(key))
                if own is not None and _persistent(targets[key], kinds.get(key)):
                    again[key] = _current(targets, key, kinds.get(key), owners.get(key))
            template = _lookup(current[key], path[1:])
            if template is None and kinds.get(key) == "optimizer" and len(path) == 4:
                # A fresh optimizer has no state yet: its moments are laid out like their
                # parameter (state/<param>/<moment>).
                params = current[key].get("params", {})
                template = params.get(path[2]) if path[1] == "state" else None
            elif own is not None and key in again and isinstance(template, torch.Tensor):
                twin = _lookup(again[key], path[1:])
                if isinstance(twin, torch.Tensor) and _span(twin) == _span(template):
                    own.add(name)
        out[name] = template
    return out


def _persistent(target: Any, kind: str | None) -> bool:
    """Whether ``target``'s tensors may be its own memory (a module, EMA or optimizer)."""
    if isinstance(target, nn.Module | EMA):
        return True
    return kind == "optimizer" and isinstance(target, torch.optim.Optimizer)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; a plain tensor itself."""
    if not is_dtensor(t):
        return t
    # What to_local() returns under no_grad (the local tensor itself, not an autograd
    # function's), without entering no_grad: ~3 us a call, thousands of calls a restore.
    loc = getattr(t, "_local_tensor", None)
    if type(loc) is torch.Tensor:
        return loc
    with torch.no_grad():
        return t.to_local()  # type: ignore[attr-defined,no-any-return]


def _span(t: torch.Tensor) -> tuple[int, int]:
    """``(first, end)`` addresses of the memory of ``t``'s local data (contiguous or not)."""
    loc = local_of(t)
    numel = loc.numel()
    if numel == 0:
        return 0, 0
    first = loc.data_ptr()
    if loc.is_contiguous():  # nearly every target: no walk over the strides
        return first, first + numel * loc.element_size()
    reach = sum((n - 1) * abs(st) for n, st in zip(loc.shape, loc.stride(), strict=True))
    return first, first + (reach + 1) * loc.element_size()


def live_targets(
    leaves: Mapping[str, tuple[tuple[Any, ...], TensorEntry]],
    templates: Mapping[str, Any],
    own: set[str],
) -> dict[str, torch.Tensor]:
    """The leaves read straight into their targets' own tensors, and those tensors.

    A leaf of ``own`` (see :func:`restore_templates`) qualifies when its template is a
    tensor of the stored shape and dtype (a DTensor: of the stored global shape) whose local
    data is a contiguous, non-empty tensor on the CPU or a GPU (``extents.DEVICES``: read
    into in place rather than into a fresh tensor on the device and then copied, which took
    the state's size again in device memory) sharing no byte with another qualifying
    leaf's (two names tied to one tensor in the targets would write it twice, from two
    threads: both are read into fresh tensors, and ``apply_state`` loads them in turn as
    before). Every other leaf gets a fresh tensor (:func:`fresh_targets`).
    """
    found: dict[str, torch.Tensor] = {}
    for name in own:
        t = templates.get(name)
        entry = leaves[name][1] if name in leaves else None
        if not isinstance(t, torch.Tensor) or entry is None:
            continue
        loc = local_of(t)
        if (
            tuple(t.shape) == entry.shape
            and t.dtype == entry.torch_dtype
            and (loc.device.type == "cpu" or loc.device.type in extents.DEVICES)
            and loc.numel() > 0
            and loc.is_contiguous()
        ):
            found[name] = t
    # By start address; a span that starts before the farthest end so far overlaps the span
    # of that end (and every span that overlaps another is flagged this way, one or other).
    clash: set[str] = set()
    far, far_name = 0, ""
    for (lo, hi), name in sorted((_span(t), name) for name, t in found.items()):
        if lo < far:
            clash.update((name, far_name))
        if hi > far:
            far, far_name = hi, name
    return {n: t for n, t in found.items() if n not in clash}


def fresh_targets(
    leaves: Mapping[str, tuple[tuple[Any, ...], TensorEntry]],
    templates: Mapping[str, Any],
    skip: Mapping[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """A fresh tensor for every stored DTensor leaf not in ``skip``, laid out like its template."""
    return {
        name: _fresh_like(templates.get(name), entry.shape, entry.torch_dtype)
        for name, (_, entry) in leaves.items()
        if skip is None or name not in skip
    }


def _current(targets: Mapping[Any, Any], key: Any, kind: str | None, owner: Any) -> Any:
    """A target's present state, to lay restored tensors out like it."""
    target = targets[key]
    # The module's own parameters (read into under no_grad, through their memory), without
    # a detach per tensor
    if isinstance(target, nn.Module):
        return module_state(target, keep_vars=True)
    if isinstance(target, EMA):
        return {"weights": module_state(target.module, keep_vars=True)}
    if kind == "optimizer" and isinstance(target, torch.optim.Optimizer):
        model = targets.get(owner) if owner is not None else None
        if isinstance(model, EMA):
            model = model.module
        if not isinstance(model, nn.Module):
            return {}
        state = named_optimizer_state(target, model)
        state["params"] = dict(de_parallel(model).named_parameters())
        return state
    if kind is None:
        return target  # plain data: DTensors in it are laid out as they are now
    return None


def target_box(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(lo, hi)`` of the part of the full tensor that ``t`` (a fresh restore target) holds.

    A DTensor holds its local shard's box on this rank; a plain tensor the whole.
    """
    return template_box(t, tuple(int(s) for s in t.shape))


#: ``(lo, hi)`` of a box: the first index of every dim, and one past the last.
Box = tuple[tuple[int, ...], tuple[int, ...]]


def template_box(template: Any, shape: tuple[int, ...], cache: dict[Any, Box] | None = None) -> Box:
    """:func:`target_box` of the tensor :func:`fresh_targets` makes of ``template``, unmade.

    A DTensor template of the stored shape holds its local shard's box on this rank;
    anything else (none, another shape, a plain tensor) makes a full tensor. ``cache``
    (one per restore) keeps the box of each shape, mesh and placements: a model's layers
    repeat a few of them, and torch's ``compute_local_shape_and_global_offset`` costs
    ~60 us a call.
    """
    if is_dtensor(template) and tuple(template.shape) == shape:
        dt: Any = template
        key = (shape, id(dt.device_mesh), tuple(dt.placements))
        got = cache.get(key) if cache is not None else None
        if got is not None:
            return got
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if dt.device_mesh.get_coordinate() is None:  # not in its mesh: holds nothing
            zero = tuple(0 for _ in shape)
            box: Box = (zero, zero)
        elif not shard_is_box(shape, dt.device_mesh, dt.placements):
            # Read as the box of its first offset, the part would be filled with other rows.
            placements = ", ".join(str(p) for p in dt.placements)
            raise StateMismatchError(
                f"a DTensor target laid out as ({placements}) holds on this rank a part that "
                "is not one box of the tensor (a strided shard); checkpoints store and read "
                "parts as boxes, so it cannot be restored into: lay it out as FSDP2 over tensor "
                "parallelism does, or with Shard/Replicate placements"
            )
        else:
            sizes, offsets = compute_local_shape_and_global_offset(
                shape, dt.device_mesh, dt.placements
            )
            lo = tuple(int(o) for o in offsets)
            box = (lo, tuple(o + int(s) for o, s in zip(lo, sizes, strict=True)))
        if cache is not None:
            # The mesh is held by the key's template for as long as the cache lives (one
            # restore), so its ``id`` names no other mesh meanwhile.
            cache[key] = box
        return box
    return tuple(0 for _ in shape), tuple(shape)


def files_read(index: ChunkIndex, leaves: Collection[str], boxes: Mapping[str, Box]) -> list[str]:
    """The files holding a stored chunk that overlaps the box of one of ``leaves``.

    What a restoring rank will read, known before any target is made (``boxes`` holds
    every leaf's box): its sizes are checked first (``RangeReader.check_size``).
    """
    return sorted({c.file for _, _, c in chunks_read(index, leaves, boxes)})


def chunks_read(
    index: ChunkIndex, leaves: Collection[str], boxes: Mapping[str, Box]
) -> list[tuple[str, str, Chunk]]:
    """``(name, dtype, chunk)`` of each stored chunk that overlaps the box of one of ``leaves``.

    What :func:`read_into` will read of them, known before any target is made: a restore
    checks each against its shard file's header first (``chunks.check_entries``).
    """
    out: list[tuple[str, str, Chunk]] = []
    for name in leaves:
        entry = index.tensors.get(name)
        box = boxes.get(name)
        if entry is None or box is None:
            continue  # read_items names it
        lo, hi = box
        out += ((name, entry.dtype, c) for c in entry.chunks if _overlap(lo, hi, c) is not None)
    return out


def _overlap(
    lo: tuple[int, ...], hi: tuple[int, ...], c: Chunk
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """Where chunk ``c`` overlaps the box ``[lo, hi)``, or None where they share nothing.

    Returns:
        (offsets in the chunk, offsets in the box, lengths).
    """
    src, dst, lengths = [], [], []
    for d, (a, b) in enumerate(zip(lo, hi, strict=True)):
        c_lo = c.offsets[d]
        s, e = max(a, c_lo), min(b, c_lo + c.sizes[d])
        if e <= s:
            return None
        src.append(s - c_lo)
        dst.append(s - a)
        lengths.append(e - s)
    return tuple(src), tuple(dst), tuple(lengths)


#: One read of :func:`read_into`: ``(name, chunk, offsets in the chunk, offsets in the
#: target's local data, lengths)``.
Item = tuple[str, Chunk, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def read_items(
    index: ChunkIndex, flat: Mapping[str, torch.Tensor], boxes: Mapping[str, Box]
) -> list[Item]:
    """What to read to fill ``flat``, one item per stored chunk a target's box overlaps.

    An :data:`Item` for every non-empty overlap of a stored chunk with the box a target holds
    (``boxes``, else :func:`target_box`), in ``flat``'s order.

    The resharding DCP's ``create_default_local_load_plan`` computes, without its
    per-tensor objects (~0.2 ms a DTensor): the boxes are known already.

    Raises:
        IntegrityError: a target the index does not hold, or of another shape.
    """
    out: list[Item] = []
    for name, t in flat.items():
        entry = index.tensors.get(name)
        if entry is None:
            raise IntegrityError(f"the chunk index holds no tensor {name!r}")
        if tuple(t.shape) != entry.shape:
            raise IntegrityError(
                f"{name!r}: the chunk index holds {list(entry.shape)}, the target is "
                f"{list(t.shape)}"
            )
        box = boxes.get(name)
        lo, hi = box if box is not None else target_box(t)
        for c in entry.chunks:
            got = _overlap(lo, hi, c)
            if got is not None:
                out.append((name, c, *got))
    return out


#: Boxes smaller than this go to a read thread together, up to this many bytes a task: a
#: task handed to a thread costs ~100 us of CPU (the pool's queue and the GIL passed between
#: threads), more than reading a bias of a few KB from the page cache.
BATCH_BYTES = 1 << 20


def batches(items: list[Item], tensors: Mapping[str, TensorEntry]) -> list[list[Item]]:
    """``items`` (:func:`read_items`) in order, as the tasks of the read threads.

    A box of :data:`BATCH_BYTES` or more is a task of its own; smaller ones that follow each
    other share a task until it holds that many bytes.
    """
    out: list[list[Item]] = []
    group: list[Item] = []
    held = 0
    for item in items:
        size = math.prod(item[4]) * ITEMSIZE[tensors[item[0]].dtype]
        if size >= BATCH_BYTES:
            out.append([item])
            continue
        group.append(item)
        held += size
        if held >= BATCH_BYTES:
            out.append(group)
            group, held = [], 0
    if group:
        out.append(group)
    return out


def _spans_in_order(
    tasks: list[list[Item]], flat: Mapping[str, torch.Tensor]
) -> list[tuple[int, int]]:
    """``(address, nbytes)`` of each CPU target's local memory, in the order ``tasks`` read."""
    out: list[tuple[int, int]] = []
    seen: set[str] = set()
    for task in tasks:
        for item in task:
            name = item[0]
            if name in seen:
                continue
            seen.add(name)
            t = flat[name]
            if t.device.type == "cpu":
                first, end = _span(t)
                if end > first:
                    out.append((first, end - first))
    return out


def read_into(
    index: ChunkIndex,
    flat: Mapping[str, torch.Tensor],
    read: Callable[[str, int, int], bytearray],
    where: str,
    read_to: Callable[[str, int, list[memoryview]], None] | None = None,
    *,
    live: Collection[str] = (),
    boxes: Mapping[str, Box] | None = None,
    direct_fd: Callable[[str], int | None] | None = None,
) -> int:
    """Fill ``flat`` (tensors or DTensors) from the saved chunks that overlap them.

    Each rank reads only the byte ranges that overlap its own shards, and every block it
    reads is checked against its CRC32C once, right after it was read. With ``read_to``
    (``RangeReader.read_into``) a box that is one contiguous range of its chunk and of its
    target goes through ``chunks.read_box_into``: into a fresh tensor straight (checked
    where it landed: a block that fails leaves nothing of the caller's written), into a
    tensor named in ``live`` (the caller's own, see :func:`live_targets`) through a
    block-sized buffer of the reading thread, each block copied in only once it passed, so
    a live target never holds a byte that failed its check. Any other box is read into a
    buffer, checked, then copied. ``boxes`` holds the box each target holds where the caller
    knows it (:func:`template_box`); :func:`target_box` computes the others.

    With ``direct_fd`` (a file's ``O_DIRECT`` descriptor, or None where it has none), the
    files whose every box is one contiguous range of its chunk and of its target (on the
    CPU or a GPU) are read by extent instead (``extents``): runs of their boxes, one request
    each, into a stage, each block checked there and then copied into its target, fresh or
    live. Without it, the files whose every box goes to a GPU target so are read by extent
    too, each run with one buffered ``read_to``.

    The caller has checked that each chunk read is its shard file's own entry
    (``chunks.check_entries``: :func:`chunks_read` of a restore's targets, or the whole
    index as ``split_index.read_index`` reads it).

    Returns:
        The number of bytes read.
    """
    if not flat:
        return 0
    items = read_items(index, flat, boxes or {})
    runs: list[extents.Run] = []
    tasks: list[Callable[[], int]] = []
    gate = threading.BoundedSemaphore(READ_THREADS)
    # GPU targets go by runs either way: through the page cache too, a run a request on
    # READ_THREADS threads beats one box at a time, each read into a buffer and then copied.
    on_device = direct_fd is None and any(
        local_of(t).device.type in extents.DEVICES for t in flat.values()
    )
    if read_to is not None and (direct_fd is not None or on_device):
        fd_of: Callable[[str], int | None] = direct_fd or (lambda f: None)
        runs, items = extents.plan(
            items,
            flat,
            local_of,
            block=index.block,
            dtype_of=lambda n: index.tensors[n].torch_dtype,
            files=lambda f: direct_fd is None or fd_of(f) is not None,
            host=direct_fd is not None,
        )
        tasks = run_tasks(runs, index.block, fd_of, read_to, where, gate)
    # One box at a time through a buffer (the size of the blocks that cover it: nearly a
    # whole chunk for a column range), as before the reads ran at once: the memory a
    # restore takes beyond its targets stays one box.
    buffered = threading.Lock()
    stages = threading.local()  # each read thread's block buffer, for live targets

    def stage_of() -> bytearray | None:
        if index.block > STAGE_MAX:
            return None
        buf: bytearray | None = getattr(stages, "buf", None)
        if buf is None:
            buf = stages.buf = bytearray(index.block)
        return buf

    def one(item: Item) -> int:
        """Read and check one box, then put it in place; the bytes read."""
        name, chunk, src_at, dest_at, lengths = item
        dtype = index.tensors[name].torch_dtype  # the stored one: a target may differ
        dest = local_of(flat[name])
        if tuple(dest.shape) != lengths:  # the box is part of the target's local data
            for dim, (off, n) in enumerate(zip(dest_at, lengths, strict=True)):
                dest = dest.narrow(dim, off, n)
        stage = stage_of() if name in live else None
        if read_to is not None and (stage is not None or name not in live):
            got = read_box_into(
                read_to,
                chunk,
                dtype,
                src_at,
                lengths,
                dest=dest,
                block=index.block,
                where=f"{where}: tensor {name!r}",
                stage=stage,
            )
            if got is not None:
                return got
        nbytes = [0]

        def counted(file: str, offset: int, length: int) -> bytearray:
            nbytes[0] += length
            return read(file, offset, length)

        with buffered:
            src = read_box(
                counted,
                chunk,
                dtype,
                src_at,
                lengths,
                block=index.block,
                where=f"{where}: tensor {name!r}",
            )
            dest.copy_(src)
            del src  # freed before the next buffered box is read
        return nbytes[0]

    def batch(group: list[Item]) -> int:
        # Beside runs (twice the threads), a batch holds the gate while it reads and checks.
        with torch.no_grad(), gate if runs else contextlib.nullcontext():  # no_grad: per thread
            return sum(one(item) for item in group)

    # READ_THREADS tasks in flight: the disk serves several requests at once (and an object
    # store several GETs), and the CRCs of one box overlap the reads of the others. Leaving
    # the block waits for every running read, so no thread writes a target after we return.
    groups = batches(items, index.tensors)
    tasks += [functools.partial(batch, g) for g in groups]
    spans = extents.spans(runs) + _spans_in_order(groups, flat)
    nread = run_reads(tasks, READ_THREADS * (2 if runs else 1), spans)
    log.debug("%s: read %d bytes of sharded tensors", where, nread)
    return nread


def run_tasks(  # noqa: PLR0917 - read_run's arguments
    runs: list[extents.Run],
    block: int,
    direct_fd: Callable[[str], int | None],
    read_to: Callable[[str, int, list[memoryview]], None],
    where: str,
    gate: threading.Semaphore,
) -> list[Callable[[], int]]:
    """The tasks that read ``runs`` (``extents.read_run``), their requests through ``gate``.

    Run on twice as many threads as ``gate`` lets requests through (:func:`run_reads`):
    while some threads check and copy a run, others have the next requests at the disk.
    With one thread a request, reads that finished together left the disk idle while their
    threads shared the two cores (no request in flight for 10-43 ms of a 370 ms read).
    """
    return [
        functools.partial(extents.read_run, run, block, direct_fd, read_to, where, gate=gate)
        for run in runs
    ]


def run_reads(tasks: list[Callable[[], int]], threads: int, spans: list[tuple[int, int]]) -> int:
    """Run ``tasks`` (reads into targets) on up to ``threads`` threads; the bytes they read.

    The pages of ``spans`` (the targets' memory, in the order the tasks fill it) are faulted
    in by a thread of their own meanwhile (``_prefault``; with :data:`PREFAULT`), stopped
    and joined after the last read. The first failure is raised once every running task
    ended (those not started are cancelled): no thread writes a target after this returns.
    """
    total = 0
    prefault = Prefaulter(spans) if PREFAULT else None
    with prefault or contextlib.nullcontext():
        if len(tasks) <= 1:
            return sum(t() for t in tasks)
        with concurrent.futures.ThreadPoolExecutor(
            min(threads, len(tasks)), thread_name_prefix="ckptstore-read"
        ) as pool:
            futures = [pool.submit(t) for t in tasks]
            try:
                for f in futures:
                    total += f.result()
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    return total

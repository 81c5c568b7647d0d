"""Restore stage 3, read and check: a step's files into tensors, every block checked first.

In: the :class:`~ckptstore.session.Session`, a step, the entries wanted, the targets (the
state being restored; their tensors are read into in place where they fit) or blobs
rank 0 broadcast. Out: the decoded entries and their kinds. Every byte is checked against
the manifest's checksums (per 4 MiB block) before it is used; only the files, and the
byte ranges of files, that the wanted entries need are read; DTensor leaves are read as
the byte ranges that overlap this rank's targets.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .. import ranktable
from .._phases import PhaseClock, mark
from ..codec import payload as payload_codec
from ..codec import safetensors as st
from ..codec import strictjson, treecheck
from ..codec.tree import STATE_FORMAT, TreeDecoder, is_key, stored_tensors
from ..errors import CkptStoreError, IntegrityError, ManifestError, StateMismatchError
from ..integrity import crc32c_of
from ..manifest import FileEntry, Manifest
from ..session import Session
from ..sharded import split_index
from ..sharded import targets as targets_mod
from ..sharded.chunks import INDEX_FILE, ChunkIndex, TensorEntry, check_entries
from ..state.modules import rng_for_rank
from ..tiers import nodes
from . import partial
from .load import check_targets, indexed_optimizer, persistent_targets
from .plan import dtensor_leaves, layout_of, unwrap

__all__ = ["decode", "decode_files", "read_blobs"]

_MANIFEST_BLOB = "manifest.json"


def decode(
    session: Session, step: int, wanted: Iterable[Any] | None, **kw: Any
) -> tuple[dict[Any, Any], dict[Any, str | None]]:
    """:func:`decode_files`, with missing files of a node's partial copy named.

    A file missing from a node's copy of a step (see ``nodes``) is an ``IntegrityError``
    naming the ranks whose files live elsewhere.
    """
    try:
        return decode_files(session, step, wanted, **kw)
    except (FileNotFoundError, IntegrityError) as e:
        err = nodes.missing_error(session.storage, step, None, e)
        if err is e:
            raise
        raise err from e


def decode_files(
    session: Session,
    step: int,
    wanted: Iterable[Any] | None,
    *,
    allow_pickle: bool,
    rank: int | None = None,
    blobs: Mapping[str, bytearray] | None = None,
    targets: Mapping[Any, Any] | None = None,
    strict: bool = True,
    in_place: bool | None = None,
    require: bool = False,
    touched: dict[int, str] | None = None,
    report: dict[str, Any] | None = None,
    checked: Callable[[BaseException | None], None] | None = None,
    clock: PhaseClock | None = None,
) -> tuple[dict[Any, Any], dict[Any, str | None]]:
    """Decode the entries ``wanted`` (all if None) of ``step`` as ``rank`` sees them.

    Every byte is checked against the manifest's checksum before it is trusted; with
    ``blobs`` the files come from memory (broadcast by rank 0) instead of storage. Only
    the files, and byte ranges of files, that the entries ``wanted`` reference are read;
    with ``require`` an entry ``wanted`` that the checkpoint lacks is an error.

    With ``targets`` (the state being restored) the checkpoint is first checked against
    them from ``state.json`` alone (``StateMismatchError`` before any payload is read).
    Unless ``in_place`` is False, tensors are then read straight into the targets' own
    tensors where dtype, shape and layout match: no intermediate copy, each block checked
    before its bytes are copied (``None``), or even without block CRCs (``True``). If a
    payload fails, those tensors hold partial data (``restore`` goes on to an older
    checkpoint, which overwrites them, or raises). ``touched`` (address -> name) receives the
    tensors of the modules, optimizers and EMA in ``targets`` this step holds a value for.

    ``report`` receives what the read covered, for the callers that count a step as known
    good only when all of it was checked: ``whole`` (every entry of the step was decoded)
    and ``ranks`` (how many ranks' parts a per-rank step holds, of which this read one; 1
    for a replicated or DTensor step), and ``keys`` (the step's top-level entries).


    ``checked`` is called once the targets passed their checks, before any payload is read
    (a restore's ranks agree there that none refused: ``restore:check``); it may raise.

    ``clock`` (a restore's) gets the phases: ``state`` (the manifest and ``state.json``),
    ``check`` (the targets against it), ``x:check``, for DTensor leaves ``plan`` (the
    chunk index, this rank's boxes and reads) and ``read`` (their bytes, checked, in their
    targets), and ``decode`` (the tree rebuilt, other payloads read).
    """
    explicit = rank is not None
    rank = session.coord.rank if rank is None else rank
    if blobs is None:
        # The rank table (format 4) is read line by line: only the lines of the ranks whose
        # files this rank reads, not a line per rank of the job.
        manifest = ranktable.lean(session.storage, session.storage.read_manifest(step, table=False))
    else:
        manifest = _blob_manifest(blobs)
    where = session.storage.describe(step)
    sname, groups = layout_of(session, manifest, rank, explicit=explicit)

    def fetch(name: str) -> bytearray:
        entry = manifest.files.get(name)
        if entry is None:  # a DTensor step whose manifest lists no index: hostile or torn
            raise ManifestError(f"{where}: the manifest lists no {name}")
        if blobs is None:
            return session.storage.read_file(step, name, entry)
        data = blobs.get(name)
        if data is None or len(data) != entry.bytes or crc32c_of(data) != entry.crc32c:
            raise IntegrityError(f"{where}/{name}: broadcast copy does not match the manifest")
        return data

    raw = fetch(sname)
    try:
        tree = strictjson.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise IntegrityError(f"{where}/{sname}: not valid JSON ({e})") from None
    if not isinstance(tree, dict) or tree.get("ckptstore_state") != STATE_FORMAT:
        raise IntegrityError(f"{where}/{sname}: not a ckptstore state (format {STATE_FORMAT})")
    root = tree.get("root")
    keys = root.get("keys") if isinstance(root, dict) else None
    vals = root.get("vals") if isinstance(root, dict) else None
    if not isinstance(keys, list) or not isinstance(vals, list) or len(keys) != len(vals):
        raise IntegrityError(f"{where}/{sname}: malformed root")
    bad = next((k for k in keys if not is_key(k)), None)
    if bad is not None:
        raise IntegrityError(f"{where}/{sname}: top-level key {bad!r} is not str or int")
    mark(clock, "state")
    wanted_set = None if wanted is None else set(wanted)
    if report is not None:
        report["whole"] = wanted_set is None or wanted_set.issuperset(keys)
        report["ranks"] = manifest.world_size if manifest.sharded and not manifest.dtensor else 1
        report["keys"] = list(keys)
    if require and wanted_set is not None:
        absent = sorted((k for k in wanted_set if k not in keys), key=repr)
        if absent:
            raise StateMismatchError(
                f"{where} holds no entries {absent}; it holds {keys}. Ask for those, or "
                "load(step) for all of them"
            )
    into: dict[str, dict[str, torch.Tensor]] = {}
    if targets is not None:
        try:
            into = check_targets(
                targets,
                keys=keys,
                vals=vals,
                where_state=f"{where}/{sname}",
                strict=strict,
                where=where,
                pair=in_place is not False and not manifest.dtensor,
            )
        except StateMismatchError as e:
            if blobs is None:
                _blame_the_step(session, step, manifest, tree, groups, f"{where}/{sname}", e)
            raise
        if touched is not None:
            touched.update(persistent_targets(targets, keys, vals))
        mark(clock, "check")
    if checked is not None:
        checked(None)
        mark(clock, "x:check")
    sharded_leaves: dict[str, torch.Tensor] = {}
    if manifest.dtensor:
        sharded_leaves = read_sharded(
            session,
            manifest,
            fetch(INDEX_FILE),
            keys,
            vals,
            wanted_set,
            targets,
            in_place=in_place is not False,
            touched=touched,
            clock=clock,
        )
    cache: dict[str, dict[str, torch.Tensor]] = {}
    # What each group's tensors take, from state.json alone: a compressed payload never
    # inflates past that (with a generous allowance for its container).
    stored: list[dict[str, dict[str, tuple[int, int]]]] = []

    def limit_of(group: str, entry: FileEntry) -> int | None:
        if entry.compression is None:
            return None  # the manifest's size bounds it
        if not stored:
            stored.append(stored_tensors(vals))
        return payload_codec.max_payload_bytes(stored[0].get(group, {}))

    # A partial load reads, of a file that holds more than it needs (a tensor shared
    # with an entry not asked for), only the ranges of the tensors it needs.
    needs: dict[str, set[str]] = {}
    if wanted_set is not None and blobs is None and not wanted_set.issuperset(keys):
        everything = partial.tensor_refs(vals)
        needs = partial.tensor_refs([v for k, v in zip(keys, vals, strict=True) if k in wanted_set])
        needs = {g: ks for g, ks in needs.items() if ks != everything.get(g)}

    def load_group(group: str) -> None:
        names = groups.get(group)
        if not names:
            raise IntegrityError(f"{where}: no payload file for group {group!r}")
        merged: dict[str, torch.Tensor] = {}
        some = needs.get(group)
        for n in sorted(names):
            entry = manifest.files[n]
            limit = limit_of(group, entry)
            if some is not None and len(names) == 1 and partial.can_read_some(entry):
                part = partial.read_some(session.storage, step, n, entry, some, into.get(group))
            elif blobs is None:
                part = payload_codec.read_group(
                    session.storage,
                    step,
                    n,
                    entry,
                    into.get(group),
                    limit=limit,
                    checked=in_place is not True,
                )
            else:  # a broadcast copy, checked whole: a compressed one streams
                part = payload_codec.decode_bytes(
                    fetch(n), entry, f"{where}/{n}", into.get(group), limit=limit
                )
            merged.update(part)
        cache[group] = merged

    # A store that serves several requests at once (an object store) has the files the
    # entries need read side by side, each as a few ranged GETs; a local disk reads them
    # in turn, each at its full speed.
    workers = getattr(session.storage, "read_concurrency", 1)
    if workers > 1 and blobs is None:
        refs = partial.tensor_refs(
            vals
            if wanted_set is None
            else [v for k, v in zip(keys, vals, strict=True) if k in wanted_set]
        )
        todo = sorted(g for g in refs if g in groups)
        if len(todo) > 1:
            limit_of(todo[0], manifest.files[groups[todo[0]][0]])  # computed once, here
            with concurrent.futures.ThreadPoolExecutor(
                min(workers, len(todo)), thread_name_prefix="ckptstore-read"
            ) as pool:
                for f in [pool.submit(load_group, g) for g in todo]:
                    f.result()

    def get_tensor(group: str, key: str) -> torch.Tensor:
        if group not in cache:
            load_group(group)
        t = cache[group].get(key)
        if t is None:
            raise IntegrityError(f"{where}: tensor {key!r} missing from payload {group!r}")
        return t

    dec = TreeDecoder(
        get_tensor,
        allow_pickle=allow_pickle,
        where=f"{where}/{sname}",
        get_dtensor=lambda name, _path: sharded_leaves[name],
    )
    out: dict[Any, Any] = {}
    kinds: dict[Any, str | None] = {}
    for k, node in zip(keys, vals, strict=True):
        if isinstance(k, bool) or not isinstance(k, str | int):
            raise IntegrityError(f"{where}/{sname}: top-level key {k!r} is not str or int")
        if wanted_set is not None and k not in wanted_set:
            continue
        kind, inner = unwrap(node)
        value = dec.decode(inner, (k,))
        if kind == "optimizer" and targets is not None:
            value = indexed_optimizer(targets, k, node, value, where)
        if kind == "rng" and isinstance(value, dict):
            # A per-rank checkpoint keeps each rank's own stream in its own state file;
            # replicated and DTensor ones keep every rank's in rank 0's.
            index = 0 if manifest.sharded and not manifest.dtensor else rank
            streams = value.get("per_rank")
            if explicit and isinstance(streams, list) and streams and index >= len(streams):
                # load(rank=r) asks for rank r's stream by name: rank 0's in its place was a
                # silent wrong answer (a per-rank step refuses such a rank, as here).
                raise StateMismatchError(
                    f"{where}: {k!r} holds the RNG streams of ranks 0..{len(streams) - 1}, "
                    f"not of rank {index}"
                )
            target = targets.get(k) if targets is not None else None
            value = rng_for_rank(value, index, target=target, warn=targets is not None)
        out[k] = value
        kinds[k] = kind
    mark(clock, "decode")
    return out, kinds


def _blame_the_step(  # noqa: PLR0917 - private, one call site
    session: Session,
    step: int,
    manifest: Manifest,
    tree: Any,
    groups: Mapping[str, list[str]],
    where: str,
    mismatch: StateMismatchError,
) -> None:
    """Raise an IntegrityError where the step contradicts itself, not the targets.

    The targets are checked against the state file alone, before any payload is read. A
    state file that its own payloads' headers contradict (a dtype, a shape, a tensor none
    holds: a writer's bug, or a forgery with its checksum) then blamed the model ("build
    the model as it was when saved"), and restore() stopped there instead of going on to
    the step before (found by review). Read on this failure path only: each uncompressed
    safetensors payload's header, held against the state as ``verify`` holds it.
    """
    unreadable: list[OSError] = []

    def codes_of(name: str) -> Mapping[str, tuple[str, list[int], int, int]] | None:
        entry = manifest.files[name]
        if unreadable or entry.codec != "safetensors" or entry.compression is not None:
            return None  # a zip's or a compressed file's contents: not looked into
        try:
            with session.storage.open_file(step, name) as f:
                return st.read_header(f, entry.bytes, session.storage.describe(step, name)).codes
        except OSError as e:
            unreadable.append(e)
            return None
        except (CkptStoreError, ValueError) as e:  # a header that does not parse
            raise IntegrityError(str(e)) from mismatch

    contents = treecheck.group_contents(groups, codes_of)
    if unreadable:
        return  # unreadable now: the mismatch stands as it was found
    problems = treecheck.check_state(tree, contents, where)
    if problems:
        raise IntegrityError(problems[0]) from mismatch


def read_sharded(  # noqa: PLR0917 - private, one call site
    session: Session,
    manifest: Manifest,
    raw_index: bytearray,
    keys: list[Any],
    vals: list[Any],
    wanted: set[Any] | None,
    targets: Mapping[Any, Any] | None,
    *,
    in_place: bool = False,
    touched: dict[int, str] | None = None,
    clock: PhaseClock | None = None,
) -> dict[str, torch.Tensor]:
    """Read this rank's part of every DTensor leaf of the entries to decode.

    With ``in_place``, a leaf whose target is a module's, EMA's or optimizer's own tensor
    of the stored shape and dtype with contiguous CPU local data is read straight into it
    (``targets.live_targets``), each block copied in only once its CRC32C passed; the
    address of every own target tensor this step holds a value for goes into ``touched``
    before anything is read, so a step that fails counts them as written. Every other
    leaf is read into a fresh tensor laid out like its target (a DTensor with the target's
    mesh and placements, so only the overlapping byte ranges are read) or, with no target,
    a full CPU tensor. Returns every leaf's tensor (a live target itself, or a fresh one).
    """
    step = manifest.step
    where = session.storage.describe(step)
    layout: split_index.Layout | None = None
    if split_index.is_split(manifest):
        # Split index: the layout now, the chunks of this rank's targets once they are known.
        layout = split_index.Layout.from_bytes(
            raw_index, f"{where}/{INDEX_FILE}", strided=split_index.is_strided_format(manifest)
        )
        index = ChunkIndex(tensors=layout.tensors, block=layout.block)
    else:
        index = ChunkIndex.from_bytes(raw_index, manifest.files, f"{where}/{INDEX_FILE}")
    leaves: dict[str, tuple[tuple[Any, ...], TensorEntry]] = {}
    kinds: dict[Any, str | None] = {}
    owners: dict[Any, Any] = {}
    for k, node in zip(keys, vals, strict=True):
        if wanted is not None and k not in wanted:
            continue
        if targets is not None and k not in targets:
            continue
        kind, inner = unwrap(node)
        kinds[k] = kind
        if isinstance(node, dict) and "owner" in node:
            owners[k] = node["owner"]
        dtensor_leaves(inner, (k,), index, leaves, where)
    own: set[str] | None = set() if in_place and targets is not None else None
    templates = targets_mod.restore_templates(leaves, targets, kinds, owners, own=own)
    # The box of the tensor each leaf is read into (integers only, a cache per shape,
    # mesh and placements): what the index is resolved for, and what read_into reads.
    geometry: dict[Any, targets_mod.Box] = {}
    boxes: dict[str, targets_mod.Box] = {}
    for n, (_, e) in leaves.items():
        try:
            boxes[n] = targets_mod.template_box(templates[n], e.shape, geometry)
        except StateMismatchError as err:  # before a byte is read: name the tensor
            raise StateMismatchError(f"{where}: {n}: {err}") from None
    if layout is not None:
        # Only the parts of the ranks that wrote what overlaps this rank's targets. Read
        # and checked before any tensor is made: the layout alone names the shapes, and
        # a tensor is allocated only once the chunks that fill it were found, each the
        # size of its box, inside its file and sharing no byte with another (issue 24 #7;
        # a hostile shape made the allocator raise before any chunk was looked at).
        read_part = split_index.part_reader(session.storage, step, manifest.files)
        index = layout.resolve(boxes, read_part, manifest.files, f"{where}/{INDEX_FILE}")
    live = targets_mod.live_targets(leaves, templates, own) if own else {}
    if touched is not None and own:
        # Every own tensor this step writes (in place here, or later by apply_state), by
        # address, before a byte is read: a step that fails leaves them "dirty" (reader.py).
        for name in own:
            loc = targets_mod.local_of(templates[name])
            if loc.numel():
                touched[loc.data_ptr()] = name
    with session.storage.range_reader(step, manifest.files) as reader:
        # Every file this rank reads is checked against its manifest size before any
        # target is made: chunks inside a forged size (rank table and index agreeing on a
        # 32 TiB tensor over a 256 KB file) must not get that tensor allocated first.
        reads = targets_mod.chunks_read(index, leaves, boxes)
        for name in sorted({c.file for _, _, c in reads}):
            reader.check_size(name)
        # Each chunk read is its shard file's own entry (byte range, dtype, shape): a small
        # read of each file's header, then a dict lookup a chunk.
        check_entries(reads, reader.read, where)
        flat = targets_mod.fresh_targets(leaves, templates, skip=live)
        flat.update(live)
        # Whole runs of a file with O_DIRECT, or box by box through the page cache: as the
        # store says or, measured, as its device reads faster (``extents``, ``iomode``).
        mode = reader.read_mode()
        mark(clock, "plan")
        t0 = time.perf_counter()
        nbytes = targets_mod.read_into(
            index,
            flat,
            reader.read,
            where,
            reader.read_into,
            live=live,
            boxes=boxes,
            direct_fd=reader.direct_fd if mode == "direct" else None,
        )
        if mode is not None:
            reader.record_read(mode, nbytes, time.perf_counter() - t0)
    mark(clock, "read")
    return flat


def read_blobs(session: Session, step: int) -> dict[str, bytearray]:
    """Rank 0's verified copy of every file of a replicated checkpoint, for broadcast."""
    manifest = session.storage.read_manifest(step)
    if manifest.sharded:
        raise StateMismatchError(
            f"{session.storage.describe(step)} is sharded: every rank reads its own shard, so "
            "restore it without broadcast=True"
        )
    blobs = {n: session.storage.read_file(step, n, e) for n, e in manifest.files.items()}
    blobs[_MANIFEST_BLOB] = bytearray(manifest.to_bytes())
    return blobs


def _blob_manifest(blobs: Mapping[str, bytearray]) -> Manifest:
    data = blobs.get(_MANIFEST_BLOB)
    if data is None:
        raise IntegrityError("rank 0 sent no manifest")
    return Manifest.from_bytes(bytes(data))

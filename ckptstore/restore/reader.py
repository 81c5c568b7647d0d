"""The read side of :class:`~ckptstore.manager.CheckpointManager`: restore, resume, load.

Restore is collective under torch.distributed: rank 0 lists the candidates (newest first),
every rank reads and verifies the step (or rank 0 reads and broadcasts, for node-local
disks), and a step that fails anywhere is skipped by all, so every rank ends on the same
checkpoint or raises the same error. Payload bytes reach a target's tensors only once their
checksum passed (per 4 MiB block); ``in_place=False`` keeps every target unchanged until
the whole step has been checked (at the cost of a second copy of the state in memory).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
from collections.abc import Iterable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

import torch

from .._log import logger as log
from ..codec import payload as payload_codec
from ..codec.tree import TreeDecoder, stored_tensors
from ..dist import Coordinator
from ..errors import (
    BarrierTimeout,
    CkptStoreError,
    IntegrityError,
    ManifestError,
    NoCheckpointError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from ..integrity import crc32c_of
from ..layout import state_file
from ..manifest import FileEntry, Manifest
from ..sharded import plan as sharding
from ..sharded.chunks import INDEX_FILE, ChunkIndex, TensorEntry
from ..state.capture import apply_state, capture, kind_of, precheck
from ..state.modules import EMA, rng_for_rank
from ..storage import Storage
from ..tiers import nodes
from ..tiers import twotier as tiers
from . import partial

__all__ = ["STATE_FORMAT", "Reader", "collect_targets"]

#: Version of the state.json tree format.
STATE_FORMAT = 1

_MANIFEST_BLOB = "manifest.json"
#: How often a restore looks for the new newest checkpoint when the one it was reading was
#: deleted under it; past that, a deleted step counts as a failed one.
_RELISTS = 16


class Reader:
    """Restore, resume and load; mixed into ``CheckpointManager``, which owns the state."""

    storage: Storage
    #: The replica tier's store (``replica=``), or None: restore takes steps from both.
    replica_storage: Storage | None
    coord: Coordinator
    root: str
    allow_pickle: bool
    _known_good: set[int]
    _known_bad: set[int]
    #: Node-local roots (see ``nodes``): whether the ranks' stores differ, and whether this
    #: rank is the lowest of those sharing its store (the one that writes it).
    _split: bool
    _node_leader: bool

    if TYPE_CHECKING:
        # Provided by CheckpointManager.
        def steps(self) -> list[int]:
            """Committed steps, ascending."""

        def wait_save(self) -> None:
            """Wait for an async save in flight."""

        def _check_open(self) -> None: ...
        def _raise_bg_error(self) -> None: ...
        def _resolve(self, step: int | None) -> int: ...

    def _layout_of(
        self, manifest: Manifest, rank: int, *, explicit: bool = False
    ) -> tuple[str, dict[str, list[str]]]:
        """The state file and payload files (by group) that ``rank`` reads.

        Per-rank state (``sharded=True`` without DTensors) is opaque: it restores only on
        the world size that saved it. Asking for one rank's part explicitly
        (``load(rank=r)``) is the only way to read it anywhere else.
        """
        where = self.storage.describe(manifest.step)
        per_rank = manifest.sharded and not manifest.dtensor
        if per_rank:
            if manifest.world_size != self.coord.world_size and not explicit:
                raise StateMismatchError(
                    f"{where} holds per-rank state saved with sharded=True by "
                    f"{manifest.world_size} ranks, and this job has {self.coord.world_size}: "
                    "each rank's part is opaque, so it restores only on the same world size. "
                    "Relaunch with that many ranks, or load(step, rank=r) to read one rank's "
                    "part (DTensor/FSDP2 state restores on any world size)"
                )
            if not 0 <= rank < manifest.world_size:
                raise StateMismatchError(
                    f"{where} has shards for ranks 0..{manifest.world_size - 1}, not {rank}"
                )
        want_rank = rank if per_rank else None
        groups: dict[str, list[str]] = {}
        for name, fe in manifest.files.items():
            if fe.codec != "json" and fe.rank == want_rank:
                groups.setdefault(payload_codec.group_of(name), []).append(name)
        sname = state_file(want_rank)
        if sname not in manifest.files:
            raise ManifestError(f"{where}: manifest lists no {sname}")
        return sname, groups

    def _decode(
        self, step: int, wanted: Iterable[Any] | None, **kw: Any
    ) -> tuple[dict[Any, Any], dict[Any, str | None]]:
        """:meth:`_decode_files`, with missing files of a node's partial copy named.

        A file missing from a node's copy of a step (see ``nodes``) is an ``IntegrityError``
        naming the ranks whose files live elsewhere.
        """
        try:
            return self._decode_files(step, wanted, **kw)
        except (FileNotFoundError, IntegrityError) as e:
            err = nodes.missing_error(self.storage, step, None, e)
            if err is e:
                raise
            raise err from e

    def _decode_files(
        self,
        step: int,
        wanted: Iterable[Any] | None,
        *,
        rank: int | None = None,
        blobs: Mapping[str, bytearray] | None = None,
        targets: Mapping[Any, Any] | None = None,
        strict: bool = True,
        in_place: bool | None = None,
        require: bool = False,
        touched: dict[int, str] | None = None,
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
        """
        explicit = rank is not None
        rank = self.coord.rank if rank is None else rank
        manifest = self.storage.read_manifest(step) if blobs is None else _blob_manifest(blobs)
        where = self.storage.describe(step)
        sname, groups = self._layout_of(manifest, rank, explicit=explicit)

        def fetch(name: str) -> bytearray:
            entry = manifest.files[name]
            if blobs is None:
                return self.storage.read_file(step, name, entry)
            data = blobs.get(name)
            if data is None or len(data) != entry.bytes or crc32c_of(data) != entry.crc32c:
                raise IntegrityError(f"{where}/{name}: broadcast copy does not match the manifest")
            return data

        raw = fetch(sname)
        try:
            tree = json.loads(bytes(raw).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise IntegrityError(f"{where}/{sname}: not valid JSON ({e})") from None
        if not isinstance(tree, dict) or tree.get("ckptstore_state") != STATE_FORMAT:
            raise IntegrityError(f"{where}/{sname}: not a ckptstore state (format {STATE_FORMAT})")
        root = tree.get("root")
        keys = root.get("keys") if isinstance(root, dict) else None
        vals = root.get("vals") if isinstance(root, dict) else None
        if not isinstance(keys, list) or not isinstance(vals, list) or len(keys) != len(vals):
            raise IntegrityError(f"{where}/{sname}: malformed root")
        wanted_set = None if wanted is None else set(wanted)
        if require and wanted_set is not None:
            absent = sorted((k for k in wanted_set if k not in keys), key=repr)
            if absent:
                raise StateMismatchError(
                    f"{where} holds no entries {absent}; it holds {keys}. Ask for those, or "
                    "load(step) for all of them"
                )
        into: dict[str, dict[str, torch.Tensor]] = {}
        if targets is not None:
            into = self._precheck(
                targets,
                keys=keys,
                vals=vals,
                where_state=f"{where}/{sname}",
                strict=strict,
                where=where,
            )
            if touched is not None:
                touched.update(_persistent_targets(targets, keys, vals))
            if in_place is False or manifest.dtensor:
                into = {}
        sharded_leaves: dict[str, torch.Tensor] = {}
        if manifest.dtensor:
            sharded_leaves = self._read_sharded(
                manifest, fetch(INDEX_FILE), keys, vals, wanted_set, targets
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
        if wanted_set is not None and blobs is None:
            everything = partial.tensor_refs(vals)
            needs = partial.tensor_refs(
                [v for k, v in zip(keys, vals, strict=True) if k in wanted_set]
            )
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
                    part = partial.read_some(self.storage, step, n, entry, some, into.get(group))
                elif blobs is None:
                    part = payload_codec.read_group(
                        self.storage,
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
        workers = getattr(self.storage, "read_concurrency", 1)
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
            allow_pickle=self.allow_pickle,
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
            kind, inner = _unwrap(node)
            value = dec.decode(inner, (k,))
            if kind == "optimizer" and targets is not None:
                value = self._indexed_optimizer(targets, k, node, value, where)
            if kind == "rng" and isinstance(value, dict):
                # A per-rank checkpoint keeps each rank's own stream in its own state file;
                # replicated and DTensor ones keep every rank's in rank 0's.
                index = 0 if manifest.sharded and not manifest.dtensor else rank
                target = targets.get(k) if targets is not None else None
                value = rng_for_rank(value, index, target=target, warn=targets is not None)
            out[k] = value
            kinds[k] = kind
        return out, kinds

    def _precheck(
        self,
        targets: Mapping[Any, Any],
        *,
        keys: list[Any],
        vals: list[Any],
        where_state: str,
        strict: bool,
        where: str,
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Check ``targets`` against the tree; map payload entries to target tensors."""
        nodes = dict(zip(keys, vals, strict=True))
        meta = TreeDecoder(None, allow_pickle=False, where=where_state, meta=True)
        shadow: dict[Any, Any] = {}
        kinds: dict[Any, str | None] = {}
        for k, node in nodes.items():
            kind, inner = _unwrap(node)
            kinds[k] = kind
            target = targets.get(k) if isinstance(k, str | int) else None
            if isinstance(target, torch.nn.Module | EMA):
                shadow[k] = meta.decode(inner, (k,))
            elif kind == "optimizer" and isinstance(target, torch.optim.Optimizer):
                # Name-keyed optimizer state (a DTensor save), checked as its optimizer
                # numbers it: groups by parameter name here, then shapes like any other.
                shadow[k] = self._indexed_optimizer(
                    targets, k, node, meta.decode(inner, (k,)), where
                )
            elif kind_of(target) == "stateful":  # an optimizer's param groups, say
                try:
                    shadow[k] = meta.decode(inner, (k,))
                except UnsafeCheckpointError:
                    shadow[k] = None  # holds a pickle: checked when loaded
            else:
                shadow[k] = None  # present; checked when loaded
        precheck(targets, shadow, kinds, strict=strict, where=where)
        into: dict[str, dict[str, torch.Tensor]] = {}
        for k, target in targets.items():
            if k not in nodes or kind_of(target) in (None, "rng"):
                continue  # plain values are replaced, never written into in place
            _, inner = _unwrap(nodes[k])
            collect_targets(inner, capture(target), into)
        return into

    def _indexed_optimizer(
        self, targets: Mapping[Any, Any], key: Any, node: Any, value: Any, where: str
    ) -> Any:
        """Name-keyed optimizer state as the target optimizer numbers its parameters."""
        target = targets.get(key)
        if not isinstance(target, torch.optim.Optimizer):
            return value
        at = f"{where}[{key!r}]"
        owner = node.get("owner") if isinstance(node, dict) else None
        model = targets.get(owner) if isinstance(owner, str | int) else None
        if model is None:
            found = sharding.owner_of(target, targets)
            model = targets.get(found) if found is not None else None
        if isinstance(model, EMA):
            model = model.module
        if not isinstance(model, torch.nn.Module):
            raise StateMismatchError(
                f"{at}: the optimizer state is keyed by parameter name; put the model that "
                f"owns its parameters in the state (it was saved as {owner!r})"
            )
        return sharding.indexed_optimizer_state(target, model, value, at)

    def _read_sharded(  # noqa: PLR0917 - private, one call site
        self,
        manifest: Manifest,
        raw_index: bytearray,
        keys: list[Any],
        vals: list[Any],
        wanted: set[Any] | None,
        targets: Mapping[Any, Any] | None,
    ) -> dict[str, torch.Tensor]:
        """Read this rank's part of every DTensor leaf of the entries to decode.

        Each leaf is read into a fresh tensor laid out like its target (a DTensor with the
        target's mesh and placements, so only the overlapping byte ranges are read) or, with
        no target, a full CPU tensor. Every block is checked before its bytes are copied.
        """
        step = manifest.step
        where = self.storage.describe(step)
        index = ChunkIndex.from_bytes(raw_index, manifest.files, f"{where}/{INDEX_FILE}")
        leaves: dict[str, tuple[tuple[Any, ...], TensorEntry]] = {}
        kinds: dict[Any, str | None] = {}
        owners: dict[Any, Any] = {}
        for k, node in zip(keys, vals, strict=True):
            if wanted is not None and k not in wanted:
                continue
            if targets is not None and k not in targets:
                continue
            kind, inner = _unwrap(node)
            kinds[k] = kind
            if isinstance(node, dict) and "owner" in node:
                owners[k] = node["owner"]
            _dtensor_leaves(inner, (k,), index, leaves, where)
        flat = sharding.restore_targets(leaves, targets, kinds, owners)
        with self.storage.range_reader(step, manifest.files) as reader:
            sharding.read_into(index, flat, reader.read, where)
        return flat

    def _read_blobs(self, step: int) -> dict[str, bytearray]:
        """Rank 0's verified copy of every file of a replicated checkpoint, for broadcast."""
        manifest = self.storage.read_manifest(step)
        if manifest.sharded:
            raise StateMismatchError(
                f"{self.storage.describe(step)} is sharded: every rank reads its own shard, so "
                "restore it without broadcast=True"
            )
        blobs = {n: self.storage.read_file(step, n, e) for n, e in manifest.files.items()}
        blobs[_MANIFEST_BLOB] = bytearray(manifest.to_bytes())
        return blobs

    def _vanished(self, step: int) -> bool:
        """Whether ``step`` is no longer committed: deleted (by retention), not corrupt."""
        try:
            return step not in self.storage.list_steps()
        except OSError:
            return False

    def _restore_steps(self) -> list[int]:
        """The committed steps a restore chooses from: both tiers' when there is a replica."""
        if self.replica_storage is None:
            return self.steps()
        return tiers.all_steps(self.storage, self.replica_storage)

    def _bring_local(self, step: int, *, replace: bool, broadcast: bool) -> None:
        """Make ``step`` readable from the local store, fetching it from the replica.

        Collective: rank 0 fetches first (on a shared filesystem that serves every rank),
        then every other rank fetches what its own (node-local) root still lacks, unless
        rank 0 alone reads (``broadcast``). Every rank raises rank 0's error alike. On
        node-local roots the lowest rank of each node fetches into its store (replacing a
        copy that failed, or that holds only some ranks' files), the others wait for it.
        """
        assert self.replica_storage is not None
        outcome: tuple[str, Any] = ("ok", None)
        if self.coord.is_leader:
            try:
                tiers.ensure_local(self.storage, self.replica_storage, step, replace=replace)
            except BaseException as e:
                outcome = ("error", e)
        status, value = self.coord.broadcast(outcome, "restore:fetch", step)
        if status == "error":
            raise value if isinstance(value, BaseException) else IntegrityError(str(value))
        if self._split:
            mine: tuple[str, Any] = ("ok", None)
            if self._node_leader and not self.coord.is_leader and not broadcast:
                try:
                    tiers.ensure_local(self.storage, self.replica_storage, step, replace=replace)
                except BaseException as e:
                    mine = ("error", e)
            every = self.coord.all_gather(mine, "restore:fetched", step)
            failed = [(r, v) for r, (st, v) in enumerate(every) if st == "error"]
            if failed:
                r, err = failed[0]
                raise err if isinstance(err, BaseException) else IntegrityError(f"rank {r}: {err}")
        elif not self.coord.is_leader and not broadcast:
            tiers.ensure_local(self.storage, self.replica_storage, step)

    def _written_by_rank0(self, step: int) -> bool:
        """Collective: whether ``step`` is a replicated save (rank 0's node alone holds it).

        On node-local roots such a step is read by rank 0 and broadcast to the others.
        """
        plain: tuple[str, Any] = ("ok", False)
        if self.coord.is_leader:
            # Unreadable: every rank reads its own copy, and the verdicts say why.
            with contextlib.suppress(OSError, CkptStoreError):
                plain = ("ok", not self.storage.read_manifest(step).sharded)
        _, value = self.coord.broadcast(plain, "restore:kind", step)
        return bool(value)

    def _candidates(self, step: int | None) -> list[int]:
        steps = self._restore_steps()
        if step is not None:
            if step not in steps:
                self._resolve(step)  # raises NoCheckpointError with context
            return [step]
        if not steps:
            raise NoCheckpointError(
                f"{self.root}: no committed checkpoint to restore; check the path, or use "
                "resume(), which starts from scratch on an empty store"
            )
        return list(reversed(steps))

    def restore(
        self,
        state: MutableMapping[Any, Any],
        step: int | None = None,
        *,
        strict: bool = True,
        broadcast: bool = False,
        in_place: bool | None = None,
    ) -> int:
        """Load a checkpoint into ``state`` in place; collective under torch.distributed.

        Rank 0 picks the step (the newest that verifies, or exactly ``step``) and every rank
        loads that one: each reads the files itself (shared storage), or with
        ``broadcast=True`` rank 0 reads them and sends them to the others (node-local
        disks). Every byte is checked against its checksum before it reaches ``state``; a
        checkpoint that fails on any rank is skipped by all (when ``step`` is None), while
        one deleted as it was read (a running job's retention) is not taken for corrupt: the
        newest is chosen again. Tensors go to CPU, then into each target's own device.

        By default payloads stream straight into the tensors of the modules, optimizers and
        EMA in ``state`` (where dtype, shape and layout match), each 4 MiB block checked
        before its bytes are copied: no second copy of the state in memory. Names, shapes
        and dtypes are checked before anything is read. The price: a block that fails is
        found after the blocks before it were copied. The fallback to an older checkpoint
        then overwrites every tensor the failed one wrote (if it holds no value for one of
        them, ``IntegrityError`` says which); when no checkpoint verifies, the
        ``NoCheckpointError`` leaves those tensors holding a mix of verified bytes of the
        steps tried and their previous values (see the README, "What a failed restore
        leaves").

        ``in_place=False`` keeps every target unchanged until the whole step has been read
        and checked (a full second copy of the state in memory); ``in_place=True`` also
        streams straight into the targets from old checkpoints whose manifests have no block
        CRCs (checked when each file's last byte is in).

        Returns:
            The restored step.

        Raises:
            NoCheckpointError: the store is empty, or nothing verifies.
            IntegrityError: the requested ``step`` is corrupt.
            StateMismatchError: the checkpoint does not fit the objects in ``state``; nothing
                in ``state`` changed.
            CommitError: the previous async save failed (raised on every rank).
            BarrierTimeout: a rank did not join in time.
        """
        self._check_open()
        self.wait_save()
        self.coord.barrier("restore:enter", step)
        keys = list(state.keys())
        listing: tuple[str, Any] = ("ok", None)
        if self.coord.is_leader:
            try:
                # A failed async save (only rank 0 writes) is raised on every rank, carried
                # by this first exchange, as save carries it by "save:enter".
                self._raise_bg_error()
                listing = ("ok", self._candidates(step))
            except BaseException as e:
                listing = ("error", e)
        status, value = self.coord.broadcast(listing, "restore:choose", step)
        if status == "error":
            raise value
        skipped: list[str] = []
        queue, bad, relists = list(value), set(), 0
        refetched: set[int] = set()
        dirty: dict[int, str] = {}  # target tensors a failed step may have written
        while queue:
            s = queue.pop(0)
            touched: dict[int, str] = {}
            stored: dict[Any, Any] | None = None
            kinds: dict[Any, str | None] = {}
            mine: tuple[str, Any] = ("ok", None)
            blobs: dict[str, bytearray] | None = None
            try:
                if self.replica_storage is not None:
                    try:
                        self._bring_local(s, replace=s in refetched, broadcast=broadcast)
                    except (IntegrityError, ManifestError):
                        # The replica's copy failed as it was fetched (every rank raises
                        # rank 0's error alike): no copy there to fall back on.
                        refetched.add(s)
                        raise
                if self._split and not broadcast and self._written_by_rank0(s):
                    send = True  # node-local roots: only rank 0's node holds this step
                else:
                    send = broadcast
                if send:
                    if self.coord.is_leader:
                        try:
                            blobs = self._read_blobs(s)
                        except BaseException:
                            self.coord.broadcast_bytes({}, "restore:broadcast", s)
                            raise
                    blobs = self.coord.broadcast_bytes(blobs, "restore:broadcast", s)
                    if not blobs:
                        raise IntegrityError(f"step {s}: rank 0 could not read it")
                stored, kinds = self._decode(
                    s,
                    keys,
                    blobs=blobs or None,
                    targets=state,
                    strict=strict,
                    in_place=in_place,
                    touched=touched,
                )
            except (IntegrityError, ManifestError) as e:
                mine = ("skip", e)
            except BarrierTimeout:
                raise
            except BaseException as e:
                mine = ("error", e)
            verdicts = self.coord.all_gather(mine, "restore:load", s)
            hard = [(r, v) for r, (st, v) in enumerate(verdicts) if st == "error"]
            soft = [(r, v) for r, (st, v) in enumerate(verdicts) if st == "skip"]
            if hard:
                r, err = hard[0]
                if r == self.coord.rank or not isinstance(err, CkptStoreError):
                    raise err
                raise type(err)(f"rank {r}: {err}")
            if soft and self.replica_storage is not None:
                # The local copy failed: rank 0 looks for the replica's, which replaces it
                # (rank 0 decides whether one was tried already, so every rank agrees).
                there: tuple[str, Any] = ("ok", False)
                if self.coord.is_leader and s not in refetched:
                    there = ("ok", tiers.on_replica(self.replica_storage, s))
                _, retry = self.coord.broadcast(there, "restore:replica", s)
                if retry:
                    why = "; ".join(f"rank {r}: {v}" for r, v in soft)
                    log.warning("step %d: the local copy failed (%s); using the replica's", s, why)
                    refetched.add(s)
                    queue.insert(0, s)
                    continue
            if soft and step is not None:
                # An explicit step: raised only once the replica's copy was tried too (above).
                r, err = soft[0]
                if r == self.coord.rank or not isinstance(err, CkptStoreError):
                    raise err
                raise type(err)(f"rank {r}: {err}")
            if soft and relists < _RELISTS:
                # Deleted while we read it (a running job's retention), not corrupt: rank 0
                # looks again, and every rank goes on with the new newest.
                again: tuple[str, Any] = ("ok", None)
                if self.coord.is_leader:
                    try:
                        if self._vanished(s):
                            again = ("ok", [c for c in self._candidates(None) if c not in bad])
                    except BaseException as e:
                        again = ("error", e)
                status, fresh = self.coord.broadcast(again, "restore:rechoose", s)
                if status == "error":
                    raise fresh
                if fresh is not None:
                    relists += 1
                    queue = fresh
                    continue
            if soft:
                dirty.update(touched)
                bad.add(s)
                # A save of this step (or of one after it, once training resumed before
                # it) replaces it; it does not count as the newest (see save()).
                self._known_bad.add(s)
                why = "; ".join(f"rank {r}: {v}" for r, v in soft)
                log.warning("skipping step %d: %s", s, why)
                skipped.append(f"step {s}: {why}")
                continue
            assert stored is not None
            self._known_good.add(s)
            self._known_bad.discard(s)
            try:
                apply_state(state, stored, kinds, strict=strict, where=self.storage.describe(s))
            except StateMismatchError as e:
                if in_place is False or not touched:
                    raise
                raise StateMismatchError(
                    f"{e}; but the tensors of the modules and optimizers in state were already "
                    f"read in place from step {s} (they hold its values). Restore with "
                    "in_place=False to keep every target unchanged when an entry refuses"
                ) from e
            left = sorted(name for i, name in dirty.items() if i not in touched)
            if left and in_place is not False:
                raise IntegrityError(
                    f"{self.storage.describe(s)} was restored, but {len(left)} tensors of state "
                    f"were partly written by a newer step that failed its checksum, and this "
                    f"step holds no value for them: {', '.join(left[:5])}. Restore with "
                    "in_place=False to keep every target unchanged until a step verifies"
                )
            return int(s)
        raise NoCheckpointError(
            f"{self.root}: no checkpoint verifies (`ckptstore verify --all` shows why); "
            "tried newest first: " + " | ".join(skipped)
        )

    def resume(
        self,
        state: MutableMapping[Any, Any],
        *,
        strict: bool = True,
        broadcast: bool = False,
        in_place: bool | None = None,
    ) -> int:
        """Restore the newest good checkpoint if there is one (collective).

        Returns:
            0 on an empty store, else the restored step + 1 (the next step to run).

        Raises:
            CommitError: the previous async save failed (raised on every rank).
            StateMismatchError, BarrierTimeout: as :meth:`restore`.
        """
        self._check_open()
        self.wait_save()
        listed: tuple[str, Any] = ("ok", None)
        if self.coord.is_leader:
            try:
                self._raise_bg_error()  # on every rank, as in restore
                listed = ("ok", not self._restore_steps())
            except BaseException as e:
                listed = ("error", e)
        status, empty = self.coord.broadcast(listed, "resume:list")
        if status == "error":
            raise empty
        if empty:
            return 0
        return self.restore(state, strict=strict, broadcast=broadcast, in_place=in_place) + 1

    def load(
        self,
        step: int | None = None,
        *,
        rank: int | None = None,
        keys: Iterable[Any] | None = None,
    ) -> dict[Any, Any]:
        """The stored state as plain data (modules as state dicts, tensors on CPU).

        Not collective. Without ``step``, the newest checkpoint that verifies (chosen again
        if the one being read is deleted meanwhile). ``rank`` picks the shard of a sharded
        checkpoint (default: this process's rank).

        ``keys`` asks for some top-level entries only (``keys=["model"]`` for evaluation):
        only the files they need are read, and of a file that also holds tensors of other
        entries only the byte ranges of theirs, each range checked against the manifest's
        per-block CRCs before it is used (locally, and as ranged GETs on object stores).
        A step is then judged by what was read: a corrupt file of an entry not asked for
        goes unnoticed (``verify`` checks everything).

        Raises:
            NoCheckpointError: nothing committed (or nothing that verifies).
            IntegrityError: the requested ``step`` is corrupt.
            StateMismatchError: an entry of ``keys`` is not in the checkpoint.
            TypeError: ``keys`` is a string (one entry is ``keys=["model"]``).
        """
        if isinstance(keys, str | bytes):
            msg = f"keys= takes a list of top-level entries, e.g. keys=[{keys!r}], not a string"
            raise TypeError(msg)
        wanted = None if keys is None else list(keys)
        skipped: list[str] = []
        queue, bad, relists = self._candidates(step), set(), 0
        refetched: set[int] = set()
        while queue:
            s = queue.pop(0)
            try:
                if self.replica_storage is not None:
                    try:
                        tiers.ensure_local(
                            self.storage, self.replica_storage, s, replace=s in refetched
                        )
                    except (IntegrityError, ManifestError):
                        refetched.add(s)  # the replica's copy failed: none to fall back on
                        raise
                out, _ = self._decode(s, wanted, rank=rank, require=True)
            except (IntegrityError, ManifestError) as e:
                if s not in refetched and tiers.on_replica(self.replica_storage, s):
                    log.warning("step %d: the local copy failed (%s); using the replica's", s, e)
                    refetched.add(s)
                    queue.insert(0, s)
                    continue
                if step is None and relists < _RELISTS and self._vanished(s):
                    # Deleted while we read it (a running job's retention), not corrupt.
                    relists += 1
                    queue = [c for c in self._candidates(None) if c not in bad]
                    continue
                if step is not None:
                    raise
                bad.add(s)
                self._known_bad.add(s)
                log.warning("skipping step %d: %s", s, e)
                skipped.append(f"step {s}: {e}")
                continue
            self._known_good.add(s)
            return out
        raise NoCheckpointError(
            f"{self.root}: no checkpoint verifies (`ckptstore verify --all` shows why); "
            "tried newest first: " + " | ".join(skipped)
        )

    # ---- verify / retention -------------------------------------------------------------


def _dtensor_leaves(  # noqa: PLR0917 - private recursion
    node: Any,
    path: tuple[Any, ...],
    index: ChunkIndex,
    out: dict[str, tuple[tuple[Any, ...], TensorEntry]],
    where: str,
    depth: int = 0,
) -> None:
    """Collect the DTensor leaves under ``node`` (name -> (path, index entry))."""
    if depth > 300:
        raise IntegrityError(f"{where}: state nested too deeply; the file is hostile")
    if isinstance(node, list):
        for i, x in enumerate(node):
            _dtensor_leaves(x, (*path, i), index, out, where, depth + 1)
        return
    if not isinstance(node, dict):
        return
    t = node.get("t")
    if t == "dtensor":
        name = node.get("name")
        entry = index.tensors.get(name) if isinstance(name, str) else None
        if entry is None or list(entry.shape) != node.get("shape"):
            raise IntegrityError(
                f"{where}: sharded tensor {name!r} at {path} is not in the chunk index as saved"
            )
        out[str(name)] = (path, entry)
    elif t in ("dict", "odict"):
        keys, vals = node.get("keys"), node.get("vals")
        if isinstance(keys, list) and isinstance(vals, list):
            for k, v in zip(keys, vals, strict=False):
                _dtensor_leaves(v, (*path, k), index, out, where, depth + 1)
    elif t == "tuple":
        vs = node.get("v")
        if isinstance(vs, list):
            for i, x in enumerate(vs):
                _dtensor_leaves(x, (*path, i), index, out, where, depth + 1)


def _unwrap(node: Any) -> tuple[str | None, Any]:
    if isinstance(node, dict) and node.get("t") == "stateful":
        kind = node.get("kind")
        return (kind if isinstance(kind, str) else "stateful"), node.get("v")
    return None, node


def _persistent_targets(
    targets: Mapping[Any, Any], keys: list[Any], vals: list[Any]
) -> dict[int, str]:
    """The tensors of modules, optimizers and EMA in ``targets`` this step holds a value for.

    Only those: their tensors are the objects' own memory, so what an in-place read writes
    into them stays. Other Stateful objects hand out copies (``state_dict()``), and what is
    written into a copy is gone with it.
    """
    nodes = dict(zip(keys, vals, strict=True))
    out: dict[str, dict[str, torch.Tensor]] = {}
    for k, target in targets.items():
        if k in nodes and isinstance(target, torch.nn.Module | torch.optim.Optimizer | EMA):
            collect_targets(_unwrap(nodes[k])[1], capture(target), out)
    return _names_of(out)


def _names_of(into: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[int, str]:
    """``address -> "group/key"`` of every target tensor of a read.

    By the address of its memory, not ``id``: a module's ``state_dict()`` makes new tensor
    objects (detached views) at every call.
    """
    return {t.data_ptr(): f"{g}/{k}" for g, ts in into.items() for k, t in ts.items() if t.numel()}


def _blob_manifest(blobs: Mapping[str, bytearray]) -> Manifest:
    data = blobs.get(_MANIFEST_BLOB)
    if data is None:
        raise IntegrityError("rank 0 sent no manifest")
    return Manifest.from_bytes(bytes(data))


def collect_targets(node: Any, current: Any, out: dict[str, dict[str, torch.Tensor]]) -> None:
    """Pair each tensor reference in ``node`` with the tensor at the same place in ``current``.

    ``current`` is a target's present state; the pairs let payloads be read straight into it.
    """
    if isinstance(node, list):
        if isinstance(current, list | tuple):
            for n, c in zip(node, current, strict=False):
                collect_targets(n, c, out)
        return
    if not isinstance(node, dict):
        return
    t = node.get("t")
    if t == "tensor" and isinstance(current, torch.Tensor):
        group, key = node.get("file"), node.get("key")
        if isinstance(group, str) and isinstance(key, str):
            out.setdefault(group, {})[key] = current
    elif t in ("dict", "odict") and isinstance(current, Mapping):
        keys, vals = node.get("keys"), node.get("vals")
        if isinstance(keys, list) and isinstance(vals, list):
            for k, v in zip(keys, vals, strict=False):
                if isinstance(k, str | int) and k in current:
                    collect_targets(v, current[k], out)
    elif t == "tuple" and isinstance(current, tuple | list):
        collect_targets(node.get("v"), list(current), out)

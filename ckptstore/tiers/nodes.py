"""Node-local roots: which ranks share a local store, and steps that hold some ranks' files.

Under torch.distributed every rank may pass its own ``root``: one shared filesystem, or a
disk per node (different paths stand for different nodes in tests). :func:`peers` finds out
which ranks see the same store, by writing a probe file and looking for the others' probes
(a path comparison would be wrong both ways: the same path on two nodes is two disks, and
two paths may be one mount). The lowest rank of each group writes its store (its lock, its
retention); the ranks of a sharded save write into their own group's tmp directory.

A step committed on node-local roots holds, on each node, the ranks' files written there,
every file of no rank (rank 0's plain state and chunk index, copied to every node at the
save) and the full manifest; a :data:`LOCAL_RANKS_NAME` marker says which ranks' files are
present (it carries a CRC32C of its body; a damaged one makes the step fail ``verify``, and
never reduces what is checked). ``verify`` checks the files present and names the ranks whose
files live elsewhere; a read that needs one of those fails with :func:`missing_error`
(restore then takes the step from the replica, or passes over it), never with a silent
partial result.
"""

from __future__ import annotations

import itertools
import json
import os
import uuid
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from .._log import logger as log
from ..codec import strictjson
from ..errors import ConfigError, IntegrityError
from ..integrity import crc32c_of, format_crc, parse_crc
from ..layout import LOCAL_RANKS_NAME, step_dirname
from ..manifest import FileEntry, Manifest
from ..storage import Pending, Storage

if TYPE_CHECKING:  # torch-free at import: the CLI's reading commands load this module
    from ..dist import Coordinator

__all__ = [
    "Links",
    "elsewhere",
    "leader_links",
    "local_ranks",
    "marker_bytes",
    "missing_error",
    "peers",
    "plain_blobs",
    "ranks_with_files",
    "write_marker",
    "write_plain",
]

#: A probe file's name prefix; a ``.ckptstore.`` name, so it never makes a root look foreign.
_PROBE = ".ckptstore.probe-"


#: A rank's place in the tree of node leaders: its parent (None for rank 0) and children.
Links = tuple[int | None, tuple[int, ...]]


def leader_links(leaders: Sequence[int]) -> dict[int, Links]:
    """A binomial tree over ``leaders`` (ascending, rank 0 first): each one's parent and children.

    The leader at index ``i > 0`` hangs under index ``i`` with its lowest set bit cleared,
    so rank 0 has ``ceil(log2 M)`` children for ``M`` leaders, any other at most as many,
    and a payload sent down the tree reaches every leader in ``ceil(log2 M)`` rounds.
    """
    out: dict[int, Links] = {}
    m = len(leaders)
    for i, rank in enumerate(leaders):
        parent = leaders[i & (i - 1)] if i else None
        low = i & -i if i else 1 << max(m - 1, 0).bit_length()
        kids = []
        bit = 1
        while bit < low and i + bit < m:
            kids.append(leaders[i + bit])
            bit <<= 1
        out[rank] = (parent, tuple(reversed(kids)))  # the largest subtree is sent first
    return out


def peers(storage: Storage, coord: Coordinator) -> tuple[list[int], Links | None]:
    """The ranks whose store is this rank's store (collective; this rank included).

    Rank 0 makes a probe directory in its root and sends its name; a rank that finds it in
    its own root shares rank 0's store. When every rank does (one shared store, the usual
    case) that is all: two exchanges whose size does not depend on the world size, and one
    lookup a rank. Otherwise (node-local roots) every rank makes a probe named with its rank
    and a token of this job, lists its own root once (a node's root holds its node's probes)
    and sends rank 0 what it saw; rank 0 checks that the views agree. Object stores (no
    rename: a URL names one store wherever it is opened) are shared by every rank.

    It replaced an exchange of every rank's probe name and view with every rank, after which
    each rank looked for N probes and compared N views of N ranks: O(N) bytes a rank, N^2
    lookups on a shared filesystem, and O(N^3) CPU (hours at 16,384 ranks).

    On node-local roots, rank 0 also sends each node's leader (its lowest rank) its place
    in a tree of the leaders (:func:`leader_links`, ``init:tree``: one slot a rank), down
    which a sharded save sends the files every node's copy needs (``save:prepared``).

    Returns:
        The ranks sharing this rank's store, and this rank's :data:`Links` in the tree of
        node leaders (None on a shared store, and on a rank that leads no node).

    Raises:
        ConfigError: the views disagree (rank A sees rank B's probe, B does not see A's): the
            roots are neither one shared store nor disjoint ones.
        OSError: the probe could not be written (the root is read-only, say): on every
            rank, rank 0's.
    """
    if not coord.enabled:
        return [0], None
    if not storage.atomic_rename:  # an object store (a local path is the only other kind)
        return list(range(coord.world_size)), None
    token = uuid.uuid4().hex

    def probe() -> str:
        name = f"{_PROBE}{token}"
        _make_probe(storage, name)
        return name

    # Rank 0's failure to make its probe (a read-only root) is raised on every rank at
    # once: the others waited in the broadcast until barrier_timeout (found by review).
    first = coord.leader_value(probe, "init:probe")
    try:
        shared = coord.reduce(coord.is_leader or storage._exists(first), all, "init:shared")
    finally:
        if coord.is_leader:
            _remove_probe(storage, first)
    if shared:
        return list(range(coord.world_size)), None
    # Node-local roots: each rank's own probe, found by the ranks of its node.
    prefix = f"{first}-r"
    mine = f"{prefix}{coord.rank}"
    _make_probe(storage, mine)
    try:
        coord.barrier("init:probes")  # every probe exists before any root is listed
        view = sorted(
            int(n[len(prefix) :])
            for n in os.listdir(storage.root)
            if n.startswith(prefix) and n[len(prefix) :].isdigit()
        )
        # Every rank has listed its root once the verdict arrives: the probes may go.
        views: list[list[int]] = []  # rank 0's, from the check

        def check(every: list[list[int]]) -> None:
            _agreeing(every)
            views.extend(every)

        coord.reduce(view, check, "init:peers")
    finally:
        _remove_probe(storage, mine)
    tree = None
    if coord.is_leader:
        links = leader_links(sorted({min(v) for v in views}))
        tree = [links.get(r) for r in range(coord.world_size)]
    return view, coord.scatter(tree, "init:tree")


def _make_probe(storage: Storage, name: str) -> None:
    # A directory, made with the root where that is still missing, and nothing fsynced: the
    # probe is gone before the constructor returns (the first save makes the root durable),
    # so the other ranks never wait on this rank's disk. A root made here stays: removing it
    # once empty raced with a peer that, past the exchange, was already taking the store's
    # lock in it (its open failed with ENOENT).
    os.makedirs(os.path.join(storage.root, name))


def _remove_probe(storage: Storage, name: str) -> None:
    try:
        os.rmdir(os.path.join(storage.root, name))
    except OSError as e:
        log.warning("could not remove the probe %s: %s", name, e)


def _agreeing(views: list[list[int]]) -> None:
    """Rank 0's check of every rank's view (the ranks whose probes its root holds).

    Work: the sum of the views' sizes (each distinct view is compared with its members').

    Raises:
        ConfigError: two views disagree, or a rank does not see its own probe.
    """
    for r, view in enumerate(views):
        if r not in view:
            msg = (
                f"rank {r} does not see its own probe in its root (it sees the stores of "
                f"rank(s) {view}): its root is not a directory it can list"
            )
            raise ConfigError(msg)
    checked: set[tuple[int, ...]] = set()
    for r, view in enumerate(views):
        key = tuple(view)
        if key in checked:
            continue
        checked.add(key)
        for other in view:
            if views[other] != view:
                msg = (
                    f"rank {r} sees the store of rank(s) {view} at its root, rank {other} sees "
                    f"{views[other]}: the ranks' roots must be one shared store or one store "
                    "per node, each seen alike by the ranks of that node"
                )
                raise ConfigError(msg)


def plain_blobs(pending: Pending, files: Mapping[str, FileEntry]) -> dict[str, bytes]:
    """The files of no rank written into ``pending`` (rank 0's plain state, the chunk index).

    Read back from rank 0's tmp directory, checked against their entries, to be copied into
    every other node's copy of the step.

    Raises:
        IntegrityError: a file does not read back as written.
    """
    out: dict[str, bytes] = {}
    storage = pending.storage
    for name, entry in files.items():
        if entry.rank is not None:
            continue
        with storage._open_read(f"{pending.dirname}/{name}") as f:
            data = f.read(entry.bytes + 1)
        if len(data) != entry.bytes or crc32c_of(data) != entry.crc32c:
            raise IntegrityError(f"{pending.dirname}/{name}: does not read back as written")
        out[name] = data
    return out


def write_plain(
    pending: Pending, files: Mapping[str, FileEntry], blobs: Mapping[str, bytes]
) -> None:
    """Write rank 0's ``blobs`` into this node's ``pending`` copy, checked against ``files``.

    Raises:
        IntegrityError: a blob is not what the manifest says.
        OSError: writing failed.
    """
    for name, data in blobs.items():
        entry = files[name]
        with pending.open(name, codec=entry.codec, compression=entry.compression, rank=None) as w:
            w.write(data)
        got = pending.files[name]
        if (got.bytes, got.crc32c) != (entry.bytes, entry.crc32c):
            raise IntegrityError(
                f"{pending.dirname}/{name}: the copy of rank 0's file does not match the manifest"
            )


def marker_bytes(ranks: Collection[int], world_size: int) -> bytes:
    """The ``local-ranks`` marker of a copy holding the files of ``ranks``.

    ``{"ranks": [...], "world_size": N, "checksum": "<crc32c>"}``: the checksum is the
    CRC32C of the canonical body (sorted keys, no whitespace) without it, as a manifest's.
    """
    body = {"ranks": sorted(ranks), "world_size": world_size}
    doc = dict(body, checksum=format_crc(crc32c_of(_canonical(body))))
    return json.dumps(doc).encode() + b"\n"


def write_marker(pending: Pending, ranks: Collection[int], world_size: int) -> None:
    """Mark ``pending`` as holding the files of ``ranks`` only (before its commit)."""
    body = marker_bytes(ranks, world_size)
    pending.storage._put_small(f"{pending.dirname}/{LOCAL_RANKS_NAME}", body)


#: More than any marker the writer makes (a rank list of a 16,384-rank node is ~100 KB).
_MARKER_MAX = 1 << 22


def local_ranks(storage: Storage, step: int, manifest: Manifest | None = None) -> list[int] | None:
    """The ranks whose files the committed ``step`` holds here; ``None``: every rank's.

    ``None`` only when the step has no marker. A marker that cannot be read, does not parse,
    fails its checksum, or says something impossible (a rank outside the world, a world
    size other than ``manifest``'s) raises: it is never taken as "no rank's files are here",
    which would switch off the checks of every rank's files. Markers of older versions (no
    checksum) are read strictly: exactly their two fields, well-formed.

    Raises:
        IntegrityError: the marker is damaged; the message names it and says why.
    """
    rel = f"{step_dirname(step)}/{LOCAL_RANKS_NAME}"
    where = storage.describe(step, LOCAL_RANKS_NAME)
    try:
        if not storage._exists(rel):
            return None
        with storage._open_read(rel) as f:
            data = f.read(_MARKER_MAX + 1)
    except OSError as e:
        raise IntegrityError(f"{where}: the node-local marker is unreadable ({e})") from e
    if len(data) > _MARKER_MAX:
        raise IntegrityError(f"{where}: the node-local marker is over {_MARKER_MAX} bytes")
    ranks, world = _parse_marker(data, where)
    if manifest is not None and world != manifest.world_size:
        raise IntegrityError(
            f"{where}: the node-local marker is corrupt (a world of {world} ranks, the "
            f"manifest's is of {manifest.world_size})"
        )
    return ranks


def _parse_marker(data: bytes, where: str) -> tuple[list[int], int]:
    """``(ranks, world_size)`` of a marker's bytes, checked; else ``IntegrityError``."""
    bad = f"{where}: the node-local marker is corrupt"
    try:
        doc = strictjson.loads(data, object_pairs_hook=_unique)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise IntegrityError(f"{bad} (not valid JSON: {e})") from None
    if not isinstance(doc, dict):
        raise IntegrityError(f"{bad} (not a JSON object)")
    keys = set(doc)
    if keys not in ({"ranks", "world_size"}, {"ranks", "world_size", "checksum"}):
        raise IntegrityError(f"{bad} (its fields are {sorted(keys)})")
    if "checksum" in doc:
        body = {"ranks": doc["ranks"], "world_size": doc["world_size"]}
        try:
            stored = parse_crc(doc["checksum"])
            actual = crc32c_of(_canonical(body))
        except ValueError as e:
            raise IntegrityError(f"{bad} ({e})") from None
        if stored != actual:
            raise IntegrityError(
                f"{bad} (its crc32c {format_crc(actual)} does not match its checksum "
                f"{format_crc(stored)})"
            )
    ranks, world = doc["ranks"], doc["world_size"]
    if not (isinstance(world, int) and not isinstance(world, bool) and world >= 1):
        raise IntegrityError(f"{bad} (world_size {world!r})")
    if not (
        isinstance(ranks, list)
        and ranks
        and all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world for r in ranks)
        and all(a < b for a, b in itertools.pairwise(ranks))
    ):
        raise IntegrityError(
            f"{bad} (ranks {str(ranks)[:80]}: not ascending ranks of a world of {world})"
        )
    return ranks, world


def _canonical(body: Mapping[str, object]) -> bytes:
    """The bytes a marker's checksum covers (as a manifest's: sorted keys, no whitespace)."""
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _unique(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise IntegrityError(f"duplicate key {k!r}")  # a ValueError: reported as not JSON
        out[k] = v
    return out


def ranks_with_files(manifest: Manifest) -> list[int]:
    """The ranks that wrote files of ``manifest`` (files of no rank count as rank 0's)."""
    return sorted({0 if e.rank is None else e.rank for e in manifest.files.values()})


def elsewhere(manifest: Manifest, present: Collection[int] | None) -> list[int]:
    """The ranks with files in ``manifest`` whose files this copy lacks (``present`` ranks)."""
    if present is None:
        return []
    return sorted({e.rank for e in manifest.files.values() if e.rank is not None} - set(present))


#: What a restore of a node's partial copy can do instead (:func:`missing_error`).
RESTORE_ADVICE = (
    "Restore it with the ranks of that save, or give the manager its replica (replica=...)"
)


def missing_error(
    storage: Storage,
    step: int,
    manifest: Manifest | None,
    cause: BaseException,
    *,
    advice: str = RESTORE_ADVICE,
) -> BaseException:
    """The error for a read of ``step`` that found a file missing.

    On a node's partial copy: an ``IntegrityError`` naming the ranks whose files live on
    other nodes (restore passes over the step, or takes it from the replica); else ``cause``
    (also for an ``IntegrityError`` that names no file of those ranks: a corrupt file). A
    damaged marker makes it an ``IntegrityError`` naming the marker: the step is corrupt.
    """
    try:
        present = local_ranks(storage, step)
    except IntegrityError as e:
        return IntegrityError(f"{e}; the read found: {cause}")
    if present is None:
        return cause
    if manifest is None:
        try:
            manifest = storage.read_manifest(step)
        except Exception:
            return cause
    away = elsewhere(manifest, present)
    if isinstance(cause, IntegrityError):
        # Only a file of a rank whose files live elsewhere; a bad file of its own is corrupt.
        names = [n for n, e in manifest.files.items() if e.rank in away]
        if not any(f"/{n}:" in str(cause) or f"/{n} " in str(cause) for n in names):
            return cause
    return IntegrityError(
        f"{storage.describe(step)} on this node holds only rank(s) {present}'s files (node-local "
        f"roots); the read needs files of rank(s) {away}, which live on the other nodes' local "
        f"roots ({cause}). {advice}"
    )

"""The rank table of a format-4 checkpoint: each rank's files, one fixed-width line a rank.

A sharded save on N ranks writes a file or two a rank. Listed in ``manifest.json`` they made
it grow with N (about 270 bytes a rank, more with the per-block CRCs of large shards: 64 MiB,
the most a manifest may hold, at about 16,000 ranks of 1 GB shards), and every restoring rank
read it whole. In format 4 the manifest lists the files of no rank, and ``_ranks.jsonl``
(itself one of them, with its size and CRC32C) holds a line a rank::

    {"crc32c":"1f2e3d4c","files":{"_index.rank00003.json":{...},...},"rank":3}      (newline)

padded with spaces to the table's ``width``, so rank ``r``'s line is the byte range
``[r * width, (r + 1) * width)``. Each line carries the CRC32C of its canonical body
(``files`` and ``rank``), so a restoring rank reads and checks the lines of the ranks it reads
from, and nothing else of the table; :func:`expand` reads it whole (verify, uploads, listings)
and checks it against the manifest's CRC32C as well. A rank's files are named with its rank
(``*.rankNNNNN.*``), so a file's line is known from its name.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .codec import strictjson
from .errors import CkptStoreError, CommitError, IntegrityError, ManifestError
from .integrity import crc32c_of, format_crc, parse_crc
from .layout import step_dirname
from .manifest import (
    MAX_RANK_LINE,
    RANK_TABLE_NAME,
    FileEntry,
    Manifest,
    RankTable,
    file_entry_from_json,
    validate_payload_name,
)

__all__ = ["RankFiles", "encode", "expand", "lean", "parse_line", "rank_of"]

_RANK_RE = re.compile(r"\.rank(\d{5,8})\.")


def rank_of(name: str) -> int | None:
    """The rank a per-rank file's name carries (``_shards.rank00003.safetensors`` -> 3)."""
    m = _RANK_RE.search(name)
    return None if m is None else int(m.group(1))


def _canonical(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def encode(rows: Mapping[int, Mapping[str, FileEntry]], count: int) -> tuple[bytes, RankTable]:
    """The table of ``count`` ranks' files (``rows``: rank -> its files), and its shape.

    Raises:
        ValueError: a file listed under a rank that its entry or its name does not carry.
        CommitError: a line longer than a reader accepts (:data:`MAX_RANK_LINE`).
    """
    lines = []
    for r in range(count):
        files = rows.get(r, {})
        for name, e in files.items():
            if e.rank != r or rank_of(name) != r:
                raise ValueError(f"{name} (rank {e.rank}) listed under rank {r}")
        body = {"files": {n: e.to_json() for n, e in sorted(files.items())}, "rank": r}
        line = dict(body, crc32c=format_crc(crc32c_of(_canonical(body))))
        lines.append(json.dumps(line, sort_keys=True, separators=(",", ":")).encode())
    width = max((len(x) for x in lines), default=0) + 1
    if width > MAX_RANK_LINE:  # never commit a step that no reader would open
        raise CommitError(
            f"a rank's line of the rank table would take {width} bytes, more than the "
            f"{MAX_RANK_LINE} a reader accepts: a rank wrote too many files or blocks"
        )
    data = b"".join(x.ljust(width - 1) + b"\n" for x in lines)
    return data, RankTable(count, width)


def parse_line(data: bytes | bytearray | memoryview, rank: int, where: str) -> dict[str, FileEntry]:
    """Rank ``rank``'s files from its line of the table, checked against the line's CRC32C.

    Raises:
        IntegrityError: the line is not rank ``rank``'s, is malformed, or fails its CRC.
    """
    what = f"{where} line {rank}"
    try:
        doc = strictjson.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise IntegrityError(f"{what}: not valid JSON ({e}); the table is corrupt") from None
    if not isinstance(doc, dict) or set(doc) != {"crc32c", "files", "rank"}:
        raise IntegrityError(f"{what}: not a line of a rank table; the table is corrupt")
    body = {"files": doc["files"], "rank": doc["rank"]}
    try:
        crc = parse_crc(doc["crc32c"])
        ok = crc32c_of(_canonical(body)) == crc
    except (ValueError, TypeError):
        ok = False
    if not ok:
        raise IntegrityError(f"{what}: fails its CRC32C; the table is corrupt")
    if doc["rank"] != rank or not isinstance(doc["files"], dict):
        raise IntegrityError(f"{what}: holds rank {doc['rank']!r}'s files; the table is corrupt")
    out: dict[str, FileEntry] = {}
    try:
        for name, row in doc["files"].items():
            validate_payload_name(name)
            entry = file_entry_from_json(row, f"{what}: file {name!r}")
            if entry.rank != rank or rank_of(name) != rank:
                raise ManifestError(f"{what}: file {name!r} is not rank {rank}'s")
            out[name] = entry
    except ManifestError as e:
        raise IntegrityError(f"{e}; the table is corrupt or hostile") from None
    return out


def expand(manifest: Manifest, data: bytes | bytearray, where: str) -> Manifest:
    """``manifest`` with every rank's files from its whole table ``data`` (already checked).

    Raises:
        IntegrityError: a line is malformed, or a name is listed twice.
    """
    table = manifest.rank_table
    if table is None:
        return manifest
    if len(data) != table.count * table.width:
        raise IntegrityError(f"{where}: {len(data)} bytes, the manifest says more")
    files = manifest.plain_files()
    view = memoryview(data)
    for r in range(table.count):
        _add_line(files, parse_line(view[r * table.width : (r + 1) * table.width], r, where), where)
    return dataclasses.replace(manifest, files=files, complete=True)


def _add_line(files: dict[str, FileEntry], line: Mapping[str, FileEntry], where: str) -> None:
    for name, e in line.items():
        if name in files:
            raise IntegrityError(f"{where}: {name} is listed twice; the table is corrupt")
        files[name] = e


class RankFiles(Mapping[str, FileEntry]):
    """The files of a format-4 step, each rank's line read from the table when first asked.

    ``head``: the files of no rank (the manifest's). Looking a rank's file up reads that rank's
    line (``read_line(rank)``, checked); iterating reads them all (``read_all``), so code that
    walks every file sees every file.
    """

    def __init__(
        self,
        head: Mapping[str, FileEntry],
        count: int,
        read_line: Callable[[int], dict[str, FileEntry]],
        read_all: Callable[[], Mapping[str, FileEntry]],
    ) -> None:
        self.head = dict(head)
        self._count = count
        self._read_line = read_line
        self._read_all = read_all
        self._lines: dict[int, dict[str, FileEntry]] = {}
        self._all: Mapping[str, FileEntry] | None = None
        #: Lines read so far (rank -> its files): what a restore needed of the table.
        self.lines_read = 0

    def __getitem__(self, name: str) -> FileEntry:
        if name in self.head:
            return self.head[name]
        if self._all is not None:
            return self._all[name]
        r = rank_of(name)
        if r is None or not 0 <= r < self._count:
            raise KeyError(name)
        line = self._lines.get(r)
        if line is None:
            line = self._lines[r] = self._read_line(r)
            self.lines_read += 1
        return line[name]

    def _every(self) -> Mapping[str, FileEntry]:
        if self._all is None:
            self._all = self._read_all()
        return self._all

    def __iter__(self) -> Iterator[str]:
        return iter(self._every())

    def __len__(self) -> int:
        return len(self._every())


def read_table(storage: Any, manifest: Manifest) -> Manifest:
    """``manifest`` (just read from ``storage``) with its rank table read whole and checked.

    Raises:
        ManifestError: the table is missing, unreadable or corrupt (the step cannot be
            trusted, as with a corrupt manifest).
    """
    table = manifest.rank_table
    if table is None:
        return manifest
    step = manifest.step
    where = storage.describe(step, RANK_TABLE_NAME)
    try:
        return _stream_table(storage, manifest, table, where)
    except (OSError, CkptStoreError) as e:
        if isinstance(e, ManifestError):
            raise
        from .storage.reach import unanswered  # storage imports this module

        refused = unanswered(storage, e, RANK_TABLE_NAME)  # the store's, not the step's
        if refused is not None:
            raise refused from e
        said = str(e)
        raise ManifestError(said if said.startswith(where) else f"{where}: {said}") from None


def _stream_table(storage: Any, manifest: Manifest, table: RankTable, where: str) -> Manifest:
    """:func:`expand` of the table as it streams in, one line in memory at a time.

    Read whole first, a table a forged manifest declared at 192 ranks of 16 MiB (a sparse
    file on disk: no space used) cost ``ls`` and ``verify`` 3 GiB of memory and seconds of
    reading before its CRC failed (found by review). A line is parsed, and its CRC checked,
    as soon as its last byte arrives: the first bad one ends the read.
    """
    files = manifest.plain_files()
    line = bytearray()
    rank = 0

    def consume(offset: int, chunk: memoryview) -> None:
        nonlocal rank
        del offset  # slices come in order (stream_file)
        while chunk:
            take = table.width - len(line)
            line.extend(chunk[:take])
            chunk = chunk[take:]
            if len(line) == table.width:
                _add_line(files, parse_line(line, rank, where), where)
                line.clear()
                rank += 1

    storage.stream_file(manifest.step, RANK_TABLE_NAME, manifest.files[RANK_TABLE_NAME], consume)
    if rank != table.count or line:
        raise IntegrityError(f"{where}: {rank} whole lines, the manifest says {table.count}")
    return dataclasses.replace(manifest, files=files, complete=True)


def lean(storage: Any, manifest: Manifest) -> Manifest:
    """``manifest`` whose rank files are looked up line by line (:class:`RankFiles`).

    What a restoring rank reads of the table: the lines of the ranks whose files it reads
    (``table.width`` bytes each), each checked against its own CRC32C, not the whole table.
    """
    table = manifest.rank_table
    if table is None:
        return manifest
    step = manifest.step
    where = storage.describe(step, RANK_TABLE_NAME)
    rel = f"{step_dirname(step)}/{RANK_TABLE_NAME}"

    def read_line(rank: int) -> dict[str, FileEntry]:
        try:
            with storage._open_read(rel) as f:
                f.seek(rank * table.width)
                data = f.read(table.width)
        except OSError as e:
            from .storage.reach import unanswered  # storage imports this module

            refused = unanswered(storage, e, rel)  # the store's, not the step's
            if refused is not None:
                raise refused from e
            raise IntegrityError(f"{where}: unreadable ({e})") from None
        if len(data) != table.width:
            raise IntegrityError(f"{where}: line {rank} is cut short; the table is truncated")
        return parse_line(data, rank, where)

    def read_all() -> Mapping[str, FileEntry]:
        try:
            return read_table(storage, manifest).files
        except ManifestError as e:
            raise IntegrityError(str(e)) from None

    files = RankFiles(manifest.plain_files(), table.count, read_line, read_all)
    return dataclasses.replace(manifest, files=files, complete=False)

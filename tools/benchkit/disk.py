"""Disk helpers of the bench: fsync, cold caches (posix_fadvise + mincore), O_DIRECT probe."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

ALIGN = 4096  # O_DIRECT: offsets, lengths and buffer addresses aligned to this
CHUNK = 32 << 20  # raw writes and reads go in slices of this size


def dma_buffer(size: int = CHUNK) -> mmap.mmap:
    """A page-aligned buffer for the raw O_DIRECT contenders, on transparent huge pages
    where the kernel gives them (ckptstore's own ``directio.new_buffer``), every page
    touched.

    The raw contenders are the disk's best. A request's size is capped by the device's
    segment count (``/sys/block/*/queue/max_segments``: 254 on the test VM's virtio disk),
    and each physically discontiguous 4 KiB page is a segment of its own. Measured there
    (session 20), 768 MB in 32 MiB slices: from 4 KiB pages the requests averaged 570-740
    KiB, and the bytes took 0.44-0.47 s to write and 0.62-0.75 s to read; from 2 MiB pages
    3.8-3.9 MiB, 0.24 s and 0.28 s. Which pages a plain buffer got was decided once per
    process: the "fast and slow modes of the disk" that earlier runs saw between jobs.
    """
    from ckptstore.storage.directio import new_buffer

    buf = new_buffer(size)
    for off in range(0, size, mmap.PAGESIZE):
        buf[off] = 0
    return buf


def huge_share(buf: mmap.mmap) -> float:
    """The share of ``buf`` on huge pages (``AnonHugePages`` of its mapping), 0.0 unknown."""
    anchor = ctypes.c_char.from_buffer(buf)
    try:
        address = ctypes.addressof(anchor)
    finally:
        del anchor
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0.0
    inside = False
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, _, hi = head.partition("-")
            inside = int(lo, 16) <= address < int(hi, 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024 / len(buf)
    return 0.0


def fill_buffer(buf: mmap.mmap, tensors: Any) -> None:
    """Fill the aligned buffer ``buf`` (:data:`CHUNK` bytes) with the bytes of ``tensors``,
    random bytes after them: real state bytes, so nothing could compress zeros."""
    import torch

    dst = torch.frombuffer(buf, dtype=torch.uint8)
    pos = 0
    for t in tensors:
        src = t.detach().contiguous().reshape(-1).view(torch.uint8)
        n = min(len(src), CHUNK - pos)
        dst[pos : pos + n].copy_(src[:n])
        pos += n
        if pos == CHUNK:
            break
    if pos < CHUNK:
        dst[pos:].random_()
    del dst


def odirect_write(path: Path, buf: mmap.mmap, nbytes: int) -> None:
    """Write ``nbytes`` (a multiple of :data:`ALIGN`) to a new file ``path`` with O_DIRECT,
    :data:`CHUNK` at a time from the aligned buffer ``buf``, then fsync it."""
    mv = memoryview(buf)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    try:
        left = nbytes
        while left:
            n = os.write(fd, mv[: min(left, CHUNK)])
            if n <= 0 or n % ALIGN:
                msg = f"short O_DIRECT write ({n} bytes)"
                raise OSError(msg)
            left -= n
        os.fsync(fd)
    finally:
        os.close(fd)
        mv.release()


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory, deepest first."""
    dirs = []
    for here, _, files in os.walk(root):
        for f in files:
            fsync_file(Path(here, f))
        dirs.append(Path(here))
    for d in reversed(dirs):
        fsync_dir(d)


def tree_files(root: Path) -> list[Path]:
    return [Path(here, f) for here, _, files in os.walk(root) for f in files]


def du(root: Path) -> int:
    return sum(p.stat().st_size for p in tree_files(root))


def remove(path: Path) -> None:
    """Delete after a measurement, and let the filesystem settle before the next one."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    os.sync()
    time.sleep(0.2)


_libc: Any = None


def _load_libc() -> Any:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = lib
    return _libc


def resident_bytes(path: Path) -> int | None:
    """How many bytes of ``path`` sit in the page cache (mincore), or None if unknown."""
    size = path.stat().st_size
    if size == 0:
        return 0
    try:
        lib = _load_libc()
    except (OSError, AttributeError):
        return None
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            if lib.mincore(addr, size, vec) != 0:
                return None
            return min(size, (pages - bytes(vec).count(0)) * page)
        finally:
            lib.munmap(addr, size)
    finally:
        os.close(fd)


def drop_cache(root: Path) -> float | None:
    """fsync and evict every file under ``root`` (a directory or one file) from the page
    cache; the fraction of its bytes still resident afterwards (None: unknown, or no bytes)."""
    files = tree_files(root) if root.is_dir() else [root]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    total = resident = 0
    for f in files:
        r = resident_bytes(f)
        if r is None:
            return None
        total += f.stat().st_size
        resident += r
    return resident / total if total else None


def df_info(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"path": str(path)}
    try:
        res = subprocess.run(
            ["df", "-T", str(path)], capture_output=True, text=True, timeout=10, check=False
        )
        fields = res.stdout.strip().splitlines()[-1].split()
        out.update(device=fields[0], fstype=fields[1], mount=fields[-1])
    except (OSError, IndexError, subprocess.SubprocessError) as e:
        out["df_error"] = str(e)
    st = os.statvfs(path)
    out.update(block_size=st.f_bsize, free_bytes=st.f_bavail * st.f_frsize)
    return out


def probe_odirect(work: Path) -> tuple[bool, str]:
    """Whether O_DIRECT works in ``work`` (tmpfs and some FUSE filesystems refuse it)."""
    if not hasattr(os, "O_DIRECT"):
        return False, "os.O_DIRECT does not exist on this platform"
    path = work / ".odirect-probe"
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False, f"O_DIRECT refused by the filesystem ({e})"
        return False, f"O_DIRECT probe failed ({e})"
    finally:
        buf.close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return True, "ok"

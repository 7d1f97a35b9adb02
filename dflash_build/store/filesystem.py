"""The filesystem under the store: its type, its free space, and its failures as one line each.

A network filesystem (NFS, Lustre, GPFS, CIFS, FUSE shares) changes how the row index may lock: SQLite's
WAL keeps its index in shared memory that only one host sees (:mod:`dflash_build.store.rowindex`). A
full disk or a store this process cannot write is an ordinary event of a day-long run, not a bug: it is
reported as :class:`StoreFault`, one line that names the path, the filesystem, its free space and what
to do, and the work done so far stays (the journal keeps finished rows).
"""

from __future__ import annotations

import errno
import os
import sqlite3
import tempfile
from dataclasses import dataclass
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")
# Filesystems whose files several hosts share: no host's shared memory or local locks reach the others.
NETWORK_TYPES = frozenset(
    {"nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "ceph", "beegfs", "glusterfs", "9p", "afs"}
    | {"panfs", "wekafs", "orangefs", "pvfs2", "ocfs2", "gfs2", "davfs", "vboxsf", "virtiofs"}
)
_FULL = {errno.ENOSPC, errno.EDQUOT}
NEARLY_FULL_BYTES = 1 << 20  # SQLite says "disk I/O error" when its log cannot grow: on a disk this full, that is why
_DENIED = {errno.EROFS, errno.EACCES, errno.EPERM}
# pyarrow's and some C libraries' OSErrors carry the reason in their text only, with no errno
_TEXTS = {
    "No space left on device": errno.ENOSPC,
    "Disk quota exceeded": errno.EDQUOT,
    "Read-only file system": errno.EROFS,
}
_SQLITE_FULL = {"SQLITE_FULL"}
_SQLITE_DENIED = {"SQLITE_READONLY", "SQLITE_READONLY_DIRECTORY", "SQLITE_READONLY_DBMOVED", "SQLITE_CANTOPEN"}


@dataclass(frozen=True)
class Mount:
    point: Path
    fstype: str
    read_only: bool

    @property
    def network(self) -> bool:
        """Files shared between hosts (FUSE shares such as sshfs, s3fs or JuiceFS count: most are)."""
        return self.fstype in NETWORK_TYPES or self.fstype == "fuse" or self.fstype.startswith("fuse.")


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline and backslash in a path as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def existing(path: str | os.PathLike[str]) -> Path:
    """``path``, or its nearest ancestor that exists (a store not made yet lies on its parent's filesystem)."""
    return Path(os.path.realpath(_ancestor(Path(os.path.abspath(path)))))


def mount_of(path: str | os.PathLike[str], mountinfo: Path = MOUNTINFO) -> Mount:
    """The mount that holds ``path``: the longest mount point above it (``/proc/self/mountinfo``)."""
    absolute = Path(os.path.abspath(path))
    found = existing(absolute)  # links resolved in what exists; a store not made yet keeps its own name
    target = found / absolute.relative_to(_ancestor(absolute)) if found != absolute else found
    best = Mount(Path("/"), "unknown", False)
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        fields, _, rest = line.partition(" - ")
        parts, after = fields.split(), rest.split()
        if len(parts) < 6 or not after:
            continue
        point = Path(_unescape(parts[4]))
        if (target == point or point in target.parents) and len(point.parts) >= len(best.point.parts):
            best = Mount(point, after[0], "ro" in parts[5].split(","))
    return best


def free_bytes(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(bytes free to this user, bytes in all) on the filesystem of ``path``."""
    st = os.statvfs(existing(path))
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def block_size(path: str | os.PathLike[str]) -> int:
    """The smallest space a file takes on the filesystem of ``path``."""
    return os.statvfs(existing(path)).f_frsize


def size_text(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def describe(path: str | os.PathLike[str]) -> str:
    """``filesystem /mnt/x (tmpfs): 196.0 KB free of 30.0 MB``."""
    mount = mount_of(path)
    try:
        free, total = free_bytes(path)
    except OSError:
        return f"filesystem {mount.point} ({mount.fstype})"
    return f"filesystem {mount.point} ({mount.fstype}): {size_text(free)} free of {size_text(total)}"


def below_floor(path: str | os.PathLike[str], free: int, min_free_gb: float) -> str | None:
    """Why ``free`` bytes on the filesystem of ``path`` are too few for a build (``checks.min_free_gb``)."""
    if free >= min_free_gb * 1e9:
        return None
    return (
        f"{os.path.abspath(path)} has {size_text(free)} free, below checks.min_free_gb {min_free_gb:g} "
        f"({describe(path)}); free space there (`dflash-build gc` lists what no config uses) or lower "
        "checks.min_free_gb"
    )


class StoreFault(OSError):
    """The environment refused a write (a full disk, a read-only store): one line that says what to do."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(code, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def fault(error: BaseException, path: str | os.PathLike[str] | None = None) -> StoreFault | None:
    """The one-line form of ``error`` if the environment caused it (None otherwise).

    ``path``: what was being written, where the error does not name it (SQLite's errors never do).
    """
    if isinstance(error, StoreFault):
        return error
    if isinstance(error, sqlite3.OperationalError):
        name = getattr(error, "sqlite_errorname", "")
        code = errno.ENOSPC if name in _SQLITE_FULL else errno.EACCES if name in _SQLITE_DENIED else None
        if name.startswith("SQLITE_IOERR") and path is not None and _nearly_full(path):
            code = errno.ENOSPC  # its log or shared-memory file could not grow: "disk I/O error" on a full disk
    elif isinstance(error, OSError):
        code = error.errno if error.errno in _FULL | _DENIED else None
        code = code or next((c for text, c in _TEXTS.items() if text in str(error)), None)
        path = error.filename or path
    else:
        return None
    if code is None:
        return None
    where = Path(os.path.abspath(path)) if path is not None else Path.cwd()
    if code in _FULL:
        return StoreFault(
            f"no space left writing {where} ({describe(where)}); free space there (or move `store:`), then run "
            "again: what finished is kept and nothing is generated twice",
            code,
        )
    mount = mount_of(where)
    why = "the filesystem is mounted read-only" if mount.read_only else "permission denied"
    return StoreFault(
        f"cannot write {where}: {why} ({describe(where)}); give this user write access to it, or point `store:` "
        "at a store it can write (plan, explain, status, verify and gc without --yes only read)",
        code,
    )


def _nearly_full(path: str | os.PathLike[str]) -> bool:
    try:
        return free_bytes(path)[0] < NEARLY_FULL_BYTES
    except OSError:
        return False


def check_writable(folder: Path) -> None:
    """Fail with one line unless this process can create files in ``folder`` (made if missing)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".write-check.", suffix=".tmp", dir=folder)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        # named as the folder (the store), not as the probe file the check made in it
        raise fault(OSError(e.errno, e.strerror), folder) or e from None

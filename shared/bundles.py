"""Workspace bundles: a directory packed as a reproducible tar, named by its sha256
(docs/workspaces.md).

The same tree always packs to the same bytes (sorted entries, mtime 0, owner 0, modes
reduced to 0644/0755, PAX format, no compression), so its digest names its content and a
tree submitted twice is uploaded once. What `.gitignore` and `.berthignore` files (in the
root or any directory below it) exclude is left out, as are `.git/` and `.berth/` (a local
`berth up` keeps its data there). Unpacking uses tarfile's "data" filter: no absolute
paths, no links out of the directory, no device files.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import pathspec

DIGEST_PREFIX = "sha256:"
IGNORE_FILES = (".gitignore", ".berthignore")
ALWAYS_IGNORED = (".git/", ".berth/")
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
# Object store chunks a bundle is uploaded in (nats-py's default is 128 KiB): a worker's
# fetch is then fewer, larger messages. Capped by the server's max_payload (1 MiB for
# berth's servers). Chunks of any size are read back alike, so older bundles stay readable.
UPLOAD_CHUNK_BYTES = 1024 * 1024


class BundleError(ValueError):
    """The workspace cannot be bundled; the message is one line saying why."""


@dataclass(frozen=True)
class Entry:
    path: str  # relative, '/'-separated
    kind: str  # "dir", "file" or "symlink"
    size: int
    executable: bool = False
    target: str = ""  # a symlink's


def object_name(digest: str) -> str:
    """The object store name of a bundle: its digest, `sha256:<hex>`."""
    return digest


def digest_of(sha256_hex: str) -> str:
    return DIGEST_PREFIX + sha256_hex


def _specs_here(directory: Path, rel: str) -> list[tuple[str, pathspec.GitIgnoreSpec]]:
    out = []
    for name in IGNORE_FILES:
        path = directory / name
        if path.is_file():
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
            out.append((rel, pathspec.GitIgnoreSpec.from_lines(lines)))
    return out


def _ignored(rel: str, is_dir: bool,
             specs: list[tuple[str, pathspec.GitIgnoreSpec]]) -> bool:
    for base, spec in specs:
        below = rel[len(base) + 1:] if base else rel
        if spec.match_file(below + "/" if is_dir else below):
            return True
    return False


def scan(root: Path) -> list[Entry]:
    """The entries a bundle of `root` holds, in the order they are packed."""
    if not root.exists():
        raise BundleError(f"workspace {str(root)!r}: no such directory")
    if not root.is_dir():
        raise BundleError(f"workspace {str(root)!r}: not a directory")
    always = pathspec.GitIgnoreSpec.from_lines(ALWAYS_IGNORED)
    out: list[Entry] = []

    def walk(directory: Path, rel: str, specs: list[tuple[str, pathspec.GitIgnoreSpec]]) -> None:
        specs = specs + _specs_here(directory, rel)
        try:
            names = sorted(os.listdir(directory))
        except OSError as exc:
            raise BundleError(f"workspace: cannot read {str(directory)!r}: {exc.strerror}"
                              ) from None
        for name in names:
            path = directory / name
            child = f"{rel}/{name}" if rel else name
            st = path.lstat()
            is_dir = stat.S_ISDIR(st.st_mode)
            if always.match_file(child + "/" if is_dir else child) or _ignored(
                    child, is_dir, specs):
                continue
            if is_dir:
                out.append(Entry(child, "dir", 0))
                walk(path, child, specs)
            elif stat.S_ISLNK(st.st_mode):
                out.append(Entry(child, "symlink", 0, target=os.readlink(path)))
            elif stat.S_ISREG(st.st_mode):
                out.append(Entry(child, "file", st.st_size,
                                 executable=bool(st.st_mode & 0o111)))
            # Sockets, fifos and devices have no place in a bundle.

    walk(root, "", [])
    return out


def check_size(entries: list[Entry], limit: int) -> int:
    """The total size of the files; above `limit`, a BundleError naming the largest."""
    total = sum(e.size for e in entries)
    if total <= limit:
        return total
    largest = sorted((e for e in entries if e.kind == "file"), key=lambda e: -e.size)[:5]
    names = ", ".join(f"{e.path} ({mib(e.size)})" for e in largest)
    raise BundleError(f"workspace is {mib(total)}, over the {mib(limit)} limit "
                      f"(BERTH_BUNDLE_MAX_MB); largest files: {names}; list what the tasks "
                      "do not need in .berthignore")


def mib(size: int) -> str:
    if size < 1024 * 1024:
        return f"{size / 1024:.1f} KiB" if size >= 1024 else f"{size} bytes"
    return f"{size / (1024 * 1024):.1f} MiB"


class _HashingWriter:
    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.out.write(data)


def write_tar(root: Path, entries: list[Entry], out: BinaryIO) -> str:
    """Packs `entries` of `root` into `out`; returns the digest of the bytes written."""
    writer = _HashingWriter(out)
    with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
        for entry in entries:
            info = tarfile.TarInfo(entry.path)
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if entry.kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif entry.kind == "symlink":
                info.type, info.mode, info.linkname = tarfile.SYMTYPE, 0o777, entry.target
                tar.addfile(info)
            else:
                info.mode = 0o755 if entry.executable else 0o644
                with open(root / entry.path, "rb") as f:
                    info.size = os.fstat(f.fileno()).st_size
                    tar.addfile(info, f)
    return digest_of(writer.sha.hexdigest())


@dataclass(frozen=True)
class Packed:
    digest: str
    files: int
    size: int  # of the files in it


def pack(root: Path, out: BinaryIO, limit: int = DEFAULT_MAX_BYTES) -> Packed:
    """Packs the workspace `root` into `out`. Raises BundleError (one line)."""
    entries = scan(root)
    size = check_size(entries, limit)
    digest = write_tar(root, entries, out)
    return Packed(digest, sum(1 for e in entries if e.kind == "file"), size)


def unpack(archive: Path, dest: Path) -> None:
    """Unpacks a bundle into `dest` (files already there are overwritten, others kept)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, mode="r:") as tar:
        tar.extractall(dest, filter="data")


# tarfile's stream mode keeps what it has read ahead in one bytes object and copies the
# rest of it on every read: reads of this size, from a source that hands out at most this
# much at a time, keep that copy small.
STREAM_BLOCK = 64 * 1024


def unpack_stream(source: BinaryIO, dest: Path) -> None:
    """Unpacks a bundle read front to back from `source` (no seeking: bytes as they arrive
    from the object store) into `dest`, as `unpack` does. It stops reading at the tar's end
    marker, which may leave padding unread."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=source, mode="r|", bufsize=STREAM_BLOCK,  # type: ignore[call-overload]
                      copybufsize=STREAM_BLOCK) as tar:
        tar.extractall(dest, filter="data")

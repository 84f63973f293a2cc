"""A bundle unpacked once per worker, and given to each task directory without copying it
(docs/workspaces.md, "The cache").

The cache holds each digest's tree with its files read-only and their mtime 0 (the tar's).
A task directory gets the tree's directories as its own, its symlinks as they are, and its
files as reflinks where the filesystem has them (btrfs, XFS: a copy that shares blocks
until either side writes), else as hard links (ext4), else as copies. Hard links share the
file itself with the cache and every other task on the worker, which is why every bundled
file is read-only in every task directory, whichever way it got there: a task that opens
one for writing gets EACCES. Replacing a file (write another and rename it over, or delete
it first) is always fine: that changes the task's directory, not the file.

Read-only does not stop root (or a task that makes the file writable first): such a write
changes the file for every task directory that shares it. Its mtime changes with it, so
the next placement notices (TreeChanged) and the cache fetches the bundle again, but the
task directories that share the file keep the change. BERTH_BUNDLE_COPIES=1 gives each task
directory its own writable copies instead (reflinks where the filesystem has them), at the
cost of copying the bundle for every task.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# linux/fs.h: _IOW(0x94, 9, int), clone a whole file's extents into another.
FICLONE = 0x40049409
# What FICLONE says on a filesystem (or pair of files) that cannot share extents.
NO_REFLINK = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS,
              errno.EBADF, errno.EPERM}
WRITE_BITS = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH


class TreeChanged(Exception):
    """A file of the cached tree is no longer what the bundle held (the message names it)."""


def _files(tree: Path) -> Iterator[tuple[str, os.stat_result]]:
    for root, _, names in os.walk(tree):
        for name in names:
            path = os.path.join(root, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                yield path, st


@dataclass(frozen=True)
class Footprint:
    bytes: int  # of its files
    files: int


def seal(tree: Path) -> Footprint:
    """Makes every file of a freshly unpacked tree read-only; returns what it holds."""
    total = files = 0
    for path, st in _files(tree):
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~WRITE_BITS)
        total += st.st_size
        files += 1
    return Footprint(total, files)


def footprint(tree: Path) -> Footprint:
    sizes = [st.st_size for _, st in _files(tree)]
    return Footprint(sum(sizes), len(sizes))


class Placer:
    """How files reach task directories on this worker's filesystem: reflink, else hard link
    (unless `copies`), else copy. What failed once is not tried again (one per cache: the
    filesystem does not change). With `copies` the task's files are its own: writable."""

    def __init__(self, copies: bool = False) -> None:
        self.reflink = True
        self.link = not copies
        self.extra_mode = stat.S_IWUSR if copies else 0

    def shares_files(self) -> bool:
        """Whether placed files are hard links to the cache's (known after a placement)."""
        return self.link and not self.reflink

    def place(self, tree: Path, dest: Path) -> None:
        """Gives `dest` the content of the cached `tree` (files already there with a
        bundled file's name are replaced, others kept). Raises TreeChanged if a cached file
        was written since it was sealed, OSError if `dest` cannot take it."""
        dest.mkdir(parents=True, exist_ok=True)
        stack = [(str(tree), str(dest))]
        while stack:
            src_dir, dst_dir = stack.pop()
            with os.scandir(src_dir) as entries:
                for entry in entries:
                    dst = os.path.join(dst_dir, entry.name)
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        os.makedirs(dst, exist_ok=True)
                        stack.append((entry.path, dst))
                        continue
                    if stat.S_ISREG(st.st_mode) and (st.st_mode & WRITE_BITS or st.st_mtime):
                        raise TreeChanged(f"{os.path.relpath(entry.path, tree)} was written "
                                          "in a task directory")
                    try:
                        self._entry(entry.path, dst, st)
                    except FileExistsError:
                        # An older bundle's file, or the task's own: the bundle's wins. (Not
                        # unlinked first: in a new directory that is a wasted system call.)
                        os.unlink(dst)
                        self._entry(entry.path, dst, st)

    def _entry(self, src: str, dst: str, st: os.stat_result) -> None:
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(src), dst)
            return
        if self.reflink and self._reflink(src, dst, st):
            return
        if self.link:
            try:
                os.link(src, dst)
                return
            except OSError as exc:
                # EMLINK: this file is in 65000 task directories (ext4's limit).
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                    raise
                if exc.errno != errno.EMLINK:
                    self.link = False
        with open(src, "rb") as fin, open(dst, "xb") as fout:
            shutil.copyfileobj(fin, fout)
        os.chmod(dst, stat.S_IMODE(st.st_mode) | self.extra_mode)
        os.utime(dst, (st.st_mtime, st.st_mtime))

    def _reflink(self, src: str, dst: str, st: os.stat_result) -> bool:
        fd_in = os.open(src, os.O_RDONLY)
        try:
            fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                             stat.S_IMODE(st.st_mode) | stat.S_IWUSR)
            try:
                fcntl.ioctl(fd_out, FICLONE, fd_in)
            except OSError as exc:
                os.close(fd_out)
                os.unlink(dst)
                if exc.errno not in NO_REFLINK:
                    raise
                self.reflink = False
                return False
            os.fchmod(fd_out, stat.S_IMODE(st.st_mode) | self.extra_mode)
            os.utime(fd_out, (st.st_mtime, st.st_mtime))
            os.close(fd_out)
            return True
        finally:
            os.close(fd_in)


def place(tree: Path, dest: Path, copies: bool = False) -> None:
    """Placer(copies).place, for one placement."""
    Placer(copies).place(tree, dest)

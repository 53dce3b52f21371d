"""A local checkpoint directory's own files, never what a link in it points to.

Checkpoint directories are shared (a team's NFS, a download), so anything in
one may have been planted: a step directory that is a symbolic link to its
user's home, a commit marker that is a FIFO (a read of it never returns), a
manifest hard-linked to another file. Below the checkpoint's root (which may
itself be a link: the user chose it) jaxckpt therefore

- reads only real directories and regular files: a key or a leaf's array whose
  path passes through a symbolic link, or that is a FIFO, socket or device, is
  refused before anything opens it (:func:`check_key`, :func:`check_tree`), as
  damage (CorruptSnapshotError): a restore goes back to an older step;
- deletes names, never what they point to (:func:`remove`): a link or a special
  file is unlinked, a directory removed without following any link inside it
  (``shutil.rmtree`` on a directory descriptor), and a hard link loses only its
  own name. A delete that would have to pass *through* a link (``commits/``
  itself a link) is refused (PermissionDeniedError naming it).

Writes go through tensorstore, which replaces a key by renaming a new file
over it (a link or a hard link there is replaced, its target untouched);
:func:`check_dirs` refuses a write whose directories pass through a link.
Object stores have no links: every function here is for local paths only.

A power loss keeps only what was synced. tensorstore fsyncs each file it writes
and the directory it renames it into, but not the directories it makes on the
way: the entry of a new directory in its parent is durable only once that parent
is fsynced. Before a step's commit marker is written, :func:`sync_tree` fsyncs
every directory of the step and each one on the way to it, and
:func:`ensure_dir` makes ``commits/`` durable; a removal or a move fsyncs the
directories whose entries it changed (a deleted step does not come back).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat

from jaxckpt import errors

log = logging.getLogger(__name__)

_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _kind(mode: int) -> str:
  """What a file of ``mode`` is, in words."""
  for test, what in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                     (stat.S_ISREG, "a regular file"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                     (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                     (stat.S_ISBLK, "a block device")):
    if test(mode):
      return what
  return "a special file"


def _target(path: str) -> str:
  try:
    return f" (to {os.readlink(path)!r})"
  except OSError:
    return ""


def _parts(rel: str) -> list[str]:
  parts = [p for p in rel.split("/") if p]
  if any(p in (".", "..") for p in parts):
    raise errors.InvalidArgumentError(f"{rel!r} climbs out of the checkpoint")
  return parts


def _refused(root: str, rel: str, mode: int, where: str) -> errors.CorruptSnapshotError:
  path = os.path.join(root, rel)
  return errors.CorruptSnapshotError(
      f"{where}: {path!r} is {_kind(mode)}{_target(path) if stat.S_ISLNK(mode) else ''}, "
      "not a real directory or file of the checkpoint; jaxckpt never reads through a link or "
      "a special file in a checkpoint (it was planted, or copied without -L), so nothing "
      "was read through it; remove it, or restore another step")


def check_dirs(root: str, rel: str, *, where: str, writing: bool = False) -> None:
  """Raises CorruptSnapshotError (``writing``: PermissionDeniedError) unless every
  directory of ``rel`` (a key's, or a prefix ending in ``/``) below ``root`` that
  exists is a real directory, no link."""
  parts = _parts(rel)
  dirs = parts if rel.endswith("/") else parts[:-1]
  path = root
  for i, name in enumerate(dirs):
    path = os.path.join(path, name)
    try:
      mode = os.lstat(path).st_mode
    except FileNotFoundError:
      return
    if not stat.S_ISDIR(mode):
      if writing:
        raise errors.PermissionDeniedError(
            f"{where}: {path!r} is {_kind(mode)}{_target(path) if stat.S_ISLNK(mode) else ''}, "
            "not a directory of the checkpoint; jaxckpt never writes through a link out of a "
            "checkpoint: remove it (it was planted, or left by a copy), or write elsewhere")
      raise _refused(root, "/".join(dirs[:i + 1]), mode, where)


def check_key(root: str, key: str, *, where: str) -> None:
  """Raises CorruptSnapshotError unless ``key`` below ``root`` is a regular file
  (or absent) reached through real directories only: checked before it is read."""
  check_dirs(root, key, where=where)
  try:
    mode = os.lstat(os.path.join(root, key)).st_mode
  except (FileNotFoundError, NotADirectoryError):
    return
  if not stat.S_ISREG(mode):
    raise _refused(root, key, mode, where)


def check_tree(root: str, prefix: str, *, where: str) -> None:
  """Raises CorruptSnapshotError unless everything under ``prefix`` (a directory
  below ``root``, reached through real directories) is a real directory or a
  regular file: checked before a reader opens any file in it."""
  check_dirs(root, prefix.rstrip("/") + "/", where=where)
  top = os.path.join(root, prefix)
  stack = [top]
  while stack:
    here = stack.pop()
    try:
      entries = list(os.scandir(here))
    except (FileNotFoundError, NotADirectoryError):
      continue
    for e in entries:
      if e.is_dir(follow_symlinks=False):
        stack.append(e.path)
      elif not e.is_file(follow_symlinks=False):
        raise _refused(root, os.path.relpath(e.path, root), e.stat(follow_symlinks=False).st_mode,
                       where)


def _open_parent(root: str, parts: list[str], what: str, *, create: bool = False) -> int:
  """A descriptor of ``root/parts[:-1]`` (``create``: made where missing), opened
  without following any link below ``root``; PermissionDeniedError naming the
  link if one is on the way."""
  fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
  try:
    for i, name in enumerate(parts[:-1]):
      if create:
        try:
          os.mkdir(name, 0o777, dir_fd=fd)
        except FileExistsError:
          pass
      try:
        nxt = os.open(name, _FLAGS, dir_fd=fd)
      except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
          path = os.path.join(root, *parts[:i + 1])
          mode = os.lstat(path).st_mode
          raise errors.PermissionDeniedError(
              f"{what}: {path!r} is {_kind(mode)}"
              f"{_target(path) if stat.S_ISLNK(mode) else ''}, not a directory of the "
              "checkpoint; refusing to delete or move anything through it (jaxckpt never "
              "follows a link out of a checkpoint): remove it yourself if the checkpoint "
              "should not have it") from None
        raise
      os.close(fd)
      fd = nxt
    return fd
  except BaseException:
    os.close(fd)
    raise


def remove(root: str, rel: str, *, what: str) -> bool:
  """Removes ``rel`` (a key, or a directory with everything in it) below ``root``
  without following any link: a link, a special file or a hard link loses its
  name only. True if something was there.

  Raises:
    PermissionDeniedError: a directory on the way to ``rel`` is a link (or a file).
  """
  parts = _parts(rel)
  if not parts:
    raise errors.InvalidArgumentError(f"{what}: refusing to remove the checkpoint's root")
  try:
    fd = _open_parent(root, parts, what)
  except (FileNotFoundError, NotADirectoryError):
    return False
  name = parts[-1]
  try:
    try:
      mode = os.lstat(name, dir_fd=fd).st_mode
    except FileNotFoundError:
      return False
    if stat.S_ISDIR(mode):
      shutil.rmtree(name, dir_fd=fd)        # fd-based: a link inside loses its name only
    else:
      if not stat.S_ISREG(mode):
        path = os.path.join(root, rel)
        log.warning("%s: %r was %s%s, not what jaxckpt writes; removed it, not what it points "
                    "to", what, path, _kind(mode), _target(path) if stat.S_ISLNK(mode) else "")
      os.unlink(name, dir_fd=fd)
    os.fsync(fd)              # the removal survives a power loss: nothing deleted comes back
    return True
  finally:
    os.close(fd)


def _fsync_dir(path: str, *, dir_fd: int | None = None) -> None:
  fd = os.open(path, _FLAGS, dir_fd=dir_fd)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def sync_tree(root: str, rel: str) -> None:
  """Makes everything written under ``rel`` (a directory below ``root``) survive a
  power loss: fsyncs each directory in it (deepest first, links never followed),
  then each directory on the way back up to ``root`` and ``root`` itself.

  Raises:
    StorageError: an fsync failed (the data may not be on the disk: commit nothing).
  """
  top = os.path.join(root, rel)
  try:
    for here, _, _ in os.walk(top, topdown=False, followlinks=False):
      _fsync_dir(here)
    parts = _parts(rel)
    for i in range(len(parts) - 1, -1, -1):
      _fsync_dir(os.path.join(root, *parts[:i]) if i else root)
  except OSError as e:
    raise errors.StorageError(e.errno, f"syncing {top!r} to disk failed ({e.strerror}): its "
                              "files may not survive a power loss, so it is not committed",
                              top) from None


def ensure_dir(root: str, rel: str) -> None:
  """Makes directory ``rel`` below ``root`` (if missing) and its entry durable."""
  parts = _parts(rel)
  path = os.path.join(root, *parts)
  try:
    os.makedirs(path, exist_ok=True)
    for i in range(len(parts) - 1, -1, -1):
      _fsync_dir(os.path.join(root, *parts[:i]) if i else root)
  except OSError as e:
    raise errors.StorageError(e.errno, f"making {path!r} durable failed ({e.strerror})",
                              path) from None


def make_durable_dirs(path: str) -> None:
  """``os.makedirs(path, exist_ok=True)``, each directory it makes fsynced into its
  parent (a checkpoint directory made on the first save survives a power loss)."""
  missing = []
  here = os.path.abspath(path)
  while not os.path.isdir(here):
    missing.append(here)
    up = os.path.dirname(here)
    if up == here:
      break
    here = up
  os.makedirs(path, exist_ok=True)
  for made in reversed(missing):
    _fsync_dir(os.path.dirname(made))


def rmdir_if_empty(root: str, rel: str) -> None:
  """Removes the directory ``rel`` below ``root`` if it is empty (and a real directory)."""
  parts = _parts(rel)
  try:
    fd = _open_parent(root, parts, f"removing {rel!r}")
  except (OSError, errors.JaxckptError):
    return
  try:
    os.rmdir(parts[-1], dir_fd=fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def rename(root: str, rel: str, into: str, *, what: str) -> bool:
  """Moves ``rel`` (a link moves as the link) into directory ``into`` below ``root``,
  created if missing; refuses (PermissionDeniedError) if a directory on either
  way is a link. True if something was there."""
  src_parts = _parts(rel)
  dst_parts = _parts(into) + src_parts[-1:]
  try:
    src = _open_parent(root, src_parts, what)
  except (FileNotFoundError, NotADirectoryError):
    return False
  try:
    dst = _open_parent(root, dst_parts, what, create=True)
    try:
      try:
        os.replace(src_parts[-1], dst_parts[-1], src_dir_fd=src, dst_dir_fd=dst)
      except FileNotFoundError:
        return False
      os.fsync(dst)           # both entries survive a power loss
      os.fsync(src)
      return True
    finally:
      os.close(dst)
  finally:
    os.close(src)

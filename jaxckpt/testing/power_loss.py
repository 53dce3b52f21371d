"""Power loss on a local filesystem: what survives of a program's writes when the
machine loses power, from the system calls it made.

:func:`traced` runs a program under ``strace -f -y`` and :class:`Disk` replays its
calls on a model of a POSIX filesystem that keeps, for every directory entry and
every file's data, what was last *synced* apart from what was last *written*
(the model of the crash-consistency studies, e.g. ALICE, OSDI 2014, and of etcd's
robustness suite's lazyfs):

- a file's data survives only as of its last ``fsync``/``fdatasync``;
- a directory entry (a file or directory made, renamed into place, removed)
  survives only once its parent directory was fsynced after it; an fsync of a
  file does not make its own name durable;
- what existed before the trace began was durable.

So the model answers, at the end of the trace or at any point in it, which files
a power loss would leave (:meth:`Disk.survives`), and with which of their
writes. Unlike a filesystem that drops unsynced data when it crashes once, it
judges every point of the trace at once, and no kernel module or FUSE daemon is
needed: only ``strace`` (``apt-get install -y strace``).

>>> d = Disk()
>>> d.apply(["mkdir", "/r/a"]); d.apply(["create", "/r/a/f"]); d.apply(["write", "/r/a/f"])
>>> d.apply(["fsync", "/r/a/f"]); d.survives("/r/a/f")
False
>>> d.apply(["fsync", "/r/a"]); d.apply(["fsync", "/r"]); d.survives("/r/a/f")
True
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Iterable

INSTALL = "apt-get install -y strace"
_SYSCALLS = ("openat,open,creat,write,pwrite64,writev,pwritev,ftruncate,truncate,fsync,fdatasync,"
             "rename,renameat,renameat2,mkdir,mkdirat,unlink,unlinkat,rmdir,syncfs,sync")


class StraceMissing(RuntimeError):
  """strace is not installed."""


def traced(argv: list[str], trace_path: str, *, env: dict[str, str] | None = None,
           timeout: float = 600) -> subprocess.CompletedProcess:
  """Runs ``argv`` (and every process it starts) under strace, writing the calls that
  change a filesystem to ``trace_path``; raises StraceMissing naming the install."""
  strace = shutil.which("strace")
  if strace is None:
    raise StraceMissing(f"the power-loss model needs strace: install it ({INSTALL})")
  return subprocess.run([strace, "-f", "-qq", "-y", "-e", f"trace={_SYSCALLS}", "-o",
                         trace_path, *argv], env=env, timeout=timeout, capture_output=True,
                        text=True, check=False)


# -- reading a trace ------------------------------------------------------------

_LINE = re.compile(r"^(\d+)\s+(.*)$")
_CALL = re.compile(r"^(\w+)\((.*)\)\s+=\s+(-?\d+)")
_FD = re.compile(r"^(-?\d+|AT_FDCWD)<(.*)>$")


def _args(text: str) -> list[str]:
  """The top-level arguments of a call, strings unquoted."""
  out, cur, depth, quoted, esc = [], "", 0, False, False
  for ch in text:
    if quoted:
      if esc:
        cur, esc = cur + ch, False
      elif ch == "\\":
        esc = True
      elif ch == '"':
        quoted = False
      else:
        cur += ch
      continue
    if ch == '"':
      quoted = True
    elif ch in "[{(<":
      depth += 1
      cur += ch
    elif ch in "]})>":
      depth -= 1
      cur += ch
    elif ch == "," and depth == 0:
      out.append(cur.strip())
      cur = ""
    else:
      cur += ch
  if cur.strip():
    out.append(cur.strip())
  return out


def _fd_path(arg: str) -> str | None:
  m = _FD.match(arg)
  if m is None:
    return None
  path = m.group(2)
  return None if path.endswith(" (deleted)") else path


def _at(dirfd: str, name: str) -> str | None:
  if name.startswith("/"):
    return os.path.normpath(name)
  base = _fd_path(dirfd)
  return None if base is None else os.path.normpath(os.path.join(base, name))


def operations(trace_path: str) -> list[list[str]]:
  """The trace's calls that succeeded, in the order they returned, as the model's
  operations: ``mkdir P``, ``create P``, ``write P``, ``fsync P``, ``rename S D``,
  ``remove P``, ``syncfs``."""
  pending: dict[str, str] = {}
  ops: list[list[str]] = []
  with open(trace_path, errors="replace") as f:
    for raw in f:
      m = _LINE.match(raw.rstrip("\n"))
      if m is None:
        continue
      pid, rest = m.groups()
      if rest.endswith("<unfinished ...>"):
        pending[pid] = rest[:-len("<unfinished ...>")].rstrip()
        continue
      r = re.match(r"^<\.\.\. (\w+) resumed>\s?(.*)$", rest)
      if r is not None:
        rest = pending.pop(pid, r.group(1) + "(") + r.group(2)
      c = _CALL.match(rest)
      if c is None or int(c.group(3)) < 0:
        continue
      ops += _ops(c.group(1), _args(c.group(2)), c.group(3))
  return ops


def _ops(name: str, a: list[str], ret: str) -> list[list[str]]:
  if name in ("openat", "open", "creat"):
    dirfd, path, flags = (a[0], a[1], a[2]) if name == "openat" else ("AT_FDCWD<>", a[0],
                                                                       a[1] if len(a) > 1 else "")
    p = _at(dirfd, path)
    if p is None or name != "creat" and "O_CREAT" not in flags and "O_TRUNC" not in flags:
      return []
    return [["create", p]] + ([["write", p]] if "O_TRUNC" in flags else [])
  if name in ("write", "pwrite64", "writev", "pwritev", "ftruncate"):
    p = _fd_path(a[0])
    return [] if p is None or int(ret) == 0 and name != "ftruncate" else [["write", p]]
  if name == "truncate":
    return [["write", os.path.normpath(a[0])]]
  if name in ("fsync", "fdatasync"):
    p = _fd_path(a[0])
    return [] if p is None else [["fsync", p]]
  if name in ("syncfs", "sync"):
    return [["syncfs"]]
  if name in ("rename", "renameat", "renameat2"):
    src, dst = (a[0], a[1]) if name == "rename" else (_at(a[0], a[1]), _at(a[2], a[3]))
    return [] if src is None or dst is None else [["rename", os.path.normpath(src),
                                                   os.path.normpath(dst)]]
  if name in ("mkdir", "mkdirat"):
    p = os.path.normpath(a[0]) if name == "mkdir" else _at(a[0], a[1])
    return [] if p is None else [["mkdir", p]]
  if name in ("unlink", "rmdir"):
    return [["remove", os.path.normpath(a[0])]]
  if name == "unlinkat":
    p = _at(a[0], a[1])
    return [] if p is None else [["remove", p]]
  return []


# -- the model ------------------------------------------------------------------


class Disk:
  """A POSIX filesystem's written and synced states (see the module docstring)."""

  ROOT = 0

  def __init__(self) -> None:
    self._next = 1
    self.vol: dict[tuple[int, str], int] = {}      # (directory inode, name) -> inode
    self.dur: dict[tuple[int, str], int] = {}
    self.isdir: dict[int, bool] = {self.ROOT: True}
    self.version: dict[int, int] = {}
    self.synced: dict[int, int] = {}

  def _new(self, isdir: bool) -> int:
    i, self._next = self._next, self._next + 1
    self.isdir[i] = isdir
    self.version[i] = self.synced[i] = 0
    return i

  def _resolve(self, path: str, table: dict, *, make_old: bool) -> int | None:
    """The inode at ``path`` in ``table``; a directory the trace never made is one that
    existed (durably) before it began (``make_old``: added to both states)."""
    node = self.ROOT
    for name in [p for p in path.split("/") if p]:
      nxt = table.get((node, name))
      if nxt is None:
        if not make_old or (node, name) in self.vol or (node, name) in self.dur:
          return None
        nxt = self._new(True)
        self.vol[node, name] = self.dur[node, name] = nxt
      node = nxt
    return node

  def _parent(self, path: str) -> tuple[int | None, str]:
    head, name = os.path.split(path.rstrip("/"))
    return self._resolve(head, self.vol, make_old=True), name

  def apply(self, op: list[str]) -> None:
    kind = op[0]
    if kind in ("mkdir", "create"):
      parent, name = self._parent(op[1])
      if parent is not None and (parent, name) not in self.vol:
        self.vol[parent, name] = self._new(kind == "mkdir")
    elif kind == "write":
      i = self._resolve(op[1], self.vol, make_old=False)
      if i is not None:
        self.version[i] += 1
    elif kind == "fsync":
      i = self._resolve(op[1], self.vol, make_old=False)
      if i is None:
        return
      self.synced[i] = self.version[i]
      if self.isdir[i]:           # its entries as they are now
        for key in [k for k in self.dur if k[0] == i]:
          del self.dur[key]
        self.dur.update({k: v for k, v in self.vol.items() if k[0] == i})
    elif kind == "rename":
      self._resolve(op[1], self.vol, make_old=True)      # what existed before the trace
      sp, sn = self._parent(op[1])
      dp, dn = self._parent(op[2])
      if sp is not None and dp is not None and (sp, sn) in self.vol:
        self.vol[dp, dn] = self.vol.pop((sp, sn))
    elif kind == "remove":
      self._resolve(op[1], self.vol, make_old=True)
      parent, name = self._parent(op[1])
      self.vol.pop((parent, name), None)
    elif kind == "syncfs":
      self.dur = dict(self.vol)
      self.synced = dict(self.version)

  def survives(self, path: str) -> bool:
    """Whether a power loss now leaves ``path`` with every write made to it."""
    i = self._resolve(path, self.dur, make_old=True)    # one the trace never touched: as it was
    if i is None:
      return False
    if i != self._resolve(path, self.vol, make_old=False):
      return False
    return self.synced.get(i, 0) == self.version.get(i, 0)

  def left(self, path: str) -> bool:
    """Whether a power loss now leaves anything named ``path`` (synced or not)."""
    return self._resolve(path, self.dur, make_old=False) is not None


def replay(ops: Iterable[list[str]]) -> Disk:
  d = Disk()
  for op in ops:
    d.apply(op)
  return d

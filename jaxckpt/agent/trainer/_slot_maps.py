"""The trainer's maps of its agent's slot files (``AgentStore.maps``): each slot's
file mapped once and kept across saves and restores, checked against its file
before every use; the maps lent to restored arrays; and the manifests this trainer
committed, so that a restore of one need not parse it again."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxckpt import errors
from jaxckpt.agent import _paths, _requests
from jaxckpt.host.snapshot import SnapshotManifest

if TYPE_CHECKING:
  from jaxckpt.agent.trainer.client import AgentStore

logger = logging.getLogger("jaxckpt.agent.trainer.client")

# slot -> (path, size, map, the mapped file's (device, inode))
_Map = tuple[str, int, np.ndarray, tuple[int, int]]


class SlotMaps:
  """``store``'s maps of its agent's slot files, and what it committed into them."""

  def __init__(self, store: AgentStore, *, keep: int) -> None:
    self.store = store
    self.keep = keep            # manifests remembered: the agent's snapshots, and 2 more
    # slot -> its map: checked against the file before every use (_intact), as a save
    # writes it and as a restore reads it
    self.maps: dict[int, _Map] = {}
    self.lock = threading.Lock()
    # Maps of slot files lent to restores (never written again): a later restore of the
    # same step reads them without a page fault a page; dropped at this trainer's next
    # reservation, so their memory goes with the restored arrays.
    self.lent: dict[int, _Map] = {}
    self.lending: dict[int, tuple[int, list[bool]]] = {}   # step read -> (slot, lent?)
    self.allocated: dict[int, str] = {}    # slot -> the file this trainer allocated
    self.committed: dict[int, tuple[str, SnapshotManifest]] = {}   # step -> what it sent

  def forget(self) -> None:
    """Drops every map (a new agent: its files are other files)."""
    with self.lock:
      self.maps.clear()
      self.lent.clear()
      self.allocated.clear()

  def remember(self, step: int, text: str, manifest: SnapshotManifest) -> None:
    """``step`` was committed with ``manifest`` (its JSON ``text``)."""
    with self.lock:           # a restore of it need not parse its manifest again
      self.committed[step] = (text, manifest)
      while len(self.committed) > self.keep + 2:
        self.committed.pop(next(iter(self.committed)))

  def manifest(self, step: int, text: str) -> SnapshotManifest:
    """The manifest whose JSON is ``text`` (the agent's, of ``step``): the one this
    trainer committed if it is the same, else parsed."""
    with self.lock:
      known = self.committed.get(step)
    return (known[1] if known is not None and known[0] == text
            else SnapshotManifest.from_json(text))

  def unlend(self, r: _requests.Open.Reply, lent: bool) -> None:
    """The read of ``r`` ended; with ``lent`` its map is the restored arrays' now: its
    memory goes with the last of them (and the next reservation), not with this slot's
    next file."""
    if lent:
      with self.lock:
        if self.maps.get(r.index, ("",))[0] == r.path:
          self.lent[r.index] = self.maps.pop(r.index)

  def drop_lent(self) -> None:
    """Forgets the maps of lent slot files before a reservation (one of them may be
    renewed: its old file's memory must go back once no restored array views it)."""
    with self.lock:
      self.lent.clear()

  def map(self, index: int, path: str, size: int, *, allocate: bool = False,
          write: bool = False) -> np.ndarray:
    """Slot ``index``'s file, mapped once and kept across saves and restores (a
    fresh map of tmpfs pays a page fault per page; a kept one none); ``allocate``
    gives a new, sparse file its memory first. A kept map is used only while its
    file is intact (:func:`_intact`: the same file, at least ``size`` long): a file
    truncated or replaced under it (a /dev/shm cleaner, a full tmpfs) would kill
    this process with SIGBUS at its first touch. ``write`` (a save's slot) then
    allocates the file again and maps it afresh; a read raises CorruptSnapshotError."""
    if size == 0:                      # a state with no array bytes (only scalars)
      return np.empty(0, np.uint8)
    with self.lock:
      cached = self.maps.get(index)
      if cached is not None and cached[:2] != (path, size):
        # The slot has another file now: forget the old one's map first, so that its
        # memory goes back (once no restored array views it) before the new one takes any.
        del self.maps[index]
        cached = None
    if cached is not None and not allocate:
      why = _intact(cached[2], path, cached[3], size)
      if why is None:
        return cached[2]
      with self.lock:
        if self.maps.get(index) is cached:
          del self.maps[index]
      if not write:
        raise errors.CorruptSnapshotError(f"the snapshot file {path} {why}")
      logger.warning("%s: snapshot slot file %s %s; allocating it again for this save",
                     self.store.who, path, why)
      allocate = True
    del cached
    if write and not allocate and _paths.file_size(path) < size:
      logger.warning("%s: snapshot slot file %s is shorter than its %d bytes (truncated); "
                     "allocating it again for this save", self.store.who, path, size)
      allocate = True
    if allocate:      # memory that exists now: a full /dev/shm must not SIGBUS our copy
      _paths.allocate(path, size, host=self.store.host)
    buf, ident = _map_file(path, size)
    with self.lock:
      self.maps[index] = (path, size, buf, ident)
      if allocate:
        self.allocated[index] = path
    return buf

  def read_map(self, r: _requests.Open.Reply, manifest: SnapshotManifest) -> np.ndarray:
    """The pinned slot's memory, through the map kept for it; a missing, short or
    replaced file is corrupt (CorruptSnapshotError: the restore reads the next tier),
    never a SIGBUS."""
    if not manifest.nbytes:
      return np.empty(0, np.uint8)
    where = f"step {manifest.step}: the snapshot file {r.path}"
    if r.size < manifest.nbytes:
      raise errors.CorruptSnapshotError(
          f"{where} has {r.size} bytes, its manifest needs {manifest.nbytes}; it was "
          "truncated (restore another tier)")
    with self.lock:
      lent = self.lent.get(r.index)
    if lent is not None and lent[:2] == (r.path, r.size):
      why = _intact(lent[2], r.path, lent[3], manifest.nbytes)
      if why is None:                  # (the agent never writes a lent file again)
        return lent[2]
      with self.lock:            # (a new agent's file of that name, or a truncated one)
        if self.lent.get(r.index) is lent:
          del self.lent[r.index]
    try:
      buf = self.map(r.index, r.path, r.size)
    except (OSError, ValueError) as e:
      if isinstance(e, errors.JaxckptError):
        raise errors.CorruptSnapshotError(f"step {manifest.step}: {e} (restore another "
                                          "tier)") from None
      raise errors.CorruptSnapshotError(f"{where} cannot be mapped ({e})") from None
    if (why := _intact(buf, r.path, None, manifest.nbytes)) is not None:
      raise errors.CorruptSnapshotError(f"{where} {why} (restore another tier)")
    return buf

  def lend(self, step: int, buffer: Any) -> bool:
    """Restored arrays keep views of ``buffer`` (``step``'s slot, pinned by
    ``read``): the agent never writes that slot's file again, as the unpin at
    the end of ``read`` tells it (until then the pin keeps every writer out)."""
    with self.lock:
      mapped = self.lending.get(step)
      if mapped is None or all(m.get(mapped[0], (None, None, None))[2] is not buffer
                               for m in (self.maps, self.lent)):
        return False                   # the caller copies instead
    mapped[1].append(True)
    return True


def _intact(buf: np.ndarray, path: str, ident: tuple[int, int] | None, need: int) -> str | None:
  """Why the map ``buf`` of ``path`` must not be touched, or None: its file (the one
  mapped, by the map's own descriptor: fstat) is shorter than ``need`` bytes (a page
  past its end is SIGBUS), or ``path`` now names another file than ``ident``."""
  try:
    size = buf.base.obj.size()          # fstat of the mapped file (frombuffer's base: a view)
  except (AttributeError, OSError, ValueError):
    size = None
  if size is not None and size < need:
    return f"is {size} bytes, shorter than the {need} mapped: it was truncated"
  if ident is not None:
    try:
      st = os.stat(path)
    except OSError as e:
      return f"is gone ({e.strerror})"
    if (st.st_dev, st.st_ino) != ident:
      return "was replaced by another file"
  return None


_MADV_POPULATE_WRITE = 23       # Linux 5.14+ (Python's mmap module names it from 3.13)


def _map_file(path: str, size: int) -> tuple[np.ndarray, tuple[int, int]]:
  """A shared, writable map of ``size`` bytes of ``path`` (huge pages where the run
  root's tmpfs allows them), and the mapped file's (device, inode)."""
  with open(path, "r+b") as f:
    st = os.fstat(f.fileno())
    if st.st_size < size:              # (mmap would map past the end: SIGBUS at first touch)
      raise errors.CorruptSnapshotError(
          f"the snapshot file {path} is {st.st_size} bytes, shorter than its slot's {size}: "
          "it was truncated")
    mm = mmap.mmap(f.fileno(), size)
  with contextlib.suppress(OSError, AttributeError, ValueError):
    mm.madvise(mmap.MADV_HUGEPAGE)
  return np.frombuffer(mm, np.uint8), (st.st_dev, st.st_ino)


def _populate(buf: np.ndarray) -> None:
  """Maps every page of a slot map for writing, now (``prepare()``): the first save
  into the slot then pays no page fault a page (~4 us each: 0.25 s for 256 MiB)."""
  if not buf.size:
    return
  try:
    buf.base.obj.madvise(_MADV_POPULATE_WRITE)    # (frombuffer's base: a view of the mmap)
  except (OSError, AttributeError, ValueError):   # an older kernel: write each page
    view = buf[::mmap.PAGESIZE]
    np.bitwise_or(view, 0, out=view)

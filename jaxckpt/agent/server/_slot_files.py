"""The agent's slot files and the host memory they take (``Agent.files``): a file
record beside each slot of the table, kept maps for remote readers, the room checks
of a reservation (the budget, the run root's free memory) and the slots retired
beyond what fits."""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import shutil
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxckpt import errors
from jaxckpt.agent import _paths, _requests
from jaxckpt.host import _slots
from jaxckpt.host.snapshot import aligned_empty

if TYPE_CHECKING:
  from jaxckpt.agent.server._server import Agent

# The pin owner of a retired slot (beyond max_snapshots + 1): no reader is ever this.
_RETIRED = -(2**62)


@dataclasses.dataclass
class _Slot:
  """What the agent keeps beside a slot's table entry: its file.

  Each (re)allocation is a new file (``gen``): a trainer's restored arrays may keep
  views of a lent slot's old file (``op_lend``), which nothing writes again. The
  agent creates a file sparse and the trainer allocates its memory off the save
  path (``fresh`` in the reserve reply); once a step committed into it, it is
  ``allocated``."""

  index: int
  dir: str
  gen: int = 0
  allocated: bool = False
  # A read-only map of the slot kept across steps (remote readers): mapping 1 GiB
  # afresh costs ~0.1 s of page faults.
  map: Any = None
  map_path: str | None = None
  map_ino: int | None = None

  @property
  def path(self) -> str:
    return _paths.slot_file(self.dir, self.index, self.gen)

  def read_map(self, size: int) -> Any:
    """The kept map, once checked against its file (a short one is SIGBUS at a touch
    past its end: it is mapped afresh, and a file still short is refused)."""
    if (self.map is None or self.map_path != self.path or len(self.map) != size
        or not _same_file(self.map, self.path, size, self.map_ino)):
      self.map = None                      # a replaced map lives on while readers use it
      self.map_ino = _paths.inode(self.path)
      self.map = map_slot_file(self.path, size)
      self.map_path = self.path
    return self.map

  def renew(self, nbytes: int) -> None:
    """A new, sparse file of ``nbytes`` for this slot; the old one is unlinked (a
    trainer that maps it keeps its memory until it unmaps)."""
    old = self.path
    self.gen += 1
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
      os.ftruncate(fd, nbytes)
    finally:
      os.close(fd)
    self.allocated = False
    self.map, self.map_path = None, None      # (a reader holding the old map keeps it)
    with contextlib.suppress(FileNotFoundError):
      os.unlink(old)


def map_slot_file(path: str, size: int) -> mmap.mmap:
  """A read-only map of ``size`` bytes of slot file ``path``; CorruptSnapshotError if the
  file is shorter (truncated under the agent: mapping past its end would be SIGBUS)."""
  with open(path, "rb") as f:
    have = os.fstat(f.fileno()).st_size
    if have < size:
      raise errors.CorruptSnapshotError(
          f"snapshot slot file {path} is {have} bytes, shorter than the {size} it holds: it "
          "was truncated (a /dev/shm cleaner, a full tmpfs); its step is lost on this host")
    return mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)


class SlotReader:
  """``size`` bytes of slot file ``path`` read through its descriptor (``pread``), never
  through a map: a file truncated under the reader (a /dev/shm cleaner, a full tmpfs)
  is a short read, a CorruptSnapshotError naming it, where a map is SIGBUS at the
  first touch past the file's new end. A persist reads its slot this way for as long as
  storage takes (``read_shard``: each shard, as it is written; a private copy that the
  trainer's next save into the slot cannot change either)."""

  def __init__(self, path: str, size: int, step: int) -> None:
    self.path, self.size, self.step = path, size, step
    self._fd = os.open(path, os.O_RDONLY)
    try:
      have = os.fstat(self._fd).st_size
      if have < size:
        raise self._short(have)
    except BaseException:
      os.close(self._fd)
      raise

  def _short(self, have: int) -> errors.CorruptSnapshotError:
    return errors.CorruptSnapshotError(
        f"snapshot slot file {self.path} is {have} bytes, shorter than the {self.size} of step "
        f"{self.step} it holds: it was truncated (a /dev/shm cleaner, a full tmpfs) while its "
        "persist read it; this persist fails and the step is lost on this host")

  def read_shard(self, shard: Any) -> np.ndarray:
    """Shard ``shard`` (its ``offset`` and ``nbytes``) as a fresh uint8 array."""
    out = aligned_empty((shard.nbytes,), np.uint8)
    if not 0 <= shard.offset <= shard.offset + shard.nbytes <= self.size:
      raise errors.CorruptSnapshotError(
          f"step {self.step}: a shard at bytes [{shard.offset}, {shard.offset + shard.nbytes}) "
          f"lies outside its slot of {self.size} bytes")
    got = 0
    while got < shard.nbytes:
      n = os.preadv(self._fd, [memoryview(out)[got:]], shard.offset + got)
      if n <= 0:
        raise self._short(os.fstat(self._fd).st_size)
      got += n
    return out

  def close(self) -> None:
    if self._fd >= 0:
      os.close(self._fd)
      self._fd = -1


def _same_file(mm: mmap.mmap, path: str, size: int, ino: int | None) -> bool:
  """Whether map ``mm`` still covers ``size`` bytes of its file (``mm.size()``: fstat of
  the map's own descriptor) and ``path`` still names that file (inode ``ino``)."""
  try:
    return mm.size() >= size and os.stat(path).st_ino == ino
  except (OSError, ValueError):
    return False



class SlotFiles:
  """The files of ``agent``'s slots, each kept in its slot's record (``memory``)."""

  def __init__(self, agent: Agent) -> None:
    self.agent = agent

  def of(self, index: int) -> _Slot:
    """Slot ``index``'s file record."""
    return self.agent.table.slots[index].memory

  def ensure(self) -> None:
    """The loop's ``max_snapshots + 1`` slots, and up to ``table.spare`` more for steps
    held for their persists, in use; those beyond (a trainer asked for fewer, or host
    memory has no room for them now) are retired: pinned by ``_RETIRED`` (never handed
    out again) and their memory freed once they are free."""
    self.agent.table.keep = self.agent.max_snapshots
    self.agent.table.base = self.agent.max_snapshots + 1
    self.agent.table.grow_to(self.agent.table.base)
    self.fit()
    usable = self.agent.table.usable()
    for st in self.agent.table.slots:
      retired = _RETIRED in st.pins
      if st.index >= usable and not retired:
        st.pins[_RETIRED] = 1
        self.free_retired(st)
      elif st.index < usable and retired:
        del st.pins[_RETIRED]

  def fit(self) -> None:
    """A file record for every slot of the table (it adds slots for held steps)."""
    for st in self.agent.table.slots:
      if st.memory is None:
        st.memory = _Slot(st.index, self.agent.dir)

  def free_retired(self, st: _slots.SlotState) -> None:
    """Gives back the memory of retired slot ``st`` once it is free (the file is
    unlinked, so a reader's or a restored array's map of it stays valid)."""
    if st.state != _slots.FREE or set(st.pins) != {_RETIRED} or not st.size:
      return
    s = st.memory
    if s.map is not None:
      with contextlib.suppress(BufferError):
        s.map.close()
      s.map = None
    with contextlib.suppress(OSError):
      os.unlink(s.path)
    st.size, st.lent = 0, False

  def check_file_room(self, index: int) -> None:
    """The memory slot ``index``'s file lacks (a new file is sparse: the trainer
    allocates it in the background copy) must be free now, or the reservation is
    given up with HostMemoryBudgetError: said by this save, not by a failed copy."""
    size = self.agent.table.slots[index].size
    try:
      lacking = size - os.stat(self.of(index).path).st_blocks * 512
    except FileNotFoundError:
      lacking = size
    free = shutil.disk_usage(self.agent.dir).free
    if lacking > free:
      self.agent.dropped([self.agent.table.abort(index)])
      raise errors.HostMemoryBudgetError(
          f"host {self.agent.host}: a snapshot slot of {size / 2**20:.1f} MiB does not fit in "
          f"{self.agent.dir}: {free / 2**20:.1f} MiB free there. Arrays restored from this agent "
          "keep the memory of the slot they were read from while they live (its next save "
          "needs a new file): drop or copy them, free shared memory, lower max_snapshots, "
          "or point AgentOptions.run_root at a larger filesystem")

  def op_preallocate(self, nbytes: int) -> _requests.Preallocate.Reply:
    """Sizes every free slot for snapshots of ``nbytes`` now (``prepare()``): the
    trainer allocates and maps their memory before its first save; one slot more
    when it persists (a held step's), as host memory allows."""
    self.check_room(nbytes)
    if self.agent.persister is not None and self.agent.table.spare:
      self.agent.table.grow_to(max(len(self.agent.table), self.agent.table.base + 1))
      self.fit()
    for i in self.agent.table.grow_free(nbytes):
      self.of(i).renew(nbytes)
    free = [s.index for s in self.agent.table.slots
            if s.state == _slots.FREE and not s.pinned and s.size >= nbytes]
    return _requests.Preallocate.Reply(slots=[
        [i, self.of(i).path, self.agent.table.slots[i].size, not self.of(i).allocated]
        for i in free])

  def check_room(self, nbytes: int) -> tuple[int, int]:
    """Raises HostMemoryBudgetError, at the first save of a state (not a later one),
    if the loop's ``max_snapshots + 1`` slots of ``nbytes`` do not fit the budget
    or the run root's free memory. Sets how many slots more steps held for their
    persists may take (``table.spare``: what both have room for, counting what this
    agent holds already); returns the bytes of a slot (with its parity) and what
    the run root could hold."""
    a = self.agent
    self.ensure()
    usable = a.max_snapshots + 1             # the loop's slots
    need = usable * nbytes
    per_slot = nbytes
    what = f"{_slots.loop_slots(a.max_snapshots)} x {nbytes / 2**20:.1f} MiB"
    if a.parity is not None:
      pbytes = a.parity.estimate_bytes(nbytes)
      need += usable * pbytes
      per_slot += pbytes
      what += f" + {usable} parity slots x {pbytes / 2**20:.1f} MiB"
    if need > a.limit_bytes:
      raise errors.HostMemoryBudgetError(
          f"{what} = {need / 2**20:.1f} MiB exceed host_memory_limit_bytes={a.limit_bytes} "
          f"({a.limit_bytes / 2**20:.1f} MiB) on host {a.host}; lower "
          "max_snapshots, shard the state over more hosts, or raise the limit")
    held = sum(s.size for s in a.table.slots)
    held += 0 if a.parity is None else a.parity.bytes_held()
    free = shutil.disk_usage(a.dir).free
    if need > free + held:
      raise errors.HostMemoryBudgetError(
          f"{what} = {need / 2**20:.1f} MiB do not fit in {a.dir} on host {a.host}: "
          f"{free / 2**20:.1f} MiB free there (+ {held / 2**20:.1f} MiB this agent holds); "
          "free shared memory, lower max_snapshots, or point AgentOptions.run_root at a "
          "larger filesystem")
    a.table.spare = _slots.spare_slots(keep=a.max_snapshots, nbytes=per_slot,
                                       limit_bytes=a.limit_bytes, room_bytes=free + held)
    self.ensure()                     # (retires what no longer fits)
    return per_slot, free + held

  def close(self) -> None:
    """Closes the kept maps (one a reader still holds is freed with it)."""
    for s in (st.memory for st in self.agent.table.slots if st.memory is not None):
      if s.map is not None:
        with contextlib.suppress(BufferError):   # a reader still holds it: freed with it
          s.map.close()
        s.map = None

"""The snapshot agent process: owns a host's snapshots in shared memory.

Run by ``python -m jaxckpt.agent serve ...`` (spawned by the manager, or as a
sidecar by ``jaxckpt agent start``). It imports no JAX. One thread serves
requests in order; a step becomes visible when its trainer commits it, and
every read of it (a restore, a persist, a peer's parity rebuild) checks each
shard against the checksum the trainer took of the bytes it wrote.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import mmap
import os
import shutil
import signal
import threading
import time
from typing import Any, Iterator

import msgspec
import psutil
import zmq

from jaxckpt import errors
from jaxckpt.agent import _parity_config, _parity_worker, _paths, _protocol, _requests
from jaxckpt.host import _persist, _slots
from jaxckpt.host.snapshot import SnapshotManifest
from jaxckpt.net import _bulk, _schema, _wire

logger = logging.getLogger("jaxckpt.agent")


def _storage() -> _persist.PersistStorage:
  """The universal format, where this agent persists: imported by the persist thread
  when a persist runs (it imports JAX), never by an agent that does not persist."""
  from jaxckpt import universal  # pylint: disable=import-outside-toplevel
  return universal


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


def _same_file(mm: mmap.mmap, path: str, size: int, ino: int | None) -> bool:
  """Whether map ``mm`` still covers ``size`` bytes of its file (``mm.size()``: fstat of
  the map's own descriptor) and ``path`` still names that file (inode ``ino``)."""
  try:
    return mm.size() >= size and os.stat(path).st_ino == ino
  except (OSError, ValueError):
    return False


# Deleted steps an agent remembers (the newest deletes).
_DELETES_KEPT = 1024

# The pin owner of a retired slot (beyond max_snapshots + 1): no reader is ever this.
_RETIRED = -(2**62)


class Agent:
  """The agent's state and request handlers (no sockets here; see ``serve``)."""

  def __init__(self, *, job: str, host: int, directory: str, max_snapshots: int,
               limit_bytes: int, idle_timeout_secs: float, secret: bytes,
               tcp_host: str = "127.0.0.1") -> None:
    self.job, self.host, self.dir = job, host, directory
    self.secret = secret
    self.lease: tuple[int, str | None, int] | None = None   # (trainer pid, its manager, generation)
    self.generation = 0
    self.tcp_host = tcp_host
    self.max_snapshots = max_snapshots
    self.limit_bytes = limit_bytes
    self.idle_timeout_secs = idle_timeout_secs
    self.table = _slots.SlotTable(max_snapshots)   # which slot holds what (shared rules)
    self.slots: list[_Slot] = []                    # each slot's file
    self.manifests: dict[int, str] = {}        # step -> manifest JSON
    self.foreign_manifests: dict[int, str] = {}   # slot -> manifest JSON of an earlier run's
    # slot -> (the manifest JSON of the step it holds, parsed): parsed once, on first use
    # (the parity thread, the persist, ...), not by each (see ``manifest_of``)
    self._parsed: dict[int, tuple[str, SnapshotManifest]] = {}
    self.processes: dict[int, tuple[int, int]] = {}   # step -> (saving process, of how many)
    self.trainers: set[int] = set()
    self.last_active = time.monotonic()
    self.stopping = False
    self.lock = threading.RLock()      # the persist and parity threads use it too
    self.persister = None
    # process index -> its agent's address, as the job's current run published them
    self.peers: dict[int, dict[str, Any]] = {}
    self.parity = None                 # a _parity_worker.ParityWorker once a trainer asks for parity
    self._bulk_readers = itertools.count(1)
    self.replays = _wire.Replays()     # requests are applied at most once
    self.leases: dict[int, tuple[float, float]] = {}   # remote reader -> (expiry, lease secs)
    self.deleted: dict[int, int] = {}  # step -> the host whose delete came first (op_discard)
    self.crowded = 0                   # reserves that found held steps in the loop's slots
    self.run: str | None = None        # the run whose snapshots it holds (its directory)
    self.served = 0                    # bytes bulk reads sent (others' restores, parity)

  # -- helpers --------------------------------------------------------------

  def _slot_of(self, step: int) -> _slots.SlotState:
    s = self.table.committed(step)
    if s is None:
      raise errors.StepNotFoundError(
          f"agent of job {self.job!r} host {self.host} holds no step {step} "
          f"(held: {self.steps()})")
    return s

  def steps(self) -> list[int]:
    return self.table.steps()

  def _ensure_slots(self) -> None:
    """The loop's ``max_snapshots + 1`` slots, and up to ``table.spare`` more for steps
    held for their persists, in use; those beyond (a trainer asked for fewer, or host
    memory has no room for them now) are retired: pinned by ``_RETIRED`` (never handed
    out again) and their memory freed once they are free."""
    self.table.keep = self.max_snapshots
    self.table.base = self.max_snapshots + 1
    self.table.grow_to(self.table.base)
    self._fit_slots()
    usable = self.table.usable()
    for st in self.table.slots:
      retired = _RETIRED in st.pins
      if st.index >= usable and not retired:
        st.pins[_RETIRED] = 1
        self._free_retired(st)
      elif st.index < usable and retired:
        del st.pins[_RETIRED]

  def _fit_slots(self) -> None:
    """A file record for every slot of the table (it adds slots for held steps)."""
    while len(self.slots) < len(self.table):
      self.slots.append(_Slot(len(self.slots), self.dir))

  def _free_retired(self, st: _slots.SlotState) -> None:
    """Gives back the memory of retired slot ``st`` once it is free (the file is
    unlinked, so a reader's or a restored array's map of it stays valid)."""
    if st.state != _slots.FREE or set(st.pins) != {_RETIRED} or not st.size:
      return
    s = self.slots[st.index]
    if s.map is not None:
      with contextlib.suppress(BufferError):
        s.map.close()
      s.map = None
    with contextlib.suppress(OSError):
      os.unlink(s.path)
    st.size, st.lent = 0, False

  def _dropped(self, dropped: list[_slots.Dropped]) -> None:
    """Releases what the agent keeps beside slots the table freed."""
    for d in dropped:
      self._parsed.pop(d.index, None)
      if d.foreign:                     # an earlier run's step: its persist ended
        self.foreign_manifests.pop(d.index, None)
        self._free_retired(self.table.slots[d.index])
        continue
      if d.state == _slots.COMMITTED and self.parity is not None:
        self.parity.drop(d.step)
      if d.state == _slots.COMMITTED:
        self.manifests.pop(d.step, None)
        self.processes.pop(d.step, None)
      if d.held and self.persister is not None:   # rolled back before it was persisted
        self.persister.fence(d.step)
      self._free_retired(self.table.slots[d.index])

  def reap(self) -> None:
    """Forgets dead trainers (their half-written slots and their read pins, by pid:
    they are local) and remote readers whose lease ran out (never by pid)."""
    dead = {p for p in self.trainers | self.table.owners() if p > 0 and not psutil.pid_exists(p)}
    now = time.monotonic()
    expired = {r for r, (until, _) in self.leases.items() if until < now}
    for r in expired:
      logger.warning("remote reader %d: its lease on a step ran out (it died or hung); "
                     "unpinning", -r)
      del self.leases[r]
    dead |= expired
    dropped = self.table.forget(dead)
    for d in dropped:
      logger.info("slot %d: its writer died mid-snapshot of step %s; discarding", d.index, d.step)
    self._dropped(dropped)
    self.trainers -= dead

  # -- requests -------------------------------------------------------------

  def op_hello(self, pid: int, max_snapshots: int | None = None,
               limit_bytes: int | None = None,
               persist: _requests.PersistOptions | None = None,
               parity: _requests.ParityOptions | None = None,
               owner: str | None = None, run: str | None = None) -> _requests.Hello.Reply:
    persist = None if persist is None else msgspec.structs.asdict(persist)
    parity = None if parity is None else msgspec.structs.asdict(parity)
    self.reap()
    self._take_lease(int(pid), owner)
    if run is not None:
      self._start_run(run)
    if persist and self.persister is None:
      self.persister = _persist.Persister(_persist.PersistConfig(**persist), self._pinned,
                                          self._release_held, storage=_storage)
    elif persist and self.persister.config.to_obj() != persist:
      # A trainer relaunched with other options: the persists queued and running keep
      # theirs, in the same queue (its status, fences and errors cover them all).
      self.persister.configure(_persist.PersistConfig(**persist))
    if parity:
      self._configure_parity(parity)
    self.trainers.add(pid)
    if max_snapshots is not None:     # (range-checked with the request, as every value is)
      self.max_snapshots = int(max_snapshots)
    if limit_bytes is not None:
      self.limit_bytes = int(limit_bytes)
    self._ensure_slots()
    return _requests.Hello.Reply(pid=os.getpid(), steps=self.steps(), slots=self.max_snapshots + 1,
                                 generation=self.generation)

  def _start_run(self, run: str) -> None:
    """A trainer of run ``run`` (its directory): the snapshots of another run of the
    job are never offered to it: freed, or, while their persists run, held apart
    (foreign: no request by step reaches them, and no save of the new run drops or
    fences them, whatever its step numbers) until those persists end; the same run
    resumes them."""
    if self.run is not None and run != self.run:
      dropped = self.table.new_run()
      foreign = [s for s in self.table.slots if s.foreign]
      for st in foreign:
        if st.step in self.manifests:
          self.foreign_manifests[st.index] = self.manifests.pop(st.step)
        self.processes.pop(st.step, None)
      self._dropped(dropped)
      if self.persister is not None:
        self.persister.disown({st.attempt for st in foreign if st.attempt})
      if self.parity is not None:
        for step in list(self.parity.records):
          self.parity.drop(step)
      logger.info("job %s host %d: a new run (directory %r) follows run %r: the snapshots "
                  "of steps %s of the previous run are freed, those of %s once their "
                  "persists end", self.job, self.host, run, self.run,
                  [d.step for d in dropped], [st.step for st in foreign])
    self.run = run

  def _take_lease(self, pid: int, owner: str | None = None) -> None:
    """One manager per job and host, in any process: a live holder keeps the lease
    against another process, and against another manager of its own process
    (``owner``); a dead one's lease passes on (the generation counts the holders),
    and a closed one's was given up (``op_bye``)."""
    if self.lease is not None:
      holder, holding, gen = self.lease
      if holder == pid and holding == owner:
        return
      if holder == pid and holding is not None and owner is not None:
        raise errors.PermissionDeniedError(
            f"job {self.job!r} host {self.host} is held by another live manager in this "
            f"process: {holding} (lease generation {gen}); a step belongs to the manager "
            "that saved it: close that manager first (mgr.close(), or a with block), or "
            "give this one another AgentOptions(job_name=...)")
      if holder != pid and psutil.pid_exists(holder):
        raise errors.PermissionDeniedError(
            f"job {self.job!r} host {self.host} already has a live trainer, pid {holder}"
            + (f" ({holding})" if holding else "") + f" (lease generation {gen}); one "
            "manager per job and host: stop it, or give this one another "
            "AgentOptions(job_name=...)")
      if holder != pid:
        logger.warning("trainer pid %d (lease generation %d) is gone; pid %d takes over",
                       holder, gen, pid)
      elif holding is not None:         # a bare store beside a manager: it keeps the lease
        return
    self.generation += 1
    self.lease = (pid, owner, self.generation)

  def _configure_parity(self, parity: dict[str, Any]) -> None:
    """Starts the parity thread, or gives it a trainer's options for later steps: the
    parity already held keeps the options it was made with (a job relaunched with
    other options, or on another number of processes, rebuilds what it restores)."""
    config = _parity_config.ParityConfig(**parity)
    if self.parity is None:
      self.parity = _parity_worker.ParityWorker(self, config)
    elif self.parity.config != config:
      if self.parity.config.options != config.options:
        logger.info("parity options changed from %s to %s for later steps; the parity held "
                    "keeps its own", self.parity.config.options, config.options)
      self.parity.reconfigure(config)

  def op_reserve(self, pid: int, step: int, nbytes: int) -> _requests.Reserve.Reply:
    room = self._check_room(nbytes)
    note = None
    if self.persister is not None and self.table.crowded():
      note = _slots.short_of_room(keep=self.max_snapshots, spare=self.table.spare,
                                  nbytes=room[0], limit_bytes=self.limit_bytes,
                                  room_bytes=room[1], run_root=os.path.dirname(
                                      os.path.dirname(self.dir)),
                                  where=f"the snapshot agent of job {self.job!r} host {self.host}")
      self.crowded += 1
      logger.log(logging.WARNING if self.crowded & (self.crowded - 1) == 0 else logging.DEBUG,
                 "%s", note)
    stale = self.table.abandon(pid)
    for d in stale:
      logger.warning("slot %d: trainer pid %d moved on from step %s; freeing it",
                     d.index, pid, d.step)
    self._dropped(stale)
    r = self.table.reserve(step, nbytes, pid)
    if r is None:
      self.reap()
      r = self.table.reserve(step, nbytes, pid)
      if r is None:
        return _requests.Reserve.Reply(index=None, note=note)
    self._fit_slots()
    slot = self.slots[r.index]
    if r.grow:                     # too small, or lent to a restore: a new file
      slot.renew(nbytes)
    self._check_file_room(r.index)
    return _requests.Reserve.Reply(index=r.index, path=slot.path,
                                   size=self.table.slots[r.index].size,
                                   fresh=not slot.allocated, note=note)

  def _check_file_room(self, index: int) -> None:
    """The memory slot ``index``'s file lacks (a new file is sparse: the trainer
    allocates it in the background copy) must be free now, or the reservation is
    given up with HostMemoryBudgetError: said by this save, not by a failed copy."""
    size = self.table.slots[index].size
    try:
      lacking = size - os.stat(self.slots[index].path).st_blocks * 512
    except FileNotFoundError:
      lacking = size
    free = shutil.disk_usage(self.dir).free
    if lacking > free:
      self._dropped([self.table.abort(index)])
      raise errors.HostMemoryBudgetError(
          f"host {self.host}: a snapshot slot of {size / 2**20:.1f} MiB does not fit in "
          f"{self.dir}: {free / 2**20:.1f} MiB free there. Arrays restored from this agent "
          "keep the memory of the slot they were read from while they live (its next save "
          "needs a new file): drop or copy them, free shared memory, lower max_snapshots, "
          "or point AgentOptions.run_root at a larger filesystem")

  def op_preallocate(self, nbytes: int) -> _requests.Preallocate.Reply:
    """Sizes every free slot for snapshots of ``nbytes`` now (``prepare()``): the
    trainer allocates and maps their memory before its first save; one slot more
    when it persists (a held step's), as host memory allows."""
    self._check_room(nbytes)
    if self.persister is not None and self.table.spare:
      self.table.grow_to(max(len(self.table), self.table.base + 1))
      self._fit_slots()
    for i in self.table.grow_free(nbytes):
      self.slots[i].renew(nbytes)
    free = [s.index for s in self.table.slots
            if s.state == _slots.FREE and not s.pinned and s.size >= nbytes]
    return _requests.Preallocate.Reply(slots=[
        [i, self.slots[i].path, self.table.slots[i].size, not self.slots[i].allocated]
        for i in free])

  def _check_room(self, nbytes: int) -> tuple[int, int]:
    """Raises HostMemoryBudgetError, at the first save of a state (not a later one),
    if the loop's ``max_snapshots + 1`` slots of ``nbytes`` do not fit the budget
    or the run root's free memory. Sets how many slots more steps held for their
    persists may take (``table.spare``: what both have room for, counting what this
    agent holds already); returns the bytes of a slot (with its parity) and what
    the run root could hold."""
    self._ensure_slots()
    usable = self.max_snapshots + 1          # the loop's slots
    need = usable * nbytes
    per_slot = nbytes
    what = f"{usable} snapshot slots x {nbytes / 2**20:.1f} MiB"
    if self.parity is not None:
      pbytes = self.parity.estimate_bytes(nbytes)
      need += usable * pbytes
      per_slot += pbytes
      what += f" + {usable} parity slots x {pbytes / 2**20:.1f} MiB"
    if need > self.limit_bytes:
      raise errors.HostMemoryBudgetError(
          f"{what} = {need / 2**20:.1f} MiB exceed host_memory_limit_bytes={self.limit_bytes} "
          f"({self.limit_bytes / 2**20:.1f} MiB) on host {self.host}; lower "
          "max_snapshots, shard the state over more hosts, or raise the limit")
    held = sum(s.size for s in self.table.slots)
    held += 0 if self.parity is None else self.parity.bytes_held()
    free = shutil.disk_usage(self.dir).free
    if need > free + held:
      raise errors.HostMemoryBudgetError(
          f"{what} = {need / 2**20:.1f} MiB do not fit in {self.dir} on host {self.host}: "
          f"{free / 2**20:.1f} MiB free there (+ {held / 2**20:.1f} MiB this agent holds); "
          "free shared memory, lower max_snapshots, or point AgentOptions.run_root at a "
          "larger filesystem")
    self.table.spare = _slots.spare_slots(keep=self.max_snapshots, nbytes=per_slot,
                                          limit_bytes=self.limit_bytes, room_bytes=free + held)
    self._ensure_slots()                     # (retires what no longer fits)
    return per_slot, free + held

  def op_commit(self, index: int, manifest: str, step: int, nbytes: int,
                process: list[int], persist_attempt: str | None = None) -> _requests.Commit.Reply:
    """Slot ``index`` holds ``step``: it becomes visible. The trainer hashed every
    shard as it wrote it (the checksums are those of the slot's bytes); every
    read (a restore, a persist, a peer's parity rebuild) verifies them again."""
    size = self.table.writing(index, step).size
    have = _paths.file_size(self.slots[index].path)
    if not 0 <= nbytes <= min(size, have):
      self._dropped([self.table.abort(index)])
      raise errors.CorruptSnapshotError(
          f"step {step}: a commit of {nbytes} bytes into slot {index} of {size} bytes, whose "
          f"file holds {have} (truncated under the agent?); the snapshot is not kept")
    persist = persist_attempt is not None and self.persister is not None
    # a rollback, then the oldest; a step due for storage is held until persisted
    self._dropped(self.table.commit(index, step, hold=persist,
                                    attempt=str(persist_attempt) if persist else None))
    self.slots[index].allocated = True
    self.manifests[step] = manifest
    self.processes[step] = (int(process[0]), int(process[1]))
    self.deleted.pop(step, None)             # saved again after a delete
    if persist:
      self.persister.submit(step, str(persist_attempt))
    if self.parity is not None and step in self.manifests:
      self.parity.on_commit(step, self.manifest_of(step), manifest, self.processes[step])
    return _requests.Commit.Reply(steps=self.steps(), **self._persist_reply())

  def manifest_of(self, step: int, slot: _slots.SlotState | None = None) -> SnapshotManifest:
    """The manifest of committed ``step`` (or of the step ``slot`` holds, an earlier
    run's too), parsed once per commit: the parity thread and each persist of the step
    share it (StepNotFoundError if not committed). Parsed outside the agent's lock by
    whichever thread first needs it."""
    s = slot if slot is not None else self._slot_of(step)
    text = self.foreign_manifests[s.index] if s.foreign else self.manifests[step]
    got = self._parsed.get(s.index)
    if got is not None and got[0] is text:
      return got[1]
    manifest = SnapshotManifest.from_json(text)
    self._parsed[s.index] = (text, manifest)
    return manifest

  def _persist_reply(self, errors: bool = True) -> dict[str, Any]:
    """The persist status (and, with ``errors``, the errors since the last ask)."""
    p = self.persister
    if p is None:
      return {"persist": {}, "persist_errors": []}
    return {"persist": p.status().to_obj(),
            "persist_errors": [e.to_obj() for e in p.take_errors()] if errors else []}

  def held_for_persist(self, step: int) -> bool:
    """Whether committed ``step`` is held until its persist ends."""
    with self.lock:
      s = self.table.committed(step)
      return s is not None and s.held

  def protected(self, step: int) -> None:
    """Every host of ``step``'s parity group holds its parity (parity thread): the
    keep rule keeps it while it is the newest such step."""
    with self.lock:
      self._dropped(self.table.protect(step))

  def _release_held(self, step: int, attempt: str | None = None) -> None:
    """The persist ``attempt`` of ``step`` ended: the keep rule may drop it now
    (persist thread)."""
    with self.lock:
      self._dropped(self.table.release(step, attempt))

  @contextlib.contextmanager
  def _pinned(self, step: int, attempt: str | None = None):
    """Pins a committed step (the one held for persist ``attempt``, an earlier run's
    too) for the persist thread while it reads the slot."""
    me = -os.getpid()                   # a pin owner that reap() never treats as dead
    with self.lock:
      s = self.table.pin(step, me, attempt) or self._slot_of(step)
    mm = None
    try:
      manifest = self.manifest_of(step, s)
      if not s.size:
        yield manifest, b""
      else:
        mm = map_slot_file(self.slots[s.index].path, s.size)
        yield manifest, mm
    finally:
      if mm is not None:
        with contextlib.suppress(BufferError):   # views of a failed write live on a while:
          mm.close()                             # the map goes with the last of them
      with self.lock:
        self.table.unpin(s.index, me)

  def op_persisted(self, errors: bool = True) -> _requests.Persisted.Reply:
    """The persist status, and (``errors``) the persist errors since the last
    ask, each reported once."""
    return _requests.Persisted.Reply(**self._persist_reply(errors))

  def op_abort(self, index: int) -> _requests.Done:
    d = self.table.abort(index)
    self._dropped([d] if d else [])
    return _requests.Done()

  def op_peers(self, peers: dict[str, _requests.AgentAddress],
               merge: bool = False) -> _requests.Done:
    """The job's current agents by process index (their address records), published
    through the job's coordination service: parity reaches its peers there.
    ``merge``: only the processes named change (a trainer announces its new agent
    after the old one died)."""
    new = {int(h): msgspec.structs.asdict(info) for h, info in peers.items()}
    self.peers = {**self.peers, **new} if merge else new
    return _requests.Done()

  def op_discard(self, step: int, by: int | None = None) -> _requests.Discard.Reply:
    """Forgets ``step`` and fences its persists; ``persisting`` while one still
    runs (it will not commit: the caller asks again until it has ended). A
    delete's discard (``by`` the deleting host, this one or a peer) is
    remembered until the step is committed again, so that the other hosts'
    own deletes of it later find it gone, not missing (``deleted_by``)."""
    before = self.deleted.get(step)
    d = self.table.discard(step)
    self._dropped([d] if d else [])
    busy = False
    if self.persister is not None:
      self.persister.fence(step)
      busy = self.persister.busy(step)
    if by is not None:
      self.deleted.setdefault(step, by)
      while len(self.deleted) > _DELETES_KEPT:
        self.deleted.pop(next(iter(self.deleted)))
    return _requests.Discard.Reply(discarded=d is not None, persisting=busy, deleted_by=before)

  def op_steps(self) -> _requests.Steps.Reply:
    return _requests.Steps.Reply(steps=self.steps(), free_slots=self.table.room(),
                                 protected=self.table.protected_step())

  def op_bye(self, pid: int, owner: str | None = None) -> _requests.Done:
    """Trainer ``pid`` closed its manager ``owner``: it gives up the lease (if it
    holds it) and its pins."""
    self._dropped(self.table.forget([pid]))
    self.trainers.discard(pid)
    if self.lease is not None and self.lease[:2] == (pid, owner):
      self.lease = None
    return _requests.Done()

  def op_open(self, pid: int, step: int,
              lease_secs: float | None = None) -> _requests.Open.Reply:
    """Pins ``step`` for local reader ``pid``, or with ``lease_secs`` (a remote
    reader: ``handle`` gives one to every open over tcp, and none to an open over
    the local socket) for a reader id of its own whose pin ends with its lease,
    renewed by each bulk read of the step."""
    reader = pid if lease_secs is None else -next(self._bulk_readers)
    s = self.table.pin(step, reader) or self._slot_of(step)
    if lease_secs is not None:
      self.leases[reader] = (time.monotonic() + lease_secs, lease_secs)
    return _requests.Open.Reply(path=self.slots[s.index].path, manifest=self.manifests[step],
                                index=s.index, size=s.size,
                                reader=None if lease_secs is None else reader)

  def op_close(self, pid: int, step: int, index: int | None = None,
               lend: bool = False, reader: int | None = None) -> _requests.Done:
    """Unpins what ``op_open`` pinned: slot ``index`` (the step may have been
    dropped meanwhile), or the slot still holding ``step``; a leased pin by its
    ``reader``. With ``lend`` the (local) reader keeps views of the slot's memory
    (restored arrays): it is never written again, and its next reservation gets
    a new file."""
    s = self.table.committed(step) if index is None else self.table.slots[index]
    if reader is not None:
      self.leases.pop(reader, None)
    if s is not None:
      owner = pid if reader is None else reader
      if lend and reader is None and pid in s.pins:
        self.table.lend(s.index)
      self.table.unpin(s.index, owner)
    return _requests.Done()

  def _renew(self, s: _slots.SlotState) -> None:
    """A read of ``s``'s step: the leases of the remote readers pinning it go on."""
    now = time.monotonic()
    for r in s.pins:
      if r in self.leases:
        self.leases[r] = (now + self.leases[r][1], self.leases[r][1])

  def op_manifest(self, step: int) -> _requests.Manifest.Reply:
    self._slot_of(step)
    return _requests.Manifest.Reply(manifest=self.manifests[step])

  def op_held(self) -> _requests.Held.Reply:
    """Every committed step with the saving process index and count."""
    return _requests.Held.Reply(held=[[step, *self.processes[step]] for step in self.steps()])

  @contextlib.contextmanager
  def bulk(self, header: dict[str, Any]) -> Iterator[list[Any]]:
    """What a bulk request (:mod:`jaxckpt.net._bulk`) reads: byte ``ranges`` of
    ``step``'s snapshot (``what="snapshot"``), as views of the slot's memory
    sent without a copy, the step pinned until they are sent; or of the parity
    block of ``stripe`` (``what="parity"``)."""
    what, step, ranges = header.get("what"), int(header["step"]), header["ranges"]
    if what == "parity":
      with self.lock:
        path, size, start, nbytes = self._parity_worker().block_at(step, int(header["stripe"]))
        wanted = _checked(ranges, nbytes, f"parity of step {step}")
        self.served += sum(n for _, n in wanted)
      with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
        yield [mm[start + o:start + o + n] for o, n in wanted]       # copies, taken unlocked
      return
    if what != "snapshot":
      raise errors.InvalidArgumentError(f"bulk request for {what!r}: expected 'snapshot' or 'parity'")
    reader = -next(self._bulk_readers)          # a pin owner no trainer pid can be
    with self.lock:
      s = self.table.pin(step, reader) or self._slot_of(step)
      self._renew(s)
      view = memoryview(self.slots[s.index].read_map(s.size))
    try:
      wanted = _checked(ranges, s.size, f"step {step}")
      with self.lock:
        self.served += sum(n for _, n in wanted)
      yield [view[o:o + n] for o, n in wanted]
    finally:
      with self.lock:
        self.table.unpin(s.index, reader)

  def op_peer_manifest(self, step: int) -> _requests.PeerManifest.Reply:
    """A peer's parity thread asks: have you committed ``step``? (its manifest if so)."""
    steps = self.steps()
    return _requests.PeerManifest.Reply(manifest=self.manifests.get(step),
                                        newest=steps[-1] if steps else None)

  def op_parity_done(self, step: int, peer: int, digest: str) -> _requests.Done:
    """Group peer ``peer`` finished its parity of ``step`` (``ParityWorker.peer_done``)."""
    if self.parity is not None:
      self.parity.peer_done(int(step), int(peer), str(digest))
    return _requests.Done()

  def op_parity_status(self) -> _requests.ParityStatus.Reply:
    if self.parity is None:
      return _requests.ParityStatus.Reply(steps=[], bytes=0, config=None)
    return _requests.ParityStatus.Reply(**self.parity.status())

  def op_parity_info(self, step: int) -> _requests.ParityInfo.Reply:
    return _requests.ParityInfo.Reply(**self._parity_worker().info(step))

  def _parity_worker(self) -> Any:
    if self.parity is None:
      raise errors.StepNotFoundError(
          f"agent of job {self.job!r} host {self.host} holds no parity (no trainer "
          "asked for it: CheckpointOptions(parity=ParityOptions(...)))")
    return self.parity

  def op_status(self) -> _requests.Status.Reply:
    self.reap()                         # (what it says of pins is true now)
    parity_bytes = 0 if self.parity is None else self.parity.bytes_held()
    return _requests.Status.Reply(
        pid=os.getpid(), job=self.job, host=self.host, steps=self.steps(),
        slots=[{"index": s.index, "state": s.state, "step": s.step, "bytes": s.size,
                "readers": sum(1 for r in s.pins if r != _RETIRED)} for s in self.table.slots],
        bytes=sum(s.size for s in self.table.slots) + parity_bytes,
        parity_bytes=parity_bytes, trainers=sorted(self.trainers),
        max_snapshots=self.max_snapshots, limit_bytes=self.limit_bytes, served_bytes=self.served,
        lease=None if self.lease is None else {"pid": self.lease[0], "owner": self.lease[1],
                                               "generation": self.lease[2]},
        idle_secs=None if self.trainers else time.monotonic() - self.last_active,
        idle_timeout_secs=self.idle_timeout_secs)

  def op_stop(self) -> _requests.Done:
    self.stopping = True
    return _requests.Done()

  def idle(self) -> bool:
    self.reap()
    return (not self.trainers and
            time.monotonic() - self.last_active > self.idle_timeout_secs)

  def cleanup(self) -> None:
    for s in self.slots:
      if s.map is not None:
        with contextlib.suppress(BufferError):   # a reader still holds it: freed with it
          s.map.close()
        s.map = None
    shutil.rmtree(self.dir, ignore_errors=True)
    job = os.path.dirname(self.dir)
    with contextlib.suppress(OSError):
      os.unlink(_paths.log_file(self.dir))
    with contextlib.suppress(OSError):
      os.unlink(self.dir + ".lock")
      if set(os.listdir(job)) <= {"secret"}:    # the last agent of the job on this run root
        os.unlink(os.path.join(job, "secret"))
      os.rmdir(job)                             # the job's directory, once empty

  def op_job_view(self) -> _requests.JobView.Reply:
    """The job's agents as this one knows them, its persist configuration and lag."""
    p = self.persister
    since = None if p is None else p.status().oldest_since
    return _requests.JobView.Reply(
        peers={str(h): dict(info) for h, info in self.peers.items()},
        persist=None if p is None else p.config.to_obj(),
        directories=[] if p is None else p.directories(),
        lag_secs=None if since is None else max(0.0, time.time() - since))


# The lease of a pin taken over tcp without one (a reader elsewhere: its pid means
# nothing here), renewed by its reads of the step. jaxckpt's own readers ask for theirs
# (agent._remote.READ_LEASE_SECS); a pin that asks none holds its slot seconds, not a
# minute, once its reader stops reading.
REMOTE_LEASE_SECS = 10.0


# A trainer's requests (and the agent's own CLI's): they name processes of this machine
# by pid, so they come over the local socket only; over tcp they are refused.
_LOCAL_ONLY = (_requests.Hello, _requests.Reserve, _requests.Preallocate, _requests.Commit,
               _requests.Abort, _requests.Bye, _requests.Stop)


def _by_connection(request: _requests.Request, remote: bool) -> _requests.Request:
  """``request`` as its connection says, never as its fields say: over tcp (another
  machine, whose pids mean nothing here) a pin is leased (``REMOTE_LEASE_SECS`` unless
  it asks for its own) and closed by its reader id, and a trainer's request is refused;
  over the local socket a pin is the (kernel-given) pid's, whatever lease it asks for."""
  if remote and isinstance(request, _LOCAL_ONLY):
    raise errors.PermissionDeniedError(
        f"{request.op!r} is a trainer's request on this machine; it came over tcp (from "
        "another machine, whose pids mean nothing here) and was refused: send it over the "
        "agent's local (ipc) socket")
  if isinstance(request, _requests.Open):
    return msgspec.structs.replace(
        request, lease_secs=(request.lease_secs or REMOTE_LEASE_SECS) if remote else None)
  if remote and isinstance(request, _requests.Close) and request.reader is None:
    raise errors.InvalidArgumentError(
        f"close of step {request.step} over tcp names no reader: a pin taken over tcp is "
        "closed by the reader id its open's reply gave, never by a pid")
  return request


# Requests that only look (``jaxckpt status --watch``, ``agent status``): an agent
# whose trainers are gone still exits idle_timeout_secs after its last real use.
_WATCHING = (_requests.Status, _requests.JobView)


def handle(agent: Agent, frames: list[Any], *, remote: bool = False,
           peer_pid: int | None = None) -> list[bytes]:
  """One request's reply frames; ``remote``: it came over tcp (a pin it takes is leased).
  ``peer_pid``: the caller's pid as the kernel gives it for a local (ipc) connection, in
  this agent's pid namespace: a request's ``pid`` (the caller's own, in its namespace:
  a containerised trainer is pid 1 there, each time it restarts) stands for it."""
  try:
    req = _protocol.verify(agent.secret, frames, agent.replays)
  except Exception as e:  # pylint: disable=broad-except  (refused, logged, never run)
    logger.warning("refused a request: %s", e)
    err = e if isinstance(e, errors.PermissionDeniedError) else errors.PermissionDeniedError(
        f"malformed request refused ({type(e).__name__})")
    return [_protocol.pack({"ok": False, "error": str(err), "type": type(err).__name__})]
  op = req.get("op", "")
  if _protocol.expired(req):
    logger.warning("request %s arrived after its caller gave up; not applied", op)
    return [_protocol.pack({"ok": False, "type": "AgentUnavailableError",
                            "error": f"{op!r} arrived after its deadline; not applied"})]
  try:
    request = _requests.decode(req)
    if peer_pid and getattr(request, "pid", None) not in (None, peer_pid):
      request = msgspec.structs.replace(request, pid=peer_pid)
    request = _by_connection(request, remote)
    handler = HANDLERS[type(request)]
    if not isinstance(request, _WATCHING):       # a watcher does not keep an agent alive
      agent.last_active = time.monotonic()
    with agent.lock:
      out = handler(agent, **_schema.fields(request))
    if type(out) is not type(request).Reply:        # (a handler's bug, named to the caller)
      raise TypeError(f"Agent.op_{op} returned a {type(out).__qualname__}, not "
                      f"{type(request).Reply.__qualname__}")
    return [_protocol.pack({"ok": True, **_requests.encode_reply(out)})]
  except Exception as e:  # the error travels back to the caller, typed (never ends the loop)
    logger.warning("request %s failed: %s", op, e)
    return [_protocol.pack({"ok": False, "error": str(e), "type": type(e).__name__})]


# The handler of each request, by its type (agent/_requests.py is the table of
# requests): ``Agent.op_`` + its op. A request declared without one fails here, at import.
HANDLERS: dict[type[_requests.Request], Any] = {
    cls: getattr(Agent, "op_" + cls.op) for cls in _requests.REQUESTS.values()}


def serve(agent: Agent) -> None:
  """Serves until stopped, idle, or signalled; always frees the directory."""
  ctx = zmq.Context.instance()
  sock = ctx.socket(zmq.ROUTER)
  sock.setsockopt(zmq.LINGER, 1000)
  stop = []
  bulk = None
  signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
  signal.signal(signal.SIGINT, lambda *_: stop.append(1))
  try:
    sock.bind(_paths.ipc_endpoint(agent.dir))
    tcp_port = sock.bind_to_random_port(f"tcp://{agent.tcp_host}")
    bulk = _bulk.Server(agent.tcp_host, agent.secret, agent.bulk,
                        name=f"agent {agent.job} host {agent.host}")
    _write_address(agent, tcp_port, bulk.address)
    logger.info("agent of job %s host %d serving (pid %d)", agent.job, agent.host, os.getpid())
    while not stop and not agent.stopping:
      if not sock.poll(1000):
        if _idle(agent):
          logger.info("idle for %.0f s with no trainer; exiting", agent.idle_timeout_secs)
          break
        continue
      ident, empty, *frames = sock.recv_multipart(copy=False)
      remote = _over_tcp(empty)
      sock.send_multipart([ident, empty, *handle(agent, frames, remote=remote,
                                                 peer_pid=None if remote else _ipc_pid(empty))],
                          copy=False)  # no 2nd copy
  finally:
    sock.close(linger=1000)
    if bulk is not None:
      bulk.close()
    if agent.persister is not None:
      try:
        agent.persister.close()
      except errors.JaxckptError as e:      # what is left goes with the agent; its memory must
        logger.error("stopping: %s", e)       # still be freed below

    if agent.parity is not None:
      agent.parity.close()
    agent.cleanup()
    logger.info("agent of job %s host %d stopped; shared memory freed", agent.job, agent.host)


def _idle(agent: Agent) -> bool:
  """Whether the agent is idle; an error asking it (EMFILE: connections took the
  process's files) is logged and counts as busy: what it holds outlives it."""
  try:
    return agent.idle()
  except OSError as e:
    logger.warning("could not check for dead trainers (%s); serving on", e)
    return False


def _over_tcp(frame: Any) -> bool:
  """Whether ``frame`` came over tcp: its peer is an address (an ipc peer is named
  ``localhost:uid:gid:pid``, from the socket's credentials); unknown counts as tcp."""
  try:
    return not str(frame.get("Peer-Address")).startswith("localhost:")
  except (zmq.ZMQError, AttributeError):
    return True


def _ipc_pid(frame: Any) -> int | None:
  """The pid of an ipc peer in this process's pid namespace (from the socket's
  credentials: ``localhost:uid:gid:pid``); None where unknown, or not visible here
  (0: a sibling namespace, whose pids mean nothing here either)."""
  try:
    pid = int(str(frame.get("Peer-Address")).rsplit(":", 1)[1])
  except (zmq.ZMQError, AttributeError, IndexError, ValueError):
    return None
  return pid if pid > 0 else None


def _checked(ranges: list[list[int]], size: int, what: str) -> list[tuple[int, int]]:
  out = [(int(o), int(n)) for o, n in ranges]
  bad = [r for r in out if r[0] < 0 or r[1] < 0 or r[0] + r[1] > size]
  if bad:
    raise errors.InvalidArgumentError(f"byte ranges {bad} lie outside {what} ({size} bytes)")
  return out


def _write_address(agent: Agent, tcp_port: int, bulk: str) -> None:
  info = {"pid": os.getpid(), "job": agent.job, "host": agent.host,
          "ipc": _paths.ipc_endpoint(agent.dir), "tcp": f"tcp://{agent.tcp_host}:{tcp_port}",
          "bulk": bulk}
  tmp = _paths.address_file(agent.dir) + ".tmp"
  with open(tmp, "w") as f:
    json.dump(info, f)
  os.replace(tmp, _paths.address_file(agent.dir))

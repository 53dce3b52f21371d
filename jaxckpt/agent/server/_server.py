"""The snapshot agent process: owns a host's snapshots in shared memory.

Run by ``python -m jaxckpt.agent serve ...`` (spawned by the manager, or as a
sidecar by ``jaxckpt agent start``). It imports no JAX. One thread serves
requests in order; a step becomes visible when its trainer commits it, and
every read of it (a restore, a persist, a peer's parity rebuild) checks each
shard against the checksum the trainer took of the bytes it wrote.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import threading
import time
from typing import Any

import msgspec
import psutil
import zmq

from jaxckpt import errors
from jaxckpt.agent import _paths, _protocol, _requests
from jaxckpt.agent.server._durability import Durability
from jaxckpt.agent.server._job_keep import JobKeep
from jaxckpt.agent.server._parity_worker import ParityWorker
from jaxckpt.agent.server._reads import Reads
from jaxckpt.agent.server._slot_files import _RETIRED, SlotFiles
from jaxckpt.host import _persist, _slots
from jaxckpt.host.snapshot import SnapshotManifest
from jaxckpt.net import _bulk, _schema, _wire

logger = logging.getLogger("jaxckpt.agent")

# Deleted steps an agent remembers (the newest deletes).
_DELETES_KEPT = 1024



class Agent:
  """The agent's state and request handlers (no sockets here; see ``serve``).

  Its parts, each with the handlers of its requests (``HANDLERS``): ``files``
  (:class:`~jaxckpt.agent.server._slot_files.SlotFiles`: the slots' files and the memory they
  take), ``reads`` (:class:`~jaxckpt.agent.server._reads.Reads`: the readers' pins and the
  bulk path) and ``durable`` (:class:`~jaxckpt.agent.server._durability.Durability`: the
  persists and parity of committed steps).
  """

  def __init__(self, *, job: str, host: int, directory: str, max_snapshots: int,
               limit_bytes: int, idle_timeout_secs: float, secret: bytes,
               tcp_host: str = "127.0.0.1") -> None:
    self.job, self.host, self.dir = job, host, directory
    self.secret = secret
    self.lease: tuple[int, str | None, int] | None = None   # (trainer pid, its manager, generation)
    self.generation = 0
    self.tcp_host = tcp_host
    self.tcp_address: str | None = None   # tcp://host:port, once bound (_write_address)
    self.max_snapshots = max_snapshots
    self.limit_bytes = limit_bytes
    self.idle_timeout_secs = idle_timeout_secs
    # which slot holds what (shared rules), and each slot's one record: its step's
    # manifest, saving process, run, persist attempt and file (nothing kept beside it)
    self.table = _slots.SlotTable(max_snapshots)
    self.trainers: set[int] = set()
    self.last_active = time.monotonic()
    self.stopping = False
    self.lock = threading.RLock()      # the persist and parity threads use it too
    # process index -> its agent's address, as the job's current run published them
    self.peers: dict[int, dict[str, Any]] = {}
    self.replays = _wire.Replays()     # requests are applied at most once
    self.deleted: dict[int, int] = {}  # step -> the host whose delete came first (op_discard)
    self.rollbacks: dict[str, dict] = {}   # the job's rollbacks applied here (op_rollback)
    self.crowded = 0                   # reserves that found held steps in the loop's slots
    self.run: str | None = None        # the run whose snapshots it holds (its directory)
    self.files = SlotFiles(self)       # each slot's file, and the room they take
    self.reads = Reads(self)           # the readers' pins and the bulk path
    self.durable = Durability(self)    # the persist and parity glue
    self.keep = JobKeep(self)          # what the job's other hosts hold: the keep rule's

  @property
  def persister(self) -> _persist.Persister | None:
    """The persister (None until a trainer asks for persists): ``durable``'s."""
    return self.durable.persister

  @property
  def parity(self) -> ParityWorker | None:
    """The parity thread (None until a trainer asks for parity): ``durable``'s."""
    return self.durable.parity

  # -- helpers --------------------------------------------------------------

  def slot_of(self, step: int) -> _slots.SlotState:
    s = self.table.committed(step)
    if s is None:
      raise errors.StepNotFoundError(
          f"agent of job {self.job!r} host {self.host} holds no step {step} "
          f"(held: {self.steps()})")
    return s

  def steps(self) -> list[int]:
    return self.table.steps()

  def dropped(self, dropped: list[_slots.Dropped]) -> None:
    """Releases what the agent keeps beside slots the table freed."""
    if any(d.state == _slots.COMMITTED and not d.foreign for d in dropped):
      self.keep.changed()               # (the job's other hosts hear it)
    for d in dropped:
      if d.foreign:                     # an earlier run's step: its persist ended
        self.files.free_retired(self.table.slots[d.index])
        continue
      if d.state == _slots.COMMITTED and self.parity is not None:
        self.parity.drop(d.step)
      if d.held and self.persister is not None:   # rolled back before it was persisted
        self.persister.fence(d.step)
      self.files.free_retired(self.table.slots[d.index])

  def reap(self) -> None:
    """Forgets dead trainers (their half-written slots and their read pins, by pid:
    they are local) and remote readers whose lease ran out (never by pid)."""
    dead = {p for p in self.trainers | self.table.owners() if p > 0 and not psutil.pid_exists(p)}
    dead |= self.reads.expired()
    dropped = self.table.forget(dead)
    for d in dropped:
      logger.info("slot %d: its writer died mid-snapshot of step %s; discarding", d.index, d.step)
    self.dropped(dropped)
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
    if persist:
      self.durable.configure_persist(persist)
    if parity:
      self.durable.configure_parity(parity)
    self.trainers.add(pid)
    if max_snapshots is not None:     # (range-checked with the request, as every value is)
      self.max_snapshots = int(max_snapshots)
    if limit_bytes is not None:
      self.limit_bytes = int(limit_bytes)
    self.files.ensure()
    return _requests.Hello.Reply(pid=os.getpid(), steps=self.steps(), slots=self.max_snapshots + 1,
                                 generation=self.generation)

  def _start_run(self, run: str) -> None:
    """A trainer of run ``run`` (its directory): the snapshots of another run of the
    job are never offered to it: freed, or, while their persists run, held apart
    (foreign: no request by step reaches them, and no save of the new run drops or
    fences them, whatever its step numbers) until those persists end; the same run
    resumes them."""
    if self.run is not None and run != self.run:
      t = self.table
      dropped = t.new_run(run)           # (each slot's record goes with it, foreign or not)
      self.dropped(dropped)
      foreign = [s for s in t.slots if s.foreign]
      if self.persister is not None:
        self.persister.disown({st.attempt for st in foreign if st.attempt})
      if self.parity is not None:
        for step in list(self.parity.records):
          self.parity.drop(step)
      logger.info("job %s host %d: a new run (directory %r) follows run %r: the snapshots "
                  "of steps %s of the previous run are freed, those of %s once their "
                  "persists end", self.job, self.host, run, self.run,
                  [d.step for d in dropped], [st.step for st in foreign])
    self.table.new_run(run)              # (the first run: the steps held are its own)
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

  def op_reserve(self, pid: int, step: int, nbytes: int) -> _requests.Reserve.Reply:
    room = self.files.check_room(nbytes)
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
    self.dropped(stale)
    r = self.table.reserve(step, nbytes, pid)
    if r is None:
      self.reap()
      r = self.table.reserve(step, nbytes, pid)
      if r is None:
        return _requests.Reserve.Reply(index=None, note=note)
    self.files.fit()
    slot = self.files.of(r.index)
    if r.grow:                     # too small, or lent to a restore: a new file
      slot.renew(nbytes)
    self.files.check_file_room(r.index)
    return _requests.Reserve.Reply(index=r.index, path=slot.path,
                                   size=self.table.slots[r.index].size,
                                   fresh=not slot.allocated, note=note)

  def op_commit(self, index: int, manifest: str, step: int, nbytes: int,
                process: list[int], persist_attempt: str | None = None) -> _requests.Commit.Reply:
    """Slot ``index`` holds ``step``: it becomes visible. The trainer hashed every
    shard as it wrote it (the checksums are those of the slot's bytes); every
    read (a restore, a persist, a peer's parity rebuild) verifies them again."""
    size = self.table.writing(index, step).size
    have = _paths.file_size(self.files.of(index).path)
    if not 0 <= nbytes <= min(size, have):
      self.dropped([self.table.abort(index)])
      raise errors.CorruptSnapshotError(
          f"step {step}: a commit of {nbytes} bytes into slot {index} of {size} bytes, whose "
          f"file holds {have} (truncated under the agent?); the snapshot is not kept")
    persist = persist_attempt is not None and self.persister is not None
    # a rollback, then the oldest; a step due for storage is held until persisted
    saver = (int(process[0]), int(process[1]))
    self.dropped(self.table.commit(index, step, hold=persist,
                                    attempt=str(persist_attempt) if persist else None,
                                    manifest=manifest, process=saver))
    self.files.of(index).allocated = True
    self.deleted.pop(step, None)             # saved again after a delete
    self.keep.committed(step)
    if persist:
      self.persister.submit(step, str(persist_attempt))
    if self.parity is not None:
      self.parity.on_commit(step, self.manifest_of(step), manifest, saver)
    return _requests.Commit.Reply(steps=self.steps(), **self.durable.reply())

  def manifest_of(self, step: int, slot: _slots.SlotState | None = None) -> SnapshotManifest:
    """The manifest of committed ``step`` (or of the step ``slot`` holds, an earlier run's
    too), parsed once per commit by whichever thread first needs it (the parity thread
    and each persist of the step share it; StepNotFoundError if not committed)."""
    return (slot if slot is not None else self.slot_of(step)).parsed()

  def held_for_persist(self, step: int) -> bool:
    """Whether committed ``step`` is held until its persist ends (parity thread)."""
    return self.durable.held_for_persist(step)

  def protected(self, step: int) -> None:
    """Every host of ``step``'s parity group holds its parity (parity thread)."""
    self.durable.protected(step)

  def op_abort(self, index: int) -> _requests.Done:
    d = self.table.abort(index)
    self.dropped([d] if d else [])
    return _requests.Done()

  def op_peers(self, peers: dict[str, _requests.AgentAddress],
               merge: bool = False) -> _requests.Done:
    """The job's current agents by process index (their address records), published
    through the job's coordination service: parity reaches its peers there.
    ``merge``: only the processes named change (a trainer announces its new agent
    after the old one died)."""
    new = {int(h): msgspec.structs.asdict(info) for h, info in peers.items()}
    self.peers = {**self.peers, **new} if merge else new
    self.keep.peers_changed(merge)
    return _requests.Done()

  def op_discard(self, step: int, by: int | None = None) -> _requests.Discard.Reply:
    """Forgets ``step`` and fences its persists; ``persisting`` while one still
    runs (it will not commit: the caller asks again until it has ended). A
    delete's discard (``by`` the deleting host, this one or a peer) is
    remembered until the step is committed again, so that the other hosts'
    own deletes of it later find it gone, not missing (``deleted_by``)."""
    before = self.deleted.get(step)
    d = self.table.discard(step)
    self.dropped([d] if d else [])
    busy = False
    if self.persister is not None:
      self.persister.fence(step)
      busy = self.persister.busy(step)
    if by is not None:
      self.deleted.setdefault(step, by)
      while len(self.deleted) > _DELETES_KEPT:
        self.deleted.pop(next(iter(self.deleted)))
    return _requests.Discard.Reply(discarded=d is not None, persisting=busy, deleted_by=before)

  def op_rollback(self, id: str | None = None,  # pylint: disable=redefined-builtin
                  steps: tuple[int, ...] = (), by: int | None = None, run: str | None = None,
                  agents: tuple[str, ...] = ()) -> _requests.Rollback.Reply:
    """Rollback ``id``: its steps discarded in one request (no other request sees a part
    of it: a trainer killed meanwhile leaves it whole), recorded once (the newest
    ``_DELETES_KEPT``) for a relaunch to complete on the other agents."""
    applied = id is not None and id not in self.rollbacks
    if applied:
      for step in steps:
        self.op_discard(step, by)
      self.rollbacks[id] = {"steps": sorted(steps), "run": run, "agents": sorted(agents)}
      while len(self.rollbacks) > _DELETES_KEPT:
        self.rollbacks.pop(next(iter(self.rollbacks)))
    mine = self.rollbacks[id]["steps"] if id in self.rollbacks else []
    busy = [s for s in mine if self.persister is not None and self.persister.busy(s)]
    return _requests.Rollback.Reply(applied=applied, persisting=busy, rollbacks={
        i: _requests.RollbackRecord(**r) for i, r in self.rollbacks.items()})

  def op_steps(self) -> _requests.Steps.Reply:
    return _requests.Steps.Reply(steps=self.steps(), free_slots=self.table.room(),
                                 protected=self.table.protected_step())

  def op_bye(self, pid: int, owner: str | None = None) -> _requests.Done:
    """Trainer ``pid`` closed its manager ``owner``: it gives up the lease (if it
    holds it) and its pins."""
    self.dropped(self.table.forget([pid]))
    self.trainers.discard(pid)
    if self.lease is not None and self.lease[:2] == (pid, owner):
      self.lease = None
    return _requests.Done()

  def op_manifest(self, step: int) -> _requests.Manifest.Reply:
    return _requests.Manifest.Reply(manifest=self.slot_of(step).manifest)

  def op_held(self) -> _requests.Held.Reply:
    """Every committed step with the saving process index and count."""
    return _requests.Held.Reply(held=[[s.step, *s.process] for s in self.table.committed_slots()])

  def op_peer_manifest(self, step: int) -> _requests.PeerManifest.Reply:
    """A peer's parity thread asks: have you committed ``step``? (its manifest if so)."""
    steps, s = self.steps(), self.table.committed(step)
    return _requests.PeerManifest.Reply(manifest=None if s is None else s.manifest,
                                        newest=steps[-1] if steps else None)

  def op_status(self) -> _requests.Status.Reply:
    self.reap()                         # (what it says of pins is true now)
    parity_bytes = 0 if self.parity is None else self.parity.bytes_held()
    return _requests.Status.Reply(
        pid=os.getpid(), job=self.job, host=self.host, steps=self.steps(),
        slots=[_requests.SlotStatus(index=s.index, state=s.state, step=s.step, bytes=s.size,
                                    readers=sum(1 for r in s.pins if r != _RETIRED))
               for s in self.table.slots],
        bytes=sum(s.size for s in self.table.slots) + parity_bytes,
        parity_bytes=parity_bytes, trainers=sorted(self.trainers),
        max_snapshots=self.max_snapshots, limit_bytes=self.limit_bytes,
        served_bytes=self.reads.served,
        lease=None if self.lease is None else _requests.LeaseStatus(
            pid=self.lease[0], owner=self.lease[1], generation=self.lease[2]),
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
    """Frees the agent's files. The job's secret goes with the job's last agent on this
    run root, unless a trainer of it still lives (stopped, signalled or crashed under
    it): that trainer holds the secret, and the agent its next save starts (or a
    sidecar started again) must share it, never make a new one."""
    self.files.close()
    shutil.rmtree(self.dir, ignore_errors=True)
    with contextlib.suppress(OSError):
      os.unlink(_paths.log_file(self.dir))
    with contextlib.suppress(OSError):
      os.unlink(self.dir + ".lock")
    holders = self.trainers | ({self.lease[0]} if self.lease is not None else set())
    live = sorted(p for p in holders if p > 0 and _paths.pid_alive(p))
    if live:
      logger.info("the job's secret is kept for its live trainers %s", live)
    else:
      _paths.release_job_dir(os.path.dirname(os.path.dirname(self.dir)), self.job)

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
  try:   # its mac, its framing (ts, nonce, deadline: their schema), the replay window
    req = _protocol.verify(agent.secret, frames, agent.replays)
    late = _protocol.expired(req)
  except Exception as e:  # pylint: disable=broad-except  (refused, logged, never run)
    logger.warning("refused a request: %s", e)
    err = e if isinstance(e, errors.PermissionDeniedError) else errors.PermissionDeniedError(
        f"malformed request refused ({type(e).__name__})")
    return [_protocol.pack({"ok": False, "error": str(err), "type": type(err).__name__})]
  op = req.get("op", "")
  if late:
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


# The parts of an agent that handle requests of their own, by attribute.
_PARTS = {"files": SlotFiles, "reads": Reads, "durable": Durability, "keep": JobKeep}


def _handler(op: str) -> Any:
  """``Agent.op_`` + ``op``, or the ``op_`` method of the part of the agent that has it
  (called on that part of the agent it is given)."""
  name = "op_" + op
  if hasattr(Agent, name):
    return getattr(Agent, name)
  part = next((p for p, cls in _PARTS.items() if hasattr(cls, name)), None)
  if part is None:
    raise AttributeError(f"no handler of request {op!r}: neither Agent nor its parts "
                         f"({', '.join(_PARTS)}) have {name}")
  method = getattr(_PARTS[part], name)

  @functools.wraps(method)
  def on_part(agent: Agent, **fields: Any) -> Any:
    return method(getattr(agent, part), **fields)
  return on_part


# The handler of each request, by its type (agent/_requests.py is the table of
# requests): ``Agent.op_`` + its op, or its part's (``_PARTS``). A request declared
# without one fails here, at import.
HANDLERS: dict[type[_requests.Request], Any] = {
    cls: _handler(cls.op) for cls in _requests.REQUESTS.values()}


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
    bulk = _bulk.Server(agent.tcp_host, agent.secret, agent.reads.bulk,
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
    agent.keep.close()
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


def _write_address(agent: Agent, tcp_port: int, bulk: str) -> None:
  agent.tcp_address = f"tcp://{agent.tcp_host}:{tcp_port}"   # (its identity in the job's map)
  info = {"pid": os.getpid(), "job": agent.job, "host": agent.host,
          "ipc": _paths.ipc_endpoint(agent.dir), "tcp": agent.tcp_address, "bulk": bulk}
  tmp = _paths.address_file(agent.dir) + ".tmp"
  with open(tmp, "w") as f:
    json.dump(info, f)
  os.replace(tmp, _paths.address_file(agent.dir))

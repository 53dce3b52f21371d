"""The agent's parity thread: Reed-Solomon parity of this host's group, held in shared memory.

:class:`ParityWorker`, one per agent with parity on: after a step
commits on this host, a background thread of the agent (never the request
thread, never the trainer) waits until every host of its parity group has
committed the step, pulls the data chunks of the stripes it holds parity for
from their agents, encodes them, and stores its parity blocks in its own
shared-memory files. It also keeps every group member's manifest and the
checksums of every piece of its stripes: restore needs both to rebuild a lost
host (:mod:`jaxckpt.agent.trainer._parity_recovery`). A step is *protected* when every
host holds its parity for it: each
agent tells its group peers when its own parity of a step is done
(``parity_done``), and once all of its group has said so the keep rule keeps
that step while it is the newest such (``SlotTable.protect``), so a lost host
can always be rebuilt to some step while the newer ones wait for their parity.

Hosts are the saving processes of a step: its parity group, stripes, pieces and
``parity_done`` messages name them by the step's process indices (each agent's
record of a step keeps the index its trainer saved it as, and the parity options it
was made with). An agent reaches a peer through the job's map of its current
processes' agents (``Agent.peers``, from ``AgentStore.discover``), so a relaunched job
whose machines run other process indices than before (another number of processes)
still finds the agents that hold an earlier run's steps; without a map (one machine,
no ``jax.distributed``) through the run root, where the host id is the process index.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import xxhash

from jaxckpt import errors
from jaxckpt.agent import _paths, _requests
from jaxckpt.agent._parity_config import ParityConfig, _lib
from jaxckpt.agent._protocol import Client
from jaxckpt.host.snapshot import SnapshotManifest

if TYPE_CHECKING:
  from jaxckpt.parity.placement import Piece, StripeLayout

logger = logging.getLogger("jaxckpt.agent.parity")
R = TypeVar("R", bound=_requests.Reply)


@dataclasses.dataclass
class _ParitySlot:
  """A reused shared-memory file holding one step's parity blocks."""

  index: int
  path: str
  size: int = 0
  step: int | None = None


@dataclasses.dataclass
class Record:
  """This host's parity state for one committed step."""

  step: int
  committed_at: float
  state: str = "pending"                      # pending | done | failed
  slot: _ParitySlot | None = None
  blocks: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
  manifests: dict[int, str] = dataclasses.field(default_factory=dict)   # group host -> JSON
  checksums: list[list[Any]] = dataclasses.field(default_factory=list)
  process_count: int = 0
  secs: float | None = None
  error: str | None = None
  seq: int = 0                                 # the agent's commit count when it committed
  group: tuple[int, ...] = ()                  # the parity group's hosts (this one too)
  index: int = -1                              # the process that saved it here, of the step's
  config: ParityConfig | None = None           # the options its parity is made with


def _warm_up(config: ParityConfig) -> None:
  """Loads the compiled codec (seconds on a busy machine) before the first step needs it."""
  k = max(config.group_size - config.parity, 1)
  _lib().codec.codec(k, config.parity).encode([np.zeros(64, np.uint8)] * k)


# How long a group peer may hold a newer step (or none) but not this one before this
# one's parity is given up (it skipped it, has yet to roll back to it after a relaunch,
# or is a new agent that will never hold it).
AHEAD_GRACE_SECS = 30.0
# Steps whose peers' parity_done are kept (the newest): enough for any steps in flight.
PEERS_DONE_KEPT = 64


def _digest(rec: "Record") -> str:
  """What identifies the group's snapshots of a step that a parity covered: every
  member's manifest, in group order (``parity_done``)."""
  h = xxhash.xxh3_64()
  for host in rec.group:
    h.update(rec.manifests.get(host, "").encode())
    h.update(b"\0")
  return h.hexdigest()


class _Superseded(Exception):
  """A newer step committed here while this one waited: skip it."""


class ParityWorker:
  """Computes and holds this agent's parity, on its own thread.

  ``agent`` is the :class:`jaxckpt.agent.server._server.Agent`; its ``lock`` guards
  ``records`` and the parity slots, and is never held during network I/O or
  encoding.
  """

  def __init__(self, agent: Any, config: ParityConfig) -> None:
    self.agent = agent
    self.config = config
    self.records: dict[int, Record] = {}
    self.slots: list[_ParitySlot] = []
    self.process_count: int | None = None
    self._newest = -1          # the step committed last (lower after a rollback)
    self._seq = 0              # commits so far: a record with a lower seq is superseded
    # step -> {group peer: digests of the group's manifests its parity covered}
    self._peers_done: dict[int, dict[int, set[str]]] = {}
    self._peers: dict[int, tuple[int, Client]] = {}
    self._scratch_bufs: list[np.ndarray] = []
    self._stop = threading.Event()
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxckpt-parity")
    self._pool.submit(_warm_up, config)   # load the codec off the request thread

  # -- called by the agent, under its lock ------------------------------------

  def on_commit(self, step: int, manifest: SnapshotManifest, manifest_json: str,
                process: tuple[int, int]) -> None:
    """Schedules the parity of a just-committed step (its manifest, and as JSON; saved
    by ``process`` = (index, count) of its job); returns at once."""
    self._seq += 1
    rec = self.records[step] = Record(step, time.monotonic(), seq=self._seq, index=process[0],
                                      process_count=process[1], config=self.config)
    self._newest = step
    self._pool.submit(self._run, rec, manifest, manifest_json)

  def peer_done(self, step: int, host: int, digest: str) -> None:
    """Group peer ``host`` finished its parity of ``step`` over the group's
    snapshots whose manifests have ``digest``: the step is protected once every
    member of the group has, each over the very snapshots this host's parity
    covered (not one of a timeline the job rolled back from)."""
    self._peers_done.setdefault(step, {}).setdefault(host, set()).add(digest)
    while len(self._peers_done) > PEERS_DONE_KEPT:   # a peer's word on steps never seen here
      del self._peers_done[min(self._peers_done)]
    rec = self.records.get(step)
    if rec is not None:
      self._maybe_protected(rec)

  def _maybe_protected(self, rec: Record) -> None:
    """Under the agent's lock: tells the agent once all of ``rec``'s group is done."""
    if not (rec.state == "done" and rec.group and self.records.get(rec.step) is rec):
      return
    done, mine = self._peers_done.get(rec.step, {}), _digest(rec)
    if all(mine in done.get(h, ()) for h in rec.group if h != rec.index):
      self.agent.protected(rec.step)

  def reconfigure(self, config: ParityConfig) -> None:
    """Later steps' parity is made with ``config``; the parity held keeps the options
    it was made with (a relaunch with other options, or on another number of
    processes, still rebuilds the steps it restores)."""
    if config.options != self.config.options:
      self._pool.submit(_warm_up, config)
    self.config = config

  def drop(self, step: int) -> None:
    """Forgets a dropped step's parity (its slot is reused once no thread writes it)."""
    self._peers_done.pop(step, None)
    rec = self.records.pop(step, None)
    if rec is not None and rec.slot is not None and rec.state != "pending":
      rec.slot.step = None

  def bytes_held(self) -> int:
    return sum(s.size for s in self.slots)

  def estimate_bytes(self, nbytes: int) -> int:
    """Parity bytes of a snapshot of ``nbytes`` on this host (for the memory budget)."""
    n = self.process_count or self.config.group_size
    smallest_group = n // -(-n // self.config.group_size)     # as placement.groups splits
    k = max(smallest_group - self.config.parity, 1)
    return self.config.parity * -(-nbytes // k)

  def status(self) -> dict[str, Any]:
    return {"steps": [[r.step, r.state, r.secs, r.error, r.process_count, r.index,
                       r.config.group_size, r.config.parity]
                      for r in sorted(self.records.values(), key=lambda r: r.step)],
            "bytes": self.bytes_held(), "config": self.config.to_obj()}

  def info(self, step: int) -> dict[str, Any]:
    rec = self._done(step)
    return {"process_count": rec.process_count, "config": rec.config.to_obj(),
            "manifests": rec.manifests, "checksums": rec.checksums,
            "stripes": sorted(rec.blocks), "index": rec.index}

  def block_at(self, step: int, stripe: int) -> tuple[str, int, int, int]:
    """Where the parity block of ``stripe`` of ``step`` lies: (file, its size,
    offset, length). Read it outside the agent's lock (a later step may reuse
    the file meanwhile: its bytes then fail the block's checksum)."""
    rec = self._done(step)
    if stripe not in rec.blocks:
      raise errors.StepNotFoundError(
          f"host {self.agent.host} holds no parity of stripe {stripe} of step {step} "
          f"(it holds stripes {sorted(rec.blocks)})")
    off, n = rec.blocks[stripe]
    return rec.slot.path, rec.slot.size, off, n

  def close(self) -> None:
    self._stop.set()
    self._pool.shutdown(wait=False, cancel_futures=True)

  def _done(self, step: int) -> Record:
    rec = self.records.get(step)
    if rec is None or rec.state != "done":
      raise errors.StepNotFoundError(
          f"host {self.agent.host} holds no finished parity of step {step} (parity "
          f"states: { {r.step: r.state for r in self.records.values()} })")
    return rec

  # -- the parity thread ----------------------------------------------------

  def _run(self, rec: Record, manifest: SnapshotManifest, manifest_json: str) -> None:
    try:
      if self._superseded(rec):          # fell behind: protect the newest step instead
        raise _Superseded()
      self._protect(rec, manifest, manifest_json)
    except _Superseded:
      self._finish(rec, "failed", f"superseded by step {self._newest} before its peers committed")
      logger.info("step %d: parity skipped, superseded by step %d", rec.step, self._newest)
    except Exception as e:  # pylint: disable=broad-except  (recorded; a save never fails on it)
      self._finish(rec, "failed", f"{type(e).__name__}: {e}")
      logger.warning("step %d: parity on host %d failed: %s", rec.step, self.agent.host, e)
    else:
      self._finish(rec, "done", None)
      logger.info("step %d: parity stored on host %d (%.3f s after commit)", rec.step,
                  self.agent.host, rec.secs)
      self._tell_done(rec)

  def _tell_done(self, rec: Record) -> None:
    """Tells the group's peers this host's parity of ``rec.step`` is done (network
    I/O: outside the agent's lock; a peer that does not hear it keeps the step
    unprotected, which only keeps an older step longer)."""
    digest = _digest(rec)
    for h in rec.group:
      if h != rec.index:
        try:
          self._ask(h, _requests.ParityDone(step=rec.step, peer=rec.index, digest=digest),
                    timeout_secs=1.0)
        except Exception as e:  # pylint: disable=broad-except  (never ends the parity thread)
          logger.warning("step %d: telling host %d its parity is done failed: %s", rec.step, h, e)

  def _finish(self, rec: Record, state: str, error: str | None) -> None:
    with self.agent.lock:
      rec.state, rec.error = state, error
      rec.secs = time.monotonic() - rec.committed_at
      if rec.slot is not None and (state != "done" or self.records.get(rec.step) is not rec):
        rec.slot.step = None            # failed, or dropped while we computed it
      if state == "done":
        self._maybe_protected(rec)      # its group's peers may all have said so already

  def _protect(self, rec: Record, manifest: SnapshotManifest, manifest_json: str) -> None:
    me, n = manifest.process_index, manifest.process_count
    self.process_count = rec.process_count = n
    self._check_reachable(me)
    options = rec.config.options
    _lib().check_hosts(n, options)
    group = next(g for g in _lib().groups(n, options.group_size) if me in g)
    rec.group = tuple(group)
    parsed = {me: manifest}
    rec.manifests = self._gather(rec, group, me, manifest_json, parsed)
    sizes = [0] * n
    for h, m in parsed.items():
      sizes[h] = m.nbytes
    layout = _lib().StripeLayout.build(sizes, options)
    mine = layout.parity_pieces(me)
    if not sum(p.nbytes for p in mine):
      return                  # this host holds no parity of the step (its group's data is elsewhere)
    slot = self._reserve(rec, sum(p.nbytes for p in mine))
    # Written through its descriptor (pwrite), never a map: a file truncated under the
    # agent (a /dev/shm cleaner, a hostile process) is then grown again by the write, its
    # lost bytes failing the block's checksum when read, where a write through a map past
    # the file's new end is SIGBUS, the agent and every step it holds lost.
    fd = os.open(slot.path, os.O_WRONLY)
    try:
      if os.fstat(fd).st_size < slot.size:        # truncated while free: reserve it again
        _paths.allocate(slot.path, slot.size, host=self.agent.host)
      self._encode(rec, layout, mine, fd)
    finally:
      os.close(fd)

  def _check_reachable(self, me: int) -> None:
    """Refuses a step whose process index its peers cannot reach this agent by: the
    job's map names another agent for it (the step is of a run whose processes the
    map no longer describes), or, with no map, this agent's host id is another."""
    peers = self.agent.peers
    if peers:
      mine = peers.get(me)
      if mine is None or mine.get("pid") != os.getpid():
        raise errors.InvalidArgumentError(
            f"this agent (host {self.agent.host}) got the snapshot of process {me}, but the "
            f"job's agents map process {me} to "
            + (f"the agent at {mine.get('tcp')}" if mine else "no agent")
            + " (a run of the job with other processes): its parity is given up")
    elif me != self.agent.host:
      raise errors.InvalidArgumentError(
          f"parity needs the agent's host id to equal the saving process index when the "
          f"job published no map of its agents, but host {self.agent.host} got the snapshot "
          f"of process {me}; leave AgentOptions.host_id unset (the job then agrees which "
          "agent serves each process)")

  def _encode(self, rec: Record, layout: StripeLayout, mine: tuple[Piece, ...],
              fd: int) -> None:
    """Streams each stripe in sub-blocks: pull k data ranges, encode them, write this
    host's parity row into the parity file ``fd`` (pwrite). Small, equal-sized transfers
    reuse memory the allocator already touched (first touch of fresh memory costs
    seconds per GiB) and bound what is in flight to k sub-blocks."""
    off = 0
    for piece in mine:
      stripe = layout.stripes[piece.stripe]
      block, k = stripe.block_bytes, len(stripe.data)
      hashes = [xxhash.xxh3_64() for _ in range(k)]
      written = xxhash.xxh3_64()                       # (checksum() of the whole block)
      rs = _lib().codec.codec(k, len(stripe.parity))   # (the layout's, the record's options)
      sub = self.config.sub_block_bytes
      for lo in range(0, block, sub):
        hi = min(block, lo + sub)
        data = [self._pull(rec.step, p, lo, hi, h) for p, h in zip(stripe.data, hashes)]
        outs = [self._scratch(t + k, hi - lo) for t in range(len(stripe.parity))]
        rs.encode_into(data, outs)
        row = next(o for o, p in zip(outs, stripe.parity) if p is piece)
        written.update(row)
        _pwrite_all(fd, row, off + lo)
      rec.checksums += [_ck(p, h.hexdigest()) for p, h in zip(stripe.data, hashes)]
      rec.checksums.append(_ck(piece, written.hexdigest()))
      rec.blocks[stripe.id] = (off, block)
      off += block

  def _scratch(self, i: int, nbytes: int) -> np.ndarray:
    """Reused buffer ``i`` (padded data ranges, parity rows other holders keep)."""
    while len(self._scratch_bufs) <= i:
      self._scratch_bufs.append(np.empty(0, np.uint8))
    if self._scratch_bufs[i].size < nbytes:
      self._scratch_bufs[i] = np.empty(max(nbytes, self.config.sub_block_bytes), np.uint8)
    return self._scratch_bufs[i][:nbytes]

  def _reserve(self, rec: Record, nbytes: int) -> _ParitySlot:
    with self.agent.lock:
      if self.records.get(rec.step) is not rec:
        raise _Superseded()
      free = [s for s in self.slots if s.step is None]
      if not free:
        i = len(self.slots)
        self.slots.append(_ParitySlot(i, os.path.join(self.agent.dir, f"parity{i}.bin")))
        free = [self.slots[-1]]
      slot = max(free, key=lambda s: s.size >= nbytes)
      if slot.size < nbytes:
        _paths.allocate(slot.path, nbytes, host=self.agent.host)   # 0600, memory reserved
        slot.size = nbytes
      slot.step, rec.slot = rec.step, slot
      return slot

  def _pull(self, step: int, piece: Piece, lo: int, hi: int, hasher: Any) -> np.ndarray:
    """Bytes [lo, hi) of a data piece from its host, zero past the piece's end."""
    n = max(0, min(hi, piece.nbytes) - lo)
    data = np.empty(0, np.uint8)
    if n:
      data, = self._peer(piece.host).read("snapshot", step, [(piece.start + lo, n)])
      hasher.update(data)
    if n == hi - lo:
      return data
    out = self._scratch(piece.slot, hi - lo)
    out[:n] = data
    out[n:] = 0
    return out

  def _superseded(self, rec: Record) -> bool:
    """A later commit came (a newer step, or an older or the same one after a
    rollback), or the step was dropped: protect the current timeline instead.
    A step held for its persist is never superseded by a newer one: its parity
    is what lets a host lost while it is written to storage be rebuilt, and
    its persist finished (``AgentStore.recover_persists``)."""
    if self.records.get(rec.step) is not rec:
      return True
    return self._seq > rec.seq and not self.agent.held_for_persist(rec.step)

  def _gather(self, rec: Record, group: tuple[int, ...], me: int, manifest_json: str,
              parsed: dict[int, SnapshotManifest]) -> dict[int, str]:
    """Every group member's manifest of ``rec.step`` (JSON), once each has committed
    it; each one parsed (once) into ``parsed``."""
    step = rec.step
    out = {me: manifest_json}
    start = time.monotonic()
    deadline = start + self.config.timeout_secs
    # A peer whose newest step is newer skipped or dropped this one, or still holds a
    # step of a timeline the job rolled back from (it commits this one soon): it is
    # given up on only once it has stayed ahead for a while.
    ahead_for = AHEAD_GRACE_SECS      # past timeout_secs: the timeout names the late hosts
    while True:
      for h in [h for h in group if h not in out]:
        r = self._ask(h, _requests.PeerManifest(step=step))
        if r is None:
          continue
        if r.manifest is not None:
          parsed[h] = _saved_by(r.manifest, h, rec.process_count, step)
          out[h] = r.manifest
        elif ((r.newest is None or r.newest > step)
              and time.monotonic() - start > ahead_for):
          held = ("holds no step" if r.newest is None
                  else f"committed step {r.newest} but not step {step}")
          raise errors.StepNotFoundError(
              f"host {h} {held} within {ahead_for} s (it skipped or dropped it, or its agent "
              f"is new), so step {step} cannot be protected")
      late = [h for h in group if h not in out]
      if not late:
        return out
      if self._superseded(rec) or self._stop.is_set():
        raise _Superseded()
      if time.monotonic() > deadline:
        raise errors.SnapshotTimeoutError(
            f"parity of step {step} on host {me}: hosts {late} of parity group "
            f"{list(group)} did not commit step {step} within {self.config.timeout_secs} s")
      time.sleep(self.config.poll_secs)

  def _ask(self, host: int, req: _requests.Request[R],
           timeout_secs: float = 5.0) -> R | None:
    try:
      return self._peer(host).call(req, timeout_secs=min(timeout_secs, self.config.timeout_secs))[0]
    except errors.AgentUnavailableError as e:
      logger.debug("host %d: %s", host, e)
      self._peers.pop(host, None)
      return None

  def _peer(self, host: int) -> Client:
    """A client of ``host``'s live agent over TCP: at the address the job published
    (``Agent.peers``, multi-host jobs), else the one under this run root; a new
    client when the host's agent was replaced."""
    d = os.path.join(os.path.dirname(self.agent.dir), f"host{host}")
    known = self.agent.peers.get(host)
    info = known if known is not None else _paths.read_address(d)
    cached = self._peers.pop(host, None)
    if info is None:
      if cached is not None:
        cached[1].close()
      raise errors.AgentUnavailableError(
          f"host {host} of job {self.agent.job!r} has no live snapshot agent at {d}")
    if cached is not None and cached[0] == info["pid"]:
      self._peers[host] = cached
      return cached[1]
    if cached is not None:
      cached[1].close()
    client = Client.of(info, who=f"snapshot agent of host {host} (pid {info['pid']})",
                       timeout_secs=self.config.timeout_secs, secret=self.agent.secret)
    self._peers[host] = (info["pid"], client)
    return client


def _saved_by(manifest: str, index: int, count: int, step: int) -> SnapshotManifest:
  """``manifest`` parsed; StepNotFoundError unless it is of process ``index`` of a job of
  ``count`` processes: the agent the job's map names for ``index`` holds the step of
  another run of the job, where it served another process."""
  m = SnapshotManifest.from_json(manifest)
  if (m.process_index, m.process_count) != (index, count):
    raise errors.StepNotFoundError(
        f"the agent the job maps process {index} to holds step {step} as process "
        f"{m.process_index} of {m.process_count}, not of {count}: the job runs on other "
        f"processes now, so step {step} cannot be protected")
  return m


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
  view, done = memoryview(data).cast("B"), 0
  while done < len(view):
    done += os.pwrite(fd, view[done:], offset + done)


def _ck(piece: Piece, value: str) -> list[Any]:
  return [piece.stripe, piece.slot, piece.host, piece.start, piece.stop, value]

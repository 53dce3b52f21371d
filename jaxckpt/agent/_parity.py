"""Reed-Solomon parity across the agents of a job, and recovery of lost hosts.

Agent side (:class:`ParityWorker`, one per agent with parity on): after a step
commits on this host, a background thread of the agent (never the request
thread, never the trainer) waits until every host of its parity group has
committed the step, pulls the data chunks of the stripes it holds parity for
from their agents, encodes them, and stores its parity blocks in its own
shared-memory files. It also keeps every group member's manifest and the
checksums of every piece of its stripes: restore needs both to rebuild a lost
host. A step is *protected* when every host holds its parity for it: each
agent tells its group peers when its own parity of a step is done
(``parity_done``), and once all of its group has said so the keep rule keeps
that step while it is the newest such (``SlotTable.protect``), so a lost host
can always be rebuilt to some step while the newer ones wait for their parity.

Restore side (:func:`survey`, :func:`recover`, :func:`rebuild_ranges`): which steps the
survivors can rebuild, the rebuilt, checksum-verified snapshots of lost hosts, and
the byte ranges of them that a restore onto another mesh needs.

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
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import xxhash

from jaxckpt import errors
from jaxckpt.agent import _paths, _requests
from jaxckpt.agent._protocol import Client, each
from jaxckpt.host.snapshot import SnapshotManifest, checksum

if TYPE_CHECKING:
  from jaxckpt.parity.placement import ParityOptions, Piece, StripeLayout


def _lib() -> Any:
  """``jaxckpt.parity``, imported on first use: its compiled codec takes a while to
  load, and an agent answers its trainer's hello before that (see ParityWorker)."""
  import jaxckpt.parity  # pylint: disable=import-outside-toplevel
  return jaxckpt.parity

logger = logging.getLogger("jaxckpt.agent.parity")


@dataclasses.dataclass(frozen=True)
class ParityConfig:
  """What the trainer tells its agent at hello (``CheckpointOptions.parity``)."""

  group_size: int
  parity: int
  timeout_secs: float = 300.0
  poll_secs: float = 0.005
  sub_block_bytes: int = 4 << 20     # pulled and encoded per data host at a time

  @property
  def options(self) -> ParityOptions:
    return _lib().ParityOptions(group_size=self.group_size, parity=self.parity)

  def to_obj(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


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

  ``agent`` is the :class:`jaxckpt.agent._server.Agent`; its ``lock`` guards
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

  def on_commit(self, step: int, manifest: str, process: tuple[int, int]) -> None:
    """Schedules the parity of a just-committed step (saved by ``process`` = (index,
    count) of its job); returns at once."""
    self._seq += 1
    rec = self.records[step] = Record(step, time.monotonic(), seq=self._seq, index=process[0],
                                      process_count=process[1], config=self.config)
    self._newest = step
    self._pool.submit(self._run, rec, SnapshotManifest.from_json(manifest), manifest)

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
          self._ask(h, "parity_done", timeout_secs=1.0, step=rec.step, peer=rec.index,
                    digest=digest)
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
    rec.manifests = self._gather(rec, group, me, manifest_json)
    sizes = [0] * n
    for h, js in rec.manifests.items():
      sizes[h] = SnapshotManifest.from_json(js).nbytes
    layout = _lib().StripeLayout.build(sizes, options)
    mine = layout.parity_pieces(me)
    if not sum(p.nbytes for p in mine):
      return                  # this host holds no parity of the step (its group's data is elsewhere)
    slot = self._reserve(rec, sum(p.nbytes for p in mine))
    buf = np.memmap(slot.path, np.uint8, mode="r+", shape=(slot.size,))
    try:
      self._encode(rec, layout, mine, buf)
    finally:
      del buf

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
              buf: np.ndarray) -> None:
    """Streams each stripe in sub-blocks: pull k data ranges, encode them into the
    parity file. Small, equal-sized transfers reuse memory the allocator already
    touched (first touch of fresh memory costs seconds per GiB) and bound what is
    in flight to k sub-blocks."""
    off = 0
    for piece in mine:
      stripe = layout.stripes[piece.stripe]
      block, k = stripe.block_bytes, len(stripe.data)
      out = buf[off:off + block]
      hashes = [xxhash.xxh3_64() for _ in range(k)]
      rs = _lib().codec.codec(k, len(stripe.parity))   # (the layout's, the record's options)
      sub = self.config.sub_block_bytes
      for lo in range(0, block, sub):
        hi = min(block, lo + sub)
        data = [self._pull(rec.step, p, lo, hi, h) for p, h in zip(stripe.data, hashes)]
        outs = [out[lo:hi] if p is piece else self._scratch(t + k, hi - lo)
                for t, p in enumerate(stripe.parity)]
        rs.encode_into(data, outs)
      rec.checksums += [_ck(p, h.hexdigest()) for p, h in zip(stripe.data, hashes)]
      rec.checksums.append(_ck(piece, checksum(out)))
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

  def _gather(self, rec: Record, group: tuple[int, ...], me: int,
              manifest_json: str) -> dict[int, str]:
    """Every group member's manifest of ``rec.step``, once each has committed it."""
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
        r = self._ask(h, "peer_manifest", step=step)
        if r is None:
          continue
        if r.manifest is not None:
          _check_saved_by(r.manifest, h, rec.process_count, step)
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

  def _ask(self, host: int, op: str, timeout_secs: float = 5.0,
           **kw: Any) -> _requests.Reply | None:
    try:
      return self._peer(host).call(op, timeout_secs=min(timeout_secs, self.config.timeout_secs),
                                   **kw)[0]
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


def _check_saved_by(manifest: str, index: int, count: int, step: int) -> None:
  """Raises StepNotFoundError unless ``manifest`` is of process ``index`` of a job of
  ``count`` processes: the agent the job's map names for ``index`` holds the step of
  another run of the job, where it served another process."""
  m = SnapshotManifest.from_json(manifest)
  if (m.process_index, m.process_count) != (index, count):
    raise errors.StepNotFoundError(
        f"the agent the job maps process {index} to holds step {step} as process "
        f"{m.process_index} of {m.process_count}, not of {count}: the job runs on other "
        f"processes now, so step {step} cannot be protected")


def _ck(piece: Piece, value: str) -> list[Any]:
  return [piece.stripe, piece.slot, piece.host, piece.start, piece.stop, value]


# -- restore side -------------------------------------------------------------


@dataclasses.dataclass
class StepParity:
  """What the live agents of a job say about one step.

  Attributes:
    step: The step.
    process_count: Saving processes (hosts) of the step.
    options: The parity options it was protected with.
    held: Hosts whose agent holds the step's snapshot.
    done: Hosts whose agent holds all of its parity for the step.
  """

  step: int
  process_count: int
  options: ParityOptions
  held: set[int] = dataclasses.field(default_factory=set)
  done: set[int] = dataclasses.field(default_factory=set)
  errors: dict[int, str] = dataclasses.field(default_factory=dict)

  @property
  def lost(self) -> list[int]:
    return sorted(set(range(self.process_count)) - self.held)

  @property
  def protected(self) -> bool:
    return self.done == set(range(self.process_count))

  def check(self) -> None:
    """Raises unless the survivors can rebuild every lost host of this step.

    Raises:
      UnrecoverableLossError: a group lost more hosts than parity (naming the
        groups and hosts), or a survivor of a damaged group has no parity.
    """
    layout = _lib().StripeLayout.build([0] * self.process_count, self.options)
    try:
      _lib().check_recoverable(layout, self.lost)
    except errors.UnrecoverableLossError as e:
      raise errors.UnrecoverableLossError(f"step {self.step}: {e}") from None
    hit = [g for g in layout.groups if set(g) & set(self.lost)]
    missing = sorted(h for g in hit for h in g if h in self.held and h not in self.done)
    if missing:
      raise errors.UnrecoverableLossError(
          f"step {self.step}: hosts {self.lost} are lost and survivors {missing} of their "
          "parity groups hold no finished parity of it (it was never protected); restore "
          "an older protected step or from storage")


def survey(clients: dict[int, Client]) -> dict[int, StepParity]:
  """Steps that some live agent holds parity (or a parity record) for, by the step's
  process indices (an agent's record says which process saved the step there, and
  with which parity options). Where another run of the job saved the same step on
  another number of processes, the size whose snapshots more agents hold stands."""
  out: dict[tuple[int, int], StepParity] = {}
  held: dict[int, dict[int, set[int]]] = {}    # step -> count -> indices
  said = each(clients, lambda c: (c.call("parity_status")[0], c.call("held")[0].held))
  for key, (status, here) in sorted(said.items()):
    c = clients[key]
    for step, index, count in here:
      held.setdefault(step, {}).setdefault(count, set()).add(index)
    if status.config is None:
      continue
    cfg = ParityConfig(**status.config)
    index_of = {step: index for step, index, _ in here}
    for entry in status.steps:
      step, state, _, error, count = entry[:5]
      if not count:
        continue
      index = entry[5] if len(entry) > 5 else index_of.get(step, c.host)   # (an older agent's)
      options = (cfg.options if len(entry) < 8 else
                 _lib().ParityOptions(group_size=entry[6], parity=entry[7]))
      sp = out.setdefault((step, count), StepParity(step, count, options))
      if state == "done":
        sp.done.add(index)
      elif error:
        sp.errors[index] = error
  for (step, count), sp in out.items():
    sp.held = held.get(step, {}).get(count, set())
  return {sp.step: sp for sp in sorted(out.values(), key=lambda sp: (sp.step, len(sp.held)))}


@dataclasses.dataclass
class Survivors:
  """What the live agents keep to rebuild a step's lost hosts: its stripe layout, every
  saving process's manifest, each piece's checksum, and the agent that was each
  process for the step (by the step's process index)."""

  step: int
  layout: StripeLayout
  manifests: dict[int, str]
  checksums: dict[Piece, str]
  holders: dict[int, Client]


def survivors(clients: dict[int, Client], step: int, lost: list[int],
              count: int | None = None) -> Survivors:
  """The survivors' parity records of ``step`` (saved by ``count`` processes: records
  of another run's step of that number are left out).

  Raises:
    UnrecoverableLossError: no live agent holds parity of the step, none the
      manifest of a lost host, or a group lost more hosts than its parity.
  """
  infos, holders = {}, {}     # by the process index each agent had for ``step``
  for c in clients.values():
    try:
      info = c.call("parity_info", step=step)[0]
    except (errors.StepNotFoundError, errors.AgentUnavailableError) as e:
      logger.info("step %d: %s has no parity to offer: %s", step, c.who, e)
      continue
    if count is not None and info.process_count != count:
      continue
    index = c.host if info.index is None else info.index      # (an older agent's reply)
    infos[index], holders[index] = info, c
  if not infos:
    raise errors.UnrecoverableLossError(
        f"step {step}: no live agent holds parity of it; cannot rebuild hosts {lost}")
  first = next(iter(infos.values()))
  cfg = ParityConfig(**first.config)
  manifests: dict[int, str] = {}
  checksums: dict[Piece, str] = {}
  for info in infos.values():
    manifests.update({int(h): js for h, js in info.manifests.items()})
    for stripe, slot, host, start, stop, value in info.checksums:
      checksums[_lib().Piece(host, stripe, slot, start, stop)] = value
  sizes = [0] * first.process_count
  for h, js in manifests.items():
    sizes[h] = SnapshotManifest.from_json(js).nbytes
  missing = [h for h in lost if h not in manifests]
  if missing:
    raise errors.UnrecoverableLossError(
        f"step {step}: no survivor holds the manifest of lost hosts {missing}")
  layout = _lib().StripeLayout.build(sizes, cfg.options)
  _lib().check_recoverable(layout, lost)
  return Survivors(step, layout, manifests, checksums, holders)


def recover(clients: dict[int, Client], step: int, lost: list[int],
            have: dict[int, Any] | None = None, *, count: int | None = None,
            known: Survivors | None = None, read: list[int] | None = None
            ) -> dict[int, tuple[SnapshotManifest, np.ndarray]]:
  """Rebuilds the whole snapshots of ``lost`` hosts of ``step`` from the survivors.

  ``have`` maps saving process indices to the pieces of ``step`` the caller
  already holds or is about to read (``BufferPiece``, ``RemotePiece``): data
  chunks are taken from them (``span``) instead of being read a second time.
  ``known``: the survivors' records, if the caller has them (:func:`survivors`);
  ``read[0]`` counts the bytes read from agents.

  Every fetched piece and every rebuilt piece is checked against the checksum
  saved when the parity was made (a corrupted survivor is left out while
  others can stand in); the caller checks each shard against its manifest
  checksum again before use.

  Raises:
    UnrecoverableLossError: too many hosts lost, or too few survivors answer.
    CorruptSnapshotError: too few survivors pass their checksums.
  """
  s = known or survivors(clients, step, lost, count)
  pieces = {h: (have or {}).get(h) for h in s.manifests}
  rebuilt = _lib().recover_hosts(s.layout, lost, _fetcher(s.holders, s.layout, step, pieces,
                                                          read), s.checksums)
  return {h: (SnapshotManifest.from_json(s.manifests[h]), buf) for h, buf in rebuilt.items()}


def rebuild_ranges(s: Survivors, lost: list[int], wanted: dict[int, list[tuple[int, int]]],
                   out: dict[int, np.ndarray], have: dict[int, Any]) -> int:
  """Rebuilds byte ranges ``wanted[h]`` of lost hosts' snapshots into ``out[h]``
  (``jaxckpt.parity.rebuild_ranges``: only the same ranges of their stripes are read,
  from the caller's pieces in ``have`` where they already hold them, else from the
  survivors' agents, each agent's ranges in one read). Unverified: the caller checks
  each rebuilt shard against its manifest. Returns the bytes read from agents."""
  read, lock = [0], threading.Lock()

  def fetch(host: int, items: Any) -> list[np.ndarray] | None:     # (hosts at once)
    got, snap, par = [None] * len(items), [], {}
    piece = have.get(host)
    for i, (p, lo, hi) in enumerate(items):
      if p.slot >= len(s.layout.stripes[p.stripe].data):
        par.setdefault(p.stripe, []).append((i, lo, hi - lo))
        continue
      a, b = p.start + lo, min(p.start + hi, p.stop)
      cached = None if piece is None or a >= b else piece.span(a, b - a, read=False)
      if a >= b:
        got[i] = np.empty(0, np.uint8)
      elif cached is not None:
        got[i] = cached
      else:
        snap.append((i, a, b - a))
    c = s.holders.get(host) or getattr(piece, "client", None)
    if c is None:
      return None if snap or par else got
    try:
      for (i, _, _), data in zip(snap, c.read("snapshot", s.step, [(a, n) for _, a, n in snap])
                                 if snap else []):
        got[i] = data
      for stripe, ranges in par.items():
        blocks = c.read("parity", s.step, [(lo, n) for _, lo, n in ranges], stripe=stripe)
        for (i, _, _), data in zip(ranges, blocks):
          got[i] = data
    except (errors.StepNotFoundError, errors.AgentUnavailableError) as e:
      logger.warning("step %d: %s could not serve its pieces' ranges: %s", s.step, c.who, e)
      return None
    with lock:
      read[0] += sum(n for _, _, n in snap) + sum(n for r in par.values() for _, _, n in r)
    return got

  _lib().rebuild_ranges(s.layout, lost, wanted, fetch, out)
  return read[0]
def _fetcher(holders: dict[int, Client], layout: StripeLayout, step: int,
             pieces: dict[int, Any], read: list[int] | None = None) -> Callable[[Piece], Any]:
  """Fetches a survivor's piece: a data chunk of its snapshot (from the
  caller's ``pieces`` where they hold it, else from the agent that was its host
  for ``step``) or a parity block; ``read[0]`` counts what agents sent."""
  lock = threading.Lock()

  def fetch(piece: Piece) -> Any:
    data_piece = piece.slot < len(layout.stripes[piece.stripe].data)
    if data_piece and piece.nbytes == 0:
      return np.empty(0, np.uint8)
    if data_piece and pieces.get(piece.host) is not None:
      data = pieces[piece.host].span(piece.start, piece.nbytes)
      if data is not None:
        return data
    c = holders.get(piece.host)
    if c is None:
      return None
    try:
      if data_piece:
        data, = c.read("snapshot", step, [(piece.start, piece.nbytes)])
      else:
        data, = c.read("parity", step, [(0, piece.stop)], stripe=piece.stripe)
    except (errors.StepNotFoundError, errors.AgentUnavailableError) as e:
      logger.warning("step %d: could not fetch %s: %s", step, piece, e)
      return None
    if read is not None:
      with lock:
        read[0] += data.size
    return data
  return fetch

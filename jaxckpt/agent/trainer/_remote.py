"""Another host's snapshot read over the bulk path, a lost host's rebuilt from parity,
and the job's agents as clients: what a restore, a parity rebuild and a replica group's
catch-up read from the agents of other hosts (the trainer's side;
:mod:`jaxckpt.agent.trainer.client` is its own agent's store)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any, Iterator, Sequence

import numpy as np

from jaxckpt import errors
from jaxckpt.agent.trainer import _parity_recovery
from jaxckpt.agent import _paths, _requests
from jaxckpt.agent._paths import read_address
from jaxckpt.agent._protocol import Client, each
from jaxckpt.host.snapshot import (LeafRecord, ShardRecord, SnapshotManifest, aligned_empty,
                                   box_shape, shard_view, verify_shard)

logger = logging.getLogger("jaxckpt.agent.trainer.client")


class RemotePiece:
  """Another host's snapshot of a step, read from its agent over the bulk path.

  ``fetch`` reads many shards at once (several streams, each shard verified
  as soon as it has arrived); ``shard_array`` returns a verified shard,
  reading it if no ``fetch`` did.
  """

  remote = True
  rebuilt = False

  def __init__(self, client: Client, manifest: SnapshotManifest) -> None:
    self.client = client
    self.manifest = manifest
    self.bytes_read = 0
    self._cache: dict[int, np.ndarray] = {}
    self._lock = threading.Lock()            # parity rebuilds read spans from several threads

  def fetch(self, wanted: Sequence[tuple[LeafRecord, ShardRecord]]) -> None:
    """Reads and verifies the shards in ``wanted`` not read yet."""
    with self._lock:
      self._fetch(wanted)

  def _fetch(self, wanted: Sequence[tuple[LeafRecord, ShardRecord]]) -> None:
    todo = list({s.offset: (leaf, s) for leaf, s in wanted if s.offset not in self._cache}.values())
    if not todo:
      return
    step = self.manifest.step

    def verify(i: int, data: np.ndarray) -> None:
      leaf, shard = todo[i]
      verify_shard(data, ShardRecord(shard.index, 0, shard.nbytes, shard.checksum),
                   path=leaf.path, step=step)
    got = self.client.read("snapshot", step, [(s.offset, s.nbytes) for _, s in todo],
                           on_done=verify)
    for (_, shard), data in zip(todo, got):
      self._cache[shard.offset] = data
      self.bytes_read += shard.nbytes

  def span(self, start: int, nbytes: int, *, read: bool = True) -> np.ndarray | None:
    """Bytes ``[start, start + nbytes)`` of the snapshot, read through the shard
    cache (so the shards a restore reads next are not read twice); None if
    shards do not cover the range (the gaps between them are not kept), or if
    ``read`` is False and some of them were not read already."""
    end = start + nbytes
    over = sorted(((leaf, s) for leaf in self.manifest.leaves for s in leaf.shards
                   if s.offset < end and s.offset + s.nbytes > start), key=lambda x: x[1].offset)
    pos = start
    for _, s in over:
      if s.offset > pos:
        return None
      pos = max(pos, s.offset + s.nbytes)
    if pos < end:
      return None
    if not read:
      with self._lock:
        if any(s.offset not in self._cache for _, s in over):
          return None
    self.fetch(over)
    if len(over) == 1:
      s = over[0][1]
      return self._cache[s.offset][start - s.offset:end - s.offset]
    out = np.empty(nbytes, np.uint8)
    for _, s in over:
      lo, hi = max(start, s.offset), min(end, s.offset + s.nbytes)
      out[lo - start:hi - start] = self._cache[s.offset][lo - s.offset:hi - s.offset]
    return out

  def shard_array(self, leaf: LeafRecord, shard: ShardRecord) -> np.ndarray:
    if shard.offset not in self._cache:
      self.fetch([(leaf, shard)])
    return self._cache[shard.offset].view(leaf.numpy_dtype).reshape(box_shape(shard.index))

  def shard_private(self, leaf: LeafRecord, shard: ShardRecord) -> np.ndarray:
    """A fetched shard is a fresh array of its own: private already."""
    return self.shard_array(leaf, shard)


def job_agents(run_root: str, job: str) -> dict[int, dict[str, Any]]:
  """The live agents of ``job`` under ``run_root``, by host id."""
  base = os.path.join(run_root, _paths.check_job_name(job))
  out = {}
  if os.path.isdir(base):
    for name in os.listdir(base):
      if name.startswith("host") and name[4:].isdigit():
        info = read_address(os.path.join(base, name))
        if info is not None:
          out[int(name[4:])] = info
  return out


@contextlib.contextmanager
def clients_of(agents: list[dict[str, Any]], job: str, *, timeout_secs: float, secret: bytes,
               local_pid: int | None = None) -> Iterator[dict[int, Client]]:
  """Clients of ``agents`` (address records), closed on exit, keyed 0, 1, ...
  (two agents may share a host id: an old one on another machine after a
  restart); each client knows its agent's ``host`` and ``pid``. The agent with
  ``local_pid`` is reached through its ipc socket, the others over tcp."""
  clients = {}
  for i, info in enumerate(sorted(agents, key=lambda a: (a["host"], a["tcp"]))):
    clients[i] = Client.of(info, who=f"snapshot agent of job {job!r} host {info['host']} "
                           f"(pid {info['pid']}, {info['tcp']})", timeout_secs=timeout_secs,
                           secret=secret, endpoint=info["ipc"] if info["pid"] == local_pid else None)
  try:
    yield clients
  finally:
    for c in clients.values():
      c.close()


@contextlib.contextmanager
def job_clients(run_root: str, job: str, *, timeout_secs: float,
                secret: bytes | None = None) -> Iterator[dict[int, Client]]:
  """Clients of every live agent of ``job`` under ``run_root`` (see :func:`clients_of`)."""
  with clients_of(list(job_agents(run_root, job).values()), job, timeout_secs=timeout_secs,
                  secret=secret or _paths.job_secret(run_root, job)) as clients:
    yield clients


def complete_steps_of(clients: dict[int, Client]) -> list[int]:
  """Steps for which the agents together hold every saving process's snapshot, of one
  number of processes (agents of another run of the job that held the same step
  of another size are not mixed in; a step complete for two sizes is left out).

  An agent that does not answer is left out (with a warning): its pieces count as lost.
  """
  seen: dict[tuple[int, int], set[int]] = {}
  for held in each(clients, lambda c: c.call(_requests.Held())[0].held).values():
    for step, index, count in held:
      seen.setdefault((step, count), set()).add(index)
  complete = [s for (s, count), idx in seen.items() if idx == set(range(count))]
  for step in {s for s in complete if complete.count(s) > 1}:
    logger.warning("step %d: the job's agents hold it whole from runs on different numbers "
                   "of processes; not restoring it from host memory", step)
  return sorted(s for s in complete if complete.count(s) == 1)


# How long another agent keeps this reader's pin on a step without a read of it (a
# dead reader's pin ends then; each read renews it).
READ_LEASE_SECS = 60.0


def open_remote_piece(client: Client, step: int,
                      stack: contextlib.ExitStack) -> RemotePiece | None:
  """The agent's snapshot of ``step``, pinned until ``stack`` closes; None if it holds none."""
  if step not in {s for s, _, _ in client.call(_requests.Held())[0].held}:
    return None
  r = client.call(_requests.Open(pid=os.getpid(), step=step, lease_secs=READ_LEASE_SECS))[0]
  stack.callback(_unpin, client, step, r.index, r.reader)
  manifest = SnapshotManifest.from_json(r.manifest)
  return RemotePiece(client, manifest)


def _rebuilt_pieces(clients: dict[int, Client], step: int, pieces: list[Any]) -> list[Any]:
  """The snapshots of the saving processes that no live agent holds, rebuilt from
  parity as a restore reads them (:class:`RebuiltPiece`)."""
  if not pieces:
    raise errors.UnrecoverableLossError(f"step {step}: no host holds any piece of it")
  count = pieces[0].manifest.process_count
  lost = sorted(set(range(count)) - {p.manifest.process_index for p in pieces})
  if not lost:
    return []
  have = {p.manifest.process_index: p for p in pieces}   # their bytes are not read twice
  known = _parity_recovery.survivors(clients, step, lost, count)
  logger.info("step %d: rebuilding what this restore needs of lost hosts %s from parity",
              step, lost)
  return [RebuiltPiece(SnapshotManifest.from_json(known.manifests[h]), clients, known, lost, have)
          for h in lost]


class RebuiltPiece:
  """A lost host's snapshot of a step, rebuilt from the survivors' parity as a restore
  reads it: ``fetch`` rebuilds only the shards asked for (the same byte ranges of
  their stripes, :func:`jaxckpt.parity.rebuild_ranges`), each checked against its
  manifest checksum; a shard that fails it has the whole host rebuilt with every
  piece verified (:func:`_parity_recovery.recover`, where another survivor can stand in for a
  corrupted one). ``whole()`` rebuilds it all (a persist of the piece).

  Read ahead after the other pieces (``rebuilt``), so that the survivors' shards this
  restore reads anyway are not read again for the rebuild.
  """

  remote = True
  rebuilt = True

  def __init__(self, manifest: SnapshotManifest, clients: dict[int, Client],
               known: _parity_recovery.Survivors, lost: list[int], have: dict[int, Any]) -> None:
    self.manifest = manifest
    self.bytes_read = 0
    self.buffer = aligned_empty((manifest.nbytes,), np.uint8)   # pages used as rebuilt
    self._clients, self._known, self._lost, self._have = clients, known, lost, have
    self._ready: set[int] = set()                    # offsets of verified shards
    self._whole = False
    self._lock = threading.Lock()

  def fetch(self, wanted: Sequence[tuple[LeafRecord, ShardRecord]]) -> None:
    """Rebuilds and verifies the shards in ``wanted`` not rebuilt yet."""
    with self._lock:
      todo = list({s.offset: (leaf, s) for leaf, s in wanted
                   if s.offset not in self._ready and s.nbytes}.values())
      if not todo:
        return
      me, step = self.manifest.process_index, self.manifest.step
      if not self._whole:
        self.bytes_read += _parity_recovery.rebuild_ranges(
            self._known, self._lost, {me: [(s.offset, s.offset + s.nbytes) for _, s in todo]},
            {me: self.buffer}, self._have)
      try:
        for leaf, s in todo:
          verify_shard(self.buffer, s, path=leaf.path, step=step)
      except errors.CorruptSnapshotError as e:
        if self._whole:
          raise
        logger.warning("step %d: a shard rebuilt for lost host %d failed its checksum (%s); "
                       "rebuilding the host whole from verified pieces", step, me, e)
        self._rebuild_whole()
        for leaf, s in todo:
          verify_shard(self.buffer, s, path=leaf.path, step=step)
      self._ready.update(s.offset for _, s in todo)

  def _rebuild_whole(self) -> None:
    read = [0]
    rebuilt = _parity_recovery.recover(self._clients, self.manifest.step, self._lost, self._have,
                              known=self._known, read=read)
    self.buffer, self._whole = rebuilt[self.manifest.process_index][1], True
    self.bytes_read += read[0]

  def whole(self) -> np.ndarray:
    """The whole snapshot, rebuilt from verified pieces (the caller verifies shards)."""
    with self._lock:
      if not self._whole:
        self._rebuild_whole()
      return self.buffer

  def shard_array(self, leaf: LeafRecord, shard: ShardRecord) -> np.ndarray:
    """A verified shard, rebuilt if no ``fetch`` did."""
    if shard.offset not in self._ready:
      self.fetch([(leaf, shard)])
    return shard_view(self.buffer, shard, leaf.numpy_dtype)

  def shard_private(self, leaf: LeafRecord, shard: ShardRecord) -> np.ndarray:
    """A rebuilt shard is in memory of this restore's own: private already."""
    return self.shard_array(leaf, shard)

  def span(self, start: int, nbytes: int, *, read: bool = True) -> None:
    """Never a source of another rebuild."""
    del start, nbytes, read


def _unpin(client: Client, step: int, index: int, reader: int | None = None) -> None:
  with contextlib.suppress(OSError):
    client.call(_requests.Close(pid=os.getpid(), step=step, index=index, reader=reader))

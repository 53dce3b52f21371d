"""Turn stored snapshot pieces back into a tree on the target shardings."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import functools
import logging
import math
import os
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import jax
import numpy as np

from jaxckpt import errors
from jaxckpt.arrays._assemble import device_boxes, make_array
from jaxckpt.host._spans import Spans, span_checksums
from jaxckpt.host.store import Piece
from jaxckpt.host.snapshot import (Box, LeafRecord, ShardRecord, SnapshotManifest, aligned_copy,
                              aligned_empty, assemble_region, box_intersection, box_shape,
                              copy_and_hash, full_box, relative_slices, shard_view,
                              verify_shard)
from jaxckpt.tree import TargetLeaf, match_target, scalar_from_json
from jaxckpt.util._progress import LogProgress

logger = logging.getLogger(__name__)


class Tier(str, enum.Enum):
  """Where a restore read its step, fastest first. A ``str``: ``tier == "host"`` holds."""

  HOST = "host"          # every saving process's snapshot held in host memory
  PARITY = "parity"      # some lost, rebuilt from the survivors' Reed-Solomon parity
  STORAGE = "storage"    # the universal format

  def __repr__(self) -> str:
    return repr(self.value)

  __str__ = str.__str__


@dataclasses.dataclass(frozen=True, slots=True)
class RestoreInfo:
  """What the last restore did: ``mgr.last_restore``."""

  step: int
  tier: Tier
  seconds: float
  nbytes: int
  #: newer steps a ``restore(step=None)`` found damaged, or could not read now (storage
  #: refused or did not answer: they stay listed), and skipped: (step, why)
  skipped: tuple[tuple[int, str], ...] = ()


class Source(Protocol):
  """A step on one tier, as :func:`restore_tree` reads it."""

  step: int

  @property
  def leaves(self) -> Sequence[LeafRecord]: ...
  @property
  def bytes_read(self) -> int: ...
  def prefetch(self, needed: dict[int, set[Box]]) -> None: ...
  def reader(self, i: int, *, private: bool = True,
             boxes: set[Box] | None = None) -> Callable[[Box], np.ndarray]: ...


class LeafMetadata(NamedTuple):
  """One saved leaf as ``CheckpointManager.metadata`` describes it (no bytes read).

  ``kind`` is ``"jax"``, ``"numpy"``, ``"prng_key"`` (``shape``/``dtype`` of its
  key data, ``key_impl`` its implementation) or ``"scalar"`` (``value`` holds it);
  ``sharding`` is how the saving program laid the leaf out (informational).
  """

  kind: str
  shape: tuple[int, ...]
  dtype: str
  sharding: dict[str, Any] | None = None
  value: Any = None
  key_impl: str | None = None


@dataclasses.dataclass(frozen=True)
class StepMetadata:
  """What ``CheckpointManager.metadata(step)`` returns: the saved tree's structure
  (nested like ``restore()`` without a target, of :class:`LeafMetadata`; flat by
  path in ``leaves``), the metadata saved with the step, and the tier it was read
  from. orbax's names are here too: ``custom_metadata`` (the metadata given to
  ``save()``), ``metrics`` and ``item_metadata`` (each item's structure)."""

  step: int
  tier: str
  tree: Any
  metadata: dict[str, Any]
  leaves: dict[str, LeafMetadata] = dataclasses.field(default_factory=dict)
  item_metadata: Any = None
  custom_metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
  metrics: Any = None


class BufferPiece:
  """One saving process's snapshot held in a local buffer (memory or shm).

  Each shard is checked against its checksum the first time it is read.
  ``private`` says the buffer is never written again (a rebuilt piece); else
  ``lend``, when given, makes it so on first use (the in-process store retires
  the slot from its pool) and returns whether it could.
  """

  remote = False
  rebuilt = False

  def __init__(self, manifest: SnapshotManifest, buffer: np.ndarray, *, private: bool = False,
               lend: Callable[[], bool] | None = None) -> None:
    self.manifest = manifest
    self.buffer = buffer
    self.bytes_read = 0
    self._verified: set[int] = set()
    self._private = private
    self._lend = lend

  def fetch(self, wanted: Sequence[tuple[LeafRecord, ShardRecord]]) -> None:
    """Verifies ``wanted`` now, on every core (nothing to read: the bytes are here)."""
    todo = list({s.offset: (leaf, s) for leaf, s in wanted
                 if s.offset not in self._verified}.values())
    if sum(s.nbytes for _, s in todo) < _PARALLEL_VERIFY_BYTES:
      return                       # verified as each is read: a thread handoff costs more
    batches = _balanced(todo, _verify_threads())
    digests = list(_verify_pool().map(
        lambda b: span_checksums(self.buffer, Spans([s.offset for _, s in b],
                                                    [s.nbytes for _, s in b])), batches))
    for batch, got in zip(batches, digests):
      for (leaf, shard), digest in zip(batch, got):
        if digest != shard.checksum:
          verify_shard(self.buffer, shard, path=leaf.path, step=self.manifest.step)  # raises
        self._mark_read(shard)

  def _mark_read(self, shard: ShardRecord) -> None:
    self._verified.add(shard.offset)
    self.bytes_read += shard.nbytes

  def shard_array(self, leaf: LeafRecord, shard: ShardRecord) -> np.ndarray:
    """A zero-copy view of a verified shard (for assembling other regions)."""
    if shard.offset not in self._verified:
      verify_shard(self.buffer, shard, path=leaf.path, step=self.manifest.step)
      self._mark_read(shard)
    return shard_view(self.buffer, shard, leaf.numpy_dtype)

  def span(self, start: int, nbytes: int, *, read: bool = True) -> np.ndarray:
    """Raw bytes ``[start, start + nbytes)`` of the snapshot (a view; unverified;
    here already, whatever ``read`` says)."""
    del read
    return np.frombuffer(self.buffer, np.uint8, count=nbytes, offset=start)

  def is_private(self) -> bool:
    """Whether views of this buffer may be kept by restored arrays (lends on first ask)."""
    if not self._private and self._lend is not None:
      self._private, self._lend = self._lend(), None
    return self._private

  def shard_private(self, leaf: LeafRecord, shard: ShardRecord) -> np.ndarray:
    """Verified values of a shard in memory that nothing writes again.

    A view when the buffer is private (or could be lent), else an aligned
    copy verified while copying (one pass over the bytes).
    """
    if self.is_private():
      return self.shard_array(leaf, shard)
    if shard.offset in self._verified:
      return aligned_copy(self.shard_array(leaf, shard))
    if shard.offset + shard.nbytes > memoryview(self.buffer).nbytes:
      verify_shard(self.buffer, shard, path=leaf.path, step=self.manifest.step)  # raises
    out = aligned_empty(box_shape(shard.index), leaf.numpy_dtype)
    src = np.frombuffer(self.buffer, np.uint8, count=shard.nbytes, offset=shard.offset)
    if copy_and_hash(src, out.reshape(-1).view(np.uint8)) != shard.checksum:
      verify_shard(self.buffer, shard, path=leaf.path, step=self.manifest.step)  # raises
    self._mark_read(shard)
    return out


_PARALLEL_VERIFY_BYTES = 8 << 20


@functools.lru_cache(maxsize=1)
def _verify_threads() -> int:
  return max(1, min(8, os.cpu_count() or 1))


@functools.lru_cache(maxsize=1)
def _verify_pool() -> concurrent.futures.ThreadPoolExecutor:
  """Threads that verify a local snapshot's shards before a restore reads them
  (xxhash releases the GIL): one per core, at most 8, for the process's life."""
  return concurrent.futures.ThreadPoolExecutor(_verify_threads(),
                                               thread_name_prefix="jaxckpt-verify")


def _balanced(items: list[tuple[LeafRecord, ShardRecord]], n: int
              ) -> list[list[tuple[LeafRecord, ShardRecord]]]:
  """``items`` in at most ``n`` batches of about equal bytes (largest first)."""
  batches: list[list[tuple[LeafRecord, ShardRecord]]] = [[] for _ in range(min(n, len(items)))]
  load = [0] * len(batches)
  for item in sorted(items, key=lambda x: -x[1].nbytes):
    i = load.index(min(load))
    batches[i].append(item)
    load[i] += item[1].nbytes
  return batches


class HostSource:
  """A step held as host snapshots: one piece per saving process."""

  def __init__(self, pieces: Sequence[Piece]) -> None:
    self.pieces = pieces
    self.step = pieces[0].manifest.step
    self.leaves = pieces[0].manifest.leaves

  @property
  def bytes_read(self) -> int:
    return sum(p.bytes_read for p in self.pieces)

  def prefetch(self, needed: dict[int, set[Box]]) -> None:
    """Reads ahead, in one transfer per remote piece, every shard the regions
    ``needed`` (leaf index -> boxes) will read (see ``reader``), and verifies
    local pieces' shards on every core; then rebuilds the shards of lost hosts'
    pieces it needs (their stripes' ranges of the others already read are not
    read again)."""
    wanted: dict[int, list[tuple[LeafRecord, ShardRecord]]] = {}
    for i, boxes in needed.items():
      shards = self._shards(i)
      for box in boxes:
        for p, leaf, s in _serving(shards, box):
          wanted.setdefault(id(p), []).append((leaf, s))
    remote = [p for p in self.pieces if id(p) in wanted and p.remote and not p.rebuilt]
    with concurrent.futures.ThreadPoolExecutor(max(1, len(remote))) as pool:   # hosts at once
      futures = [pool.submit(p.fetch, wanted[id(p)]) for p in remote]
      for p in self.pieces:
        if id(p) in wanted and not p.remote:
          p.fetch(wanted[id(p)])
      for f in futures:
        f.result()
    for p in self.pieces:
      if id(p) in wanted and p.rebuilt:
        p.fetch(wanted[id(p)])

  def reader(self, i: int, *, private: bool = True,
             boxes: set[Box] | None = None) -> Callable[[Box], np.ndarray]:
    """``read_region(box)`` for leaf ``i``: verified values of ``box``.

    With ``private`` (what XLA:CPU and numpy targets need: both keep the array
    they are given) the result is memory nothing writes again; without it
    (accelerator targets, which copy), a box stored whole may come back as a
    view of the snapshot, valid while the step is pinned. A box that is a run of
    whole rows of one shard read from another host (or rebuilt) is a view of it
    (that memory is this restore's own; a job on more processes than saved the
    step splits each saved shard so).
    """
    del boxes                  # host memory: remote pieces are read ahead by ``prefetch``
    rec = self.leaves[i]
    shards = self._shards(i)
    def read_region(box: Box) -> np.ndarray:
      found = _serving(shards, box)
      if len(found) == 1 and found[0][2].index == box:
        p, leaf, s = found[0]
        return p.shard_private(leaf, s) if private else p.shard_array(leaf, s)
      if len(found) == 1 and found[0][0].remote and _rows_of(box, found[0][2].index):
        p, leaf, s = found[0]
        return p.shard_private(leaf, s)[relative_slices(box, s.index)]
      return assemble_region(box, rec.numpy_dtype,
                             [(s.index, p.shard_array(leaf, s)) for p, leaf, s in found],
                             path=rec.path)
    return read_region

  def _shards(self, i: int) -> list[tuple[Piece, LeafRecord, ShardRecord]]:
    """Every (piece, its record of leaf ``i``, shard) of leaf ``i``."""
    return [(p, p.manifest.leaves[i], s) for p in self.pieces for s in p.manifest.leaves[i].shards]


def _serving(shards: Sequence[tuple[Piece, LeafRecord, ShardRecord]],
             box: Box) -> list[tuple[Piece, LeafRecord, ShardRecord]]:
  """The shards a read of ``box`` uses: the one stored as exactly ``box``, else
  every one overlapping it."""
  exact = next((x for x in shards if x[2].index == box), None)
  return [exact] if exact else [x for x in shards if box_intersection(x[2].index, box) is not None]


def _rows_of(box: Box, shard: Box) -> bool:
  """Whether ``box`` is a run of whole rows of ``shard`` (a contiguous part of it)."""
  return (len(box) > 0 and shard[0][0] <= box[0][0] and box[0][1] <= shard[0][1]
          and tuple(box[1:]) == tuple(shard[1:]))


def _leaf_bytes(rec: LeafRecord) -> int:
  return 0 if rec.kind == "scalar" else math.prod(rec.shape) * rec.numpy_dtype.itemsize


def restore_tree(source: Source, target: Any, *, partial: bool = False) -> Any:
  """Restores the tree held by ``source`` onto ``target``'s structure and shardings.

  A source has ``step``, ``leaves`` (LeafRecords in tree order) and
  ``reader(i) -> read_region(box)`` giving verified values (HostSource, or the
  storage tier's source). ``target=None`` returns a flat ``{path: value}`` dict
  of numpy arrays, jax PRNG key arrays and scalars.
  """
  saved = source.leaves
  if target is None:
    targets, treedef, index = [None] * len(saved), None, list(range(len(saved)))
  else:
    targets, treedef, index = match_target(target, saved, source.step, partial=partial)
  needed = {i: _needed_boxes(saved[i], t) for i, t in zip(index, targets)
            if saved[i].kind != "scalar"}
  total = sum(_leaf_bytes(saved[i]) for i in needed)
  values = []
  with LogProgress(logger, f"restoring step {source.step}", total, verb="read") as progress:
    source.prefetch(needed)
    for i, t in zip(index, targets):  # (leaf by leaf: two threads faulting in fresh memory
      values.append(_leaf_value(source, i, saved[i], t, needed.get(i)))   # took twice as long)
      progress.update(_leaf_bytes(saved[i]) if i in needed else 0)
  if treedef is None:
    return {saved[i].path: v for i, v in zip(index, values)}
  return jax.tree_util.tree_unflatten(treedef, values)


def _leaf_value(source: Source, i: int, rec: LeafRecord, t: TargetLeaf | None,
                needed: set[Box] | None) -> Any:
  if rec.kind == "scalar":
    return scalar_from_json(rec.value)
  sharded = t is not None and t.mode == "jax" and t.sharding is not None
  read_region = source.reader(i, private=_keeps_host_memory(t), boxes=needed if sharded else None)
  if t is not None and t.mode == "jax" and t.sharding is None:
    data = jax.device_put(read_region(full_box(rec.shape)))
    return jax.random.wrap_key_data(data, impl=rec.key_impl) if rec.kind == "prng_key" else data
  if t is None or t.mode == "numpy":
    host = np.array(read_region(full_box(rec.shape)), copy=True)   # the caller's to write
    if rec.kind == "prng_key":
      return jax.random.wrap_key_data(host, impl=rec.key_impl)
    return host[()] if t is not None and t.numpy_scalar else host
  if rec.kind == "prng_key":
    data = make_array(rec.shape, rec.numpy_dtype,
                      t.sharding if t.key_data else _key_data_sharding(t.sharding), read_region)
    return jax.random.wrap_key_data(data, impl=rec.key_impl)
  return make_array(rec.shape, rec.numpy_dtype, t.sharding, read_region)


def _needed_boxes(rec: LeafRecord, t: TargetLeaf | None) -> set[Box]:
  """The regions of leaf ``rec`` that restoring it onto ``t`` reads."""
  if t is not None and t.mode == "jax" and t.sharding is not None:
    sharding = (_key_data_sharding(t.sharding) if rec.kind == "prng_key" and not t.key_data
                else t.sharding)
    return set(device_boxes(rec.shape, sharding).values())
  return {full_box(rec.shape)}


def _keeps_host_memory(t: TargetLeaf | None) -> bool:
  """Whether the restored leaf may keep the host array it is built from.

  True for CPU devices (XLA:CPU adopts aligned host buffers instead of copying
  them); False when every target device is an accelerator, and for numpy
  targets, which get a copy of their own.
  """
  if t is None or t.mode != "jax":
    return False
  if t.sharding is None:       # the default device (jax_default_device may point at a CPU)
    return True
  return any(d.platform == "cpu" for d in t.sharding.device_set)


def _key_data_sharding(s: jax.sharding.Sharding) -> jax.sharding.Sharding:
  """The sharding of a key array's data (one more, unsharded, trailing dim)."""
  if isinstance(s, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec, None))
  if isinstance(s, jax.sharding.SingleDeviceSharding):
    return s
  raise errors.StructureMismatchError(
      f"PRNG key targets need a NamedSharding or SingleDeviceSharding, got {s}")


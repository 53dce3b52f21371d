"""Turn stored snapshot pieces back into a tree on the target shardings."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxckpt import errors
from jaxckpt._assemble import make_array
from jaxckpt.snapshot import (Box, LeafRecord, ShardRecord, SnapshotManifest, aligned_copy,
                              aligned_empty, assemble_region, box_intersection, box_shape,
                              copy_and_hash, full_box, shard_view, verify_shard)
from jaxckpt.tree import TargetLeaf, match_target, scalar_from_json


@dataclasses.dataclass(frozen=True, slots=True)
class RestoreInfo:
  """What the last restore did: ``mgr.last_restore``."""

  step: int
  tier: str          # "host" | "parity" | "storage"
  seconds: float
  nbytes: int


class BufferPiece:
  """One saving process's snapshot held in a local buffer (memory or shm).

  Each shard is checked against its checksum the first time it is read.
  """

  def __init__(self, manifest: SnapshotManifest, buffer: Any) -> None:
    self.manifest = manifest
    self.buffer = buffer
    self.bytes_read = 0
    self._verified: set[int] = set()

  def shard_array(self, leaf: LeafRecord, shard: ShardRecord) -> np.ndarray:
    """A zero-copy view of a verified shard (for assembling other regions)."""
    if shard.offset not in self._verified:
      verify_shard(self.buffer, shard, path=leaf.path, step=self.manifest.step)
      self._verified.add(shard.offset)
      self.bytes_read += shard.nbytes
    return shard_view(self.buffer, shard, leaf.numpy_dtype)

  def shard_copy(self, leaf: LeafRecord, shard: ShardRecord) -> np.ndarray:
    """A private aligned copy of a shard, verified while copying (one pass)."""
    if shard.offset in self._verified:
      return aligned_copy(shard_view(self.buffer, shard, leaf.numpy_dtype))
    out = aligned_empty(box_shape(shard.index), leaf.numpy_dtype)
    src = np.frombuffer(self.buffer, np.uint8, count=shard.nbytes, offset=shard.offset)
    if copy_and_hash(src, out.reshape(-1).view(np.uint8)) != shard.checksum:
      verify_shard(self.buffer, shard, path=leaf.path, step=self.manifest.step)  # raises
    self._verified.add(shard.offset)
    self.bytes_read += shard.nbytes
    return out


class HostSource:
  """A step held as host snapshots: one piece per saving process."""

  def __init__(self, pieces: Sequence[Any]) -> None:
    self.pieces = pieces
    self.step = pieces[0].manifest.step
    self.leaves = pieces[0].manifest.leaves

  @property
  def bytes_read(self) -> int:
    return sum(p.bytes_read for p in self.pieces)

  def reader(self, i: int) -> Callable[[Box], np.ndarray]:
    rec = self.leaves[i]
    dtype = rec.numpy_dtype
    shards = [(p, p.manifest.leaves[i], s) for p in self.pieces
              for s in p.manifest.leaves[i].shards]
    def read_region(box: Box) -> np.ndarray:
      for p, leaf, s in shards:
        if s.index == box:
          copy = getattr(p, "shard_copy", None)
          return copy(leaf, s) if copy else aligned_copy(p.shard_array(leaf, s))
      overlapping = [(s.index, p.shard_array(leaf, s)) for p, leaf, s in shards
                     if box_intersection(s.index, box) is not None]
      return assemble_region(box, dtype, overlapping, path=rec.path)
    return read_region


def restore_tree(source: Any, target: Any) -> Any:
  """Restores the tree held by ``source`` onto ``target``'s structure and shardings.

  A source has ``step``, ``leaves`` (LeafRecords in tree order) and
  ``reader(i) -> read_region(box)`` giving verified values (HostSource, or the
  storage tier's source). ``target=None`` returns a flat ``{path: value}`` dict
  of numpy arrays, jax PRNG key arrays and scalars.
  """
  saved = source.leaves
  if target is None:
    return {rec.path: _leaf_value(source, i, rec, None) for i, rec in enumerate(saved)}
  targets, treedef = match_target(target, saved, source.step)
  values = [_leaf_value(source, i, rec, t) for i, (rec, t) in enumerate(zip(saved, targets))]
  return jax.tree_util.tree_unflatten(treedef, values)


def _leaf_value(source: Any, i: int, rec: LeafRecord, t: TargetLeaf | None) -> Any:
  if rec.kind == "scalar":
    return scalar_from_json(rec.value)
  read_region = source.reader(i)
  if t is not None and t.mode == "jax" and t.sharding is None:
    data = jax.device_put(np.asarray(read_region(full_box(rec.shape))))   # a fresh array
    return jax.random.wrap_key_data(data, impl=rec.key_impl) if rec.kind == "prng_key" else data
  if t is None or t.mode == "numpy":
    host = np.asarray(read_region(full_box(rec.shape)))   # already a fresh array
    if rec.kind == "prng_key":
      return jax.random.wrap_key_data(host, impl=rec.key_impl)
    return host[()] if t is not None and t.numpy_scalar else host
  if rec.kind == "prng_key":
    data = make_array(rec.shape, rec.numpy_dtype, _key_data_sharding(t.sharding),
                      read_region)
    return jax.random.wrap_key_data(data, impl=rec.key_impl)
  return make_array(rec.shape, rec.numpy_dtype, t.sharding, read_region)


def _key_data_sharding(s: jax.sharding.Sharding) -> jax.sharding.Sharding:
  """The sharding of a key array's data (one more, unsharded, trailing dim)."""
  if isinstance(s, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec, None))
  if isinstance(s, jax.sharding.SingleDeviceSharding):
    return s
  raise errors.StructureMismatchError(
      f"PRNG key targets need a NamedSharding or SingleDeviceSharding, got {s}")


"""Gather many small shards into one buffer per device with one XLA call (CPU).

Taking a host view of one device buffer costs ~14 us of Python in jax (the
per-device arrays are built on first access), so a state of many small sharded
leaves (an FSDP model: ~200 leaves x 8 devices) spent ~25 ms per ``save()``
before any byte moved. For such leaves ``save()`` dispatches one jitted
``shard_map`` instead: each device concatenates the bytes of its own blocks
(no communication), and the background thread copies one buffer per device
into the snapshot. The computation is ordered before any later computation
that donates its inputs, so the snapshot stays exact when the next step
donates. The byte layout in the snapshot is the one the per-shard path writes:
each block is a shard record at a 64-byte-aligned offset.

Used for leaves that are fully sharded (every device holds a distinct,
equally shaped block) over one mesh whose devices are all CPUs of this
process, with shards of at most ``MAX_SHARD_BYTES``; everything else takes
the per-shard path.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxckpt.snapshot import Box, align, box_from_index

MAX_SHARD_BYTES = 256 << 10       # bigger shards are copied from zero-copy views instead
MIN_LEAVES = 4                    # fewer leaves are not worth a compiled program
_DTYPES = frozenset({"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
                     "uint64", "float16", "bfloat16", "float32", "float64"})


@dataclasses.dataclass(frozen=True, slots=True)
class PackEntry:
  """Leaf ``leaf``'s block ``box``: bytes at ``local_offset`` of device ``k``'s buffer."""

  leaf: int
  box: Box
  k: int
  local_offset: int
  nbytes: int
  offset: int = 0      # in the snapshot: base + k * local_bytes + local_offset


@dataclasses.dataclass(frozen=True, slots=True)
class PackPlan:
  """One compiled gather: ``fn(*leaves)`` gives ``local_bytes`` per device, device k's
  bytes go to ``base + k * local_bytes`` in the snapshot."""

  fn: Any
  leaves: tuple[int, ...]
  entries: tuple[PackEntry, ...]
  base: int
  local_bytes: int
  k_of_device: dict[int, int]

  @property
  def nbytes(self) -> int:
    return len(self.k_of_device) * self.local_bytes


def packable(x: Any) -> bool:
  """Whether leaf value ``x`` can go through the packed gather."""
  if not isinstance(x, jax.Array) or not isinstance(x.sharding, jax.sharding.NamedSharding):
    return False
  s, mesh = x.sharding, x.sharding.mesh
  if (mesh.size < 2 or x.size == 0 or np.dtype(x.dtype).name not in _DTYPES
      or not x.is_fully_addressable
      or any(d.platform != "cpu" or d.process_index != jax.process_index()
             for d in mesh.devices.flat)):
    return False
  shard_shape = s.shard_shape(x.shape)
  blocks = s.devices_indices_map(x.shape)
  boxes = {box_from_index(idx, x.shape) for idx in blocks.values()}
  return (len(boxes) == mesh.size               # fully sharded: no replicas
          and all(tuple(b - a for a, b in box) == tuple(shard_shape) for box in boxes)
          and int(np.prod(shard_shape)) * np.dtype(x.dtype).itemsize <= MAX_SHARD_BYTES)


def make_pack_plan(values: Sequence[Any], candidates: Sequence[int], base: int
                   ) -> PackPlan | None:
  """The packed gather for the ``candidates`` (indices into ``values``) on the mesh
  most of them use; None if too few qualify. Bytes start at offset ``base``."""
  by_mesh: dict[Any, list[int]] = {}
  for i in candidates:
    by_mesh.setdefault(values[i].sharding.mesh, []).append(i)
  if not by_mesh:
    return None
  mesh, chosen = max(by_mesh.items(), key=lambda kv: len(kv[1]))
  if len(chosen) < MIN_LEAVES:
    return None
  local_offsets, local = [], 0
  for i in chosen:
    x = values[i]
    local_offsets.append(local)
    local = align(local + int(np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64))
                  * np.dtype(x.dtype).itemsize)
  axes = tuple(mesh.axis_names)
  out_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axes))
  k_of_device = {d.id: box_from_index(idx, (mesh.size * local,))[0][0] // local for d, idx in
                 out_sharding.devices_indices_map((mesh.size * local,)).items()}
  if sorted(k_of_device.values()) != list(range(mesh.size)):    # one distinct block per device
    return None
  entries = []
  for i, loff in zip(chosen, local_offsets):
    x = values[i]
    nbytes = int(np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64)) * x.dtype.itemsize
    for d, idx in x.sharding.devices_indices_map(x.shape).items():
      entries.append(PackEntry(i, box_from_index(idx, x.shape), k_of_device[d.id], loff, nbytes))
  entries = sorted((dataclasses.replace(e, offset=base + e.k * local + e.local_offset)
                    for e in entries), key=lambda e: e.offset)
  specs = tuple(values[i].sharding.spec for i in chosen)
  fn = jax.jit(jax.shard_map(_concat_bytes, mesh=mesh, in_specs=specs,
                             out_specs=jax.sharding.PartitionSpec(axes), check_vma=False))
  return PackPlan(fn, tuple(chosen), tuple(entries), base, local, k_of_device)


def _concat_bytes(*blocks: jax.Array) -> jax.Array:
  parts = []
  for b in blocks:
    u8 = b.astype(jnp.uint8) if b.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(
        b, jnp.uint8)
    u8 = u8.reshape(-1)
    parts.append(u8)
    pad = align(u8.size) - u8.size
    if pad:
      parts.append(jnp.zeros((pad,), jnp.uint8))
  return jnp.concatenate(parts)


def device_buffers(out: jax.Array) -> list[tuple[int, np.ndarray]]:
  """``(device id, host view)`` of each device's packed bytes (waits for the gather)."""
  return [(next(iter(a.devices())).id, np.asarray(a)) for a in single_device_arrays(out)]


def single_device_arrays(x: jax.Array) -> Sequence[jax.Array]:
  """``x``'s per-device arrays in ``addressable_shards`` order.

  ``ArrayImpl._arrays`` when present (it is what ``addressable_data(i)``
  indexes, without the per-call checks that cost ~10 us a shard), else the
  public accessor.
  """
  arrays = getattr(x, "_arrays", None)
  if arrays is None:
    return [x.addressable_data(i) for i in range(len(x.addressable_shards))]
  return arrays

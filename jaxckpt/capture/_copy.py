"""Device -> host: dispatch in save(), complete in a background thread.

Measured on CPU (jax 0.10.2, see capture_test.py): an array donated to a jitted
step while its ``copy_to_host_async()`` is pending is deleted, and reading it
afterwards raises "Array has been deleted"; while a numpy view of its buffer is
alive, XLA skips the donation (the step allocates a new output buffer) and the
view keeps the saved values. So on CPU, ``save()`` takes zero-copy views of the
shards (this waits until the values are computed), which makes the snapshot
bit-exact whether or not the next step donates. On accelerators ``save()``
dispatches a device-to-pinned-host transfer (``jax.device_put`` to the
``pinned_host`` memory kind), which is ordered before any later computation
that donates the source, so it is donation-safe too and never blocks.

The cost on CPU, measured (jax 0.10.2, 8 emulated devices, 2 cores): ``save()``
of a 16 MiB leaf right after dispatching a 1.8 s step blocks until the step
is done (1.6-1.8 s), because the views wait for the values. Dispatching an
XLA copy of the not-yet-computed leaf instead (``jax.jit(lambda x: x.copy())``
or the eager ``x.copy()``) blocks just as long on XLA:CPU, so there is no
dispatch-only capture on CPU; save after the step's outputs are ready (the
usual loop fetches its loss first), or accept the wait. While a view is alive,
XLA:CPU also skips donating that buffer (the next step allocates a new one):
memory for one more copy of the saved leaves until the background copy ends.
Accelerators take the pinned-host path and neither block nor lose donation.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import logging
import re
import time
from typing import Any, Sequence

import jax
import numpy as np

from jaxckpt.capture import _pack
from jaxckpt.capture._plan import CapturePlan
from jaxckpt.host._spans import span_checksums
from jaxckpt.host.snapshot import (LeafRecord, ShardRecord, SnapshotManifest, checksum,
                              copy_and_hash)
from jaxckpt.tree import Leaf, scalar_to_json

logger = logging.getLogger(__name__)

_YIELD_EVERY = 32          # shards between voluntary GIL releases in the background copy
_SMALL_BYTES = 1 << 20      # shards up to this size are copied, then hashed, in two calls


def _host_copy(x: jax.Array) -> jax.Array:
  """An async copy of ``x`` into pinned host memory (accelerators)."""
  try:
    return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
  except (ValueError, NotImplementedError, jax.errors.JaxRuntimeError) as e:
    logger.debug("pinned_host transfer unavailable (%s); copying on device", e)
    return x.copy()


def start(leaves: Sequence[Leaf], plan: CapturePlan, *, copy_numpy: bool = True) -> list[Any]:
  """Dispatches the host copies of every planned shard; returns their sources.

  Each source is a numpy array (a zero-copy view on CPU; a private copy of a
  numpy leaf, unless ``copy_numpy`` is False: a caller that completes the copy
  before it returns needs none) or a single-device jax.Array whose host copy
  is in flight; then comes the packed gather's output (or None), and last the
  list of scalar leaf values (kept in the manifest).
  """
  packed = None
  if plan.pack is not None:      # dispatched first: one call for all small sharded leaves
    packed = plan.pack.fn(*[leaves[i].value for i in plan.pack.leaves])
  sources: list[Any] = []
  on_host: dict[int, Any] = {}
  arrays, arrays_of = None, -1
  for shard in plan.shards:
    x = leaves[shard.leaf].value
    if not isinstance(x, jax.Array):
      sources.append(np.array(x, copy=copy_numpy))    # numpy leaves are mutable
    elif shard.on_cpu:
      if shard.few_of_many:                     # replicated: skip building every device's array
        sources.append(np.asarray(x.addressable_data(shard.data_index)))
        continue
      if arrays_of != shard.leaf:               # shards of a leaf are consecutive
        arrays, arrays_of = _pack.single_device_arrays(x), shard.leaf
      sources.append(np.asarray(arrays[shard.data_index]))
    else:
      h = on_host.get(shard.leaf)
      if h is None:
        h = on_host[shard.leaf] = _host_copy(x)
      d = h.addressable_data(shard.data_index)
      d.copy_to_host_async()
      sources.append(d)
  sources.append(packed)
  sources.append([scalar_to_json(x.value) if x.kind == "scalar" else None for x in leaves])
  return sources


def warm_up(leaves: Sequence[Leaf], plan: CapturePlan) -> None:
  """Runs what a first save of this layout would pay for once: the packed
  gather's compilation and, on accelerators, one transfer of each leaf to
  pinned host memory, so the allocator's pinned pool has grown before the
  first save (MEASURED.md: the first transfers into a cold pool ran at ~1 GB/s
  on an H100 host, 54 GB/s once warm; the effect of this warm-up there is not
  yet measured)."""
  if plan.pack is not None:
    jax.block_until_ready(plan.pack.fn(*[leaves[i].value for i in plan.pack.leaves]))
  for i in sorted({s.leaf for s in plan.shards if not s.on_cpu}):
    x = leaves[i].value
    if isinstance(x, jax.Array):
      h = _host_copy(x)
      jax.block_until_ready(h)
      h.delete()


def complete(plan: CapturePlan, sources: Sequence[Any], buffer: Any, *, step: int,
             process_index: int = 0, process_count: int = 1,
             metadata: dict[str, Any] | None = None,
             pool: concurrent.futures.Executor | None = None) -> SnapshotManifest:
  """Copies every source into ``buffer`` at its planned offset, hashing as it goes
  (each checksum is of the bytes as they lie in ``buffer``).

  With a ``pool``, shards over 1 MiB are copied and hashed on its threads
  (numpy's copy and xxhash release the GIL), several shards at once; smaller
  ones stay on this thread, where per-shard Python is the cost.
  """
  dst = np.frombuffer(buffer, dtype=np.uint8, count=plan.nbytes)
  records: list[Any] = [[] for _ in plan.templates]
  *sources, packed, scalars = sources
  if plan.pack is not None:
    pk = plan.pack
    for dev, view in _pack.device_buffers(packed):
      lo = pk.base + pk.k_of_device[dev] * pk.local_bytes
      np.copyto(dst[lo:lo + pk.local_bytes], view)
    del packed
    # Thousands of small shards: one hashing call without the GIL, then ~0.2 us
    # of Python a shard (records built at C speed, a C-level gather per leaf).
    recs = ShardRecord.many(pk.boxes, pk.spans.offsets.tolist(), pk.spans.lengths.tolist(),
                            span_checksums(dst, pk.spans))
    for leaf, gather in pk.of_leaf.items():
      records[leaf] = gather(recs)
  pending: list[tuple[Any, int, concurrent.futures.Future]] = []
  try:
    for n, (shard, src) in enumerate(zip(plan.shards, sources)):
      if n % _YIELD_EVERY == _YIELD_EVERY - 1:
        time.sleep(0)   # hand the GIL to the training loop now, not after a 5 ms switch interval
      src = np.asarray(src)
      if src.nbytes != shard.nbytes:
        raise ValueError(f"shard {shard.box} of leaf {plan.templates[shard.leaf].path} "
                         f"has {src.nbytes} bytes, planned {shard.nbytes}")
      out = dst[shard.offset:shard.offset + shard.nbytes]
      if shard.nbytes <= _SMALL_BYTES:   # one copy and one hash call: per-shard Python is the cost
        np.copyto(out.view(src.dtype).reshape(src.shape), src)
        digest = checksum(out)
      else:
        flat = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
        if pool is not None:
          pending.append((shard, len(records[shard.leaf]), pool.submit(copy_and_hash, flat, out)))
          records[shard.leaf].append(None)          # filled in below, in plan order
          continue
        digest = copy_and_hash(flat, out)
      records[shard.leaf].append(ShardRecord(shard.box, shard.offset, shard.nbytes, digest))
    for shard, k, fut in pending:        # submission order: about the order they finish
      records[shard.leaf][k] = ShardRecord(shard.box, shard.offset, shard.nbytes, fut.result())
  except BaseException:
    # No copy may still write into the slot once the caller aborts it.
    concurrent.futures.wait([f for _, _, f in pending])
    raise
  leaves = tuple(LeafRecord(t.path, t.kind, t.shape, t.dtype, tuple(r), t.sharding, v,
                            t.key_impl)
                 for t, r, v in zip(plan.templates, records, scalars))
  return SnapshotManifest(step=step, leaves=leaves, nbytes=plan.nbytes,
                          process_index=process_index, process_count=process_count,
                          metadata=dict(metadata or {}),
                          json_renderer=functools.partial(_render_json, plan))


# -- the manifest's JSON from a per-layout template ---------------------------
#
# Encoding a manifest of ~1,700 shard records took ~9 ms per save (in the
# thread that competes with the training loop for the GIL), and only the
# checksums, scalar values, step and metadata change between saves of one
# layout. The template is the JSON of the layout with a named hole for each;
# rendering joins the pieces (~0.5 ms), only when a store asks for the JSON
# (the agent). It equals ``json.dumps(to_obj())``.

_HOLE = re.compile(r'"@@jaxckpt:([a-z]+)(\d*)@@"')


def _render_json(plan: CapturePlan, m: SnapshotManifest) -> str | None:
  if not plan.json_template:
    plan.json_template.append(_make_template(m))
  template = plan.json_template[0]
  if template is None:                       # a path happened to contain a hole's name
    return None
  pieces, holes = template
  enc = functools.partial(json.dumps, separators=(",", ":"))
  fixed = {"step": str(m.step), "meta": enc(m.metadata), "pi": str(m.process_index),
           "pc": str(m.process_count)}
  digests = [r.checksum for leaf in m.leaves for r in leaf.shards]
  values = [leaf.value for leaf in m.leaves if leaf.kind == "scalar"]
  out = [pieces[0]]
  for (kind, n), piece in zip(holes, pieces[1:]):
    if kind == "c":
      out.append('"' + digests[n] + '"')
    elif kind == "v":
      out.append(enc(values[n]))
    else:
      out.append(fixed[kind])
    out.append(piece)
  return "".join(out)


def _make_template(m: SnapshotManifest) -> tuple[list[str], list[tuple[str, int]]] | None:
  """``(pieces, holes)``: the manifest JSON split at each per-save value."""
  n = iter(range(1 << 62))
  v = iter(range(1 << 62))
  leaves = tuple(leaf._replace(
      value=f"@@jaxckpt:v{next(v)}@@" if leaf.kind == "scalar" else leaf.value,
      shards=tuple(r._replace(checksum=f"@@jaxckpt:c{next(n)}@@")
                   for r in leaf.shards)) for leaf in m.leaves)
  shaped = dataclasses.replace(m, step="@@jaxckpt:step@@", metadata="@@jaxckpt:meta@@",
                               process_index="@@jaxckpt:pi@@",
                               process_count="@@jaxckpt:pc@@", leaves=leaves,
                               json_renderer=None)
  text = shaped.to_json()
  parts = _HOLE.split(text)      # [piece, kind, number, piece, kind, number, ..., piece]
  pieces, holes = parts[0::3], [(k, int(d) if d else 0) for k, d in zip(parts[1::3], parts[2::3])]
  want = sum(len(leaf.shards) for leaf in m.leaves) + sum(leaf.kind == "scalar"
                                                          for leaf in m.leaves) + 4
  return (pieces, holes) if len(holes) == want else None

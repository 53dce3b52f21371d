"""Where each stored shard goes in a snapshot buffer, cached per tree layout."""

from __future__ import annotations

import collections
import dataclasses
import math
import logging
import threading
from typing import Any, Sequence

import jax
import numpy as np

from jaxckpt.capture._pack import PackPlan, make_pack_plan, packable
from jaxckpt.host.snapshot import Box, LeafRecord, align, box_from_index, full_box
from jaxckpt.tree import Leaf

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class ShardSlot:
  """One shard to store: leaf ``leaf``, global ``box``, bytes at ``offset``."""

  leaf: int
  box: Box
  offset: int
  nbytes: int
  data_index: int = 0         # its position in ``x.addressable_data(i)`` (jax leaves)
  on_cpu: bool = True         # host-resident device memory: zero-copy views
  few_of_many: bool = False   # one of few stored shards of many devices (replicated leaf)


@dataclasses.dataclass(frozen=True, slots=True)
class CapturePlan:
  """The byte layout of one process's snapshot of a given tree layout."""

  templates: tuple[LeafRecord, ...]    # leaves without shards or scalar values
  shards: tuple[ShardSlot, ...]        # copied one by one (not the packed leaves)
  nbytes: int
  pack: PackPlan | None = None         # small fully sharded leaves, gathered by one call
  # The manifest JSON template of this layout, built by the first save that needs it.
  json_template: list[Any] = dataclasses.field(default_factory=list, compare=False, repr=False)


def _signature(leaves: Sequence[Leaf]) -> tuple:
  sig = []
  for leaf in leaves:
    if leaf.kind == "scalar":
      sig.append((leaf.path, "scalar"))
    else:
      x = leaf.value
      sig.append((leaf.path, leaf.kind, x.shape, x.dtype,
                  getattr(x, "sharding", None), leaf.key_impl))
  return tuple(sig)


def sharding_info(x: Any) -> dict[str, Any] | None:
  """A JSON description of how a jax.Array is laid out (informational)."""
  s = getattr(x, "sharding", None)
  if isinstance(s, jax.sharding.NamedSharding):
    return {"type": "NamedSharding",
            "mesh_shape": {str(k): int(v) for k, v in s.mesh.shape.items()},
            "spec": [None if p is None else (list(p) if isinstance(p, tuple) else p)
                     for p in s.spec]}
  if s is not None:
    return {"type": type(s).__name__, "num_devices": len(s.device_set)}
  return None


class _Layout:
  """What is known of one tree layout: its plan with the packed gather, and
  the plan without it that saves use until the gather is compiled."""

  def __init__(self, leaves: Sequence[Leaf]) -> None:
    # Saves start on the shard-by-shard plan at once; the packed plan (one compiled
    # gather of the small sharded leaves) is made and compiled on a thread of its own,
    # whatever the layout's size: even 10 leaves took 60-120 ms of XLA in a fresh
    # process's first save (orbax's first async save of them blocks ~18 ms).
    self.ready = threading.Event()
    self.error: BaseException | None = None
    self.fallback = self.packed = _make_plan(leaves, pack=False)
    # Not a daemon: the interpreter's exit waits for it (a thread still inside XLA
    # when the interpreter tears down aborts the process).
    threading.Thread(target=self._pack, args=(list(leaves),), daemon=False,
                     name="jaxckpt-pack-compile").start()

  def _pack(self, leaves: list[Leaf]) -> None:
    """Plans and compiles the packed gather (seconds for thousands of leaves)."""
    pack = None
    try:
      packed = _make_plan(leaves, pack=True)
      pack = packed.pack
      if pack is not None:
        avals = [jax.ShapeDtypeStruct(leaves[i].value.shape, leaves[i].value.dtype,
                                      sharding=leaves[i].value.sharding) for i in pack.leaves]
        del leaves                       # the arrays of the first save are not held meanwhile
        compiled = pack.fn.lower(*avals).compile()
        self.packed = dataclasses.replace(packed, pack=dataclasses.replace(pack, fn=compiled))
    except Exception as e:  # pylint: disable=broad-except  (saves go on without it)
      self.error = e
      self.packed = self.fallback
      logger.warning("the packed gather of a %d-leaf layout did not compile (%s); saves "
                     "copy shard by shard", 0 if pack is None else len(pack.leaves), e)
    finally:
      self.ready.set()

  def plan(self, wait: bool) -> CapturePlan:
    if wait:
      self.ready.wait()
    return self.packed if self.ready.is_set() else self.fallback


class _Layouts:
  """Every layout this process has saved, bounded: whatever was compiled for a
  layout is shared by every manager (a manager made again in a notebook, or
  in a test, saves warm at once)."""

  def __init__(self, size: int = 64) -> None:
    self._lock = threading.Lock()
    self._size = size
    self._layouts: collections.OrderedDict[tuple, _Layout] = collections.OrderedDict()

  def get(self, leaves: Sequence[Leaf]) -> _Layout:
    sig = _signature(leaves)
    with self._lock:
      layout = self._layouts.get(sig)
      if layout is not None:
        self._layouts.move_to_end(sig)
        return layout
    layout = _Layout(leaves)          # planned outside the lock (can take a while)
    with self._lock:
      layout = self._layouts.setdefault(sig, layout)
      while len(self._layouts) > self._size:
        self._layouts.popitem(last=False)
    return layout


_LAYOUTS = _Layouts()     # process-wide by design: the compiled gathers outlive managers


class Planner:
  """The CapturePlan of a tree layout, from the process-wide cache.

  The first save of a layout never waits for a compiler: it copies shard by
  shard while the packed gather compiles on a thread of its own, and later
  saves use the gather once it is ready. ``plan(..., wait=True)`` (``prepare``)
  waits for it.
  """

  def plan(self, leaves: Sequence[Leaf], *, wait: bool = False) -> CapturePlan:
    return _LAYOUTS.get(leaves).plan(wait)


def _make_plan(leaves: Sequence[Leaf], *, pack: bool = True) -> CapturePlan:
  values = [leaf.value for leaf in leaves]
  pack = None if not pack else make_pack_plan(
      values, [i for i, leaf in enumerate(leaves)
               if leaf.kind != "scalar" and packable(leaf.value)], base=0)
  packed = set(pack.leaves) if pack else set()
  templates, shards, offset = [], [], pack.nbytes if pack else 0
  for i, leaf in enumerate(leaves):
    if leaf.kind == "scalar":
      templates.append(LeafRecord(path=leaf.path, kind="scalar"))   # value: per save
      continue
    x = leaf.value
    dtype = np.dtype(x.dtype)
    templates.append(LeafRecord(path=leaf.path, kind=leaf.kind, shape=tuple(x.shape),
                                dtype=dtype.name, sharding=sharding_info(x),
                                key_impl=leaf.key_impl))
    if i in packed:
      continue
    on_cpu = not isinstance(x, jax.Array) or all(
        d.platform == "cpu" for d in x.sharding.device_set)
    stored = _stored_boxes(x)
    # Fetching one device's array costs ~25 us; building all of them (``_arrays``)
    # ~7 us a device: a fully replicated leaf fetches only the one it stores.
    few = (isinstance(x, jax.Array) and len(stored) == 1
           and len(x.sharding.device_set) > 4)
    for box, data_index in stored:
      nbytes = math.prod(b - a for a, b in box) * dtype.itemsize
      shards.append(ShardSlot(i, box, offset, nbytes, data_index, on_cpu, few))
      offset = align(offset + nbytes)
  return CapturePlan(tuple(templates), tuple(shards), offset, pack)


def _stored_boxes(x: Any) -> list[tuple[Box, int]]:
  """This process's replica-0 shards of ``x``, each box once, with their data index.

  Computed once per (sharding, shape): ``addressable_shards`` is slow (it builds
  a Shard per device), and the leaves of a model share a few layouts.
  """
  if not isinstance(x, jax.Array):
    return [(full_box(x.shape), 0)]
  key = (x.sharding, tuple(x.shape))
  got = _BOXES.get(key)
  if got is None:
    got = _BOXES[key] = _stored_boxes_of(x)
    if len(_BOXES) > 4096:
      _BOXES.pop(next(iter(_BOXES)))
  return got


_BOXES: dict[tuple, list[tuple[Box, int]]] = {}   # (sharding, shape) -> stored boxes


def _stored_boxes_of(x: jax.Array) -> list[tuple[Box, int]]:
  seen, out = set(), []
  for i, s in enumerate(x.addressable_shards):
    box = box_from_index(s.index, x.shape)
    if s.replica_id == 0 and box not in seen:
      seen.add(box)
      out.append((box, i))
  return out

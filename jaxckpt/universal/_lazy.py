"""Lazy tensorstore views that index transforms cannot express (for conversions).

Stack, concatenate, slice and transpose are plain tensorstore operations. Pad,
reshape, average and casts to dtypes tensorstore cannot convert are
``ts.virtual_chunked`` views: reading a region of one reads only the source
regions that region needs, one read chunk at a time, and nothing is cached.

Views hold leaves in their *storage* dtype (``_layout.storage_dtype``: the
logical dtype, or a raw unsigned integer of its width when zarr v3 has no such
type); the functions here take and give logical numpy arrays.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any, Callable, Sequence

import numpy as np
import tensorstore as ts

from jaxckpt.host import snapshot as snap
from jaxckpt.host.snapshot import Box
from jaxckpt.universal import _layout as lay

READ_CHUNK_TARGET_BYTES = 4 << 20

Read = tuple[ts.TensorStore, Box, np.dtype]  # a source view, the region of it, its logical dtype
Plan = tuple[list[Read], Callable[[list[np.ndarray]], np.ndarray]]
PlanFn = Callable[[Box], Plan]


def is_native(dtype_name: str) -> bool:
  """Whether tensorstore holds ``dtype_name`` as itself (not as raw integers)."""
  return lay.storage_dtype(dtype_name) == dtype_name


def zero_origin(view: ts.TensorStore) -> ts.TensorStore:
  """The same view with every dimension starting at 0 (slicing keeps origins)."""
  return view[ts.d[:].translate_to[0]] if view.rank else view


def contiguous_chunk(shape: Sequence[int], itemsize: int,
                     target_bytes: int = READ_CHUNK_TARGET_BYTES) -> tuple[int, ...]:
  """A read unit of about ``target_bytes`` that is one C-order contiguous run.

  Whole trailing dimensions are kept while they fit; the dimension where the
  budget runs out is cut; the leading ones are 1.

  >>> contiguous_chunk((10, 4, 8), 4, target_bytes=256)
  (2, 4, 8)
  """
  out, size = [1] * len(shape), itemsize
  for i in reversed(range(len(shape))):
    d = max(1, shape[i])
    if size * d <= target_bytes:
      out[i], size = d, size * d
    else:
      out[i] = max(1, target_bytes // size)
      break
  return tuple(out)


def read_chunk(view: ts.TensorStore, itemsize: int) -> tuple[int, ...]:
  """The view's own read chunk where tensorstore knows it, else a contiguous one."""
  try:
    shape = view.chunk_layout.read_chunk.shape
  except (ValueError, AttributeError):
    shape = None
  if shape is None or any(c is None or c <= 0 for c in shape):
    return contiguous_chunk(view.shape, itemsize)
  return tuple(int(c) for c in shape)


def _slices(box: Box) -> tuple[slice, ...]:
  return tuple(slice(a, b) for a, b in box)


class _Gather:
  """Completes ``promise`` once every read is in and ``finish`` has filled the output."""

  def __init__(self, n: int, finish: Callable[[list[np.ndarray]], None], promise: Any,
               damaged: Callable[[int, Exception], Exception] | None = None):
    self._left, self._finish, self._promise = n, finish, promise
    self._damaged = damaged
    self._parts: list[Any] = [None] * n
    self._lock = threading.Lock()
    self._settled = False

  def done(self, k: int, dtype: np.dtype, future: Any) -> None:
    try:
      self._parts[k] = lay.logical_view(np.asarray(future.result()), dtype)
    except Exception as e:  # pylint: disable=broad-except
      self._settle(e if self._damaged is None else self._damaged(k, e))
      return
    with self._lock:
      self._left -= 1
      last = self._left == 0
    if last:
      self.run()

  def run(self) -> None:
    try:
      self._finish(self._parts)
    except Exception as e:  # pylint: disable=broad-except
      self._settle(e)
      return
    self._settle(None)

  def _settle(self, error: BaseException | None) -> None:
    with self._lock:
      if self._settled:
        return
      self._settled = True
    if error is None:
      self._promise.set_result(None)
    else:
      self._promise.set_exception(error)


def virtual(plan: PlanFn, shape: Sequence[int], dtype_name: str,
            chunk: Sequence[int], *,
            damaged: Callable[[Box, Exception], Exception] | None = None) -> ts.TensorStore:
  """A lazy view whose regions are computed from other views' regions.

  ``plan(box)`` names the source regions ``box`` needs, as (view, box, logical
  dtype), and a function from those regions (logical numpy arrays) to the
  values of ``box``. The reads are started at once and the result is filled
  in from their completion callbacks: no thread ever blocks on another read,
  so views nest (a pad of an average of ...) without exhausting executors.
  ``damaged(src_box, error)``, if given, turns a failed source read into the
  error to raise (naming what was being read).
  """
  storage = ts.dtype(lay.storage_dtype(dtype_name))

  def read(domain: ts.IndexDomain, array: np.ndarray, params: object) -> Any:
    del params
    box = tuple((int(lo), int(lo) + int(n)) for lo, n in zip(domain.inclusive_min, domain.shape))
    reads, compute = plan(box)

    def finish(parts: list[np.ndarray]) -> None:
      out = np.asarray(compute(parts))
      array[...] = out if out.dtype == array.dtype else out.view(array.dtype)

    promise, future = ts.Promise.new()
    gather = _Gather(len(reads), finish, promise,
                     None if damaged is None else lambda k, e: damaged(reads[k][1], e))
    if not reads:
      gather.run()
    for k, (view, src, dtype) in enumerate(reads):
      view[_slices(src)].read().add_done_callback(functools.partial(gather.done, k, dtype))
    return future

  return ts.virtual_chunked(
      read, dtype=storage, domain=ts.IndexDomain(shape=list(shape)),
      chunk_layout=ts.ChunkLayout(read_chunk_shape=[max(1, int(c)) for c in chunk]),
      context=lay.context())


def pad(view: ts.TensorStore, dtype: np.dtype, dtype_name: str, shape: Sequence[int],
        value: float) -> ts.TensorStore:
  """``view`` grown to ``shape`` at the high end of each dimension, filled with ``value``."""
  src = snap.full_box(view.shape)

  def plan(box: Box) -> Plan:
    inter = snap.box_intersection(box, src)

    def compute(parts: list[np.ndarray]) -> np.ndarray:
      out = np.full(snap.box_shape(box), value, dtype=dtype)
      if inter is not None:
        out[snap.relative_slices(inter, box)] = parts[0]
      return out

    return ([] if inter is None else [(view, inter, dtype)]), compute

  return virtual(plan, shape, dtype_name, read_chunk(view, dtype.itemsize))


def reshape(view: ts.TensorStore, dtype: np.dtype, dtype_name: str,
            shape: Sequence[int]) -> ts.TensorStore:
  """``view`` in C order with a new shape; each region reads its source bounding box."""
  src_shape = tuple(view.shape)

  def plan(box: Box) -> Plan:
    if any(a == b for a, b in box):
      return [], lambda parts: np.zeros(snap.box_shape(box), dtype)
    grids = np.meshgrid(*[np.arange(a, b) for a, b in box], indexing="ij")
    idx = np.unravel_index(np.ravel_multi_index(grids, shape), src_shape)
    cover = tuple((int(i.min()), int(i.max()) + 1) for i in idx)
    local = tuple(i - lo for i, (lo, _) in zip(idx, cover))
    return [(view, cover, dtype)], lambda parts: parts[0][local]

  return virtual(plan, shape, dtype_name, contiguous_chunk(shape, dtype.itemsize))


def average(views: Sequence[ts.TensorStore], dtype: np.dtype, dtype_name: str) -> ts.TensorStore:
  """The elementwise mean of equal-shaped views, in float64 (complex128), rounded once."""
  acc = np.complex128 if np.issubdtype(dtype, np.complexfloating) else np.float64

  def plan(box: Box) -> Plan:
    return ([(v, box, dtype) for v in views],
            lambda parts: np.mean(np.stack(parts), axis=0, dtype=acc).astype(dtype))

  return virtual(plan, views[0].shape, dtype_name, read_chunk(views[0], dtype.itemsize))


def cast(view: ts.TensorStore, src: np.dtype, src_name: str, dst_name: str) -> ts.TensorStore:
  """``view`` converted to ``dst_name`` as numpy ``astype`` does."""
  if is_native(src_name) and is_native(dst_name):
    return ts.cast(view, ts.dtype(dst_name))
  dst = snap.dtype_from_name(dst_name)

  def plan(box: Box) -> Plan:
    return [(view, box, src)], lambda parts: parts[0].astype(dst)

  return virtual(plan, view.shape, dst_name, read_chunk(view, max(src.itemsize, dst.itemsize)))


def checked_size(shape: Sequence[int], new: Sequence[int]) -> tuple[int, ...] | None:
  """``new`` with its one ``-1`` resolved, or None if it cannot hold ``shape``'s elements."""
  n = math.prod(shape)
  known = math.prod(d for d in new if d != -1)
  if -1 in new:
    if known == 0 or n % known:
      return None
    new = tuple(n // known if d == -1 else d for d in new)
  return tuple(new) if math.prod(new) == n else None

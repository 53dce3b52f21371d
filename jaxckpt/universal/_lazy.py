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

import asyncio
import functools
import math
import threading
from typing import Awaitable, Callable, Sequence

import numpy as np
import tensorstore as ts

from jaxckpt import snapshot as snap
from jaxckpt.snapshot import Box
from jaxckpt.universal import _layout as lay

READ_CHUNK_TARGET_BYTES = 4 << 20

RegionFn = Callable[[Box], Awaitable[np.ndarray]]


@functools.lru_cache(maxsize=1)
def _loop() -> asyncio.AbstractEventLoop:
  """The event loop that runs every virtual view's read coroutine (one daemon thread)."""
  loop = asyncio.new_event_loop()
  threading.Thread(target=loop.run_forever, name="jaxckpt-lazy-views", daemon=True).start()
  return loop


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


async def read_logical(view: ts.TensorStore, box: Box, dtype: np.dtype) -> np.ndarray:
  """Reads ``box`` of a storage-dtype view as a logical numpy array."""
  raw = await view[tuple(slice(a, b) for a, b in box)].read()
  return lay.logical_view(np.asarray(raw), dtype)


def virtual(fn: RegionFn, shape: Sequence[int], dtype_name: str,
            chunk: Sequence[int]) -> ts.TensorStore:
  """A lazy view whose regions ``fn(box)`` computes (logical dtype in, storage dtype out)."""
  storage = ts.dtype(lay.storage_dtype(dtype_name))

  async def read(domain: ts.IndexDomain, array: np.ndarray, params: object) -> None:
    del params
    box = tuple((int(lo), int(lo) + int(n)) for lo, n in zip(domain.inclusive_min, domain.shape))
    out = np.asarray(await fn(box))
    array[...] = out if out.dtype == array.dtype else out.view(array.dtype)

  return ts.virtual_chunked(
      read, dtype=storage, domain=ts.IndexDomain(shape=list(shape)),
      chunk_layout=ts.ChunkLayout(read_chunk_shape=[max(1, int(c)) for c in chunk]),
      context=lay.context(), loop=_loop())


def pad(view: ts.TensorStore, dtype: np.dtype, dtype_name: str, shape: Sequence[int],
        value: float) -> ts.TensorStore:
  """``view`` grown to ``shape`` at the high end of each dimension, filled with ``value``."""
  src = snap.full_box(view.shape)

  async def region(box: Box) -> np.ndarray:
    out = np.full(snap.box_shape(box), value, dtype=dtype)
    inter = snap.box_intersection(box, src)
    if inter is not None:
      out[snap.relative_slices(inter, box)] = await read_logical(view, inter, dtype)
    return out

  return virtual(region, shape, dtype_name, read_chunk(view, dtype.itemsize))


def reshape(view: ts.TensorStore, dtype: np.dtype, dtype_name: str,
            shape: Sequence[int]) -> ts.TensorStore:
  """``view`` in C order with a new shape; each region reads its source bounding box."""
  src_shape = tuple(view.shape)

  async def region(box: Box) -> np.ndarray:
    if any(a == b for a, b in box):
      return np.zeros(snap.box_shape(box), dtype)
    grids = np.meshgrid(*[np.arange(a, b) for a, b in box], indexing="ij")
    idx = np.unravel_index(np.ravel_multi_index(grids, shape), src_shape)
    cover = tuple((int(i.min()), int(i.max()) + 1) for i in idx)
    data = await read_logical(view, cover, dtype)
    return data[tuple(i - lo for i, (lo, _) in zip(idx, cover))]

  return virtual(region, shape, dtype_name, contiguous_chunk(shape, dtype.itemsize))


def average(views: Sequence[ts.TensorStore], dtype: np.dtype, dtype_name: str) -> ts.TensorStore:
  """The elementwise mean of equal-shaped views, in float64 (complex128), rounded once."""
  acc = np.complex128 if np.issubdtype(dtype, np.complexfloating) else np.float64

  async def region(box: Box) -> np.ndarray:
    parts = await asyncio.gather(*[read_logical(v, box, dtype) for v in views])
    return np.mean(np.stack(parts), axis=0, dtype=acc).astype(dtype)

  return virtual(region, views[0].shape, dtype_name, read_chunk(views[0], dtype.itemsize))


def cast(view: ts.TensorStore, src: np.dtype, src_name: str, dst_name: str) -> ts.TensorStore:
  """``view`` converted to ``dst_name`` as numpy ``astype`` does."""
  if is_native(src_name) and is_native(dst_name):
    return ts.cast(view, ts.dtype(dst_name))
  dst = snap.dtype_from_name(dst_name)

  async def region(box: Box) -> np.ndarray:
    return (await read_logical(view, box, src)).astype(dst)

  return virtual(region, view.shape, dst_name, read_chunk(view, max(src.itemsize, dst.itemsize)))


def checked_size(shape: Sequence[int], new: Sequence[int]) -> tuple[int, ...] | None:
  """``new`` with its one ``-1`` resolved, or None if it cannot hold ``shape``'s elements."""
  n = math.prod(shape)
  known = math.prod(d for d in new if d != -1)
  if -1 in new:
    if known == 0 or n % known:
      return None
    new = tuple(n // known if d == -1 else d for d in new)
  return tuple(new) if math.prod(new) == n else None

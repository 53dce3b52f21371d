"""One leaf's stored chunks read straight into the buffers of its target boxes.

The hot path of a restore from storage: every stored chunk the boxes touch is
read once, concurrently (tensorstore's own threads do the I/O and decoding),
and checked against its xxh3-64 in the manifest as soon as it arrives, while
later chunks are still in flight. A chunk that lies whole and contiguous in one
box is read by tensorstore directly into that box's buffer (no copy of ours);
any other chunk lands in a buffer of its own, is checked there, and its parts
are copied into each box it touches. At most ``window`` bytes of chunks are in
flight at once, so a restore holds its target's buffers and that window, not a
copy of the leaf. The buffers are handed out only once every chunk is checked:
a read that fails, or a chunk that does not match, raises and no byte of the
boxes reaches the caller.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
import stat
from typing import Any, Callable, Sequence

import ml_dtypes
import numpy as np
import tensorstore as ts

from jaxckpt.host import snapshot as snap
from jaxckpt.host.snapshot import Box
from jaxckpt.universal import _budget
from jaxckpt.universal import _layout as lay
from jaxckpt.universal import _manifest as man

#: Bytes of stored chunks one leaf's restore keeps in flight (the bounded window). 64 MiB
#: on loopback S3 was no faster (0.39-0.44x a raw read against 0.37-0.62x) and held
#: 127-216 MiB above the target against 93-160 MiB.
DEFAULT_WINDOW_BYTES = 16 << 20

Index = tuple[int, ...]
#: ``verify(idx, arr)``: ``arr`` (storage dtype) if it is chunk ``idx`` as saved, else raises.
Verify = Callable[[Index, np.ndarray], np.ndarray]
#: ``failed(cbox, error)``: the error to raise for a read of the chunk at ``cbox`` that failed.
Failed = Callable[[Box, Exception], Exception]


@dataclasses.dataclass
class _Chunk:
  idx: Index
  box: Box
  nbytes: int
  direct: np.ndarray | None                            # the box's view it is read into
  parts: list[tuple[np.ndarray, tuple[slice, ...]]]    # (box view, slices of the chunk)


def plan(info: man.LeafInfo, out: dict[Box, np.ndarray]) -> list[_Chunk]:
  """Every stored chunk the boxes of ``out`` touch, once, in grid order, with where its
  bytes go: straight into one box's buffer, or in parts into several."""
  holders: dict[Index, list[Box]] = collections.defaultdict(list)
  for b in out:
    if snap.box_size(b):
      for idx in lay.chunks_in(b, info.chunk_shape):
        holders[idx].append(b)
  chunks = []
  itemsize = info.numpy_dtype.itemsize
  for idx in sorted(holders):
    cbox = lay.chunk_box(idx, info.shape, info.chunk_shape)
    parts, direct = [], None
    for b in holders[idx]:
      inter = snap.box_intersection(cbox, b)
      if inter is not None and snap.box_size(inter):
        view = out[b][snap.relative_slices(inter, b) + (Ellipsis,)]   # rank 0: a view too
        parts.append((view, snap.relative_slices(inter, cbox)))
    if len(parts) == 1 and parts[0][0].shape == snap.box_shape(cbox) and \
        parts[0][0].flags.c_contiguous:
      direct, parts = parts[0][0], []
    chunks.append(_Chunk(idx, cbox, snap.box_size(cbox) * itemsize, direct, parts))
  return chunks


_INDEX = 16 + 4    # one inner chunk's (offset, nbytes) and the index's crc32c
_CRC = 4           # the crc32c after an inner chunk's bytes


@functools.lru_cache(maxsize=1)
def _pool() -> concurrent.futures.ThreadPoolExecutor:
  """Threads that read local chunk files (``os.preadv`` lets go of the GIL)."""
  return concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="jaxckpt-read")


def _whole_bytes(dtype: np.dtype) -> bool:
  """Whether each value of ``dtype`` is its own bytes (not a packed sub-byte type)."""
  if dtype.kind not in "biufcV" or dtype.byteorder == ">":
    return False
  for info in (ml_dtypes.iinfo, ml_dtypes.finfo):
    try:
      return info(dtype).bits == 8 * dtype.itemsize
    except (ValueError, TypeError):
      continue
  return dtype.kind == "b"


class ChunkFiles:
  """The stored objects of one leaf's chunks, read without tensorstore's decoding.

  A chunk stored as one inner chunk of the sharding codec is its bytes, their
  crc32c and a one-entry index: its bytes are read straight into the buffer
  they go to (``os.preadv`` for local files, one kvstore read elsewhere), and
  the manifest's xxh3-64 that every chunk is checked against covers them (the
  crc32c proves less). ``read`` answers False for anything else (a chunk at the
  array's edge, several inner chunks, a file that is not what the layout says,
  a failed read): the caller reads it through tensorstore, which says why.
  """

  def __init__(self, directory: str, step: int, info: man.LeafInfo, storage: np.dtype) -> None:
    sub = f"{lay.step_dir(step)}arrays/{info.array}/"
    self._local = lay.local_path(directory)
    self._dir = None if self._local is None else os.path.join(self._local, sub)
    self._kv = None
    if self._local is None:
      self._kv = ts.KvStore.open(lay.kvstore_spec(directory, sub), context=lay.context()).result(
          timeout=lay.REQUEST_TIMEOUT_SECS)
    self.usable = (len(info.shape) > 0 and tuple(info.inner_chunk_shape) == tuple(info.chunk_shape)
                   and storage.itemsize == info.numpy_dtype.itemsize and _whole_bytes(storage))
    self._chunk = tuple(info.chunk_shape)
    self.window = DEFAULT_WINDOW_BYTES

  def covers(self, chunk: _Chunk) -> bool:
    return self.usable and snap.box_shape(chunk.box) == self._chunk

  def start(self, chunk: _Chunk, dst: np.ndarray) -> Any:
    """Starts reading ``chunk`` into ``dst`` (contiguous); ``finish`` tells if it landed."""
    key = "c/" + "/".join(str(i) for i in chunk.idx)
    flat = dst.reshape(-1).view(np.uint8)
    if self._dir is not None:
      return _pool().submit(_pread_chunk, os.path.join(self._dir, key), flat)
    return self._kv.read(key)

  def finish(self, future: Any, dst: np.ndarray) -> bool:
    try:
      got = future.result(timeout=lay.REQUEST_TIMEOUT_SECS)
    except (TimeoutError, ValueError, OSError):
      return False
    if self._dir is not None:
      return bool(got)
    if got.state != "value":
      return False
    flat = dst.reshape(-1).view(np.uint8)
    span = _span(np.frombuffer(got.value, np.uint8), len(got.value), flat.size)
    if span is None:
      return False
    np.copyto(flat, np.frombuffer(got.value, np.uint8, flat.size, span))
    return True


def _span(tail: np.ndarray, size: int, n: int) -> int | None:
  """Where the ``n`` bytes of a one-inner-chunk shard of ``size`` bytes start (``tail``
  ends with its index), or None if its index says otherwise."""
  if size != n + _CRC + _INDEX or tail.size < _INDEX:
    return None
  off, nbytes = (int(x) for x in tail[tail.size - _INDEX:tail.size - 4].view("<u8"))
  return off if nbytes == n + _CRC and off + nbytes <= size - _INDEX else None


def _pread_chunk(path: str, flat: np.ndarray) -> bool:
  """Reads the bytes of the one-inner-chunk shard at ``path`` into ``flat``."""
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
  except OSError:
    return False
  try:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
      return False
    tail = np.frombuffer(os.pread(fd, _INDEX, max(0, st.st_size - _INDEX)), np.uint8)
    off = _span(tail, st.st_size, flat.size)
    if off is None:
      return False
    view, done = memoryview(flat), 0
    while done < flat.size:
      n = os.preadv(fd, [view[done:]], off + done)
      if n <= 0:
        return False
      done += n
    return True
  except OSError:
    return False
  finally:
    os.close(fd)


class _Copied:
  """A tensorstore read whose result ``result()`` copies into ``dst`` (contiguous)."""

  def __init__(self, future: Any, dst: np.ndarray) -> None:
    self._future, self._dst = future, dst

  def result(self, timeout: float | None = None) -> None:
    raw = np.ascontiguousarray(self._future.result(timeout=timeout))
    self._dst.reshape(-1).view(np.uint8)[...] = raw.reshape(-1).view(np.uint8)

  def cancel(self) -> bool:
    return self._future.cancel()


def _staged(spare: list[np.ndarray], chunk: _Chunk, dtype: np.dtype) -> np.ndarray:
  """A buffer for ``chunk`` (storage dtype, its shape): a spare one if one is big enough."""
  n = chunk.nbytes // dtype.itemsize
  for k, buf in enumerate(spare):
    if buf.size >= n:
      return spare.pop(k)[:n].reshape(snap.box_shape(chunk.box))
  return snap.aligned_empty(snap.box_shape(chunk.box), dtype)


def fill(store: ts.TensorStore, info: man.LeafInfo, boxes: Sequence[Box], *,
         verify: Verify, failed: Failed, budget: _budget.ByteBudget | None = None,
         window: int = DEFAULT_WINDOW_BYTES,
         files: ChunkFiles | None = None) -> tuple[dict[Box, np.ndarray], int]:
  """Fresh aligned arrays (logical dtype) holding ``boxes`` of the leaf, every chunk
  checked, and the bytes read from storage. ``budget`` (shared by a restore's leaves)
  caps the bytes in flight beside ``window``."""
  out = {b: snap.aligned_empty(snap.box_shape(b), info.numpy_dtype) for b in dict.fromkeys(boxes)}
  storage = np.dtype(store.dtype.numpy_dtype)
  todo = plan(info, out)
  if budget is not None:
    window = min(window, budget.max_bytes)
  inflight: collections.deque = collections.deque()
  staging: dict[int, np.ndarray] = {}          # chunk -> the buffer it is read into
  spare: list[np.ndarray] = []                 # flat buffers of chunks done with
  held = read = 0
  what = f"leaf {info.path!r}"

  def _ts_read(chunk: _Chunk, dst: np.ndarray) -> Any:
    src = store[tuple(slice(a, b) for a, b in chunk.box)]
    try:
      return ts.array(dst.view(storage), copy=False, write=True).write(src)
    except ValueError:      # a dtype tensorstore cannot write into in place: read, then copy
      return _Copied(src.read(), dst)

  def finish() -> None:
    nonlocal held, read
    chunk, dst, future, fast = inflight.popleft()
    if fast and not files.finish(future, dst):
      fast, future = False, _ts_read(chunk, dst)
    if not fast:
      try:
        future.result(timeout=lay.REQUEST_TIMEOUT_SECS)
      except TimeoutError:
        raise failed(chunk.box, TimeoutError(
            f"no answer within {lay.REQUEST_TIMEOUT_SECS} s")) from None
      except ValueError as e:
        raise failed(chunk.box, e) from None
    if chunk.direct is not None:
      verify(chunk.idx, chunk.direct.view(storage))
    else:
      staged = staging.pop(id(chunk))
      arr = lay.logical_view(verify(chunk.idx, staged), info.numpy_dtype)
      for dst, src in chunk.parts:
        dst[...] = arr[src]
      spare.append(staged.reshape(-1))
    held -= chunk.nbytes
    read += chunk.nbytes
    if budget is not None:
      budget.release(chunk.nbytes)

  try:
    for chunk in todo:
      while inflight and held + chunk.nbytes > window:
        finish()
      while budget is not None and not budget.try_acquire(chunk.nbytes):
        if not inflight:       # holding nothing, so waiting holds up no other leaf
          budget.acquire(chunk.nbytes, what)
          break
        finish()
      held += chunk.nbytes
      dst = chunk.direct
      if dst is None:                           # a buffer of the window, reused
        dst = staging[id(chunk)] = _staged(spare, chunk, storage)
      fast = files is not None and files.covers(chunk)
      inflight.append((chunk, dst, files.start(chunk, dst) if fast else _ts_read(chunk, dst),
                       fast))
    while inflight:
      finish()
  finally:
    for _, _, future, _ in inflight:         # a failure: nothing more lands in the buffers
      future.cancel()
    if budget is not None and held:
      budget.release(held)
  return out, read

"""The data path of the fault-tolerant all-reduce: a ring, bandwidth-optimal and bit-exact.

The G participants of a step (the quorum's healthy members, in group-id order)
pack their gradient leaves into one flat accumulator buffer (float32, or wider
where a leaf is wider), cut it into G chunks, and run

1. a reduce-scatter: in hop ``s`` (0 .. G-2) rank ``r`` sends chunk
   ``(r - s) mod G`` to rank ``r + 1`` and adds the chunk ``(r - s - 1) mod G``
   it receives from rank ``r - 1`` into its own; rank ``r`` then holds the full
   sum of chunk ``(r + 1) mod G``, summed in the fixed order ``c, c+1, ...``;
2. a division by G of that chunk, and
3. an all-gather: in hop ``s`` rank ``r`` forwards chunk ``(r + 1 - s) mod G``
   and receives chunk ``(r - s) mod G``, bytes unchanged.

Every chunk is summed once, by one rank, and then copied: every participant
gets bit-identical results. Each sends ``2 (G - 1) / G`` of the gradient's
accumulator bytes (the star it replaced sent ``G x`` through its leader).

The transport is two callables, so another backend (NCCL through a binding
such as cupy's or torch's, on device buffers) can replace the host sockets;
:mod:`jaxckpt.ft.replica_group` keeps the control (quorum, timeouts, commit).
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from jaxckpt import errors

Send = Callable[[int, list[np.ndarray]], None]       # (tag, a piece's segments) to the right neighbour
Recv = Callable[[int, np.ndarray], bool]             # (tag, where to write the piece) from the left

#: A hop's chunk travels in pieces of at most this many bytes: the receiver adds
#: one piece while the next is on the wire, and buffers this small are reused by
#: the allocator (a fresh buffer per large message costs a page fault per page).
PIECE_BYTES = 4 << 20
_MAX_PIECES = 1 << 16


def tag(hop: int, piece: int) -> int:
  """The message tag of ``piece`` of ``hop``."""
  return hop * _MAX_PIECES + piece


def accumulator_dtype(leaves: Sequence[np.ndarray]) -> np.dtype:
  """float32, or the widest floating leaf dtype above it."""
  dtype = np.dtype(np.float32)
  for x in leaves:
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise errors.UnsupportedLeafError(
          f"allreduce averages floating gradients only, got a leaf of dtype={x.dtype}")
    if x.dtype.itemsize > dtype.itemsize:
      dtype = np.dtype(x.dtype)
  return dtype


class BufferPool:
  """Flat buffers reused across steps once nothing refers to them any more (no
  result, ring entry or in-flight message holds a view): fresh memory costs a
  page fault per page on first touch, as much as the transfer itself."""

  def __init__(self, keep: int) -> None:
    self.keep = keep
    self._bufs: list[np.ndarray] = []

  def get(self, n: int, dtype: np.dtype) -> np.ndarray:
    for b in self._bufs:   # (not enumerate: its reused result tuple holds a reference too)
      # Only the pool's list, this loop's variable and getrefcount's argument refer to an unused buffer.
      if b.size == n and b.dtype == dtype and sys.getrefcount(b) <= 3:
        return b
    buf = np.empty(n, dtype)
    self._bufs.append(buf)
    if len(self._bufs) > self.keep:
      self._bufs.pop(0)
    return buf


def flatten(leaves: Sequence[np.ndarray]) -> np.ndarray:
  """The leaves in one flat accumulator buffer (a copy)."""
  out = np.empty(sum(x.size for x in leaves), accumulator_dtype(leaves))
  at = 0
  for x in leaves:
    out[at:at + x.size] = np.asarray(x).reshape(-1)
    at += x.size
  return out


def unflatten(flat: np.ndarray, like: Sequence[np.ndarray]) -> list[np.ndarray]:
  """``flat`` cut back into read-only leaves of ``like``'s shapes and dtypes
  (views where the dtype is the accumulator's)."""
  out, at = [], 0
  for x in like:
    leaf = flat[at:at + x.size].astype(x.dtype, copy=False).reshape(x.shape)
    leaf.flags.writeable = False
    out.append(leaf)
    at += x.size
  return out


def bounds(n: int, parts: int) -> list[tuple[int, int]]:
  """``parts`` contiguous chunks of ``range(n)``, sizes differing by at most one."""
  q, rem = divmod(n, parts)
  out, lo = [], 0
  for i in range(parts):
    hi = lo + q + (i < rem)
    out.append((lo, hi))
    lo = hi
  return out


def ring_mean(leaves: Sequence[np.ndarray], rank: int, size: int, send: Send, recv: Recv,
              pool: BufferPool | None = None, *, average: bool = True) -> list[np.ndarray] | None:
  """The mean (``average=False``: the sum) of every participant's ``leaves`` (read-only
  arrays); None if a hop's piece did not arrive (``recv`` returned False: a neighbour died
  or was too late). ``pool`` reuses the flat buffer of an earlier step once unused.

  ``send(tag, segments)`` queues a piece (its bytes are ``segments`` in order,
  left untouched until the right neighbour has them) and must not block;
  ``recv(tag, into)`` writes the left neighbour's piece ``tag`` into ``into``.
  """
  src = _Source(leaves, accumulator_dtype(leaves))
  flat = np.empty(src.size, src.dtype) if pool is None else pool.get(src.size, src.dtype)
  if size == 1:
    for off, seg in src.segments(0, src.size):
      flat[off:off + seg.size] = seg
  elif not _ring(src, flat, rank, size, send, recv, average):
    return None
  return unflatten(flat, leaves)


class _Source:
  """The input leaves as one virtual flat array of the accumulator dtype, not
  copied (a leaf of another dtype is converted): the ring reads each input
  byte where it lies, so no flattening pass precedes it."""

  def __init__(self, leaves: Sequence[np.ndarray], dtype: np.dtype) -> None:
    self.dtype = dtype
    self._parts = [np.asarray(x).reshape(-1).astype(dtype, copy=False) for x in leaves]
    self._starts = np.cumsum([0] + [p.size for p in self._parts])
    self.size = int(self._starts[-1])

  def segments(self, lo: int, hi: int) -> list[tuple[int, np.ndarray]]:
    """``(offset from lo, contiguous view)`` pairs covering flat elements ``lo .. hi - 1``."""
    out, at = [], lo
    i = int(np.searchsorted(self._starts, lo, side="right")) - 1
    while at < hi:
      start, stop = int(self._starts[i]), int(self._starts[i + 1])
      if stop > at:
        out.append((at - lo, self._parts[i][at - start:min(hi, stop) - start]))
        at = min(hi, stop)
      i += 1
    return out


def _pieces(lo: int, hi: int, itemsize: int) -> list[tuple[int, int]]:
  """Flat ranges of at most PIECE_BYTES covering ``lo .. hi - 1`` (one, maybe empty, at least)."""
  step = max(1, PIECE_BYTES // itemsize)
  return [(a, min(a + step, hi)) for a in range(lo, max(hi, lo + 1), step)]


def _ring(src: _Source, flat: np.ndarray, rank: int, size: int, send: Send, recv: Recv,
          average: bool = True) -> bool:
  """The mean into ``flat``. The reduce-scatter sends its first chunk from the
  input and writes each received chunk as ``input + piece``, so every element of
  ``flat`` is written once per phase and never copied from the input first. A
  chunk sent without a copy is overwritten in the all-gather only after its sum
  came back around, so after the right neighbour had the bytes; a forwarded
  chunk is never written again."""
  chunks = bounds(src.size, size)
  scratch = np.empty(max(b - a for c in chunks for a, b in _pieces(*c, src.dtype.itemsize)), src.dtype)

  def send_chunk(hop: int, c: int, from_input: bool) -> None:
    for i, (a, b) in enumerate(_pieces(*chunks[c], src.dtype.itemsize)):
      send(tag(hop, i), [seg for _, seg in src.segments(a, b)] if from_input else [flat[a:b]])

  for s in range(size - 1):                                 # reduce-scatter
    send_chunk(s, (rank - s) % size, from_input=s == 0)
    for i, (a, b) in enumerate(_pieces(*chunks[(rank - s - 1) % size], src.dtype.itemsize)):
      got = scratch[:b - a]
      if not recv(tag(s, i), got):
        return False
      for off, seg in src.segments(a, b):
        np.add(seg, got[off:off + seg.size], out=flat[a + off:a + off + seg.size])  # (a + b == b + a)
  lo, hi = chunks[(rank + 1) % size]
  if average:
    np.divide(flat[lo:hi], size, out=flat[lo:hi])
  for s in range(size - 1):                                 # all-gather
    send_chunk(size - 1 + s, (rank + 1 - s) % size, from_input=False)
    for i, (a, b) in enumerate(_pieces(*chunks[(rank - s) % size], src.dtype.itemsize)):
      if not recv(tag(size - 1 + s, i), flat[a:b]):
        return False
  return True


def reference_mean(contributions: Sequence[Sequence[np.ndarray]], *, average: bool = True
                   ) -> list[np.ndarray]:
  """What :func:`ring_mean` gives every participant, computed in one place (for
  checks): contribution ``i`` is rank ``i``'s leaves; chunk ``c`` of the flat
  buffer is summed starting at rank ``c``, in ring order, then divided (unless
  ``average`` is False: the sum)."""
  size = len(contributions)
  flats = [flatten(c) for c in contributions]
  out = np.empty_like(flats[0])
  for c, (lo, hi) in enumerate(bounds(out.size, size)):
    acc = flats[c % size][lo:hi].copy()
    for k in range(1, size):
      np.add(acc, flats[(c + k) % size][lo:hi], out=acc)
    if average:
      np.divide(acc, size, out=out[lo:hi])
    else:
      out[lo:hi] = acc
  return unflatten(out, contributions[0])

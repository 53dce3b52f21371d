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

Send = Callable[[int, np.ndarray], None]           # (tag, piece) to the right neighbour
Recv = Callable[[int], "np.ndarray | None"]        # tag -> piece from the left neighbour

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
    for i, b in enumerate(self._bufs):
      # Only the pool's list and this loop's variable refer to an unused buffer.
      if b.size == n and b.dtype == dtype and sys.getrefcount(b) <= 3:
        return b
    buf = np.empty(n, dtype)
    self._bufs.append(buf)
    if len(self._bufs) > self.keep:
      self._bufs.pop(0)
    return buf


def flatten(leaves: Sequence[np.ndarray], pool: BufferPool | None = None) -> np.ndarray:
  """The leaves in one flat accumulator buffer (a copy)."""
  dtype = accumulator_dtype(leaves)
  n = sum(x.size for x in leaves)
  out = np.empty(n, dtype) if pool is None else pool.get(n, dtype)
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
              pool: BufferPool | None = None) -> list[np.ndarray] | None:
  """The mean of every participant's ``leaves`` (read-only arrays); None if a
  hop's chunk did not arrive (``recv`` returned None: a neighbour died or was
  too late). ``pool`` reuses the flat buffer of an earlier step once unused."""
  flat = flatten(leaves, pool)
  if size > 1:
    flat = _ring(flat, rank, size, send, recv)
    if flat is None:
      return None
  else:
    np.divide(flat, 1, out=flat)
  return unflatten(flat, leaves)


def _pieces(chunk: np.ndarray) -> list[np.ndarray]:
  step = max(1, PIECE_BYTES // chunk.itemsize)
  return [chunk[i:i + step] for i in range(0, max(chunk.size, 1), step)]


def _exchange(hop: int, out: np.ndarray, into: np.ndarray, send: Send, recv: Recv,
              combine: Callable[[np.ndarray, np.ndarray], None]) -> bool:
  """Sends ``out`` and receives ``into``'s size, piece by piece, combining each
  received piece into ``into`` as it arrives; False if a piece is missing or wrong."""
  for i, piece in enumerate(_pieces(out)):
    send(tag(hop, i), piece)
  for i, dest in enumerate(_pieces(into)):
    got = recv(tag(hop, i))
    if got is None or got.shape != dest.shape or got.dtype != dest.dtype:
      return False
    combine(dest, got)
  return True


def _add(dest: np.ndarray, got: np.ndarray) -> None:
  np.add(dest, got, out=dest)                               # (a + b == b + a, bit for bit)


def _copy(dest: np.ndarray, got: np.ndarray) -> None:
  dest[...] = got


def _ring(acc: np.ndarray, rank: int, size: int, send: Send, recv: Recv) -> np.ndarray | None:
  """In place in ``acc``. A chunk sent (without a copy) in the reduce-scatter is
  overwritten in the all-gather only after its sum came back around, so after
  the right neighbour consumed the send; a forwarded chunk is never written again."""
  chunks = [acc[lo:hi] for lo, hi in bounds(acc.size, size)]
  for s in range(size - 1):                                 # reduce-scatter
    if not _exchange(s, chunks[(rank - s) % size], chunks[(rank - s - 1) % size],
                     send, recv, _add):
      return None
  own = (rank + 1) % size
  np.divide(chunks[own], size, out=chunks[own])
  for s in range(size - 1):                                 # all-gather
    if not _exchange(size - 1 + s, chunks[(rank + 1 - s) % size], chunks[(rank - s) % size],
                     send, recv, _copy):
      return None
  return acc


def reference_mean(contributions: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
  """What :func:`ring_mean` gives every participant, computed in one place (for
  checks): contribution ``i`` is rank ``i``'s leaves; chunk ``c`` of the flat
  buffer is summed starting at rank ``c``, in ring order, then divided."""
  size = len(contributions)
  flats = [flatten(c) for c in contributions]
  out = np.empty_like(flats[0])
  for c, (lo, hi) in enumerate(bounds(out.size, size)):
    acc = flats[c % size][lo:hi].copy()
    for k in range(1, size):
      np.add(acc, flats[(c + k) % size][lo:hi], out=acc)
    np.divide(acc, size, out=out[lo:hi])
  return unflatten(out, contributions[0])

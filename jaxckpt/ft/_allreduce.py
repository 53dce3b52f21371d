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

from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from jaxckpt import errors

Send = Callable[[int, np.ndarray], None]           # (hop, chunk) to the right neighbour
Recv = Callable[[int], "np.ndarray | None"]        # hop -> chunk from the left neighbour


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


def flatten(leaves: Sequence[np.ndarray]) -> np.ndarray:
  """The leaves in one flat accumulator buffer (a copy)."""
  dtype = accumulator_dtype(leaves)
  out = np.empty(sum(x.size for x in leaves), dtype)
  at = 0
  for x in leaves:
    out[at:at + x.size] = np.asarray(x).reshape(-1)
    at += x.size
  return out


def unflatten(flat: np.ndarray, like: Sequence[np.ndarray]) -> list[np.ndarray]:
  """``flat`` cut back into leaves of ``like``'s shapes and dtypes."""
  out, at = [], 0
  for x in like:
    out.append(flat[at:at + x.size].astype(x.dtype, copy=False).reshape(x.shape))
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


def ring_mean(leaves: Sequence[np.ndarray], rank: int, size: int, send: Send, recv: Recv
              ) -> list[np.ndarray] | None:
  """The mean of every participant's ``leaves``; None if a hop's chunk did not
  arrive (``recv`` returned None: a neighbour died or was too late)."""
  flat = flatten(leaves)
  if size > 1:
    flat = _ring(flat, rank, size, send, recv)
    if flat is None:
      return None
  else:
    np.divide(flat, 1, out=flat)
  return unflatten(flat, leaves)


def _ring(acc: np.ndarray, rank: int, size: int, send: Send, recv: Recv) -> np.ndarray | None:
  chunks = [acc[lo:hi] for lo, hi in bounds(acc.size, size)]
  for s in range(size - 1):                                 # reduce-scatter
    send(s, chunks[(rank - s) % size])
    got = recv(s)
    c = (rank - s - 1) % size
    if got is None or got.shape != chunks[c].shape or got.dtype != acc.dtype:
      return None
    np.add(chunks[c], got, out=chunks[c])                   # (a + b == b + a, bit for bit)
  own = (rank + 1) % size
  out = np.empty_like(acc)
  mine = [out[lo:hi] for lo, hi in bounds(acc.size, size)]
  np.divide(chunks[own], size, out=mine[own])
  for s in range(size - 1):                                 # all-gather
    hop = size - 1 + s
    send(hop, mine[(rank + 1 - s) % size])
    got = recv(hop)
    c = (rank - s) % size
    if got is None or got.shape != mine[c].shape or got.dtype != acc.dtype:
      return None
    mine[c][...] = got
  return out


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

"""Systematic Reed-Solomon erasure code over GF(2^8) for equal-length blocks.

>>> rs = ReedSolomon(3, 2)
>>> data = [b"abcd", b"efgh", b"ijkl"]
>>> parity = rs.encode(data)
>>> [bytes(b) for b in rs.decode([None, data[1], None, parity[0], parity[1]])]
[b'abcd', b'efgh', b'ijkl']
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Mapping, Sequence

import numpy as np

from jaxckpt import errors
from jaxckpt.parity import _gf
from jaxckpt.parity import _kernels

logger = logging.getLogger(__name__)

MAX_BLOCKS = 255

Buffer = Any  # bytes-like or 1-D uint8 array


def as_u8(buf: Buffer, *, name: str = "block", writable: bool = False) -> np.ndarray:
  """A zero-copy 1-D uint8 view of a contiguous bytes-like object or array."""
  if isinstance(buf, np.ndarray):
    if buf.dtype != np.uint8 or buf.ndim != 1 or not buf.flags.c_contiguous:
      raise errors.InvalidArgumentError(
          f"{name} must be a contiguous 1-D uint8 array, got dtype={buf.dtype} "
          f"shape={buf.shape} contiguous={buf.flags.c_contiguous}; use "
          "np.ascontiguousarray(x).view(np.uint8).reshape(-1)")
    arr = buf
  else:
    arr = np.frombuffer(buf, np.uint8)
  if writable and not arr.flags.writeable:
    raise errors.InvalidArgumentError(f"{name} must be writable (got a read-only buffer)")
  return arr


def _addresses(arrays: Sequence[np.ndarray]) -> np.ndarray:
  return np.array([a.ctypes.data for a in arrays], np.uint64)


class ReedSolomon:
  """RS(k, m): k data blocks, m parity blocks; any k of the k + m rebuild all.

  The generator is [I; P] with P a normalized Cauchy matrix
  (:func:`jaxckpt.parity._gf.parity_matrix`): parity row 0 is all ones, so
  ``m = 1`` is plain XOR. Blocks are bytes-like objects or 1-D uint8 arrays,
  all of one length (any length, 0 included). Methods release the GIL in the
  compiled kernels, so one instance can serve several threads.

  Attributes:
    k: Number of data blocks.
    m: Number of parity blocks.
    matrix: The m x k parity matrix P (uint8, read-only).
  """

  def __init__(self, k: int, m: int):
    if not isinstance(k, int) or k < 1:
      raise errors.InvalidArgumentError(f"k must be an int >= 1, got k={k!r}")
    if not isinstance(m, int) or m < 1:
      raise errors.InvalidArgumentError(f"m must be an int >= 1, got m={m!r}")
    if k + m > MAX_BLOCKS:
      raise errors.InvalidArgumentError(f"k + m must be <= {MAX_BLOCKS} in GF(2^8), got k={k} m={m}")
    self.k = k
    self.m = m
    self.matrix = _gf.parity_matrix(k, m)
    self.matrix.flags.writeable = False
    self._masks = _kernels.bit_masks(self.matrix)
    self._tables = _kernels.nibble_tables(self.matrix)
    self._plans: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[np.ndarray, ...]] = {}
    self._lock = threading.Lock()

  def __repr__(self) -> str:
    return f"ReedSolomon(k={self.k}, m={self.m})"

  def encode(self, data_blocks: Sequence[Buffer]) -> list[np.ndarray]:
    """Returns the m parity blocks of k equal-length data blocks."""
    data = self._check_data(data_blocks)
    out = [np.empty(data[0].size if data else 0, np.uint8) for _ in range(self.m)]
    self._encode(data, out)
    return out

  def encode_into(self, data_blocks: Sequence[Buffer], out: Sequence[Buffer]) -> None:
    """Writes the m parity blocks into ``out`` (m writable buffers); no allocation."""
    data = self._check_data(data_blocks)
    outs = self._check_out(out, self.m, data[0].size, "parity")
    self._encode(data, outs)

  def decode(self, blocks: Sequence[Buffer | None]) -> list[np.ndarray]:
    """Returns the k data blocks from the k + m blocks, None where lost.

    Surviving data blocks are returned as zero-copy uint8 views of the
    arguments; lost ones are rebuilt into new arrays.

    Raises:
      UnrecoverableLossError: more than m blocks are lost.
      ValueError: wrong count or unequal lengths.
    """
    arrs, nbytes = self._check_blocks(blocks)
    lost = [i for i in range(self.k) if arrs[i] is None]
    out = {i: np.empty(nbytes, np.uint8) for i in lost}
    self._decode(arrs, out, nbytes)
    return [out[i] if arrs[i] is None else arrs[i] for i in range(self.k)]

  def decode_into(self, blocks: Sequence[Buffer | None], out: Mapping[int, Buffer]) -> None:
    """Rebuilds lost data blocks into ``out``: {data index: writable buffer}.

    ``out`` must have exactly the indices i < k with ``blocks[i] is None``.
    """
    arrs, nbytes = self._check_blocks(blocks)
    lost = sorted(i for i in range(self.k) if arrs[i] is None)
    if sorted(out) != lost:
      raise errors.InvalidArgumentError(
          f"decode_into needs an out buffer for exactly the lost data blocks "
          f"{lost}, got keys {sorted(out)}")
    outs = {i: self._check_out([out[i]], 1, nbytes, f"out[{i}]")[0] for i in lost}
    self._decode(arrs, outs, nbytes)

  def _encode(self, data: list[np.ndarray], out: list[np.ndarray]) -> None:
    nbytes = data[0].size
    _kernels.matmul_blocks(_addresses(data), _addresses(out), self.matrix, self._masks,
                           self._tables, nbytes, _kernels.TILE_BYTES)

  def _decode(self, arrs: list[np.ndarray | None], out: dict[int, np.ndarray],
              nbytes: int) -> None:
    lost = tuple(sorted(out))
    if not lost:
      return
    rows = tuple(j for j in range(self.m) if arrs[self.k + j] is not None)[:len(lost)]
    coefs, masks, tables = self._plan(lost, rows)
    outs = [out[i] for i in lost]
    inputs = [a for i, a in enumerate(arrs[:self.k]) if i not in lost]
    inputs += [arrs[self.k + j] for j in rows] + outs[:-1]
    _kernels.matmul_blocks(_addresses(inputs), _addresses(outs), coefs, masks, tables,
                           nbytes, _kernels.TILE_BYTES)

  def _plan(self, lost: tuple[int, ...], rows: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """Decode coefficients for one erasure pattern (cached).

    Inputs are the surviving data, the parity rows ``rows`` and then all lost
    blocks but the last (rebuilt earlier in the same tile). Lost block l is row
    l of the inverse of the survivors' generator rows; when parity row 0 (all
    ones) survives, the last lost block is instead the XOR of it, the
    surviving data and the other lost blocks, which is cheaper.
    """
    key = (lost, rows)
    with self._lock:
      plan = self._plans.get(key)
    if plan is not None:
      return plan
    e, k = len(lost), self.k
    kept = [i for i in range(k) if i not in lost]
    generator = np.concatenate([np.eye(k, dtype=np.uint8), self.matrix])
    inverse = _gf.mat_inverse(generator[kept + [k + j for j in rows]])
    coefs = np.zeros((e, k + e - 1), np.uint8)
    coefs[:, :k] = inverse[list(lost)]
    if rows[0] == 0:
      coefs[-1, :] = 0
      coefs[-1, :k - e + 1] = 1
      coefs[-1, k:] = 1
    plan = (coefs, _kernels.bit_masks(coefs), _kernels.nibble_tables(coefs))
    with self._lock:
      self._plans[key] = plan
    return plan

  def _check_data(self, data_blocks: Sequence[Buffer]) -> list[np.ndarray]:
    if len(data_blocks) != self.k:
      raise errors.InvalidArgumentError(f"{self!r} encodes k={self.k} data blocks, got {len(data_blocks)}")
    data = [as_u8(b, name=f"data block {i}") for i, b in enumerate(data_blocks)]
    _check_lengths({i: a.size for i, a in enumerate(data)})
    return data

  def _check_blocks(self, blocks: Sequence[Buffer | None]) -> tuple[list[np.ndarray | None], int]:
    n = self.k + self.m
    if len(blocks) != n:
      raise errors.InvalidArgumentError(
          f"{self!r} decodes a list of k + m = {n} blocks (None for lost ones), "
          f"got {len(blocks)}")
    arrs = [None if b is None else as_u8(b, name=f"block {i}") for i, b in enumerate(blocks)]
    lost = [i for i, a in enumerate(arrs) if a is None]
    if len(lost) > self.m:
      raise errors.UnrecoverableLossError(
          f"{self!r} can rebuild at most m={self.m} lost blocks, but {len(lost)} "
          f"are lost: {lost}")
    sizes = {i: a.size for i, a in enumerate(arrs) if a is not None}
    _check_lengths(sizes)
    return arrs, next(iter(sizes.values()))

  @staticmethod
  def _check_out(out: Sequence[Buffer], count: int, nbytes: int, what: str) -> list[np.ndarray]:
    if len(out) != count:
      raise errors.InvalidArgumentError(f"expected {count} {what} out buffer(s), got {len(out)}")
    arrs = [as_u8(b, name=f"{what} out buffer {i}", writable=True) for i, b in enumerate(out)]
    bad = {i: a.size for i, a in enumerate(arrs) if a.size != nbytes}
    if bad:
      raise errors.InvalidArgumentError(f"{what} out buffers must be {nbytes} bytes long, got sizes {bad}")
    return arrs


def _check_lengths(sizes: dict[int, int]) -> None:
  if len(set(sizes.values())) > 1:
    raise errors.InvalidArgumentError(f"blocks must all have one length, got lengths by index {sizes}")


@functools.lru_cache(maxsize=64)
def codec(k: int, m: int) -> ReedSolomon:
  """A shared ReedSolomon(k, m) (decode plans are cached per instance)."""
  return ReedSolomon(k, m)


def warm_up(k: int, m: int) -> threading.Thread:
  """Loads the codec's compiled kernels in a daemon thread (numba's cached
  machine code takes ~0.5 s to load in a fresh process), so that a restore
  that has to rebuild a lost host right after a restart does not wait for it."""
  def run() -> None:
    blocks: list[np.ndarray | None] = [np.zeros(64, np.uint8) for _ in range(k + m)]
    blocks[0] = None
    codec(k, m).decode_into(blocks, {0: np.empty(64, np.uint8)})
  t = threading.Thread(target=run, name="jaxckpt-parity-warm-up", daemon=True)
  t.start()
  return t

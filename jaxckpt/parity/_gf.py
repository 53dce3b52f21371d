"""GF(2^8) arithmetic on small matrices (numpy; the per-byte work is in _kernels).

The field is reedsolo's default: primitive polynomial 0x11d, generator 2.
Elements are ``np.uint8``; matrices are 2-D ``np.uint8`` arrays.
"""

from __future__ import annotations

import numpy as np

PRIMITIVE_POLY = 0x11D
GENERATOR = 2


def _tables() -> tuple[np.ndarray, np.ndarray]:
  """Exponent table (length 512, so exp[a + b] needs no modulo) and log table."""
  exp = np.zeros(512, np.int64)
  log = np.zeros(256, np.int64)
  x = 1
  for i in range(255):
    exp[i] = x
    log[x] = i
    x <<= 1
    if x & 0x100:
      x ^= PRIMITIVE_POLY
  exp[255:510] = exp[:255]
  return exp, log


EXP, LOG = _tables()


def mul(a: np.ndarray | int, b: np.ndarray | int) -> np.ndarray:
  """Elementwise product of field elements (broadcasting)."""
  a = np.asarray(a, np.int64)
  b = np.asarray(b, np.int64)
  out = EXP[LOG[a] + LOG[b]]
  return np.where((a == 0) | (b == 0), 0, out).astype(np.uint8)


def inv(a: np.ndarray | int) -> np.ndarray:
  """Elementwise multiplicative inverse; raises ZeroDivisionError on 0."""
  a = np.asarray(a, np.int64)
  if np.any(a == 0):
    raise ZeroDivisionError("0 has no inverse in GF(2^8)")
  return EXP[255 - LOG[a]].astype(np.uint8)


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """Matrix product over GF(2^8): XOR of elementwise products."""
  prods = mul(a[:, :, None], b[None, :, :])
  return np.bitwise_xor.reduce(prods, axis=1).astype(np.uint8)


def mat_inverse(a: np.ndarray) -> np.ndarray:
  """Inverse of a square matrix by Gauss-Jordan elimination (vectorized rows).

  Raises:
    ZeroDivisionError: the matrix is singular.
  """
  n = a.shape[0]
  work = np.concatenate([a.astype(np.uint8), np.eye(n, dtype=np.uint8)], axis=1)
  for col in range(n):
    pivots = np.nonzero(work[col:, col])[0]
    if pivots.size == 0:
      raise ZeroDivisionError(f"singular {n}x{n} matrix (column {col})")
    p = col + int(pivots[0])
    work[[col, p]] = work[[p, col]]
    work[col] = mul(work[col], inv(work[col, col]))
    factors = work[:, col].copy()
    factors[col] = 0
    work ^= mul(factors[:, None], work[col][None, :])
  return work[:, n:].copy()


def parity_matrix(k: int, m: int) -> np.ndarray:
  """The m x k parity part P of the systematic generator [I; P].

  A Cauchy matrix 1 / (x_i + y_j) with x_i = i, y_j = m + j (all distinct),
  with columns scaled so row 0 is all ones and then rows scaled so column 0 is
  all ones. Scaling rows and columns by nonzero constants keeps every square
  submatrix of a Cauchy matrix nonsingular, so every k x k submatrix of
  [I; P] is invertible (the code is MDS) and m = 1 parity is a plain XOR.
  """
  x = np.arange(m, dtype=np.int64)[:, None]
  y = np.arange(m, m + k, dtype=np.int64)[None, :]
  cauchy = inv(x ^ y)
  cauchy = mul(cauchy, inv(cauchy[0])[None, :])
  return mul(cauchy, inv(cauchy[:, 0])[:, None])

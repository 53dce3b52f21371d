"""Numba kernels: GF(2^8) matrix times blocks, tiled, vectorized.

Blocks are passed as raw addresses (``uint64`` arrays) so that any number of
separately allocated buffers reaches one compiled kernel without copies. Work
proceeds in tiles small enough that every output tile stays in L1 while the
inputs stream through once. Coefficients 0 and 1 take fast paths (skip, plain
XOR, which LLVM vectorizes). A general coefficient c multiplies in one of two
ways, both measured (benchmarks/parity_codec.py):

* split-nibble shuffles (x86 with AVX2): ``c*x = lo[x & 15] ^ hi[x >> 4]``
  with two 16-entry tables held in registers and looked up 32 bytes at a time
  by ``vpshufb``, emitted as LLVM IR by :func:`_shuffle_mul_xor`, ~2x faster;
* bit-sliced doublings elsewhere and for the last < 32 bytes: ``c*x`` is the
  XOR of ``x * 2^b`` over the set bits b of c, doubling being
  ``(x << 1) ^ (0x1d if x & 0x80)``; branchless (byte masks 0x00/0xff per
  bit from :func:`bit_masks`), no tables, auto-vectorized by LLVM.
"""

from __future__ import annotations

import numba
import numpy as np
import llvmlite.binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from jaxckpt.parity import _gf

TILE_BYTES = 4096
HAS_AVX2 = bool(llvmlite.binding.get_host_cpu_features().get("avx2", False))
_VEC = 32


@intrinsic
def _u8ptr(typingctx, addr):
  """Reinterprets an integer address as a ``uint8*``."""
  del typingctx
  sig = types.CPointer(types.uint8)(addr)

  def codegen(context, builder, signature, args):
    del signature
    ptr_type = context.get_value_type(types.CPointer(types.uint8))
    return builder.inttoptr(args[0], ptr_type)

  return sig, codegen


@intrinsic
def _shuffle_mul_xor(typingctx, dst, src, nbytes, table):
  """dst ^= c * src on the first nbytes // 32 * 32 bytes; returns that count.

  ``table`` is the address of :func:`nibble_tables`' 64 bytes for c. Emits
  AVX2 ``vpshufb``; where the host has no AVX2 it emits nothing and returns
  0, so the caller's bit-sliced loop does all the work.
  """
  del typingctx
  sig = types.int64(types.uint64, types.uint64, types.int64, types.uint64)

  def codegen(context, builder, signature, args):
    del context, signature
    dst, src, nbytes, table = args
    i64 = ir.IntType(64)
    if not HAS_AVX2:
      return ir.Constant(i64, 0)
    vec = ir.VectorType(ir.IntType(8), _VEC)
    vptr = vec.as_pointer()
    shuf = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vec, [vec, vec]), "llvm.x86.avx2.pshuf.b")
    low = ir.Constant(vec, [0x0F] * _VEC)
    four = ir.Constant(vec, [4] * _VEC)
    lo_tab = builder.load(builder.inttoptr(table, vptr), align=1)
    hi_tab = builder.load(builder.inttoptr(builder.add(table, ir.Constant(i64, _VEC)), vptr),
                          align=1)
    count = builder.sdiv(nbytes, ir.Constant(i64, _VEC))
    with cgutils.for_range(builder, count) as loop:
      off = builder.mul(loop.index, ir.Constant(i64, _VEC))
      x = builder.load(builder.inttoptr(builder.add(src, off), vptr), align=1)
      lo = builder.call(shuf, [lo_tab, builder.and_(x, low)])
      hi = builder.call(shuf, [hi_tab, builder.and_(builder.lshr(x, four), low)])
      out = builder.inttoptr(builder.add(dst, off), vptr)
      acc = builder.xor(builder.load(out, align=1), builder.xor(lo, hi))
      builder.store(acc, out, align=1)
    return builder.mul(count, ir.Constant(i64, _VEC))

  return sig, codegen


@numba.njit(inline="always")
def _dbl(x):
  return np.uint8((x << np.uint8(1)) ^ ((x >> np.uint8(7)) * np.uint8(0x1D)))


@numba.njit(inline="always")
def _mul_xor(p, d, mk, table, length, assign):
  """p[:length] (^)= c * d[:length] for the constant c (bit masks mk, nibble table)."""
  if assign:
    for t in range(length):
      p[t] = 0
  done = _shuffle_mul_xor(p.ctypes.data, d.ctypes.data, length, table)
  m0, m1, m2, m3 = mk[0], mk[1], mk[2], mk[3]
  m4, m5, m6, m7 = mk[4], mk[5], mk[6], mk[7]
  for t in range(done, length):
    x = d[t]
    a = x & m0
    x = _dbl(x)
    a ^= x & m1
    x = _dbl(x)
    a ^= x & m2
    x = _dbl(x)
    a ^= x & m3
    x = _dbl(x)
    a ^= x & m4
    x = _dbl(x)
    a ^= x & m5
    x = _dbl(x)
    a ^= x & m6
    x = _dbl(x)
    a ^= x & m7
    p[t] ^= a


@numba.njit(nogil=True, cache=True)
def _mac_tile(in_ptrs, in_off, out_ptrs, out_off, coefs, masks, tables, length):
  """out[j][off:off+length] = sum_i coefs[j, i] * in[i][off:off+length]."""
  for j in range(out_ptrs.shape[0]):
    p = numba.carray(_u8ptr(out_ptrs[j] + out_off), length)
    assign = True
    for i in range(in_ptrs.shape[0]):
      c = coefs[j, i]
      if c == 0:
        continue
      d = numba.carray(_u8ptr(in_ptrs[i] + in_off), length)
      if c == 1:
        if assign:
          for t in range(length):
            p[t] = d[t]
        else:
          for t in range(length):
            p[t] ^= d[t]
      else:
        table = tables.ctypes.data + (j * coefs.shape[1] + i) * 2 * _VEC
        _mul_xor(p, d, masks[j, i], table, length, assign)
      assign = False
    if assign:
      for t in range(length):
        p[t] = 0


@numba.njit(nogil=True, cache=True)
def matmul_blocks(in_ptrs, out_ptrs, coefs, masks, tables, nbytes, tile):
  """out[j] = sum_i coefs[j, i] * in[i] over blocks of nbytes.

  Rows are computed in order within each tile, so an input may be the address
  of an earlier output row (the decoder rebuilds its last lost block as the
  XOR of parity row 0, the surviving data and the other rebuilt blocks).
  """
  for start in range(0, nbytes, tile):
    length = min(tile, nbytes - start)
    _mac_tile(in_ptrs, start, out_ptrs, start, coefs, masks, tables, length)


def bit_masks(coefs: np.ndarray) -> np.ndarray:
  """Per coefficient, 8 byte masks: 0xff where bit b of the coefficient is set."""
  bits = (coefs[..., None].astype(np.uint8) >> np.arange(8, dtype=np.uint8)) & 1
  return (bits * 0xFF).astype(np.uint8)


def nibble_tables(coefs: np.ndarray) -> np.ndarray:
  """Per coefficient c, 64 bytes: c * (0..15) twice, then c * (0..15 << 4) twice.

  Each 16-byte table is repeated for both 128-bit lanes of ``vpshufb``.
  """
  nib = np.arange(16, dtype=np.int64)
  lo = _gf.mul(coefs[..., None], nib)
  hi = _gf.mul(coefs[..., None], nib << 4)
  return np.ascontiguousarray(np.concatenate([lo, lo, hi, hi], axis=-1), dtype=np.uint8)

"""The compiled loop of :mod:`jaxckpt.host._spans`, imported on first use (numba loads in ~0.5 s)."""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic


@intrinsic
def _call_hash(typingctx, fn, addr, length):
  """``((uint64 (*)(const void*, size_t)) fn)(addr, length)``."""
  del typingctx
  sig = types.uint64(types.uint64, types.uint64, types.uint64)

  def codegen(context, builder, signature, args):
    del context, signature
    i64, u8p = ir.IntType(64), ir.IntType(8).as_pointer()
    fptr = builder.inttoptr(args[0], ir.FunctionType(i64, [u8p, i64]).as_pointer())
    return builder.call(fptr, [builder.inttoptr(args[1], u8p), args[2]])

  return sig, codegen


@numba.njit(nogil=True, cache=True)
def hash_spans_hex(fn, base, offsets, lengths, text):
  """``fn(base + offsets[i], lengths[i])`` for every span, without the GIL, each
  digest written as 16 lowercase hex digits into ``text[16 * i:16 * i + 16]``
  (ASCII): Python then only slices one string."""
  for i in range(offsets.size):
    h = _call_hash(fn, base + offsets[i], lengths[i])
    for j in range(16):
      d = (h >> np.uint64(60 - 4 * j)) & np.uint64(15)
      text[16 * i + j] = d + 48 if d < 10 else d + 87

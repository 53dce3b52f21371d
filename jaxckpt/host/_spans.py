"""Checksums of many byte spans of one buffer in one call that releases the GIL.

A save of an FSDP state hashes thousands of small shards (the example: 1,680
of ~6 KB). One ``xxhash.xxh3_64_hexdigest`` call per shard drops and retakes
the GIL each time, and every hand-off can make the training loop wait for
the GIL (measured: +2.7 ms per step on the example's loop, against +1.2 ms
with one call). :func:`span_checksums` hashes every span in one compiled
loop that runs without the GIL: it calls ``XXH3_64bits`` from the xxhash
package's own extension module (the C code that ``xxhash.xxh3_64_hexdigest``
runs) through its address, so the digests are those of
:func:`jaxckpt.host.snapshot.checksum`, bit for bit.

The compiled loop is used once it has loaded in the background (the first
call starts that) and only when the extension exports the symbol and a
self-check against ``xxhash`` passes; until then, and otherwise (another build
of xxhash, numba unusable), each span is hashed by its own call, with the same
results. Spans of 64 KiB or more on average are hashed a call each, and never
start the load (a restore of large shards does not share the cores with it). ``JAXCKPT_SPAN_HASH=python`` forces that fallback.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any, Callable, Sequence

import numpy as np

from jaxckpt.host.snapshot import checksum

logger = logging.getLogger(__name__)

_LARGE_SPAN_BYTES = 64 << 10     # spans this long on average are hashed a call each
_lock = threading.Lock()
_kernel: list[Callable[..., None] | None] = []     # [] until loaded; [None]: unavailable
_loader: list[threading.Thread] = []


def _load(*, block: bool = True) -> Callable[..., None] | None:
  """The compiled loop, or None while it loads (``block=False``) or where it cannot.

  Loading (numba's import and its cached machine code) takes ~1 s, so it runs
  in a daemon thread started by the first call; callers that do not block
  hash a span per call until it is ready, and no snapshot waits for it.
  """
  if _kernel:
    return _kernel[0]
  with _lock:
    if not _loader:
      _loader.append(threading.Thread(target=_load_now, name="jaxckpt-span-hash-load",
                                      daemon=True))
      _loader[0].start()
  if block:
    _loader[0].join()
  return _kernel[0] if _kernel else None


def _load_now() -> None:
  _kernel.append(_try_load())


def _after_fork_in_child() -> None:
  if not _kernel:          # a load in flight died with the fork: the child starts its own
    _loader.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _try_load() -> Callable[..., None] | None:
  if os.environ.get("JAXCKPT_SPAN_HASH", "") == "python":
    return None
  try:
    from xxhash import _xxhash  # pylint: disable=import-outside-toplevel
    from jaxckpt.host._spans_kernel import hash_spans_hex  # pylint: disable=import-outside-toplevel
    fn = ctypes.cast(ctypes.CDLL(_xxhash.__file__).XXH3_64bits, ctypes.c_void_p).value
    probe = np.frombuffer(bytes(range(256)) * 40, np.uint8)
    offsets = np.array([0, 1, 64, 3000, 10240], np.uint64)
    lengths = np.array([0, 17, 240, 7000, 0], np.uint64)
    text = np.zeros(16 * offsets.size, np.uint8)
    hash_spans_hex(fn, probe.ctypes.data, offsets, lengths, text)
    got = [text[16 * i:16 * i + 16].tobytes().decode("ascii") for i in range(offsets.size)]
    want = [checksum(probe[o:o + n]) for o, n in zip(offsets.tolist(), lengths.tolist())]
    if got != want:
      raise RuntimeError(f"self-check failed: {got} != {want}")
  except Exception as e:  # pylint: disable=broad-except
    logger.info("compiled span hashing unavailable (%s: %s); hashing a span per call",
                type(e).__name__, e)
    return None
  return lambda base, offsets, lengths, text: hash_spans_hex(fn, base, offsets, lengths, text)


def compiled() -> bool:
  """Whether :func:`span_checksums` runs the compiled, GIL-free loop in this process
  (waits for it to load)."""
  return _load() is not None


class Spans:
  """Byte spans ``[offsets[i], offsets[i] + lengths[i])``, prepared once, hashed often."""

  __slots__ = ("offsets", "lengths", "end")

  def __init__(self, offsets: Sequence[int], lengths: Sequence[int]) -> None:
    off = np.asarray(offsets, dtype=np.int64).reshape(-1)      # OverflowError past int64
    length = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if off.shape != length.shape:
      raise ValueError(f"{off.size} span offsets but {length.size} lengths")
    if off.size and (off.min() < 0 or length.min() < 0):
      i = int(np.argmin(np.minimum(off, length)))
      raise ValueError(f"span {i} has offset {off[i]} and length {length[i]}; both must be >= 0")
    # Python ints: no wrap-around however large the offsets.
    self.end = max((o + n for o, n in zip(off.tolist(), length.tolist())), default=0)
    self.offsets, self.lengths = off.astype(np.uint64), length.astype(np.uint64)
    self.offsets.flags.writeable = self.lengths.flags.writeable = False   # ``end`` stays true

  def __len__(self) -> int:
    return int(self.offsets.size)


def span_checksums(buffer: Any, spans: Spans) -> list[str]:
  """``[checksum(buffer[o:o + n]) for o, n in spans]``, in one GIL-free call where possible.

  ``buffer`` is a C-contiguous numpy array or a bytes-like object; a span past
  its end is a ValueError, never a read out of bounds.

  >>> span_checksums(b"jaxckpt!", Spans([0, 7], [7, 1]))[0]
  'ec69423d273eb5cf'
  """
  arr = buffer if isinstance(buffer, np.ndarray) else np.frombuffer(buffer, np.uint8)
  if not arr.flags.c_contiguous:
    raise ValueError("span_checksums needs a C-contiguous buffer; pass np.ascontiguousarray(x)")
  if spans.end > arr.nbytes:
    raise ValueError(f"spans reach byte {spans.end} of a {arr.nbytes}-byte buffer")
  # Large spans gain nothing from the kernel (one call per span costs ~1 us of a
  # hash of 64 KiB or more); loading it (~1 s of a core: numba) waits for small ones.
  large = len(spans) and int(spans.lengths.sum()) >= _LARGE_SPAN_BYTES * len(spans)
  kernel = None if large else _load(block=False)
  if kernel is None:
    with memoryview(arr) as mv, mv.cast("B") as raw:
      return [checksum(raw[o:o + n])
              for o, n in zip(spans.offsets.tolist(), spans.lengths.tolist())]
  text = np.empty(16 * len(spans), np.uint8)
  kernel(arr.ctypes.data, spans.offsets, spans.lengths, text)
  hexes = text.tobytes().decode("ascii")
  return [hexes[i:i + 16] for i in range(0, len(hexes), 16)]

"""span_checksums: the digests of checksum(), compiled or not, and no read past the end."""

import os
import subprocess
import sys

import numpy as np
import pytest

from jaxckpt.host import _spans
from jaxckpt.host.snapshot import checksum


def _random_spans(rng, nbytes, n):
  lo = rng.integers(0, nbytes, n)
  hi = np.minimum(nbytes, lo + rng.integers(0, 30000, n))
  return _spans.Spans(lo, hi - lo)


@pytest.fixture(params=["compiled", "per_call"])
def hashing(request, monkeypatch):
  """Runs a test on the compiled loop (waiting for it to load) and on the per-call path."""
  if request.param == "compiled":
    assert _spans.compiled(), "the compiled loop should load where xxhash exports XXH3_64bits"
  else:
    monkeypatch.setattr(_spans, "_load", lambda block=True: None)
  return request.param


def test_span_checksums_equal_checksum_of_each_span(hashing):
  rng = np.random.default_rng(0)
  buf = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
  spans = _random_spans(rng, buf.nbytes, 500)
  got = _spans.span_checksums(buf, spans)
  want = [checksum(buf[o:o + n]) for o, n in zip(spans.offsets.tolist(), spans.lengths.tolist())]
  assert got == want


def test_a_flipped_byte_changes_only_its_spans_digest(hashing):
  buf = np.zeros(4096, np.uint8)
  spans = _spans.Spans([0, 1024, 2048], [1024, 1024, 2048])
  before = _spans.span_checksums(buf, spans)
  buf[1500] ^= 1
  after = _spans.span_checksums(buf, spans)
  assert [a == b for a, b in zip(before, after)] == [True, False, True]


def test_bytes_objects_and_non_uint8_arrays_hash_their_raw_bytes(hashing):
  x = np.arange(10, dtype=np.float32)
  spans = _spans.Spans([0, 8], [8, 32])
  assert _spans.span_checksums(x, spans) == [checksum(x.tobytes()[:8]), checksum(x.tobytes()[8:])]
  assert _spans.span_checksums(b"jaxckpt!", _spans.Spans([0], [7])) == ["ec69423d273eb5cf"]


def test_a_span_past_the_end_is_an_error_not_a_read():
  with pytest.raises(ValueError, match=r"spans reach byte 4097 of a 4096-byte buffer"):
    _spans.span_checksums(np.zeros(4096, np.uint8), _spans.Spans([4000], [97]))
  with pytest.raises(ValueError, match="C-contiguous"):
    _spans.span_checksums(np.zeros((64, 64), np.uint8)[:, ::2], _spans.Spans([0], [8]))
  with pytest.raises(ValueError, match="2 span offsets but 1 lengths"):
    _spans.Spans([0, 1], [1])
  # Negative offsets or lengths (a corrupt manifest) never wrap around to pass the bounds check.
  with pytest.raises(ValueError, match=r"span 0 has offset -8 and length 16; both must be >= 0"):
    _spans.Spans(np.array([-8]), np.array([16]))
  with pytest.raises(ValueError, match="both must be >= 0"):
    _spans.Spans([0, 64], [8, -1])
  with pytest.raises(ValueError, match="spans reach byte"):
    _spans.span_checksums(np.zeros(16, np.uint8), _spans.Spans([1 << 62], [1 << 62]))


def test_the_python_fallback_gives_the_same_digests():
  code = ("import numpy as np; from jaxckpt.host import _spans; "
          "b = np.arange(100000, dtype=np.uint8); s = _spans.Spans([0, 5, 999], [5, 994, 99001]); "
          "print(_spans.compiled(), *_spans.span_checksums(b, s))")
  env = dict(os.environ, JAXCKPT_SPAN_HASH="python")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, check=True).stdout.split()
  b = np.arange(100000, dtype=np.uint8)
  assert out == ["False", checksum(b[:5]), checksum(b[5:999]), checksum(b[999:])]


def test_large_spans_are_hashed_without_starting_the_compiled_loop():
  # A restore verifying shards of megabytes gains nothing from the kernel; its load
  # (~1 s of a core) would share the cores with that restore. Small spans start it.
  code = ("import numpy as np; from jaxckpt.host import _spans; "
          "b = np.arange(1 << 20, dtype=np.uint8); "
          "big = _spans.span_checksums(b, _spans.Spans([0, 1 << 19], [1 << 19, 1 << 19])); "
          "print(len(_spans._loader), *big); "
          "_spans.span_checksums(b, _spans.Spans([0, 64], [64, 64])); print(len(_spans._loader))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, check=True).stdout.split()
  b = np.arange(1 << 20, dtype=np.uint8)
  assert out == ["0", checksum(b[:1 << 19]), checksum(b[1 << 19:]), "1"], out

"""The ring all-reduce's data path: bit-identical on every rank, 2(G-1)/G bytes each."""

from __future__ import annotations

import queue
import threading

import ml_dtypes
import numpy as np
import pytest

from jaxckpt import errors
from jaxckpt.ft import _allreduce


def _run(contributions, *, die: int | None = None, timeout: float = 5.0):
  """Every rank on its own thread, hops through queues; ``die`` never sends."""
  size = len(contributions)
  inbox = [queue.Queue() for _ in range(size)]
  sent = [0] * size
  out = [None] * size

  def rank(r):
    def send(hop, segments):
      if r != die:
        piece = np.concatenate([s.reshape(-1) for s in segments]) if segments else np.empty(0)
        sent[r] += piece.nbytes
        inbox[(r + 1) % size].put((hop, piece))

    def recv(hop, into):
      try:
        got_hop, piece = inbox[r].get(timeout=timeout)
      except queue.Empty:
        return False
      assert got_hop == hop           # pieces arrive in order on one connection
      into[...] = piece
      return True
    out[r] = _allreduce.ring_mean(contributions[r], r, size, send, recv)

  threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=60)
  return out, sent


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_every_rank_gets_the_same_bits_and_sends_2_g_minus_1_over_g(size):
  rng = np.random.default_rng(size)
  contributions = [[rng.standard_normal((37, 5)).astype(np.float32),
                    rng.standard_normal(11).astype(ml_dtypes.bfloat16),
                    rng.standard_normal(()).astype(np.float32)] for _ in range(size)]
  out, sent = _run(contributions)
  want = _allreduce.reference_mean(contributions)
  for r in range(size):
    assert [x.dtype for x in out[r]] == [x.dtype for x in contributions[0]]
    assert [x.shape for x in out[r]] == [x.shape for x in contributions[0]]
    for got, w in zip(out[r], want):
      assert got.tobytes() == w.tobytes(), f"rank {r} differs"
  # close to the exact mean (float32 accumulators)
  exact = np.mean([c[0].astype(np.float64) for c in contributions], axis=0)
  np.testing.assert_allclose(out[0][0], exact, rtol=1e-5, atol=1e-6)
  nbytes = sum(x.size for x in contributions[0]) * 4           # float32 accumulators
  for s in sent:
    assert abs(s - 2 * (size - 1) / size * nbytes) <= 2 * size * 4, (s, nbytes)


def test_a_rank_that_dies_mid_ring_ends_the_step_uncommitted_for_the_others():
  contributions = [[np.full(64, float(r), np.float32)] for r in range(3)]
  out, _ = _run(contributions, die=1, timeout=0.5)
  assert out[2] is None and out[0] is None       # 1's right neighbour starves first, then 0


def test_non_floating_gradients_are_refused():
  with pytest.raises(errors.UnsupportedLeafError, match="floating"):
    _allreduce.ring_mean([np.arange(3)], 0, 1, lambda *a: None, lambda *a: False)


def test_float64_leaves_accumulate_in_float64():
  a = [np.array([1e-20, 1.0]), np.array([1.0], np.float32)]
  b = [np.array([1e-20, 1.0]), np.array([3.0], np.float32)]
  out, _ = _run([a, b])
  assert out[0][0].dtype == np.float64 and out[0][0][0] == 1e-20
  assert out[0][1].dtype == np.float32 and out[0][1][0] == 2.0


def test_pieces_that_span_leaves_give_the_same_bits_and_leave_the_input_alone(monkeypatch):
  monkeypatch.setattr(_allreduce, "PIECE_BYTES", 64)       # 16 float32 per piece
  rng = np.random.default_rng(0)
  contributions = [[rng.standard_normal(n).astype(np.float32) for n in (1001, 7, 0, 33)]
                   for _ in range(3)]
  before = [[x.copy() for x in c] for c in contributions]
  for c in contributions:
    for x in c:
      x.flags.writeable = False                            # the ring never writes its input
  out, sent = _run(contributions)
  want = _allreduce.reference_mean(contributions)
  for o in out:
    assert [x.tobytes() for x in o] == [w.tobytes() for w in want]
  for c, b in zip(contributions, before):
    assert [x.tobytes() for x in c] == [x.tobytes() for x in b]
  assert all(abs(s - 2 * 2 / 3 * 1041 * 4) <= 24 for s in sent)


def test_a_pooled_buffer_is_reused_only_once_nothing_refers_to_it():
  pool = _allreduce.BufferPool(keep=4)
  a = pool.get(1000, np.dtype(np.float32))
  first = a.ctypes.data
  view = a[10:20]
  b = pool.get(1000, np.dtype(np.float32))
  assert b.ctypes.data != first                    # a view of it is alive
  del a
  assert pool.get(1000, np.dtype(np.float32)).ctypes.data not in (first, b.ctypes.data)
  del view
  c = pool.get(1000, np.dtype(np.float32))
  assert c.ctypes.data == first and c is not b     # the first buffer, free again
  second = b.ctypes.data
  del b, c
  assert pool.get(1000, np.dtype(np.float32)).ctypes.data == first   # (the oldest free one)
  assert pool.get(1000, np.dtype(np.float32)).ctypes.data in (first, second)
  c = pool.get(1000, np.dtype(np.float32))
  results = _allreduce.unflatten(c, [np.zeros(1000, np.float32)])
  with pytest.raises(ValueError, match="read-only"):
    results[0][0] = 1.0

"""A restore from storage holds its target's buffers and a bounded window, not a copy.

Each stored chunk is read once, straight into the target boxes' buffers (or,
cut across boxes, into a buffer of its own that is checked and copied out), so
the process grows by the target's size plus the chunks in flight
(``max_inflight_bytes``), whatever the target cuts.
"""

import ctypes
import gc
import os
import threading

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxckpt.universal as u
from jaxckpt.universal import _manifest as man

SHAPE = (4096, 4096)            # 64 MiB of float32
CHUNK = (128, 4096)             # 32 chunks of 2 MiB
WINDOW = 4 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
  with open("/proc/self/statm", "rb") as f:
    return int(f.read().split()[1]) * _PAGE


class _PeakGrowth:
  """Peak resident-set growth over a block (sampled every millisecond)."""

  def __enter__(self):
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)   # memory freed earlier is not counted as reused
    self.base, self.peak, self._stop = _rss(), 0, threading.Event()
    self._t = threading.Thread(target=self._run, daemon=True)
    self._t.start()
    return self

  def _run(self):
    while not self._stop.wait(0.001):
      self.peak = max(self.peak, _rss() - self.base)

  def __exit__(self, *exc):
    self._stop.set()
    self._t.join(timeout=10)
    assert not self._t.is_alive(), "the RSS sampler did not stop within 10 s"
    self.peak = max(self.peak, _rss() - self.base)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("memory"))
  want = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
  info = man.LeafInfo(path="['w']", kind="numpy", shape=SHAPE, dtype="float32", chunk_shape=CHUNK)
  u.write_leaves(d, 1, {"['w']": info}, {"['w']": want}, metadata={})
  return d, want


@pytest.mark.parametrize("spec", [P(None, "c"), P("c")], ids=["cut_across", "whole_chunks"])
def test_a_restore_grows_by_its_target_and_a_window_not_a_copy_of_the_leaf(stored, spec):
  d, want = stored
  target = {"['w']": jax.ShapeDtypeStruct(
      SHAPE, np.float32, sharding=NamedSharding(Mesh(np.array(jax.devices()), ("c",)), spec))}
  u.restore_arrays(u.open_step(d, 1), target)   # warm-up: tensorstore's and XLA's one-time buffers
  reader = u.open_step(d, 1)
  with _PeakGrowth() as m:
    got = u.restore_arrays(reader, target, max_inflight_bytes=WINDOW)["['w']"]
    jax.block_until_ready(got)
  assert reader.bytes_read == want.nbytes          # every chunk read once
  np.testing.assert_array_equal(np.asarray(got), want)
  # the target (64 MiB) plus the window of chunks in flight and tensorstore's buffers for
  # them: 87 MiB cut across, 73 MiB whole, here; a restore that kept the chunks beside the
  # boxes grew by 166-179 MiB
  assert m.peak <= want.nbytes + 10 * WINDOW, (m.peak >> 20, "MiB")

"""Resharding matrix: save from several meshes/specs, restore onto others, exactly."""

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxckpt.universal as u
from tests.support import fixtures as _fixtures

SHAPE = (16, 24)


def mesh(shape, names, n=None):
  devs = np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape)
  return Mesh(devs, names)


SAVES = {
    "8:rows": (mesh((8,), ("x",)), P("x")),
    "8:cols": (mesh((8,), ("x",)), P(None, "x")),
    "8:replicated": (mesh((8,), ("x",)), P()),
    "2x4:ab": (mesh((2, 4), ("a", "b")), P("a", "b")),
    "2x4:ba": (mesh((2, 4), ("a", "b")), P("b", "a")),
    "2x4:a-partial": (mesh((2, 4), ("a", "b")), P("a")),
    "4x2:ab": (mesh((4, 2), ("a", "b")), P("a", "b")),
    "4x2:b-partial-cols": (mesh((4, 2), ("a", "b")), P(None, "b")),
    "4x2:ab-fused": (mesh((4, 2), ("a", "b")), P(("a", "b"))),
}
TARGETS = {
    "4:rows": (mesh((4,), ("c",)), P("c")),
    "4:cols": (mesh((4,), ("c",)), P(None, "c")),
    "2x2:ab": (mesh((2, 2), ("a", "b")), P("a", "b")),
    "2x2:b-partial": (mesh((2, 2), ("a", "b")), P("b")),
    "1:single": (mesh((1,), ("s",)), P()),
    "numpy": None,
}
DTYPES = [np.float32, ml_dtypes.bfloat16, np.int8, ml_dtypes.int4]


def value(name, dtype):
  seed = sum(map(ord, name))
  raw = np.random.default_rng(seed).integers(-7, 8, SHAPE)
  if dtype == np.float32:
    raw = raw + np.random.default_rng(seed).random(SHAPE)
  return raw.astype(dtype)


def leaf(name, dtype):
  return f"['{name}'][{np.dtype(dtype).name}]"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """One step holding every (save config, dtype) leaf, written by 3 'processes'."""
  d = str(tmp_path_factory.mktemp("reshard"))
  leaves, expect = {}, {}
  for name, (m, spec) in SAVES.items():
    for dtype in DTYPES:
      host = value(name, dtype)
      leaves[leaf(name, dtype)] = jax.device_put(host, NamedSharding(m, spec))
      expect[leaf(name, dtype)] = host
  for manifest, buf in _fixtures.host_snapshots(7, leaves, process_count=3):
    u.write_process_shards(d, manifest, buf, inner_chunk_bytes=64, attempt="t")
  u.commit_step(d, 7, process_count=3, timeout_secs=10, attempt="t")
  return d, expect


@pytest.mark.parametrize("target", list(TARGETS))
def test_every_saved_layout_restores_exactly_onto(saved, target):
  d, expect = saved
  reader = u.open_step(d, 7)
  if TARGETS[target] is None:
    targets = {p: None for p in expect}
  else:
    m, spec = TARGETS[target]
    targets = {p: jax.ShapeDtypeStruct(SHAPE, expect[p].dtype, sharding=NamedSharding(m, spec))
               for p in expect}
  out = u.restore_arrays(reader, targets, max_inflight_bytes=4096)
  for p, want in expect.items():
    got = out[p]
    if TARGETS[target] is None:
      assert isinstance(got, np.ndarray)
    else:
      assert got.sharding == targets[p].sharding, p
    got = np.asarray(got)
    assert got.dtype == want.dtype, p
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=p)


def test_chunks_are_the_saved_shards_and_aligned_reads_read_only_what_is_needed(saved):
  d, _ = saved
  reader = u.open_step(d, 7)
  assert reader.leaves[leaf("2x4:ab", np.float32)].chunk_shape == (8, 6)
  assert reader.leaves[leaf("8:replicated", np.float32)].chunk_shape == SHAPE
  # Saved rows over 8, restored rows over 4: each target box is 2 whole chunks.
  m, spec = TARGETS["4:rows"]
  p = leaf("8:rows", np.float32)
  u.restore_arrays(reader, {p: jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=NamedSharding(m, spec))})
  assert reader.bytes_needed == 16 * 24 * 4
  assert reader.bytes_read == reader.bytes_needed


def test_partial_chunk_reads_cost_only_the_inner_chunks_they_touch(saved):
  d, _ = saved
  reader = u.open_step(d, 7)
  p = leaf("8:rows", np.float32)
  info = reader.leaves[p]
  assert info.chunk_shape == (2, 24) and np.prod(info.inner_chunk_shape) * 4 <= 64
  m, spec = TARGETS["4:cols"]  # every target box needs a quarter of every chunk
  u.restore_arrays(reader, {p: jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=NamedSharding(m, spec))})
  assert reader.bytes_needed == 16 * 24 * 4
  assert reader.bytes_read <= 1.1 * reader.bytes_needed

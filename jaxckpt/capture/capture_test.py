"""What JAX does with donated arrays whose host copy is pending (measured, CPU).

These tests pin down the platform behaviour that jaxckpt.capture relies on; if
a JAX release changes it, they fail and the capture strategy must be revisited.
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxckpt import capture, tree
from jaxckpt.capture import _pack, _plan
from jaxckpt.host import _spans
from jaxckpt.host.snapshot import SnapshotManifest, align, checksum


@pytest.fixture(autouse=True, scope="module")
def _compiled_hashing():
  """Packed shards are hashed by the compiled loop here (not its per-call stand-in
  while it loads); host/spans_test.py checks both against checksum()."""
  assert _spans.compiled()

X = np.arange(64, dtype=np.float32)


def _sharded():
  return jax.device_put(X, NamedSharding(jax.make_mesh((8,), ("x",)), P("x")))


def _donating_step():
  return jax.jit(lambda a: a + 1, donate_argnums=0)


def test_pending_copy_to_host_async_does_not_survive_donation():
  a = _sharded()
  shards = [s.data for s in a.addressable_shards]
  for d in shards:
    d.copy_to_host_async()
  _donating_step()(a).block_until_ready()
  assert a.is_deleted()
  try:
    np.asarray(shards[0])
  except RuntimeError as e:
    assert "deleted" in str(e)
  else:
    raise AssertionError("reading a donated shard was expected to fail on CPU")


def test_live_numpy_view_makes_xla_skip_the_donation():
  a = _sharded()
  views = [np.asarray(s.data) for s in a.addressable_shards]
  b = _donating_step()(a)
  np.testing.assert_array_equal(np.asarray(b), X + 1)
  assert not a.is_deleted()
  np.testing.assert_array_equal(np.concatenate(views), X)


def test_capture_start_holds_values_through_donation():
  a = _sharded()
  leaves, _ = tree.flatten({"a": a})
  plan = capture.Planner().plan(leaves, wait=True)
  sources = capture.start(leaves, plan)
  _donating_step()(a).block_until_ready()
  buf = np.empty(plan.nbytes, np.uint8)
  manifest = capture.complete(plan, sources, buf, step=1)
  got = np.concatenate([np.frombuffer(buf, np.float32, s.nbytes // 4, s.offset)
                        for s in manifest.leaves[0].shards])
  np.testing.assert_array_equal(got, X)


def test_plan_is_cached_per_layout():
  planner = capture.Planner()
  l1, _ = tree.flatten({"a": _sharded()})
  l2, _ = tree.flatten({"a": _sharded()})
  assert planner.plan(l1) is planner.plan(l2)


# -- the packed gather: many small fully sharded leaves in one XLA call ----------

PACK_DTYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "float16",
               "bfloat16", "float32")


def _small_state(axis_type=jax.sharding.AxisType.Explicit):
  """An FSDP-like state: small leaves of many dtypes sharded over a (2, 4) mesh,
  plus leaves the packed gather must leave alone (replicated, too big, odd dtype)."""
  mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(axis_type, axis_type))
  rng = np.random.default_rng(0)
  specs = (P("a", "b"), P(("a", "b")), P("b", "a"), P(None, ("b", "a")))
  state = {}
  for i, dt in enumerate(PACK_DTYPES):
    x = rng.integers(0, 255, (8, 16), dtype=np.uint8).astype(np.float32) / 7
    x = (x > 10) if dt == "bool" else x.astype(jnp.dtype(dt))
    state[f"w{i}"] = jax.device_put(x, NamedSharding(mesh, specs[i % len(specs)]))
  # Blocks whose bytes are no whole number of 4-byte words (gathered as uint32 words).
  for dt, cols in (("int8", 5), ("bool", 7), ("bfloat16", 3), ("float16", 1)):
    x = rng.integers(0, 255, (8, cols), dtype=np.uint8)
    x = (x > 100) if dt == "bool" else x.astype(jnp.dtype(dt))
    state[f"w_odd_{dt}"] = jax.device_put(x, NamedSharding(mesh, P(("a", "b"), None)))
  state["replicated"] = jax.device_put(np.arange(8.0), NamedSharding(mesh, P()))
  state["half"] = jax.device_put(np.arange(16.0), NamedSharding(mesh, P("b")))
  state["big"] = jax.device_put(np.arange(1 << 20, dtype=np.float32).reshape(8, -1),
                                NamedSharding(mesh, P(("a", "b"))))
  state["c64"] = jax.device_put(np.arange(8, dtype=np.complex64) * 1j, NamedSharding(mesh, P("a")))
  # Buffers XLA owns (device_put may adopt numpy memory, which is never donated in place).
  return {k: jax.jit(lambda a: a.copy())(v) for k, v in state.items()}


def _capture(state, donate=False):
  leaves, _ = tree.flatten(state)
  plan = capture.Planner().plan(leaves, wait=True)
  sources = capture.start(leaves, plan)
  if donate:
    for x in state.values():
      jax.jit(lambda a: ~a if a.dtype == bool else a + 1,           # writes in place
              donate_argnums=0)(x).block_until_ready()
  buf = np.zeros(plan.nbytes, np.uint8)
  manifest = capture.complete(plan, sources, buf, step=1)
  return plan, manifest, buf


def _stored(manifest, buf, path):
  leaf = next(l for l in manifest.leaves if l.path == path)
  out = np.zeros(leaf.shape, leaf.numpy_dtype)
  for s in leaf.shards:
    out[tuple(slice(a, b) for a, b in s.index)] = np.frombuffer(
        buf, leaf.numpy_dtype, int(np.prod([b - a for a, b in s.index])), s.offset).reshape(
            [b - a for a, b in s.index])
    assert s.offset % 64 == 0
    assert capture_checksum(buf[s.offset:s.offset + s.nbytes]) == s.checksum
  return out


def capture_checksum(b):
  from jaxckpt.host.snapshot import checksum  # pylint: disable=import-outside-toplevel
  return checksum(b)


def test_small_sharded_leaves_take_the_packed_gather_and_their_bytes_are_exact():
  state = _small_state()
  expected = {k: np.asarray(v) for k, v in state.items()}
  plan, manifest, buf = _capture(state)
  keys = sorted(state)
  packed = {keys[i] for i in plan.pack.leaves}
  odd = {f"w_odd_{dt}" for dt in ("int8", "bool", "bfloat16", "float16")}
  assert packed == {f"w{i}" for i in range(len(PACK_DTYPES))} | odd
  assert len(plan.pack.entries) == 8 * len(packed)              # each device's block once
  for k in keys:
    np.testing.assert_array_equal(_stored(manifest, buf, f"['{k}']"), expected[k])


def test_word_gather_lays_out_every_dtype_byte_exact_including_8_byte_ones():
  """_concat_words (the gather's body) against numpy's bytes, x64 on so that 8-byte
  dtypes exist: each block's bytes in order, zero-padded to 64 bytes."""
  rng = np.random.default_rng(1)
  with jax.enable_x64(True):
    for dt in sorted(_pack._DTYPES):
      for n in (1, 2, 3, 5, 9, 17):
        blocks = [rng.integers(0, 255, n).astype(np.uint8).astype(dt) for _ in range(3)]
        blocks = [b > 100 if dt == "bool" else b for b in blocks]
        got = np.asarray(jax.jit(_pack._concat_words)(*[jnp.asarray(b) for b in blocks]))
        want = b"".join(b.tobytes() + bytes(align(b.nbytes) - b.nbytes) for b in blocks)
        assert got.dtype == np.uint32 and got.tobytes() == want, (dt, n)


def test_packed_gather_holds_values_through_donation():
  state = _small_state(jax.sharding.AxisType.Auto)
  # Values from an identical state: a numpy view of ``state`` would block the donation.
  expected = {k: np.asarray(v) for k, v in _small_state(jax.sharding.AxisType.Auto).items()}
  plan, manifest, buf = _capture(state, donate=True)
  keys = sorted(state)
  assert all(state[keys[i]].is_deleted() for i in plan.pack.leaves)    # really donated
  for k, v in expected.items():
    np.testing.assert_array_equal(_stored(manifest, buf, f"['{k}']"), v)


def test_manifest_json_from_the_layout_template_equals_a_fresh_encoding():
  state = _small_state()
  state.update({"step": 7, "name": 'quote " and \u00e9', "flag": True, "x": 1.5,
                "key": jax.random.key(3), "np": np.arange(3)})
  leaves, _ = tree.flatten(state)
  plan = capture.Planner().plan(leaves, wait=True)
  buf = np.zeros(plan.nbytes, np.uint8)
  for step in (1, 2):                        # the first save builds the template, the second reuses it
    leaves, _ = tree.flatten(dict(state, step=step, name=f"run {step} \"x\""))
    m = capture.complete(plan, capture.start(leaves, plan), buf, step=step,
                         metadata={"seed": step, "note": "a\nb"})
    text = m.to_json()
    assert plan.json_template[0] is not None     # rendered from the template
    fresh = dataclasses.replace(m, json_renderer=None).to_json()
    assert text == fresh
    assert SnapshotManifest.from_json(fresh) == m


def test_a_path_that_looks_like_a_template_hole_is_encoded_exactly():
  # A hole is a whole JSON string; text inside a path is escaped, so it never matches.
  state = _small_state()
  state['"@@jaxckpt:c0@@"'] = np.zeros(2)
  state["@@jaxckpt:step@@"] = 5
  leaves, _ = tree.flatten(state)
  plan = capture.Planner().plan(leaves, wait=True)
  m = capture.complete(plan, capture.start(leaves, plan), np.zeros(plan.nbytes, np.uint8), step=1)
  assert m.to_json() == dataclasses.replace(m, json_renderer=None).to_json()
  assert plan.json_template[0] is not None
  assert SnapshotManifest.from_json(m.to_json()) == m


# -- copying and hashing large shards on several threads -------------------------

def _big_state():
  """Shards over 1 MiB (copied on the pool) beside small ones (copied inline)."""
  mesh = jax.make_mesh((8,), ("x",))
  rng = np.random.default_rng(1)
  return {
      "big": jax.device_put(rng.standard_normal((8, 1 << 19), np.float32),
                            NamedSharding(mesh, P("x"))),            # 8 x 2 MiB shards
      "replicated": jax.device_put(rng.standard_normal((1 << 19,), np.float32),
                                   NamedSharding(mesh, P())),         # one 2 MiB shard
      "small": jax.device_put(np.arange(64, dtype=np.int32), NamedSharding(mesh, P("x"))),
      "host": rng.integers(0, 9, (3 << 18,), dtype=np.int64),         # numpy, 6 MiB
  }


def test_copy_pool_gives_the_same_bytes_and_records_as_one_thread():
  import concurrent.futures  # pylint: disable=import-outside-toplevel
  state = _big_state()
  leaves, _ = tree.flatten(state)
  plan = capture.Planner().plan(leaves, wait=True)
  assert sum(s.nbytes > (1 << 20) for s in plan.shards) >= 10
  outs = []
  for threads in (None, 3):
    buf = np.zeros(plan.nbytes, np.uint8)
    pool = None if threads is None else concurrent.futures.ThreadPoolExecutor(threads)
    try:
      m = capture.complete(plan, capture.start(leaves, plan), buf, step=3, pool=pool)
    finally:
      if pool is not None:
        pool.shutdown()
    outs.append((m, buf))
  (m1, b1), (m3, b3) = outs
  assert m1.to_json() == m3.to_json()          # same records, same order, same digests
  np.testing.assert_array_equal(b1, b3)
  for path, value in (("['big']", state["big"]), ("['host']", state["host"])):
    np.testing.assert_array_equal(_stored(m3, b3, path), np.asarray(value))
  for leaf in m3.leaves:                       # each checksum is of the bytes in the buffer
    for r in leaf.shards:
      assert checksum(b3[r.offset:r.offset + r.nbytes]) == r.checksum


def test_a_failing_shard_waits_for_the_pool_before_raising():
  import concurrent.futures  # pylint: disable=import-outside-toplevel
  state = _big_state()
  leaves, _ = tree.flatten(state)
  plan = capture.Planner().plan(leaves, wait=True)
  sources = capture.start(leaves, plan)
  bad = len(plan.shards) - 1
  sources[bad] = np.zeros(plan.shards[bad].nbytes + 1, np.uint8)   # one byte too many
  buf = np.zeros(plan.nbytes, np.uint8)
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    with pytest.raises(ValueError, match="planned"):
      capture.complete(plan, sources, buf, step=1, pool=pool)
    # every copy the pool started has finished: nothing writes into the slot now
    assert pool.submit(lambda: 1).result() == 1
    snapshot = buf.copy()
  np.testing.assert_array_equal(buf, snapshot)


def _many_small(n: int, seed: int = 0) -> dict:
  mesh = jax.make_mesh((8,), ("x",))
  rng = np.random.default_rng(seed)
  return {f"w{i:05d}": jax.device_put(rng.standard_normal((16, 8), dtype=np.float32),
                                      NamedSharding(mesh, P("x")))
          for i in range(n)}


def test_a_first_save_never_waits_for_the_compiler_and_the_next_manager_starts_warm():
  """The packed gather compiles on its own thread: the first plan of a new layout
  copies shard by shard (bytes exact); once compiled, every planner of the
  process (a second manager) gets the packed plan at once."""
  state = _many_small(200, seed=1)                  # compiled aside
  leaves, _ = tree.flatten(state)
  first = capture.Planner().plan(leaves)
  assert first.pack is None                         # not waiting for XLA
  buf = np.empty(first.nbytes, np.uint8)
  manifest = capture.complete(first, capture.start(leaves, first), buf, step=1)
  for leaf in manifest.leaves:
    got = _read_leaf(buf, leaf)
    np.testing.assert_array_equal(got, np.asarray(state[leaf.path.strip("[]'")]))
  warm = capture.Planner().plan(leaves, wait=True)
  assert warm.pack is not None and len(warm.pack.leaves) == 200
  again, _ = tree.flatten(_many_small(200, seed=2))  # same layout, new values, new planner
  assert capture.Planner().plan(again) is warm


def _read_leaf(buf, leaf):
  out = np.zeros(leaf.shape, leaf.numpy_dtype)
  for s in leaf.shards:
    shape = [b - a for a, b in s.index]
    out[tuple(slice(a, b) for a, b in s.index)] = np.frombuffer(
        buf, leaf.numpy_dtype, int(np.prod(shape)), s.offset).reshape(shape)
  return out


def _first_plan_secs(n: int) -> float:
  """CPU seconds of this thread (the compile threads and other processes' load
  do not count) to plan and start a first save of ``n`` leaves. The layout's
  gather then compiles aside: it is waited for, so that the next measurement
  does not share the cores with it (its CPU time doubled on a 2-core CI host)."""
  leaves, _ = tree.flatten(_many_small(n, seed=n))
  t0 = time.thread_time()
  plan = capture.Planner().plan(leaves)
  capture.start(leaves, plan)
  secs = time.thread_time() - t0
  assert _plan._LAYOUTS.get(leaves).ready.wait(300), f"the gather of {n} leaves did not compile"
  return secs


def test_the_first_saves_blocking_cost_grows_linearly_with_leaves():
  """A ratio at two sizes, not a wall-clock limit: 4x the leaves may cost at
  most ~6x (it was superlinear: XLA compiling the gather in the save)."""
  _first_plan_secs(50)                              # imports and caches warmed
  small = min(_first_plan_secs(250 + i) for i in range(3))
  large = min(_first_plan_secs(1000 + i) for i in range(3))
  assert large / small < 6.5, (small, large)

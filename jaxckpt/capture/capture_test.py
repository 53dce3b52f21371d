"""What JAX does with donated arrays whose host copy is pending (measured, CPU).

These tests pin down the platform behaviour that jaxckpt.capture relies on; if
a JAX release changes it, they fail and the capture strategy must be revisited.
"""

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxckpt import capture, tree

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
  plan = capture.Planner().plan(leaves)
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

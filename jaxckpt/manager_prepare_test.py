"""CheckpointManager.prepare: the first save's one-time costs, paid before the loop."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt as jc
from jaxckpt import errors


def _state():
  mesh = jax.make_mesh((8,), ("x",))
  rng = np.random.default_rng(7)
  return {"w": jax.device_put(rng.standard_normal((64, 32), np.float32),
                              NamedSharding(mesh, P("x"))),
          "small": jax.device_put(np.arange(16, dtype=np.int32), NamedSharding(mesh, P("x"))),
          "step": 3}


def test_prepare_saves_nothing_and_the_first_save_restores_bit_exact():
  state = _state()
  with jc.CheckpointManager(options=jc.CheckpointOptions(max_snapshots=2)) as mgr:
    mgr.prepare(state)
    assert mgr.all_steps() == [] and mgr.stats.started == 0
    assert mgr.save(1, state)
    mgr.wait_until_finished()
    out = mgr.restore(step=1, target=state)
  np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(state["w"]))
  np.testing.assert_array_equal(np.asarray(out["small"]), np.asarray(state["small"]))
  assert out["step"] == 3


def test_prepare_refuses_a_state_over_the_budget_before_the_loop_starts():
  state = _state()
  opts = jc.CheckpointOptions(max_snapshots=2, host_memory_limit_bytes=4096)
  with jc.CheckpointManager(options=opts) as mgr:
    with pytest.raises(errors.HostMemoryBudgetError, match="host_memory_limit_bytes=4096"):
      mgr.prepare(state)


def test_prepare_keeps_held_snapshots():
  state = _state()
  with jc.CheckpointManager(options=jc.CheckpointOptions(max_snapshots=2)) as mgr:
    mgr.save(1, state)
    mgr.wait_until_finished()
    mgr.prepare(state)          # only free slots are (re)allocated
    out = mgr.restore(step=1, target=state)
    assert mgr.all_steps() == [1]
  np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(state["w"]))

"""An orbax loop ported as a careless user ports it: only the import and the construction change."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jaxckpt as jc
import jaxckpt.universal as u


class _Model(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(4, 2, rngs=rngs)


def _build():
  model = _Model(nnx.Rngs(0))
  return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


@pytest.mark.parametrize("manager", [ocp.CheckpointManager, jc.CheckpointManager])
def test_the_step_may_be_the_optimizer_s_step_array(tmp_path, manager):
  """`save(optimizer.step.value, ...)`: orbax takes a 0-d integer array as the step."""
  model, opt = _build()
  step = opt.step.value + 3                          # a jax uint32 scalar
  assert isinstance(step, jax.Array) and step.shape == ()
  with manager(tmp_path, options=ocp.CheckpointManagerOptions()) as m:
    assert m.save(step, args=ocp.args.StandardSave(nnx.state(model)))
    m.wait_until_finished()
    assert m.all_steps() == [3] and m.latest_step() == 3
    out = m.restore(np.int64(3), args=ocp.args.StandardRestore(nnx.state(model)))
  np.testing.assert_array_equal(np.asarray(out["linear"]["kernel"].value),
                                np.asarray(model.linear.kernel.value))


def test_a_float_or_boolean_array_is_not_a_step(tmp_path):
  with jc.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions()) as m:
    for bad in (jnp.asarray(3.0), jnp.asarray(True), jnp.arange(2)):
      with pytest.raises(jc.errors.InvalidArgumentError, match="a step is a non-negative int"):
        m.save(bad, args=ocp.args.StandardSave({"w": np.ones(2)}))


def test_an_orbax_loop_without_options_has_its_last_step_on_storage(tmp_path):
  """orbax's `CheckpointManager(dir)` writes every saved step. Ported without options, the
  manager takes jaxckpt's defaults (persists at storage's pace), and close() puts the newest
  step on storage, since the in-process store's host memory ends with it: a restarted job
  restores the newest saved, bit for bit (it was left in host memory only)."""
  with jc.CheckpointManager(tmp_path) as m:
    saved = [step for step in range(6)     # (a save while the last copy runs may be skipped)
             if m.save(step, args=ocp.args.StandardSave({"w": np.full(3, step, np.float32)}))]
    m.wait_until_finished()
  newest = saved[-1]
  assert u.all_steps(str(tmp_path))[-1] == newest
  with jc.CheckpointManager(tmp_path) as m:
    assert m.latest_step() == newest
    out = m.restore(newest, args=ocp.args.StandardRestore({"w": np.zeros(3, np.float32)}))
    np.testing.assert_array_equal(out["w"], np.full(3, newest, np.float32))

"""A ported orbax loop on the directory orbax wrote: the manager lists orbax's steps,
restores them, saves beside them and keeps both kinds under one retention (before, it
reported no step, logged nothing, and the loop silently started over)."""

from __future__ import annotations

import logging

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxckpt as jc
from jaxckpt import errors, universal


def _state(step: int) -> dict:
  return {"w": np.arange(32, dtype=np.float32).reshape(8, 4) + step, "b": np.full(3, step, np.int32)}


@pytest.fixture
def orbax_run(tmp_path):
  directory = str(tmp_path / "run")
  opts = ocp.CheckpointManagerOptions(max_to_keep=3)
  with ocp.CheckpointManager(directory, options=opts) as m:
    for s in (100, 200):
      m.save(s, args=ocp.args.StandardSave(_state(s)))
    m.wait_until_finished()
  return directory, opts


def test_a_ported_loop_resumes_from_orbax_s_steps_where_they_lie(orbax_run, caplog):
  directory, opts = orbax_run
  with caplog.at_level(logging.INFO, logger="jaxckpt"):
    m = jc.CheckpointManager(directory, options=opts)
  with m:
    assert any("found 2 steps written by orbax" in r.getMessage() and "100, 200" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert m.all_steps() == [100, 200] and m.latest_step() == 200
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _state(0))
    out = m.restore(m.latest_step(), args=ocp.args.StandardRestore(abstract))
    np.testing.assert_array_equal(np.asarray(out["w"]), _state(200)["w"])
    assert m.last_restore.tier == "storage"
    with pytest.raises(errors.StepAlreadyExistsError):
      m.save(200, args=ocp.args.StandardSave(_state(999)), force=True)
    for s in (300, 400):                        # saved in jaxckpt's format beside orbax's
      assert m.save(s, args=ocp.args.StandardSave(_state(s)))
    m.wait_until_finished()
    assert m.all_steps() == [200, 300, 400]    # max_to_keep=3 counts both kinds: 100 went
    assert universal.stored_steps(directory) == [200, 300, 400]
    assert universal.all_steps(directory) == [300, 400]   # jaxckpt's own; 200 is orbax's


def test_jaxckpt_s_own_options_list_and_restore_orbax_s_steps(orbax_run):
  directory, _ = orbax_run
  with jc.CheckpointManager(directory, jc.CheckpointOptions(persist_interval_steps=100)) as m:
    assert m.all_steps() == [100, 200]
    out = m.restore(None, _state(0))
    assert m.last_restore.step == 200
    np.testing.assert_array_equal(out["b"], _state(200)["b"])

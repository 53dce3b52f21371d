"""Bad input gets a JaxckptError (and the fitting builtin) naming the value, before anything is saved."""

import os

import jax
import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.options import default_copy_threads


@pytest.fixture
def mgr():
  with jc.CheckpointManager(options=jc.CheckpointOptions(max_snapshots=2)) as m:
    m.save(1, {"w": np.arange(4.0), "k": jax.random.key(3)})
    m.wait_until_finished()
    yield m


@pytest.mark.parametrize("step,why", [(True, "not a bool"), (np.bool_(True), "not a bool"),
                                      (1.0, "not a float"), ("1", "not a str"),
                                      (np.float32(1), "not a float32"),
                                      (2**64, r"in \[0, 2\*\*63\)"), (-1, r"in \[0, 2\*\*63\)")])
def test_steps_are_ints_in_save_and_restore_alike(mgr, step, why):
  for call in (lambda: mgr.restore(step=step), lambda: mgr.save(step, {"w": np.zeros(4)})):
    with pytest.raises(errors.InvalidArgumentError, match=why) as e:
      call()
    assert isinstance(e.value, ValueError) and repr(step)[:6] in str(e.value)
  assert mgr.all_steps() == [1]


def test_numpy_integer_steps_are_accepted_everywhere(mgr):
  assert mgr.save(np.int64(4), {"w": np.arange(4.0), "k": jax.random.key(3)})
  mgr.wait_until_finished()
  out = mgr.restore(step=np.int32(4), target={"w": np.zeros(4), "k": jax.random.key(0)})
  np.testing.assert_array_equal(out["w"], np.arange(4.0))
  assert mgr.all_steps() == [1, 4]


@pytest.mark.parametrize("leaf", [np.array(["ab"]), np.array([b"ab"]), np.array([None, 1]),
                                  np.zeros(2, dtype=[("a", "f4"), ("b", "i4")]),
                                  np.zeros(2, "V8")], ids=["str", "bytes", "object",
                                                           "structured", "void"])
def test_leaves_that_could_not_be_restored_are_refused_at_save(mgr, leaf):
  with pytest.raises(errors.UnsupportedLeafError, match=r"leaf \['bad'\] .*cannot restore") as e:
    mgr.save(2, {"w": np.arange(4.0), "bad": leaf})
  assert isinstance(e.value, TypeError)
  mgr.wait_until_finished()
  assert mgr.all_steps() == [1] and mgr.stats.started == 1


def test_a_prng_target_of_another_implementation_is_refused(mgr):
  out = mgr.restore(step=1, target={"w": np.zeros(4), "k": jax.eval_shape(lambda: jax.random.key(0))})
  assert (jax.random.key_data(out["k"]) == jax.random.key_data(jax.random.key(3))).all()
  for rbg in (jax.random.key(0, impl="rbg"), jax.eval_shape(lambda: jax.random.key(0, impl="rbg"))):
    with pytest.raises(errors.StructureMismatchError,
                       match=r"\['k'\] has a 'rbg' PRNG key but step 1 saved a 'threefry2x32'"):
      mgr.restore(step=1, target={"w": np.zeros(4), "k": rbg})


@pytest.mark.parametrize("kw,field", [({"max_snapshots": 0}, "max_snapshots"),
                                      ({"timeout_secs": "5"}, "timeout_secs"),
                                      ({"on_busy": "drop"}, "on_busy"),
                                      ({"copy_threads": 0}, "copy_threads")])
def test_option_errors_are_jaxckpt_errors_naming_the_field(kw, field):
  with pytest.raises(errors.InvalidArgumentError, match=field):
    jc.CheckpointOptions(**kw)
  with pytest.raises(errors.InvalidArgumentError, match="job_name"):
    jc.AgentOptions(job_name="bad name/")
  with pytest.raises(errors.InvalidArgumentError, match="group_size"):
    jc.ParityOptions(group_size=0, parity=1)


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 2), (4, 2), (8, 2), (16, 4), (64, 8),
                                            (None, 1)])
def test_the_default_copy_threads_leave_most_cores_to_the_loop_but_never_one_of_two(
    monkeypatch, cores, threads):
  monkeypatch.setattr(os, "cpu_count", lambda: cores)
  assert default_copy_threads() == threads

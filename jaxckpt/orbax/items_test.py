"""orbax's Composite with Grain's data iterator, JSON and pytree items, on every tier."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.testing import processes


def _dataset():
  return grain.MapDataset.range(1000).shuffle(seed=7).map(lambda x: x * 3).batch(8)


def _loader():
  return grain.DataLoader(
      data_source=np.arange(1000) * 5,
      sampler=grain.samplers.IndexSampler(1000, shard_options=grain.sharding.NoSharding(),
                                          shuffle=True, seed=3, num_epochs=1),
      operations=[grain.transforms.Batch(4)], worker_count=0)


ITERATORS = {"dataset": lambda: iter(_dataset().to_iter_dataset()),
             "dataloader": lambda: iter(_loader())}


def _state(step):
  mesh = jax.make_mesh((8,), ("x",))
  w = np.random.default_rng(step).standard_normal((64, 16), dtype=np.float32)
  return {"w": jax.device_put(w, NamedSharding(mesh, P("x"))), "step": step}


def _abstract():
  mesh = jax.make_mesh((8,), ("x",))
  return {"w": jax.ShapeDtypeStruct((64, 16), np.float32, sharding=NamedSharding(mesh, P("x"))),
          "step": 0}


@pytest.fixture(params=["in-process", "agent", "storage"])
def tier(request, tmp_path):
  with contextlib.ExitStack() as stack:
    agent = None
    if request.param == "agent":
      root, job = stack.enter_context(processes.agent_sandbox())
      agent = jc.AgentOptions(job_name=job, run_root=root)
    directory = str(tmp_path / "ckpt") if request.param == "storage" else None
    yield request.param, directory, jc.CheckpointOptions(agent=agent)


@pytest.mark.parametrize("kind", sorted(ITERATORS))
def test_composite_with_a_grain_iterator_resumes_at_the_next_batch(tier, kind):
  name, directory, opts = tier
  it = ITERATORS[kind]()
  for _ in range(5):                              # mid-epoch
    next(it)
  with contextlib.ExitStack() as stack:
    m = stack.enter_context(jc.CheckpointManager(directory, opts))
    m.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(5)),
                                      data_iter=grain.checkpoint.CheckpointSave(it),
                                      metadata=ocp.args.JsonSave({"lr": 0.1, "note": "x"})),
           force=True)
    m.wait_until_finished()
    expected = [np.asarray(next(it)) for _ in range(3)]   # what an uninterrupted run sees next
    fresh = ITERATORS[kind]()
    if name != "in-process":                      # a new trainer: the agent or storage
      m.close()
      m = stack.enter_context(jc.CheckpointManager(
          directory, jc.CheckpointOptions() if name == "storage" else opts))
    out = m.restore(args=ocp.args.Composite(state=ocp.args.StandardRestore(_abstract()),
                                            data_iter=grain.checkpoint.CheckpointRestore(fresh),
                                            metadata=ocp.args.JsonRestore()))
    assert m.last_restore.tier == ("storage" if name == "storage" else "host")
  np.testing.assert_array_equal(np.asarray(out.state["w"]), np.asarray(_state(5)["w"]))
  assert out.state["step"] == 5 and out["metadata"] == {"lr": 0.1, "note": "x"}
  assert out.data_iter is fresh
  for want in expected:
    np.testing.assert_array_equal(np.asarray(next(fresh)), want)


def test_an_unsupported_item_is_refused_naming_it_and_the_fix():
  with jc.CheckpointManager(options=jc.CheckpointOptions()) as m:
    with pytest.raises(errors.InvalidArgumentError,
                       match=r"Composite\(extra=ArrayRestoreArgs.*StandardSave"):
      m.save(1, args=ocp.args.Composite(extra=ocp.args.ArrayRestore()))
    m.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave({"a": np.ones(3)})))
    m.wait_until_finished()
    with pytest.raises(errors.StructureMismatchError, match="no item 'data'"):
      m.restore(args=ocp.args.Composite(data=ocp.args.JsonRestore()))


TRAIN = textwrap.dedent("""
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import grain, numpy as np, orbax.checkpoint as ocp
    import jaxckpt as jc
    root, job, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    def data():
      return iter(grain.MapDataset.range(10_000).shuffle(seed=1).batch(16).to_iter_dataset())
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root))
    with jc.CheckpointManager(options=opts) as m:
      it, w, start = data(), np.zeros(16, np.int64), 0
      if m.latest_step() is not None:
        r = m.restore(args=ocp.args.Composite(
            state=ocp.args.StandardRestore({"w": w}), data_iter=grain.checkpoint.CheckpointRestore(it)))
        w, start = np.asarray(r.state["w"]), m.last_restore.step
      for step in range(start + 1, steps + 1):
        w = w + next(it)                              # the "training" consumes the batch
        m.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": w}),
                                             data_iter=grain.checkpoint.CheckpointSave(it)))
        m.wait_until_finished()
        print("STEP", step, flush=True)
      np.save(out, w)
""")


def test_a_trainer_sigkilled_mid_epoch_resumes_with_the_batches_an_uninterrupted_run_sees(
    tmp_path):
  env = dict(os.environ, PYTHONPATH=os.getcwd())
  with processes.agent_sandbox() as (root, job):
    ref = str(tmp_path / "ref.npy")
    subprocess.run([sys.executable, "-c", TRAIN, root, job + "r", "30", ref], env=env,
                   check=True, capture_output=True, timeout=300)
    got = str(tmp_path / "got.npy")
    with processes.Proc(["-c", TRAIN, root, job, "30", got], env=env) as p:
      p.wait_for("STEP 12", 300)
      p.kill()                                    # SIGKILL in the middle of the epoch
    subprocess.run([sys.executable, "-c", TRAIN, root, job, "30", got], env=env, check=True,
                   capture_output=True, timeout=300)
    np.testing.assert_array_equal(np.load(got), np.load(ref))


@jax.jit
def _slow(x):
  """A computation still running when save() returns (its snapshot commits after it)."""
  return jax.lax.fori_loop(0, 300, lambda i, y: jax.numpy.tanh(y @ y.T @ y * 1e-3), x)


@pytest.mark.parametrize("store", ["in-process", "agent"])
def test_a_composite_restore_right_after_a_save_gets_that_step(store):
  """restore(args=Composite(...)) with step None waits for the save in flight, then takes
  the newest step: the one just saved (issue 32, item 2), as a plain restore and orbax do.
  (Before, it took the newest committed step: 1.)"""
  with contextlib.ExitStack() as stack:
    agent = None
    if store == "agent":
      root, job = stack.enter_context(processes.agent_sandbox())
      agent = jc.AgentOptions(job_name=job, run_root=root)
    m = stack.enter_context(jc.CheckpointManager(options=jc.CheckpointOptions(agent=agent)))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 256), dtype=np.float32)
    big = rng.standard_normal((16, 1024, 1024), dtype=np.float32)    # 64 MiB to copy
    m.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": x, "b": big})))
    m.wait_until_finished()
    _slow(jax.numpy.asarray(x)).block_until_ready()                  # compiled
    state = {"w": _slow(jax.numpy.asarray(x)), "b": jax.numpy.asarray(big) + 1}   # dispatched
    assert m.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
    out = m.restore(args=ocp.args.Composite(state=ocp.args.StandardRestore({"w": x, "b": big})))
    assert m.last_restore.step == 2
    np.testing.assert_array_equal(np.asarray(out.state["w"]), np.asarray(state["w"]))
    np.testing.assert_array_equal(out.state["b"], big + 1)

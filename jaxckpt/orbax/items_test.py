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
  the newest step: the one just saved, as a plain restore and orbax do.
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


def _sharded():
  mesh = jax.make_mesh((8,), ("x",))
  mesh2 = jax.make_mesh((2, 4), ("a", "b"))
  rng = np.random.default_rng(1)
  tree = {"a": jax.device_put(rng.standard_normal((16,), dtype=np.float32), NamedSharding(mesh, P("x"))),
          "c": {"d": jax.device_put(np.arange(32, dtype=np.int32).reshape(4, 8),
                                    NamedSharding(mesh2, P("a", "b"))),
                "e": jax.device_put(np.ones((4, 4), np.float32), NamedSharding(mesh2, P(None, "b")))},
          "step": 7}
  restore_args = {"a": ocp.ArrayRestoreArgs(mesh=mesh, mesh_axes=P("x")),
                  "c": {"d": ocp.ArrayRestoreArgs(sharding=NamedSharding(mesh2, P("b", None))),
                        "e": ocp.ArrayRestoreArgs(mesh=mesh2, mesh_axes=P("a", None))},
                  "step": ocp.RestoreArgs(restore_type=int)}
  return tree, restore_args


def _same(a, b):
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_pytree_restore_args_without_an_item_restore_the_saved_tree_with_those_shardings(tmp_path):
  tree, restore_args = _sharded()
  with jc.CheckpointManager(tmp_path) as m:
    m.save(1, args=ocp.args.PyTreeSave(tree))
    out = m.restore(1, args=ocp.args.PyTreeRestore(restore_args=restore_args))
  assert out["step"] == 7 and isinstance(out["step"], int)
  for path in (("a",), ("c", "d"), ("c", "e")):
    got, want, ra = out, tree, restore_args
    for k in path:
      got, want, ra = got[k], want[k], ra[k]
    _same(got, want)
    assert got.sharding.is_equivalent_to(ra.sharding or NamedSharding(ra.mesh, ra.mesh_axes), 2)


def test_placeholders_and_partial_restore(tmp_path):
  tree, restore_args = _sharded()
  with jc.CheckpointManager(tmp_path) as m:
    m.save(1, args=ocp.args.PyTreeSave(tree))
    item = {"a": object(), "c": {"d": ocp.PLACEHOLDER, "e": object()}, "step": ocp.PLACEHOLDER}
    out = m.restore(1, args=ocp.args.PyTreeRestore(item, restore_args=restore_args))
    assert out["c"]["d"] is ocp.PLACEHOLDER and out["step"] is ocp.PLACEHOLDER
    _same(out["a"], tree["a"])
    _same(out["c"]["e"], tree["c"]["e"])
    with pytest.raises(ValueError, match=r"User-provided restore item and on-disk value.*lacks "
                       r"\['c'\]\['e'\]"):
      m.restore(1, args=ocp.args.PyTreeRestore({"a": 0, "c": {"d": 0}, "step": 0}))
    with pytest.raises(ValueError, match=r"\['c'\] is a placeholder where a subtree was saved"):
      m.restore(1, args=ocp.args.PyTreeRestore({"a": 0, "c": ocp.PLACEHOLDER, "step": 0}))
    out = m.restore(1, args=ocp.args.PyTreeRestore({"a": 0, "c": {"d": 0}}, restore_args=restore_args,
                                                  partial_restore=True))
    assert sorted(out) == ["a", "c"] and list(out["c"]) == ["d"]
    _same(out["c"]["d"], tree["c"]["d"])


def test_array_items_alone_and_in_a_composite(tmp_path):
  with jc.CheckpointManager(tmp_path / "one") as m:
    m.save(1, args=ocp.args.ArraySave(np.arange(16)))
    _same(m.restore(1, args=ocp.args.ArrayRestore()), np.arange(16))
    _same(m.restore(1), np.arange(16))
  with jc.CheckpointManager(tmp_path / "many", item_names=("params", "arr", "cfg")) as m:
    m.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave({"w": np.ones(3)}),
                                      arr=ocp.args.ArraySave(jax.numpy.arange(5.0)),
                                      cfg=ocp.args.JsonSave({"lr": 0.1, "n": [1, 2]})))
    out = m.restore(1, args=ocp.args.Composite(arr=ocp.args.ArrayRestore(),
                                               cfg=ocp.args.JsonRestore()))
    assert isinstance(out, ocp.args.Composite) and "params" not in out
    _same(out.arr, np.arange(5.0))
    assert out["cfg"] == {"lr": 0.1, "n": [1, 2]}


def test_items_are_declared_and_checked_as_orbax_checks_them(tmp_path):
  save = lambda: ocp.args.StandardSave({"w": np.ones(3)})
  with jc.CheckpointManager(tmp_path / "named", item_names=("params",)) as m:
    with pytest.raises(ValueError, match="'other' does not match with any registered handler"):
      m.save(1, args=ocp.args.Composite(other=save()))
    with pytest.raises(ValueError, match="Must provide `args` of type `Composite`"):
      m.save(1, args=save())
    with pytest.raises(ValueError, match="keyword"):
      m.save(1, ocp.args.Composite(params=save()))              # positional: not args
  with jc.CheckpointManager(tmp_path / "single") as m:
    m.save(1, args=save())
    with pytest.raises(ValueError, match="Cannot provide `args` of type `Composite`"):
      m.save(2, args=ocp.args.Composite(params=save()))
    with pytest.raises(ValueError):
      m.restore(1, args=ocp.args.Composite(params=ocp.args.StandardRestore()))
  with pytest.raises(ValueError, match="should not be provided together"):
    jc.CheckpointManager(tmp_path / "x", item_names=("a",),
                         item_handlers=ocp.StandardCheckpointHandler())


def test_a_none_item_restores_as_saved_once_the_manager_knows_its_kind(tmp_path):
  tree = {"a": 1, "b": np.arange(3)}
  with jc.CheckpointManager(tmp_path) as m:
    m.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                      emb=ocp.args.StandardSave(tree)))
    out = m.restore(0, args=ocp.args.Composite(state=None))
    assert out.state["a"] == 1 and "emb" not in out
  with jc.CheckpointManager(tmp_path) as m:
    with pytest.raises(ValueError, match='the `CheckpointHandler` for item "state" was not'):
      m.restore(0, args=ocp.args.Composite(state=None))
    out = m.restore(0)                                           # every item, as saved
    assert sorted(out) == ["emb", "state"] and out.emb["a"] == 1
    _same(m.restore(0, args=ocp.args.Composite(state=None)).state["b"], np.arange(3))


def test_restore_targets_made_the_orbax_way_with_nnx_rng_keys(tmp_path):
  """ocp.utils.to_shape_dtype_struct gives a typed key's data shape (2,) uint32: the key comes
  back typed (before: "has shape (2,) but step 1 saved shape ()")."""
  from flax import nnx  # pylint: disable=import-outside-toplevel

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.dense = nnx.Linear(3, 2, rngs=rngs)
      self.dropout = nnx.Dropout(0.5, rngs=rngs)

  state = nnx.state(Model(nnx.Rngs(0, dropout=1)))
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  with jc.CheckpointManager(tmp_path) as m:
    m.save(1, args=ocp.args.StandardSave(state))
    out = m.restore(1, args=ocp.args.StandardRestore(target))
  for (path, got), (_, want) in zip(jax.tree_util.tree_leaves_with_path(out),
                                    jax.tree_util.tree_leaves_with_path(state)):
    if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
      assert jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key), path
      _same(jax.random.key_data(got), jax.random.key_data(want))
    else:
      _same(got, want)


JSON_JOB = textwrap.dedent("""
    import datetime, sys
    import jax
    port, pid, directory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    jax.config.update("jax_num_cpu_devices", 2)
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid, initialization_timeout=120)
    import numpy as np, orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxckpt as jc
    mesh = jax.make_mesh((4,), ("x",))
    opts = ocp.CheckpointManagerOptions(max_to_keep=2, keep_time_interval=datetime.timedelta(hours=1))
    with jc.CheckpointManager(directory, opts) as m:
      for step in range(4):
        full = np.arange(32, dtype=np.float32).reshape(8, 4) * step
        w = jax.make_array_from_callback((8, 4), NamedSharding(mesh, P("x")), lambda i: full[i])
        assert m.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": w}),
                                                    cfg=ocp.args.JsonSave({"step": step, "p": pid})))
      m.wait_until_finished()
      print("STEPS", m.all_steps(), flush=True)
""")


@pytest.mark.slow
def test_json_items_of_a_two_process_job_restore_in_one(tmp_path):
  """A JSON item is one value for the job (process 0's, as orbax writes it), restored at any
  process count; the job's processes kept the same steps (keep_time_interval on process 0's
  clock: the first step, then the newest 2)."""
  port = processes.free_port()
  directory = str(tmp_path / "ckpt")
  env = {"PYTHONPATH": os.getcwd()}
  with processes.Proc(["-c", JSON_JOB, str(port), "0", directory], env=env) as p0, \
       processes.Proc(["-c", JSON_JOB, str(port), "1", directory], env=env) as p1:
    outs = [p.finish(300) for p in (p0, p1)]
  assert all("STEPS [0, 2, 3]" in out for out in outs), outs
  with jc.CheckpointManager(directory, ocp.CheckpointManagerOptions()) as m:
    assert m.all_steps() == [0, 2, 3]
    out = m.restore(3, args=ocp.args.Composite(cfg=ocp.args.JsonRestore(),
                                               state=ocp.args.StandardRestore()))
  assert out.cfg == {"step": 3, "p": 0}
  _same(out.state["w"], np.arange(32, dtype=np.float32).reshape(8, 4) * 3)

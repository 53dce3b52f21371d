"""The persistent tier through the manager: written in the background, restored on any mesh."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.testing import processes

X = np.arange(32 * 16, dtype=np.float32).reshape(32, 16)


def put(x, shape, names, *spec):
  m = jax.make_mesh(shape, names, devices=jax.devices()[:int(np.prod(shape))])
  return jax.device_put(x, NamedSharding(m, P(*spec)))


def state(step):
  return {"w": put(X * step, (8,), ("x",), "x"), "key": jax.random.key(step),
          "meta": {"step": step, "name": "run"}, "bf": put(jnp.full((16,), step, jnp.bfloat16),
                                                           (2, 4), ("a", "b"), "b")}


def target():
  t = state(0)
  t["w"] = jax.ShapeDtypeStruct(X.shape, X.dtype, sharding=NamedSharding(
      jax.make_mesh((2, 2), ("c", "d"), devices=jax.devices()[:4]), P("d", "c")))
  return t


def check(out, step):
  np.testing.assert_array_equal(np.asarray(out["w"]), X * step)
  assert out["meta"] == {"step": step, "name": "run"}
  np.testing.assert_array_equal(jax.random.key_data(out["key"]),
                                jax.random.key_data(jax.random.key(step)))
  np.testing.assert_array_equal(np.asarray(out["bf"], np.float32), np.full(16, step))


@pytest.mark.parametrize("use_agent", [False, True])
def test_persisted_steps_restore_from_storage_onto_another_mesh(tmp_path, use_agent):
  with processes.agent_sandbox() as (root, job):
    agent = jc.AgentOptions(job_name=job, run_root=root) if use_agent else None
    opts = jc.CheckpointOptions(max_snapshots=2, persist_interval_steps=2, max_to_keep=2,
                                agent=agent)
    d = str(tmp_path / "ckpt")
    with jc.CheckpointManager(d, options=opts) as m:
      for step in range(1, 8):
        m.save(step, state(step), force=True)
        m.wait_until_finished()
        if step % 2 == 0:
          m.wait_until_persisted(step)
      assert jc.universal.all_steps(d) == [4, 6]                 # max_to_keep=2
      if use_agent:                  # written by the agent, never by this trainer
        deadline = time.monotonic() + 30
        while m._core._store.persisted_steps() != [2, 4, 6]:
          assert time.monotonic() < deadline, m._core._store.persist_status()
          time.sleep(0.05)
    # a fresh trainer with empty host memory: only storage has the steps
    with jc.CheckpointManager(d, options=jc.CheckpointOptions()) as m:
      assert m.all_steps() == [4, 6]
      out = m.restore(target=target())
      assert (m.last_restore.tier, m.last_restore.step) == ("storage", 6)
      check(out, 6)
      check(m.restore(step=4, target=target()), 4)
      with pytest.raises(errors.StepNotFoundError, match=r"on storage: \[4, 6\]"):
        m.restore(step=2, target=target())


def test_damaged_host_snapshot_falls_back_to_storage(tmp_path):
  d = str(tmp_path / "ckpt")
  with jc.CheckpointManager(d, options=jc.CheckpointOptions(persist_interval_steps=1)) as m:
    m.save(3, state(3))
    m.wait_until_persisted(3)
    with m._core._store.read(3) as (manifest, buf):
      buf[manifest.leaves[0].shards[0].offset] ^= 1
    out = m.restore(target=target())
    assert m.last_restore.tier == "storage"
    check(out, 3)


def test_storage_restore_to_numpy_and_single_device(tmp_path):
  d = str(tmp_path / "ckpt")
  with jc.CheckpointManager(d) as m:
    m.save(1, {"w": put(X, (4, 2), ("a", "b"), "a", "b")})
    m.wait_until_persisted(1)
  with jc.CheckpointManager(d) as m:
    np.testing.assert_array_equal(m.restore(target={"w": np.zeros_like(X)})["w"], X)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[5])
    out = m.restore(target={"w": jax.ShapeDtypeStruct(X.shape, X.dtype, sharding=one)})
    assert out["w"].sharding == one
    np.testing.assert_array_equal(np.asarray(out["w"]), X)
    assert m.last_restore.tier == "storage" and m.last_restore.nbytes == X.nbytes

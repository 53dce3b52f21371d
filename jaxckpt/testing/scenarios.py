"""Shipped test contracts: the snapshot scenarios every platform must pass.

The CPU suite runs them on 8 emulated devices (scenarios_test.py); gpu_tests/
and tpu_tests/ run the same functions on real accelerators, each through
:func:`run` over :data:`NAMES`.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt as jc
from jaxckpt.testing import processes


def _mesh(devices: Sequence[jax.Device], shape: tuple[int, ...], names: tuple[str, ...]):
  n = int(np.prod(shape))
  return jax.sharding.Mesh(np.array(devices[:n]).reshape(shape), names)


def _data(rows: int = 64, cols: int = 48) -> np.ndarray:
  return (np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) * 0.01).astype(np.float32)


def sharded_snapshot_round_trip(devices: Sequence[jax.Device]) -> None:
  """Sharded, replicated and bf16 leaves restore bit-exact onto the same shardings."""
  n = len(devices)
  m = _mesh(devices, (n,), ("x",))
  x = _data(8 * n)
  state = {"w": jax.device_put(x, NamedSharding(m, P("x"))),
           "rep": jax.device_put(x[:4], NamedSharding(m, P())),
           "bf": jax.device_put(jnp.asarray(x, jnp.bfloat16), NamedSharding(m, P(None, "x")))
           if x.shape[1] % n == 0 else jax.device_put(jnp.asarray(x, jnp.bfloat16),
                                                      NamedSharding(m, P("x")))}
  with jc.CheckpointManager() as mgr:
    assert mgr.save(1, state)
    mgr.wait_until_finished()
    out = mgr.restore(target=state)
    assert mgr.last_restore.tier == "host"
  for k in state:
    assert out[k].sharding == state[k].sharding
    np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(state[k]))


def snapshot_survives_donation(devices: Sequence[jax.Device]) -> None:
  """The next step donates the saved arrays; every snapshot is still exact."""
  n = len(devices)
  s = NamedSharding(_mesh(devices, (n,), ("x",)), P("x"))
  update = jax.jit(lambda w: w * 2.0 + 1.0, donate_argnums=0)
  w = jax.device_put(_data(8 * n), s)
  expected = {}
  with jc.CheckpointManager(options=jc.CheckpointOptions(max_snapshots=4,
                                                         on_busy="wait")) as mgr:
    for step in range(1, 5):
      expected[step] = np.asarray(w).copy()
      assert mgr.save(step, {"w": w})
      w = update(w)
    mgr.wait_until_finished()
    for step in mgr.all_steps():
      out = mgr.restore(step=step, target={"w": jax.ShapeDtypeStruct(w.shape, w.dtype,
                                                                     sharding=s)})
      np.testing.assert_array_equal(np.asarray(out["w"]), expected[step])


def restore_onto_another_mesh(devices: Sequence[jax.Device]) -> None:
  """Saved over all devices, restored onto half of them with another spec, and onto one."""
  n = len(devices)
  x = _data(8 * n, 8 * n)
  src = jax.device_put(x, NamedSharding(_mesh(devices, (n,), ("x",)), P("x", None)))
  with jc.CheckpointManager() as mgr:
    mgr.save(1, {"w": src})
    mgr.wait_until_finished()
    half = max(n // 2, 1)
    dst = NamedSharding(_mesh(devices, (half,), ("y",)), P(None, "y"))
    out = mgr.restore(target={"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dst)})
    assert out["w"].sharding == dst
    np.testing.assert_array_equal(np.asarray(out["w"]), x)
    one = jax.sharding.SingleDeviceSharding(devices[-1])
    out = mgr.restore(target={"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one)})
    np.testing.assert_array_equal(np.asarray(out["w"]), x)


def agent_restart(devices: Sequence[jax.Device], run_root: str, job: str) -> None:
  """A snapshot in the agent outlives the manager; a new manager restores it."""
  n = len(devices)
  s = NamedSharding(_mesh(devices, (n,), ("x",)), P("x"))
  x = _data(8 * n)
  opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=run_root))
  with jc.CheckpointManager(options=opts) as mgr:
    mgr.save(7, {"w": jax.device_put(x, s)})
    mgr.wait_until_finished()
  with jc.CheckpointManager(options=opts) as mgr:
    out = mgr.restore(target={"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)})
    assert (mgr.last_restore.step, mgr.last_restore.tier) == (7, "host")
    np.testing.assert_array_equal(np.asarray(out["w"]), x)


NAMES = ("sharded_snapshot_round_trip", "snapshot_survives_donation",
         "restore_onto_another_mesh", "agent_restart")


def run(name: str, devices: Sequence[jax.Device]) -> None:
  """Runs scenario ``name`` on ``devices`` (an agent scenario in a sandbox of its own)."""
  if name == "agent_restart":
    with processes.agent_sandbox() as (root, job):
      agent_restart(devices, root, job)
  else:
    globals()[name](devices)


def platform_devices(platform: str) -> list[jax.Device]:
  """The devices of ``platform`` ("gpu", "tpu"), or none where jax has no such backend."""
  try:
    return jax.devices(platform)
  except RuntimeError:
    return []

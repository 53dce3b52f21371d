"""AgentSnapshotSource against a real snapshot agent (spawned by a CheckpointManager)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt.ft import AgentSnapshotSource, GradientRing
from jaxckpt.ft.catch_up import CatchUpServer, InMemorySnapshotSource, rebuild_state
from jaxckpt.ft.ring import DigestLog
from jaxckpt.testing import processes


def _state(scale: float) -> dict:
  mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
  w = jax.device_put(jnp.arange(32, dtype=jnp.float32).reshape(8, 4) * scale,
                     jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
  return {"w": w, "count": jnp.int32(3), "lr": 0.5}


def test_latest_step_and_fetch_read_the_agents_bit_exact():
  with processes.agent_sandbox("jf") as (root, job):
    opts = jc.CheckpointOptions(max_snapshots=2, agent=jc.AgentOptions(job_name=job, run_root=root))
    with jc.CheckpointManager(options=opts) as mgr:
      for step in (1, 2, 3):
        mgr.save(step, _state(step))
        mgr.wait_until_finished()
      source = AgentSnapshotSource(**AgentSnapshotSource(run_root=root, job_name=job).locator())
      assert source.latest_step() == 3
      leaves = source.fetch(3)
      np.testing.assert_array_equal(leaves["['w']"], np.arange(32, dtype=np.float32).reshape(8, 4) * 3)
      template = _state(0.0)
      rebuilt = rebuild_state({"w": template["w"]}, leaves)
      assert rebuilt["w"].sharding == template["w"].sharding
      np.testing.assert_array_equal(np.asarray(rebuilt["w"]), leaves["['w']"])
      with pytest.raises(KeyError, match="saving processes \\[0\\]"):
        source.fetch(1)                              # evicted (max_snapshots=2)


def test_no_agent_is_a_key_error_naming_the_job_and_root(tmp_path):
  source = AgentSnapshotSource(run_root=str(tmp_path), job_name="nobody-g0")
  with pytest.raises(KeyError, match=f"nobody-g0.*{tmp_path}"):
    source.latest_step()


def test_catch_up_server_advertises_the_agent_locator_only_for_agent_sources():
  agent = AgentSnapshotSource(run_root="/dev/shm/x", job_name="demo-g1")
  server = CatchUpServer(GradientRing(2), DigestLog(), lambda: agent)
  assert server({"op": "snap_where"})[0] == {"op": "snap_where",
                                             "agent": {"run_root": "/dev/shm/x", "job_name": "demo-g1"}}
  memory = CatchUpServer(GradientRing(2), DigestLog(), InMemorySnapshotSource)
  assert memory({"op": "snap_where"})[0]["agent"] is None

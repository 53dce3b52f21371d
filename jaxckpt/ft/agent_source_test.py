"""AgentSnapshotSource against a real snapshot agent (spawned by a CheckpointManager), and the
catch-up requests a healthy group serves."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zmq

import jaxckpt as jc
from jaxckpt.ft import AgentSnapshotSource, GradientRing, _peer
from jaxckpt.ft.catch_up import CatchUpServer, InMemorySnapshotSource, fetch_ring, rebuild_state
from jaxckpt.ft.ring import DigestLog, RingEntry, chain_digest
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


def test_the_entry_of_the_step_in_flight_is_one_held_request_answered_when_committed():
  # A group that caught up waits for the step its peers reduce now: the peer holds the request
  # until it commits that step, instead of being polled every few milliseconds.
  ring, key, ctx = GradientRing(4), b"the-job", zmq.Context()
  server = _peer.PeerServer(ctx, "127.0.0.1", CatchUpServer(ring, DigestLog(), lambda: None), secret=key)
  sender = _peer.PeerSender(ctx, secret=key)
  try:
    leaves = (np.arange(4, dtype=np.float32),)
    entry = RingEntry(step=7, digest_before=11, digest_after=chain_digest(11, leaves), leaves=leaves)
    assert fetch_ring(sender, server.address, 7, 11, 8, 5.0) is None          # not committed: no wait
    threading.Timer(0.3, ring.put, args=(entry,)).start()
    t0 = time.monotonic()
    got = fetch_ring(sender, server.address, 7, 11, 8, 5.0, wait_secs=10.0)
    took = time.monotonic() - t0
    assert got is not None and got[0].digest_after == entry.digest_after and 0.25 < took < 2, took
    t0 = time.monotonic()                                     # a wait that runs out: "missing"
    assert fetch_ring(sender, server.address, 9, entry.digest_after, 10, 5.0, wait_secs=0.3) is None
    assert 0.25 < time.monotonic() - t0 < 2
  finally:
    server.stop()
    ctx.term()

"""The snapshot agent under a careless user and a hostile peer (issue 30, adversarial review)."""

from __future__ import annotations

import os
import signal

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.testing import processes


@pytest.fixture
def sandbox():
  with processes.agent_sandbox() as (root, job):
    yield root, job


@pytest.mark.timeout(180)
def test_an_agent_killed_during_a_snapshot_is_named_at_once_not_after_the_request_timeout(
    sandbox):
  # The trainer's commit waited the whole request_timeout_secs (60 s by default) for the
  # reply of an agent whose pid had gone; a due save waits on that copy meanwhile.
  root, job = sandbox
  opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root))
  s = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
  big = jax.device_put(np.ones((64 << 20) // 4, np.float32), s)
  with jc.CheckpointManager(options=opts) as m:
    m.prepare({"w": big})
    pid = m._store.pid    # pylint: disable=protected-access  (the agent to kill)
    assert m.save(1, {"w": big})
    os.kill(pid, signal.SIGKILL)          # while step 1 is copied into its slot
    with pytest.raises(errors.AgentUnavailableError, match=rf"pid {pid}.*exited"):
      m.wait_until_snapshotted(timeout_secs=30)
    assert m.save(2, {"w": big})          # a new agent takes the next save
    m.wait_until_finished()
    assert m.all_steps() == [2] and m.stats.agent_restarts == 1

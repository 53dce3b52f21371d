"""metadata(step) describes every step all_steps() lists: one other hosts' agents
hold, or one the survivors' parity rebuilds for a replaced host."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt.agent.trainer.client import AgentStore
from jaxckpt.agent.parity_test import Cluster, assert_restores
from jaxckpt.testing import processes


@pytest.fixture
def sandbox():
  with processes.agent_sandbox("jm") as (root, job):
    yield root, job


def _described(meta) -> dict:
  return {k: (v.kind, v.shape, v.dtype) for k, v in meta.tree.items()}


WANT = {"u": ("jax", (1000,), "float32"), "w": ("jax", (64, 24), "float32")}


def test_a_replaced_host_describes_a_step_only_parity_rebuilds_for_it(sandbox):
  with Cluster(*sandbox, 1) as c:
    c.protect(3)
    c.lose([0])                                   # host 0's new agent holds nothing
    with c.manager() as mgr:
      assert 3 in mgr.all_steps()
      meta = mgr.metadata(3)
      assert (meta.step, meta.tier) == (3, "parity")
      assert _described(meta) == WANT
      assert _described(mgr.metadata(mgr.latest_step())) == WANT   # the newest: the same step
      assert_restores(mgr, 3, "parity")


def test_a_host_holding_no_piece_describes_a_step_the_others_hold(sandbox):
  # A process whose agent holds nothing of the step (relaunched on another machine,
  # say): the step is complete on the job's other agents.
  root, job = sandbox
  with Cluster(root, job, 1) as c:
    c.protect(3)
    store = AgentStore(jc.AgentOptions(job_name=job, run_root=root), host=7, max_snapshots=2,
                       limit_bytes=1 << 30)
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root, host_id=7),
                                handle_sigterm=False)
    with jc.CheckpointManager(options=opts, store=store) as mgr:
      assert 3 in mgr.all_steps() and store.steps() == []
      meta = mgr.metadata(3)
      assert (meta.step, meta.tier) == (3, "host") and _described(meta) == WANT
      with pytest.raises(jc.errors.StepNotFoundError, match="step 4 is held neither by the job"):
        mgr.metadata(4)

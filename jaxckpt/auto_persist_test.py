"""A one-process job without persist_interval_steps persists one step at a time."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt as jc
from jaxckpt.testing import processes


@pytest.mark.parametrize("agent", [False, True])
def test_the_save_after_a_due_one_is_not_due_while_that_one_is_still_being_copied(agent,
                                                                                   tmp_path):
  # "Persists whenever its previous persist has ended": the previous one had not even
  # started (its copy was in flight, so the store listed no pending persist), so step 2
  # was due too. Two persists then held two slots: with max_snapshots=2 every later save
  # was skipped (a WARNING each) until both had ended.
  s = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
  x = jax.device_put(np.ones((32 << 20) // 4, np.float32), s)
  with processes.agent_sandbox() as (root, job):
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root)
                                if agent else None)
    with jc.CheckpointManager(str(tmp_path / "ckpt"), options=opts) as m:
      assert m.save(1, {"w": x})
      m.save(2, {"w": x})             # at once: step 1's copy (and so its persist) runs
      m.wait_until_finished()
    with jc.CheckpointManager(str(tmp_path / "ckpt")) as stored:
      assert stored.all_steps() == [1]

"""save(metadata=...) with values JSON cannot store: refused at save(), on every store."""

from __future__ import annotations

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.testing import processes


@pytest.mark.parametrize("where", ["agent", "storage"])
def test_metadata_json_cannot_store_is_refused_at_save_naming_the_key(where, tmp_path):
  # A careless loop passes its loss as it has it (a numpy scalar). save() said True, and
  # the snapshot failed later: a bare TypeError at the next save with the agent, a
  # StorageError of the persist with storage.
  with processes.agent_sandbox() as (root, job):
    if where == "agent":
      m = jc.CheckpointManager(options=jc.CheckpointOptions(
          agent=jc.AgentOptions(job_name=job, run_root=root)))
    else:
      m = jc.CheckpointManager(str(tmp_path / "ckpt"))
    with m:
      with pytest.raises(errors.InvalidArgumentError, match=r"metadata\['loss'\].*float32"):
        m.save(1, {"w": np.ones(4, np.float32)}, metadata={"lr": 0.1, "loss": np.float32(2)})
      assert m.save(2, {"w": np.ones(4, np.float32)}, metadata={"lr": 0.1, "loss": 2.0})
      m.wait_until_finished()
      assert m.all_steps() == [2]
      assert m.metadata(2).metadata == {"lr": 0.1, "loss": 2.0}

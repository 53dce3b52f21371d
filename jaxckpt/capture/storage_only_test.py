"""Storage-only mode (host_snapshots=False): no host snapshot, a bounded staging buffer."""

from __future__ import annotations

import tracemalloc

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.host import _spans

MiB = 1 << 20


def _state():
  mesh = jax.make_mesh((8,), ("x",))
  sharded = NamedSharding(mesh, P("x"))
  state = {f"w{i}": jax.device_put(np.full((512, 1024), i, np.float32), sharded)  # 2 MiB each
           for i in range(16)}
  state["big"] = np.arange(3 * MiB // 4, dtype=np.float32)          # 3 MiB: over the budget
  state["step"], state["lr"], state["key"] = 7, 0.25, jax.random.key(3)
  return state


def _peak(fn):
  _spans._load()      # another test may have started the hash kernel's load: its imports
  tracemalloc.start()  # allocate on their own thread, and tracemalloc counts every thread
  try:
    fn()
    return tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()


def test_saves_go_straight_to_storage_through_the_staging_budget(tmp_path):
  state = _state()
  opts = jc.CheckpointOptions(host_snapshots=False, host_memory_limit_bytes=2 * MiB)
  with jc.CheckpointManager(str(tmp_path / "c"), opts) as mgr:
    mgr.save(0, state)    # first-use costs (schema compile, tensorstore's first open) apart
    peak = _peak(lambda: mgr.save(1, state))
    assert mgr.stats.committed == 2 and mgr.all_steps() == [0, 1]
    assert mgr.stats.last_nbytes == 3 * MiB              # the biggest batch: the big leaf alone
    assert peak < 3 * MiB + MiB, peak                     # not the 35 MiB state
    out = mgr.restore(1, target=state)
    assert mgr.last_restore.tier == "storage"
  for k in state:
    if k == "key":
      assert np.array_equal(jax.random.key_data(out[k]), jax.random.key_data(state[k]))
    else:
      assert np.asarray(out[k]).tobytes() == np.asarray(state[k]).tobytes(), k
  assert type(out["step"]) is int and out["lr"] == 0.25
  with jc.CheckpointManager(str(tmp_path / "h"), jc.CheckpointOptions()) as mgr:   # the host tier
    host_peak = _peak(lambda: (mgr.save(1, state), mgr.wait_until_finished()))
  assert host_peak > 30 * MiB, host_peak


def test_interval_keep_and_restart(tmp_path):
  opts = jc.CheckpointOptions(host_snapshots=False, save_interval_steps=2, max_to_keep=2)
  d = str(tmp_path / "c")
  with jc.CheckpointManager(d, opts) as mgr:
    saved = [mgr.save(s, {"x": np.full(4, s, np.int32)}) for s in range(1, 8)]
    assert saved == [False, True, False, True, False, True, False]
    with pytest.raises(errors.StepExistsError):
      mgr.save(6, {"x": np.zeros(4, np.int32)})
  with jc.CheckpointManager(d, opts) as mgr:              # a restart finds them on storage
    assert mgr.all_steps() == [4, 6]
    assert mgr.restore()["x"].tolist() == [6, 6, 6, 6]


def test_storage_only_needs_a_directory_and_no_agent():
  with pytest.raises(errors.InvalidArgumentError, match="needs a directory"):
    jc.CheckpointManager(None, jc.CheckpointOptions(host_snapshots=False))
  with pytest.raises(errors.InvalidArgumentError, match="takes no agent"):
    jc.CheckpointOptions(host_snapshots=False, agent=jc.AgentOptions(job_name="j"))
  with pytest.raises(errors.InvalidArgumentError, match="True or False"):
    jc.CheckpointOptions(host_snapshots="no")


def test_a_failed_save_leaves_nothing_behind_and_the_step_can_be_saved_again(tmp_path):
  d = tmp_path / "c"
  opts = jc.CheckpointOptions(host_snapshots=False, host_memory_limit_bytes=MiB)
  with jc.CheckpointManager(str(d), opts) as mgr:
    bad = {"w": np.ones(MiB // 4, np.float32), "names": np.array(["a", "b"], dtype=object)}
    with pytest.raises(errors.UnsupportedLeafError, match="names"):
      mgr.save(1, bad)
    assert mgr.all_steps() == [] and mgr.stats.committed == 0
    assert mgr.save(1, {"w": np.ones(MiB // 4, np.float32)})
    assert mgr.all_steps() == [1]
    assert mgr.restore(1)["w"].sum() == MiB // 4

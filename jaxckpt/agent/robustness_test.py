"""Ordinary faults of the host tier fail closed: short slot files, a full /dev/shm."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt as jc
from jaxckpt.agent import _paths
from jaxckpt.testing import processes


def sharded(x):
  return jax.device_put(x, NamedSharding(jax.make_mesh((8,), ("x",)), P("x")))


@pytest.mark.parametrize("keep", [0.5, 0.0])
def test_a_truncated_slot_file_is_corrupt_and_restore_falls_back_to_storage(tmp_path, keep):
  x = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
  d = str(tmp_path / "ckpt")
  with processes.agent_sandbox() as (root, job):
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root))
    with jc.CheckpointManager(d, opts) as m:
      assert m.save(1, {"w": sharded(x)})
      m.wait_until_persisted(1)
    host = os.path.join(root, job, "host0")
    slots = [f for f in os.listdir(host) if f.startswith("slot")]
    for f in slots:                                   # the step's slot is among them
      path = os.path.join(host, f)
      if os.path.getsize(path):
        os.truncate(path, int(os.path.getsize(path) * keep))
    with jc.CheckpointManager(d, opts) as m:
      out = m.restore(step=1, target={"w": sharded(np.zeros_like(x))})
      assert m.last_restore.tier == "storage"
    np.testing.assert_array_equal(np.asarray(out["w"]), x)
    jc.universal.discard_step(d, 1)                          # no other tier: the error itself
    with jc.CheckpointManager(d, opts) as m:               # (the same run: its directory)
      with pytest.raises(jc.errors.CorruptSnapshotError, match="truncated|cannot be mapped"):
        m.restore(step=1, target={"w": sharded(np.zeros_like(x))})


TRAINER = textwrap.dedent("""
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxckpt as jc
    root, job = sys.argv[1], sys.argv[2]
    state = {"w": jax.device_put(np.ones((4096, 1024), np.float32),        # 16 MiB
                                 NamedSharding(jax.make_mesh((8,), ("x",)), P("x")))}
    opts = jc.CheckpointOptions(host_memory_limit_bytes=1 << 30, agent=jc.AgentOptions(
        job_name=job, run_root=root, idle_timeout_secs=5))
    with jc.CheckpointManager(options=opts) as mgr:
      try:
        mgr.save(1, state)
        mgr.wait_until_finished()
        print("SAVED")
      except jc.errors.HostMemoryBudgetError as e:
        print("REFUSED", e)
      print("ALIVE", flush=True)
""")


def test_a_full_shm_is_a_budget_error_in_the_trainer_not_sigbus(tmp_path):
  with processes.tmpfs(tmp_path / "shm", "size=8m,mode=0700") as root:
    job = "full" + os.urandom(3).hex()
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
      r = subprocess.run([sys.executable, "-c", TRAINER, root, job], capture_output=True,
                         text=True, timeout=240, env=env, check=False)
    finally:
      for pid in processes.agent_pids(root):
        with contextlib.suppress(ProcessLookupError):
          os.kill(pid, 9)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "REFUSED" in r.stdout and "ALIVE" in r.stdout, r.stdout
    # refused at the first save, before any memory is taken, naming what is needed
    assert "(max_snapshots=2) + 1 being saved: 3 slots x 16.0 MiB = 48.0 MiB do not fit in" in r.stdout, r.stdout
    assert "8.0 MiB free there" in r.stdout
    # and said at start: the budget (1 GiB) is more than the run root can hold
    assert "host_memory_limit_bytes=1073741824 (1024.0 MiB) is more than the free space of " \
        f"the run root {root}" in r.stderr, r.stderr[-2000:]
    assert not any(f.startswith("slot") and os.path.getsize(os.path.join(dp, f))
                   for dp, _, fs in os.walk(root) for f in fs)   # nothing half-reserved


def test_slot_files_and_their_directory_are_private(tmp_path):
  with processes.agent_sandbox() as (root, job):
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root))
    with jc.CheckpointManager(options=opts) as m:
      m.save(1, {"w": sharded(np.ones((64, 8), np.float32))})
      m.wait_until_finished()
      host = _paths.agent_dir(root, job, 0)
      slots = [os.path.join(host, f) for f in os.listdir(host) if f.startswith("slot")]
      assert slots and all(os.stat(p).st_mode & 0o777 == 0o600 for p in slots), \
          [oct(os.stat(p).st_mode) for p in slots]


def test_saves_resume_after_the_agent_hung_past_the_request_timeout():
  import signal  # pylint: disable=import-outside-toplevel
  x = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
  with processes.agent_sandbox() as (root, job):
    opts = jc.CheckpointOptions(max_snapshots=2, agent=jc.AgentOptions(
        job_name=job, run_root=root, request_timeout_secs=2))
    with jc.CheckpointManager(options=opts) as m:
      assert m.save(1, {"w": sharded(x)})
      m.wait_until_finished()
      pid = m._core._store.pid                                 # pylint: disable=protected-access
      os.kill(pid, signal.SIGSTOP)
      try:
        with pytest.raises(jc.errors.AgentUnavailableError, match="did not answer 'reserve'"):
          m.save(2, {"w": sharded(x * 2)})
      finally:
        os.kill(pid, signal.SIGCONT)
      for step in (3, 4, 5):                             # the reserve it gave up on is void
        assert m.save(step, {"w": sharded(x * step)}), m.stats
        m.wait_until_finished()
      assert m.all_steps() == [4, 5] and m.stats.skipped_busy == 0
      out = m.restore(step=5, target={"w": sharded(np.zeros_like(x))})
    np.testing.assert_array_equal(np.asarray(out["w"]), x * 5)

"""The snapshot agent: snapshots survive a killed trainer; the agent cleans up."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.agent import _paths, _requests
from jaxckpt.testing import processes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = [os.path.join(REPO, "examples", "train_flax.py"), "--steps", "12", "--layers", "1",
           "--d-model", "32", "--seq-len", "16", "--batch", "8", "--max-snapshots", "2"]


@pytest.fixture
def sandbox():
  with processes.agent_sandbox() as (root, job):
    yield root, job


def agent_opts(root, job, **kw):
  return jc.AgentOptions(job_name=job, run_root=root, **kw)


def mgr_for(root, job, **kw):
  return jc.CheckpointManager(options=jc.CheckpointOptions(agent=agent_opts(root, job), **kw))


def sharded(x):
  return jax.device_put(x, NamedSharding(jax.make_mesh((8,), ("x",)), P("x")))


def test_snapshots_outlive_the_manager_and_rollback_works(sandbox):
  root, job = sandbox
  x = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
  with mgr_for(root, job, max_snapshots=3) as m:
    for step in (1, 2, 3):
      assert m.save(step, {"w": sharded(x * step), "pos": step})
      m.wait_until_finished()
  with mgr_for(root, job, max_snapshots=3) as m:     # a "restarted trainer"
    assert m.all_steps() == [1, 2, 3]
    out = m.restore(step=2, target={"w": sharded(np.zeros_like(x)), "pos": 0})
    assert m.last_restore.tier == "host" and m.last_restore.step == 2
    np.testing.assert_array_equal(np.asarray(out["w"]), x * 2)
    assert out["pos"] == 2


def test_a_shard_changed_after_the_trainer_hashed_it_is_never_restored(sandbox):
  root, job = sandbox
  x = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
  with mgr_for(root, job, max_snapshots=2) as m:
    assert m.save(1, {"w": sharded(x)})
    m.wait_until_finished()
    with m._core._store.read(1) as (manifest, buf):    # a bit flip in the agent's memory
      buf[manifest.leaves[0].shards[0].offset] ^= 1
    with pytest.raises(errors.CorruptSnapshotError, match=r"of leaf \"\['w'\]\" is corrupted"):
      m.restore(step=1, target={"w": sharded(np.zeros_like(x))})


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_restored_arrays_keep_their_values_while_the_agent_reuses_its_slots(sandbox):
  root, job = sandbox
  with jc.CheckpointManager(options=jc.CheckpointOptions(
      max_snapshots=1, agent=agent_opts(root, job))) as m:
    s = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
    m.save(1, {"w": jax.device_put(np.ones(1 << 16, np.float32), s)})
    m.wait_until_finished()
    out = m.restore(target={"w": jax.ShapeDtypeStruct((1 << 16,), jnp.float32, sharding=s)})
    for step in range(2, 6):       # reuse every slot the restore read from
      m.save(step, {"w": jax.device_put(np.full(1 << 16, float(step), np.float32), s)})
      m.wait_until_finished()
    np.testing.assert_array_equal(np.asarray(out["w"]), np.ones(1 << 16, np.float32))


def test_resume_after_sigkill_is_bit_equal_to_uninterrupted_run(sandbox, tmp_path):
  root, job = sandbox
  env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jit-cache"),   # compile once, not 5x
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  base = str(tmp_path / "base.json")
  processes.Proc([*EXAMPLE, "--dump", base], cwd=REPO, env=env).finish(300)
  for seed in (1, 2):
    kill_at = random.Random(seed).randint(3, 10)
    name = f"{job}s{seed}"
    with processes.Proc([*EXAMPLE, "--job-name", name, "--agent-run-root", root,
                         "--sleep-per-step", "0.05"], cwd=REPO, env=env) as p:
      p.wait_for(f"step {kill_at} loss", 300)
      os.kill(p.p.pid, signal.SIGKILL)
      p.p.wait(30)
    out = str(tmp_path / f"resumed{seed}.json")
    log = processes.Proc([*EXAMPLE, "--job-name", name, "--agent-run-root", root,
                          "--resume", "--dump", out], cwd=REPO, env=env).finish(300)
    assert "from tier host" in log, log[-2000:]
    resumed_at = int(log.split("resumed at step ")[1].split()[0])
    assert kill_at - 1 <= resumed_at <= kill_at
    assert json.load(open(out)) == json.load(open(base))          # every loss, bit-equal
    a, b = np.load(out + ".npz"), np.load(base + ".npz")
    assert sorted(a) == sorted(b)
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])


KILL_MID_SNAPSHOT = r"""
import os, signal, sys, jax
jax.config.update("jax_num_cpu_devices", 8)
import numpy as np, jaxckpt as jc
from jax.sharding import NamedSharding, PartitionSpec as P
root, job = sys.argv[1:3]
opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root))
m = jc.CheckpointManager(options=opts)
s = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
big = lambda v: jax.device_put(np.full((64 << 20) // 4, v, np.float32), s)
m.save(1, {"w": big(1.0)}); m.wait_until_finished()
a = big(2.0); a.block_until_ready()
m.save(2, {"w": a})
os.kill(os.getpid(), signal.SIGKILL)          # while step 2 is being copied
"""


def test_kill_in_the_middle_of_a_snapshot_restores_the_previous_one(sandbox):
  root, job = sandbox
  p = subprocess.run([sys.executable, "-c", KILL_MID_SNAPSHOT, root, job], timeout=300,
                     capture_output=True, text=True)
  assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
  with mgr_for(root, job) as m:
    assert m.latest_step() == 1
    out = m.restore(target={"w": jax.ShapeDtypeStruct(((64 << 20) // 4,), jnp.float32,
                                                      sharding=jax.sharding.SingleDeviceSharding(
                                                          jax.devices()[0]))})
    assert m.last_restore.step == 1 and m.last_restore.tier == "host"
    assert bool(jnp.all(out["w"] == 1.0))
    slots = m._core._store.call(_requests.Status())["slots"]
    assert [s["state"] for s in slots].count("writing") == 0      # torn slot discarded


def test_killed_agent_is_replaced_by_the_next_save_without_hanging(sandbox):
  root, job = sandbox
  with mgr_for(root, job) as m:
    assert m.save(1, {"w": jnp.ones(8)})
    m.wait_until_finished()
    old = m._core._store.pid
    os.kill(old, signal.SIGKILL)
    processes.wait_gone(old, 10, "killed agent")
    t0 = time.monotonic()
    assert m.save(2, {"w": jnp.full(8, 2.0)})
    m.wait_until_finished()
    assert time.monotonic() - t0 < 30
    assert m._core._store.pid != old and m._core._store.restarts == 1
    assert m.all_steps() == [2]                          # step 1 died with the old agent
    np.testing.assert_array_equal(m.restore(target={"w": jnp.zeros(8)})["w"], np.full(8, 2.0))


def test_an_agent_killed_while_committing_is_replaced_by_the_next_save(sandbox):
  root, job = sandbox
  opts = jc.CheckpointOptions(agent=agent_opts(root, job, request_timeout_secs=5),
                              host_memory_limit_bytes=1 << 30)
  x = sharded(np.random.default_rng(0).standard_normal((4096, 1024), dtype=np.float32))
  with jc.CheckpointManager(options=opts) as m:
    assert m.save(1, {"w": x})
    m.wait_until_finished()
    old = m._core._store.pid
    assert m.save(2, {"w": x})                  # 16 MiB: copied and committed in the background
    os.kill(old, signal.SIGKILL)                # while it is copied, hashed or committed
    with pytest.raises(errors.JaxckptError):
      m.wait_until_snapshotted()
    assert m.save(3, {"w": x}, force=True)      # at once, no waiting for the kill to settle
    m.wait_until_snapshotted()
    assert m._core._store.pid != old and m.stats.agent_restarts == 1
    assert m.all_steps() == [3]
    np.testing.assert_array_equal(np.asarray(m.restore(target={"w": x})["w"]), np.asarray(x))


def test_budget_error_names_the_sizes(sandbox):
  root, job = sandbox
  opts = jc.CheckpointOptions(agent=agent_opts(root, job), host_memory_limit_bytes=1 << 20)
  with jc.CheckpointManager(options=opts) as m:
    with pytest.raises(errors.HostMemoryBudgetError,
                       match=r"2 snapshots kept \(max_snapshots=2\) \+ 1 being saved: 3 slots x 2\.0 MiB = 6\.0 MiB exceed") as e:
      m.save(1, {"w": np.zeros(1 << 19, np.float32)})
    assert isinstance(e.value, MemoryError)


def test_budget_error_counts_the_snapshots_the_user_set(sandbox):
  # It said "1001 snapshot slots" for max_snapshots=1000: the slot a save writes into, unnamed.
  root, job = sandbox
  opts = jc.CheckpointOptions(agent=agent_opts(root, job), max_snapshots=1000, host_memory_limit_bytes=1 << 20)
  with jc.CheckpointManager(options=opts) as m:
    with pytest.raises(errors.HostMemoryBudgetError) as e:
      m.save(1, {"w": np.zeros(1 << 10, np.float32)})
  assert ("1000 snapshots kept (max_snapshots=1000) + 1 being saved: 1001 slots x 0.0 MiB = 3.9 MiB exceed "
          "host_memory_limit_bytes=1048576") in str(e.value), e.value


def test_agent_stop_frees_every_segment(sandbox):
  root, job = sandbox
  with mgr_for(root, job) as m:
    m.save(1, {"w": jnp.ones(1 << 16)})
    m.wait_until_finished()
    pid = m._core._store.pid
  d = _paths.agent_dir(root, job, 0)
  assert any(f.startswith("slot") for f in os.listdir(d))
  out = subprocess.run([sys.executable, "-m", "jaxckpt.agent", "stop", "--job-name", job,
                        "--run-root", root], capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  processes.wait_gone(pid, 10, "stopped agent")
  assert not os.path.exists(d) and os.listdir(root) == []


def test_sidecar_start_status_and_spawn_false(sandbox):
  root, job = sandbox
  run = lambda *a: subprocess.run([sys.executable, "-m", "jaxckpt.agent", *a, "--job-name",
                                   job, "--run-root", root], capture_output=True, text=True,
                                  timeout=60)
  with pytest.raises(errors.AgentUnavailableError, match="jaxckpt agent start"):
    jc.CheckpointManager(options=jc.CheckpointOptions(agent=agent_opts(root, job, spawn=False)))
  started = json.loads(run("start").stdout)
  opts = jc.CheckpointOptions(agent=agent_opts(root, job, spawn=False))
  with jc.CheckpointManager(options=opts) as m:
    m.save(5, {"a": 1})
    m.wait_until_finished()
    assert m._core._store.pid == started["pid"]
  status = json.loads(run("status").stdout)
  assert status["running"] and status["steps"] == [5]
  assert run("stop").returncode == 0
  processes.wait_gone(started["pid"], 10, "sidecar agent")


def test_agent_exits_when_idle_after_its_trainer_died(sandbox):
  root, job = sandbox
  code = ("import jax, jaxckpt as jc, sys; o = jc.CheckpointOptions(agent=jc.AgentOptions("
          "job_name=sys.argv[2], run_root=sys.argv[1], idle_timeout_secs=1)); "
          "m = jc.CheckpointManager(options=o); m.save(1, {'a': 1}); m.wait_until_finished(); "
          "print(m._core._store.pid)")
  p = subprocess.run([sys.executable, "-c", code, root, job], capture_output=True, text=True,
                     timeout=120)
  pid = int(p.stdout.split()[-1])
  processes.wait_gone(pid, 15, "idle agent")
  assert not os.path.exists(_paths.agent_dir(root, job, 0))


@pytest.mark.slow
def test_sigterm_takes_a_last_snapshot_that_the_restarted_job_resumes(sandbox, tmp_path):
  root, job = sandbox
  env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jit-cache"),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  args = [*EXAMPLE, "--job-name", job, "--agent-run-root", root]
  with processes.Proc([*args, "--sleep-per-step", "0.2"], cwd=REPO, env=env) as p:
    p.wait_for("step 3 loss", 300)
    os.kill(p.p.pid, signal.SIGTERM)
    line = p.wait_for("preempted: last snapshot at step", 60)
    assert p.p.wait(60) == 0
  last = int(line.split("at step ")[1].split(";")[0])
  log = processes.Proc([*args, "--resume"], cwd=REPO, env=env).finish(300)
  assert f"resumed at step {last} from tier host" in log


def test_the_agents_log_is_private_and_goes_with_the_agent(sandbox):
  root, job = sandbox
  with mgr_for(root, job) as m:
    m.save(1, {"x": np.ones(4, np.float32)}, force=True)
    m.wait_until_finished()
    log = _paths.log_file(_paths.agent_dir(root, job, 0))
    assert os.path.exists(log) and os.stat(os.path.dirname(log)).st_mode & 0o077 == 0   # 0700
  subprocess.run([sys.executable, "-m", "jaxckpt.agent", "stop", "--job-name", job, "--run-root", root],
                 check=True, capture_output=True, timeout=60)
  deadline = time.monotonic() + 30
  while os.path.exists(log) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not os.path.exists(log), "the agent's log outlived it"


def test_the_agent_process_imports_no_jax():
  """An agent that never persists starts without JAX (its import is most of a start)."""
  code = "import sys, jaxckpt.agent.server._server, jaxckpt.agent.trainer.client; print('jax' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       check=True)
  assert out.stdout.strip() == "False"

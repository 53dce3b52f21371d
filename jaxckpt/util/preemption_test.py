"""SIGTERM as a preemption notice: polled by the loop, or fatal within the grace if nobody listens.

Every case is a real process that gets a real SIGTERM.
"""

import re
import signal
import subprocess
import sys
import time

import pytest

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.util import _preemption

LOOP = r"""
import os, signal, sys, time
import jaxckpt as jc
mgr = jc.CheckpointManager(options=jc.CheckpointOptions(handle_sigterm=True))
mgr._core._preemption.grace_secs = float(sys.argv[1])
print("ready", flush=True)
for step in range(1000):
    if sys.argv[2] == "poll" and mgr.reached_preemption(step):
        print("preempted at", step, flush=True)
        sys.exit(0)
    time.sleep(0.01)
"""

# The notice on its own, with a deadline callback standing in for the manager's close.
NOTICE = r"""
import sys, threading, time
import jax, jax.numpy as jnp
from jaxckpt.util import _preemption
grace, mode = float(sys.argv[1]), sys.argv[2]

def commit():
    print("deadline callback in", threading.current_thread().name, flush=True)
    if mode == "hung_callback":
        time.sleep(3600)

notice = _preemption.Notice(install=True, grace_secs=grace, on_deadline=commit)
if mode == "native":        # one XLA computation much longer than the grace, started before SIGTERM
    inner = lambda i, c: jax.lax.fori_loop(0, 1000, lambda j, d: d * 1.0000001 + 1.0, c)
    long = jax.jit(lambda x: jax.lax.fori_loop(0, 1_000_000_000, inner, x))   # minutes
    print("ready", flush=True)
    long(jnp.float32(0)).block_until_ready()
    print("the computation ended", flush=True)
print("ready", flush=True)
for step in range(100_000):
    if mode == "poll_late" and step > 50 and notice.reached(step):
        print("polled", flush=True)
        time.sleep(0.2)
        print("exit", flush=True)
        sys.exit(0)
    time.sleep(0.01)
"""


def _run(src, *args, second_sigterm=False, wait=60):
  p = subprocess.Popen([sys.executable, "-c", src, *map(str, args)], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
  try:
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.3)          # the native case: well inside the computation
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    if second_sigterm:
      time.sleep(0.2)
      p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=wait)
    _run.stderr = err
    return p.returncode, out, time.monotonic() - t0
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()


def test_loop_that_polls_exits_cleanly():
  code, out, _ = _run(LOOP, 30, "poll")
  assert code == 0 and "preempted at" in out


def test_loop_that_never_polls_still_dies_after_the_grace_period():
  code, _, _ = _run(LOOP, 0.5, "ignore")
  assert code == -signal.SIGTERM


def test_a_loop_that_never_polls_gets_the_deadline_callback_then_dies_by_sigterm():
  code, out, secs = _run(NOTICE, 2.0, "ignore")
  assert code == -signal.SIGTERM
  assert "deadline callback in MainThread" in out      # the loop is paused meanwhile
  assert 1.0 - 0.2 <= secs < 2.0 + 1.0      # after the poll window (1 s), within the grace
  assert _run.stderr.count("terminating on SIGTERM") == 1, _run.stderr   # said once


def test_a_hung_deadline_callback_still_ends_at_the_grace():
  code, out, secs = _run(NOTICE, 2.0, "hung_callback")
  assert code == -signal.SIGTERM and "deadline callback" in out
  assert 2.0 - 0.2 <= secs < 2.0 + 1.0


def test_a_main_thread_inside_a_long_xla_computation_still_ends_at_the_grace():
  code, out, secs = _run(NOTICE, 2.0, "native")
  assert code == -signal.SIGTERM, out
  assert "the computation ended" not in out
  assert "deadline callback in Thread" in out          # the main thread is in XLA: the notice's
  assert secs < 2.0 + 1.0


def test_a_loop_that_polls_in_time_owns_the_exit():
  code, out, secs = _run(NOTICE, 4.0, "poll_late")
  assert code == 0 and "exit" in out and "deadline callback" not in out


def test_a_second_sigterm_ends_the_process_at_once():
  code, out, secs = _run(NOTICE, 30.0, "ignore", second_sigterm=True)
  assert code == -signal.SIGTERM and "deadline callback" not in out
  assert secs < 5.0


FORK = r"""
import os, signal, sys, time
from jaxckpt.util import _preemption
notice = _preemption.Notice(install=True, grace_secs=30.0)
child = os.fork()
if child == 0:                              # a worker, as a data loader or a pool forks one
    time.sleep(60)
    os._exit(0)
time.sleep(0.5)
os.kill(child, signal.SIGTERM)              # Pool.terminate() does this
_, status = os.waitpid(child, 0)
time.sleep(0.5)
print(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, notice.event.is_set())
"""


def test_a_forked_child_dies_of_sigterm_and_the_parent_hears_nothing():
  out = subprocess.run([sys.executable, "-c", FORK], capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["True", "False"]


def test_the_default_grace_fits_inside_common_schedulers():
  grace = jc.CheckpointOptions().sigterm_grace_secs
  assert grace == _preemption.DEFAULT_GRACE_SECS <= 25.0        # Kubernetes, Slurm, GCE: 30 s
  assert _preemption.Notice(install=False).grace_secs == grace
  assert _preemption.Notice(install=False, grace_secs=grace).poll_secs == 15.0
  with pytest.raises(errors.InvalidArgumentError, match="sigterm_grace_secs must be > 0"):
    jc.CheckpointOptions(sigterm_grace_secs=0)


MANAGER_LOOP = r"""
import sys, time
import jax.numpy as jnp
import jaxckpt as jc
opts = jc.CheckpointOptions(max_snapshots=2, sigterm_grace_secs=float(sys.argv[2]))
mgr = jc.CheckpointManager(directory=sys.argv[1], options=opts)
print("ready", flush=True)
for step in range(1, 100_000):           # never asks reached_preemption
    print(f"saving {step}", flush=True)
    if mgr.save(step, {"w": jnp.full((256,), step, jnp.float32), "step": step}):
        print(f"saved {step}", flush=True)
    time.sleep(0.05)
"""


def test_a_manager_loop_that_never_polls_commits_its_newest_step_and_ends_within_the_grace(tmp_path):
  code, out, secs = _run(MANAGER_LOOP, tmp_path / "ckpt", 4.0, wait=4.0 + 4.0)
  assert code == -signal.SIGTERM and secs < 4.0 + 1.0
  last = int(re.findall(r"^saving (\d+)$", out, re.M)[-1])
  saved = int(re.findall(r"^saved (\d+)$", out, re.M)[-1])
  with jc.CheckpointManager(directory=str(tmp_path / "ckpt"),
                            options=jc.CheckpointOptions(handle_sigterm=False)) as mgr:
    # The last save the loop began was committed and persisted, or the notice paused the loop
    # inside it, before its snapshot began: then the last save that returned True was (on a
    # loaded machine a save between them may be skipped while the previous copy runs).
    assert mgr.latest_step() in (saved, last) and last > 1, out[-3000:]
    assert mgr.restore()["step"] == mgr.latest_step()


IDLE_LOOP = r"""
import sys, time
import jax.numpy as jnp
import jaxckpt as jc
opts = jc.CheckpointOptions(persist_interval_steps=10, on_busy="wait",
                            sigterm_grace_secs=float(sys.argv[2]))
mgr = jc.CheckpointManager(directory=sys.argv[1], options=opts)
for step in range(1, 14):                 # 10 is due for storage; 13 is the newest snapshot
    assert mgr.save(step, {"w": jnp.full((256,), step, jnp.float32), "step": step})
mgr.wait_until_snapshotted()
print("ready", flush=True)
time.sleep(600)                           # a long evaluation that never asks reached_preemption
"""


def test_the_newest_snapshot_reaches_storage_at_the_deadline_though_it_was_not_due(tmp_path):
  # The in-process store's snapshots end with the process: at SIGTERM's deadline the newest
  # one is persisted whatever the persist interval (storage had only step 10 before).
  code, _, secs = _run(IDLE_LOOP, tmp_path / "ckpt", 4.0, wait=4.0 + 30)
  assert code == -signal.SIGTERM and secs < 4.0 + 1.0, _run.stderr[-3000:]
  with jc.CheckpointManager(directory=str(tmp_path / "ckpt"),
                            options=jc.CheckpointOptions(handle_sigterm=False)) as mgr:
    assert mgr.latest_step() == 13
    assert mgr.restore()["step"] == 13

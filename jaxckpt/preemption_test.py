"""SIGTERM as a preemption notice: polled by the loop, or fatal if nobody listens."""

import signal
import subprocess
import sys

LOOP = r"""
import os, signal, sys, time
import jaxckpt as jc
mgr = jc.CheckpointManager(options=jc.CheckpointOptions(handle_sigterm=True))
mgr._preemption.grace_secs = float(sys.argv[1])
print("ready", flush=True)
for step in range(1000):
    if sys.argv[2] == "poll" and mgr.reached_preemption(step):
        print("preempted at", step, flush=True)
        sys.exit(0)
    time.sleep(0.01)
"""


def _run(grace, mode):
  p = subprocess.Popen([sys.executable, "-c", LOOP, str(grace), mode], stdout=subprocess.PIPE,
                       text=True)
  try:
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    return p.returncode, out
  finally:
    if p.poll() is None:
      p.kill()


def test_loop_that_polls_exits_cleanly():
  code, out = _run(30, "poll")
  assert code == 0 and "preempted at" in out


def test_loop_that_never_polls_still_dies_after_the_grace_period():
  code, _ = _run(0.5, "ignore")
  assert code == -signal.SIGTERM

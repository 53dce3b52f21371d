"""Preemption in a job of several processes: every process stops at the same step (issue
30, adversarial review)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from jaxckpt.testing import processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(400)
def test_a_notice_to_one_process_stops_every_process_at_the_same_step():
  # With the default handle_sigterm=True, the manager's SIGTERM handler replaced the one
  # of JAX's preemption service (installed in C by jax.distributed.initialize, which
  # Python's signal.getsignal does not see): the process told stopped alone, at its step,
  # and the others never heard (each blocked in the step's next collective).
  port = processes.free_port()
  procs = [processes.Proc(["-m", "tests.support.plan_worker", "--port", str(port),
                           "--num-processes", "2", "--process-id", str(i), "--preempt",
                           "--ballast-mib", "1", "--steps", "3000", "--sleep", "0.01"],
                          cwd=REPO) for i in range(2)]
  try:
    for p in procs:
      p.wait_for("READY", 240)
    time.sleep(0.5)                         # a few steps in
    os.kill(procs[0].p.pid, signal.SIGTERM)
    # A process that never hears blocks in a collective, silent: killed at the deadline
    # (its output then ends, and wait_for says it never printed PREEMPTED).
    deadline = threading.Timer(60, lambda: [p.kill() for p in procs])
    deadline.start()
    try:
      said = [p.wait_for("PREEMPTED", 60).split()[1:] for p in procs]
    finally:
      deadline.cancel()
  finally:
    for p in procs:
      p.__exit__(None, None, None)
  assert said[0] == said[1], said
  assert said[0][1] == "True"

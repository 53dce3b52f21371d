"""One process of a jax.distributed job on loopback whose loop asks the job's save plan.

  python -m tests.support.plan_worker --port P --num-processes N --process-id I \
      [--gated] [--steps S] [--ballast-mib B] [--sleep SECS] [--run-root R --job J]

The loop of ``--steps`` steps saves a state with a ``--ballast-mib`` leaf per
process (so that a copy takes longer than a step: the job's plan spaces
snapshots), sleeping ``--sleep`` seconds a step. With ``--gated`` it asks first,
as orbax loops do: ``if mgr.should_save(step): mgr.save(step, state)``; else it
calls ``save()`` every step. It prints ``STEPS [...]`` (the steps its save()
took) and ``PLAN n m`` (the job's last plan), and exits. With ``--run-root`` the
snapshots go to a snapshot agent of job ``--job`` under that run root; else to
the in-process store. ``--kill-agent-after`` makes process 1's snapshot fail in the
background (its agent killed during a copy) and its loop go on past the error;
``--preempt`` runs a loop with a collective per step that asks
``reached_preemption`` (the test sends SIGTERM to one process).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from jaxckpt.testing import processes


def main(argv=None) -> int:
  p = argparse.ArgumentParser()
  processes.add_job_arguments(p)
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--ballast-mib", type=int, default=16)
  p.add_argument("--sleep", type=float, default=0.0)
  p.add_argument("--gated", action="store_true")
  p.add_argument("--prepare", action="store_true", help="mgr.prepare(state) before the loop")
  p.add_argument("--run-root", default=None)
  p.add_argument("--job", default=None)
  p.add_argument("--kill-agent-after", type=int, default=None,
                 help="process 1 kills its snapshot agent (SIGKILL) while the copy of its "
                 "first snapshot after this step runs, then sleeps 1 s: its commit fails, "
                 "and the next save() raises that error (printed: RAISED step) while the "
                 "loop goes on")
  p.add_argument("--preempt", action="store_true",
                 help="a loop that runs a collective each step and asks reached_preemption "
                 "(default options): prints READY, then PREEMPTED step once told, takes that "
                 "snapshot and exits (NEVER if no notice came within --steps)")
  p.add_argument("--request-timeout", type=float, default=60.0,
                 help="AgentOptions.request_timeout_secs")
  a = p.parse_args(argv)
  processes.join_job(a)
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel

  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
  rows = a.ballast_mib * 2**20 // 4 // 256 * a.num_processes
  ballast = jax.make_array_from_callback((rows, 256), NamedSharding(mesh, P("x")),
                                         lambda i: np.ones((rows, 256), np.float32)[i])
  agent = (None if a.run_root is None else
           jc.AgentOptions(job_name=a.job, run_root=a.run_root,
                           request_timeout_secs=a.request_timeout))
  if a.preempt:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    with jc.CheckpointManager(options=jc.CheckpointOptions(agent=agent)) as mgr:
      print("READY", flush=True)
      for step in range(1, a.steps + 1):
        multihost_utils.sync_global_devices(f"step {step}")    # a training step's collective
        if mgr.reached_preemption(step):
          print("PREEMPTED", step, mgr.save(step, {"ballast": ballast}, force=True), flush=True)
          mgr.wait_until_finished()
          return 0
        mgr.save(step, {"ballast": ballast, "step": step})
        time.sleep(a.sleep)
    print("NEVER", flush=True)
    return 0
  with jc.CheckpointManager(options=jc.CheckpointOptions(agent=agent)) as mgr:
    if a.prepare:
      mgr.prepare({"ballast": ballast, "step": 0})
    taken, kill = [], a.kill_agent_after is not None and a.process_id == 1
    for step in range(1, a.steps + 1):
      state = {"ballast": ballast, "step": step}
      try:
        if a.gated:
          if mgr.should_save(step):
            assert mgr.save(step, state), f"should_save({step}) said True, save() did not save"
            taken.append(step)
        elif mgr.save(step, state):
          taken.append(step)
          if kill and step > a.kill_agent_after:
            os.kill(mgr._core._store.pid, signal.SIGKILL)   # pylint: disable=protected-access
            kill = False
            time.sleep(1.0)             # a slow step: the failed commit is known by the next
      except Exception as e:  # pylint: disable=broad-except  (the loop goes on, as a user's)
        print("RAISED", step, type(e).__name__, flush=True)
      time.sleep(a.sleep)
    mgr.wait_until_finished()
    print("STEPS", taken, flush=True)
    print("PLAN", mgr.stats.snapshot_every, mgr.stats.persist_every, flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())

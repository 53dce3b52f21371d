"""A job of several processes on one machine: kill one, relaunch, resume from host memory and parity.

  python examples/local_job.py [--processes 4] [--steps 12] [--kill-at 6]

Runs a ``jax.distributed`` job of ``--processes`` processes on localhost, each a
"host" of its own: 2 CPU devices, its own run root (so its own snapshot agent), the
default ``tcp_host``, Reed-Solomon parity across the processes. Then, as a scheduler
would:

1. the job trains; at step ``--kill-at`` one process is SIGKILLed. The others cannot
   go on (they would hang in their next collective, or abort within a second when
   process 0 is gone), so the whole job is stopped and relaunched. Every process
   resumes from its agent's host memory (tier ``host``) and trains to ``--steps``.
2. a "host" is lost: one process and its agent are killed and its run root (its
   shared memory) removed. The relaunched job resumes again; that process's state is
   rebuilt from the other processes' parity (tier ``parity``).

Each restore is checked bit-exact (the state at step s is a function of s). The
agents are stopped and their memory freed at the end. ``--worker`` runs one process
of the job (what the launcher starts).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- one process of the job ---------------------------------------------------------

def worker(a: argparse.Namespace) -> int:
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_num_cpu_devices", 2)
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{a.port}",
                             num_processes=a.processes, process_id=a.process_id,
                             initialization_timeout=120)
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel

  me = jax.process_index()
  mesh = jax.make_mesh((jax.device_count(),), ("x",))
  sharding = NamedSharding(mesh, P("x"))
  n = jax.device_count() << 18                        # 1 MiB of float32 per device
  base = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
  base = jax.make_array_from_callback((n,), sharding, lambda i: base[i])
  at = jax.jit(lambda b, s: b * 0.5 + s, out_shardings=sharding)   # "training": step s's state
  loss = jax.jit(lambda w: jnp.mean(w * w))           # a collective over every process

  def state(step: int) -> dict:
    return {"w": at(base, jnp.float32(step)), "step": step}

  options = jc.CheckpointOptions(
      agent=jc.AgentOptions(job_name=a.job, run_root=a.run_root),   # default tcp_host
      parity=jc.ParityOptions(group_size=a.processes, parity=1))
  with jc.CheckpointManager(options=options) as mgr:
    step = 0
    if a.resume and mgr.latest_step() is None:      # a relaunch must resume, never retrain
      print(f"process {me}: NOTHING to resume from: no step is held by every process "
            "of the job", flush=True)
      return 2
    if mgr.latest_step() is not None:
      target = {"w": jax.ShapeDtypeStruct((n,), np.float32, sharding=sharding), "step": 0}
      out = mgr.restore(target=target)
      info = mgr.last_restore
      step = info.step
      want = state(step)["w"]
      exact = all(np.array_equal(np.asarray(s.data), np.asarray(w.data))
                  for s, w in zip(out["w"].addressable_shards, want.addressable_shards))
      print(f"process {me}: resumed at step {step} from tier {info.tier} in "
            f"{info.seconds:.2f} s ({'bit-exact' if exact else 'NOT bit-exact'})", flush=True)
    start = step
    while step < a.steps:
      step += 1
      s = state(step)
      float(loss(s["w"]))                             # every process takes part in each step
      mgr.save(step, s)
      print(f"process {me}: step {step}", flush=True)
    mgr.wait_until_finished()
    if step > start:
      mgr.wait_until_protected()                      # the newest step has its parity
    print(f"process {me}: done at step {step}", flush=True)
  return 0


# -- the launcher ---------------------------------------------------------------------

class Job:
  """The job's processes, their output relayed line by line."""

  def __init__(self, a: argparse.Namespace, roots: list[str], *, resume: bool = False) -> None:
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
    self.procs = [subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", "--processes", str(a.processes),
         "--process-id", str(i), "--port", str(port), "--run-root", roots[i], "--job", a.job,
         "--steps", str(a.steps), *(["--resume"] if resume else [])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO}) for i in range(a.processes)]
    self.steps = [0] * a.processes
    self.lines: list[str] = []
    self._cv = threading.Condition()
    self._readers = [threading.Thread(target=self._read, args=(i,), daemon=True)
                     for i in range(a.processes)]
    for t in self._readers:
      t.start()

  def _read(self, i: int) -> None:
    for line in self.procs[i].stdout:
      with self._cv:
        if line.startswith(f"process {i}: "):
          print(line, end="", flush=True)
          self.lines.append(line.rstrip("\n"))
          if line.startswith(f"process {i}: step "):
            self.steps[i] = int(line.split()[-1])
        else:
          self.lines.append(f"[{i}] {line.rstrip()}")   # JAX's and jaxckpt's own lines
        self._cv.notify_all()
    self.procs[i].wait()
    with self._cv:                                    # (its exit code, for wait)
      self._cv.notify_all()

  def wait(self, what: str, ok, timeout_secs: float = 300) -> None:
    with self._cv:
      if not self._cv.wait_for(lambda: ok() or any(p.poll() not in (None, 0)
                                                   for p in self.procs), timeout_secs):
        raise TimeoutError(f"the job did not get {what} within {timeout_secs} s:\n"
                           + "\n".join(self.lines[-40:]))
      if not ok():
        bad = [i for i, p in enumerate(self.procs) if p.poll() not in (None, 0)]
        raise RuntimeError(f"processes {bad} failed before {what}:\n" + "\n".join(self.lines[-60:]))

  def finish(self, timeout_secs: float = 300) -> None:
    for i, p in enumerate(self.procs):
      if p.wait(timeout_secs) != 0:
        raise RuntimeError(f"process {i} exited with {p.returncode}:\n"
                           + "\n".join(self.lines[-60:]))
    for t in self._readers:
      t.join(10)

  def kill(self, i: int | None = None) -> None:
    for j, p in enumerate(self.procs):
      if (i is None or i == j) and p.poll() is None:
        p.kill()
        p.wait(30)


def resumed_at(job: Job, processes: int) -> int:
  """The step every process of a relaunched ``job`` resumed at, bit-exact (it said so);
  RuntimeError if one did not, or they resumed at different steps."""
  import re  # pylint: disable=import-outside-toplevel
  said = {int(m.group(1)): (int(m.group(2)), m.group(3)) for m in (
      re.match(r"process (\d+): resumed at step (\d+) from tier \w+ in [\d.]+ s \((.*)\)", ln)
      for ln in job.lines) if m}
  steps = {s for s, _ in said.values()}
  if sorted(said) != list(range(processes)) or len(steps) != 1 or any(
      how != "bit-exact" for _, how in said.values()):
    raise RuntimeError(f"the relaunched job did not resume every process at one step, "
                       f"bit-exact: {said}:\n" + "\n".join(job.lines[-60:]))
  return steps.pop()


def agent_pids(run_root: str) -> list[int]:
  """The pids of the agents under ``run_root`` (their address files say)."""
  import json  # pylint: disable=import-outside-toplevel
  pids = []
  for d, _, files in os.walk(run_root):
    if "agent.json" in files:
      with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(d, "agent.json")) as f:
          pids.append(int(json.load(f)["pid"]))
  return pids


def launch(a: argparse.Namespace) -> int:
  shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
  top = tempfile.mkdtemp(prefix="jaxckpt-local-job-", dir=shm)
  roots = [os.path.join(top, f"process{i}") for i in range(a.processes)]   # a run root each
  victim = a.processes - 1
  try:
    print(f"== a job of {a.processes} processes on localhost, run roots under {top}")
    job = Job(a, roots)
    try:
      job.wait(f"step {a.kill_at} on every process", lambda: min(job.steps) >= a.kill_at)
      job.kill(victim)
      print(f"== SIGKILLed process {victim} at step {job.steps[victim]}. The others cannot go on "
            "without it (they hang in their next collective, or abort when process 0 is "
            "lost): the whole job is relaunched, as a scheduler does", flush=True)
    finally:
      job.kill()
    print("== relaunched: every process resumes from its agent's host memory")
    job = Job(a, roots, resume=True)
    try:
      job.finish()
    finally:
      job.kill()
    resumed_at(job, a.processes)
    for pid in agent_pids(roots[victim]):
      os.kill(pid, signal.SIGKILL)
    shutil.rmtree(roots[victim])
    print(f"== lost the host of process {victim}: its agent SIGKILLed and its run root (its "
          "shared memory) removed; relaunched: its state comes from the others' parity",
          flush=True)
    job = Job(a, roots, resume=True)
    try:
      job.finish()
    finally:
      job.kill()
    resumed_at(job, a.processes)
    return 0
  finally:
    for root in roots:                  # the agents outlive the job: stop them
      if os.path.isdir(root):
        subprocess.run([sys.executable, "-m", "jaxckpt", "agent", "stop", "--job-name", a.job,
                        "--run-root", root], capture_output=True, timeout=120, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": REPO}, check=False)
    shutil.rmtree(top, ignore_errors=True)
    print("== the job's agents are stopped and their shared memory freed")


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--processes", type=int, default=4, help="processes of the job (at least 2)")
  p.add_argument("--steps", type=int, default=12, help="train until this step")
  p.add_argument("--kill-at", type=int, default=6, help="kill a process once every one got here")
  p.add_argument("--job", default=f"local-job-{os.getpid()}", help="the agents' job name")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
  p.add_argument("--port", type=int, help=argparse.SUPPRESS)
  p.add_argument("--run-root", help=argparse.SUPPRESS)
  p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.worker:
    return worker(a)
  if a.processes < 2 or not 0 < a.kill_at < a.steps:
    p.error(f"--processes must be at least 2 (got {a.processes}) and 0 < --kill-at < --steps "
            f"(got --kill-at {a.kill_at}, --steps {a.steps})")
  return launch(a)


if __name__ == "__main__":
  sys.exit(main())

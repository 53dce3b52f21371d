"""One process of a job that saves, or is relaunched on another number of processes
and restores (issue 42 item 4: the resized relaunch test and ``benchmarks/resized_restore.py``).

  python -m tests.support.resize_worker --port P --num-processes N --process-id I \
      --run-root R --tcp-host 127.0.1.M --job J --directory D --phase save|relaunch ...

Each process is a "machine" of its own (its own run root and loopback address, so its own
snapshot agent); which machine runs which process index is the launcher's choice, and a
relaunch may give a machine another index than before. Phases:

- ``save``: saves ``--steps`` (each persisted to ``--directory`` when given), waits until
  the last is protected by parity, closes the manager (its agent outlives it) and exits.
- ``relaunch``: a new manager restores the newest step onto this job's mesh (``--restores``
  times, each printed), reading no storage unless the host tiers cannot serve it; with
  ``--storage-restores`` it then times restores of the same step from storage (a manager
  without agents); with ``--save S`` it then saves step S and waits until it is protected.

Printed lines (the test and the benchmark read them): ``SERVED n`` (the bytes this machine's
agents had sent other processes: before the first restore and after every process's
restore), ``RESTORED step tier ok|BAD:... nbytes secs``, ``STORAGE secs``, ``PROTECTED s``,
then ``DONE`` or ``ERROR type: message``. The state is a function of the step: random
float32 matrices sharded over every device of the job (rows of one, columns of another), a
replicated leaf and a non-array one.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import signal
import sys
import time
from typing import Any, Iterator

import numpy as np

from jaxckpt.testing import processes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- the launcher's side (the test and the benchmark) ------------------------------------------

def machine(root: str, m: int) -> tuple[str, str]:
  """Machine ``m``'s own run root under ``root`` and its loopback address."""
  return os.path.join(root, f"machine{m}"), f"127.0.1.{m + 1}"


@contextlib.contextmanager
def launch(machines: list[int], root: str, job: str, directory: str, *args: str,
           env: dict[str, str] | None = None) -> Iterator[list[processes.Proc]]:
  """One process of a new job on each of ``machines`` (process i on ``machines[i]``),
  each with this module's ``args``; every one is killed on exit."""
  port, procs = processes.free_port(), []
  try:
    for i, m in enumerate(machines):
      run_root, address = machine(root, m)
      procs.append(processes.Proc(
          ["-m", "tests.support.resize_worker", "--port", str(port), "--num-processes",
           str(len(machines)), "--process-id", str(i), "--run-root", run_root, "--tcp-host",
           address, "--job", job, "--directory", directory, *args], cwd=REPO, env=env))
    yield procs
  finally:
    for p in procs:
      p.__exit__(None, None, None)


def finish(procs: list[processes.Proc], timeout_secs: float = 300) -> list[str]:
  """Every process's output once it printed DONE; a failure raises AssertionError with
  every process's output."""
  outs = []
  for i, p in enumerate(procs):
    try:
      outs.append(p.finish(timeout_secs))
    except (TimeoutError, RuntimeError) as e:
      for q in procs:
        q.kill()
      raise AssertionError(f"process {i}: {e}\n" + "\n".join(
          f"--- process {j}:\n" + "".join(q.lines)[-3000:] + (q.p.stdout.read() or "")[-3000:]
          for j, q in enumerate(procs) if j != i)) from None
  for i, out in enumerate(outs):
    if "DONE" not in out.splitlines() or said(out, "ERROR"):
      raise AssertionError(f"process {i}:\n{out[-4000:]}")
  return outs


def said(out: str, word: str) -> list[list[str]]:
  """The words after ``word`` of each line of ``out`` that starts with it."""
  return [ln.split()[1:] for ln in out.splitlines() if ln.startswith(word + " ")]


def lose(root: str, m: int) -> None:
  """Machine ``m`` is gone for good: its agents SIGKILLed (by pid: the launcher's own
  sandbox), its run root wiped."""
  run_root, _ = machine(root, m)
  for pid in processes.agent_pids(run_root):
    os.kill(pid, signal.SIGKILL)
    processes.wait_gone(pid, 30, f"the agent of machine {m}")
  shutil.rmtree(run_root)


# -- one process of the job ----------------------------------------------------------------


def say(*words: object) -> None:
  print(*words, flush=True)


@functools.lru_cache(maxsize=2)
def expected(step: int, rows: int, cols: int) -> dict[str, np.ndarray]:
  """Step ``step``'s state, the same on every process (random: nothing compresses it)."""
  rng = np.random.default_rng(step)
  return {"w": rng.standard_normal((rows, cols), dtype=np.float32),
          "u": rng.standard_normal((cols // 4, rows), dtype=np.float32),
          "rep": rng.integers(0, 2**31, (7,), dtype=np.int32)}


class Job:
  """This process's view of the job: its options, state and barriers."""

  def __init__(self, a: argparse.Namespace) -> None:
    import jax  # pylint: disable=import-outside-toplevel
    from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel  (after join_job)
    self.a, self.jax = a, jax
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    self.shardings = {"w": NamedSharding(mesh, P("x")), "u": NamedSharding(mesh, P(None, "x")),
                      "rep": NamedSharding(mesh, P())}

  def options(self, *, agent: bool = True) -> Any:
    import jaxckpt as jc  # pylint: disable=import-outside-toplevel
    return jc.CheckpointOptions(
        handle_sigterm=False, timeout_secs=120.0, max_snapshots=2,
        persist_interval_steps=1 if self.a.directory else None,
        agent=jc.AgentOptions(job_name=self.a.job, run_root=self.a.run_root,
                              tcp_host=self.a.tcp_host) if agent else None,
        parity=jc.ParityOptions(group_size=4, parity=self.a.parity) if agent else None)

  def state(self, step: int) -> dict[str, Any]:
    vals = expected(step, self.a.rows, self.a.cols)
    out = {k: self.jax.make_array_from_callback(v.shape, self.shardings[k], lambda i, v=v: v[i])
           for k, v in vals.items()}
    return {**out, "data": {"position": step}}

  def target(self) -> dict[str, Any]:
    vals = expected(0, self.a.rows, self.a.cols)
    out = {k: self.jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.shardings[k])
           for k, v in vals.items()}
    return {**out, "data": {"position": 0}}

  def check(self, out: dict[str, Any], step: int) -> str:
    """"ok" if ``out`` is ``step``'s state bit for bit on this job's mesh, else what differs."""
    wrong = [k for k, sharding in self.shardings.items() if out[k].sharding != sharding]
    if wrong:
      return f"BAD:{wrong[0]}.sharding"
    return processes.differs(out, expected(step, self.a.rows, self.a.cols), {"position": step})

  def barrier(self, name: str) -> None:
    processes.barrier(name)

  def served(self) -> int:
    """Bytes this machine's agents of the job have sent other processes so far."""
    from jaxckpt.agent.commands import jobs  # pylint: disable=import-outside-toplevel
    st = jobs.job_status(self.a.run_root, self.a.job)
    return sum(a.served_bytes for a in st.agents if a.local)


def save(job: Job) -> None:
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  with jc.CheckpointManager(job.a.directory or None, job.options()) as mgr:
    for s in job.a.steps:
      assert mgr.save(s, job.state(s), force=True)
      mgr.wait_until_finished()
    mgr.wait_until_protected(job.a.steps[-1])
    say("SAVED", job.a.steps[-1])


def relaunch(job: Job) -> None:
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  mgr = jc.CheckpointManager(job.a.directory or None, job.options())
  target = job.target()
  say("STARTED")
  say("SERVED", job.served())
  for i in range(job.a.restores):       # (each timed from a barrier: no process waits for
    job.barrier(f"restore {i}")         # another's checks at the step's agreement)
    t0 = time.perf_counter()
    out = mgr.restore(target=target)
    secs = time.perf_counter() - t0
    r = mgr.last_restore
    say("RESTORED", r.step, r.tier, job.check(out, r.step), r.nbytes, f"{secs:.6f}")
    del out
  job.barrier("restored")
  say("SERVED", job.served())
  job.barrier("served")
  if job.a.storage_restores:
    with jc.CheckpointManager(job.a.directory, job.options(agent=False)) as direct:
      for i in range(job.a.storage_restores):
        job.barrier(f"storage restore {i}")
        t0 = time.perf_counter()
        out = direct.restore(step=mgr.last_restore.step, target=target)
        secs = time.perf_counter() - t0
        assert direct.last_restore.tier == "storage"
        say("STORAGE", direct.last_restore.step, job.check(out, direct.last_restore.step),
            f"{secs:.6f}")
        del out
  if job.a.save is not None:
    assert mgr.save(job.a.save, job.state(job.a.save), force=True)
    mgr.wait_until_finished()
    mgr.wait_until_protected(job.a.save)
    say("PROTECTED", job.a.save)
  mgr.close()


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser()
  processes.add_job_arguments(p)
  processes.add_machine_arguments(p)
  p.add_argument("--phase", required=True, choices=["save", "relaunch"])
  p.add_argument("--rows", type=int, default=48)
  p.add_argument("--cols", type=int, default=64)
  p.add_argument("--parity", type=int, default=1)
  p.add_argument("--steps", type=int, nargs="*", default=[1, 2])
  p.add_argument("--restores", type=int, default=1)
  p.add_argument("--storage-restores", type=int, default=0)
  p.add_argument("--save", type=int, default=None)
  a = p.parse_args(argv)
  processes.run_job(a, lambda: {"save": save, "relaunch": relaunch}[a.phase](Job(a)))
  return 0


if __name__ == "__main__":
  sys.exit(main())

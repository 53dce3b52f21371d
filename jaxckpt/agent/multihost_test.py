"""Multi-process jax.distributed jobs on loopback: every process killed and restarted."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal

import pytest

from jaxckpt.testing import processes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def machine(root: str, m: int) -> tuple[str, str]:
  """Machine ``m``'s own run root and loopback address (nothing shared between machines)."""
  return os.path.join(root, f"machine{m}"), f"127.0.1.{m + 1}"


@contextlib.contextmanager
def launch(n, root, job, mode, *extra, machines=None):
  """``n`` processes; process i runs on machine ``machines[i]`` (default i). Every one
  is killed (SIGKILL) on exit, as a lost trainer is; the agents live on."""
  port = processes.free_port()
  machines = list(range(n)) if machines is None else machines
  procs = []
  try:
    for i in range(n):
      run_root, address = machine(root, machines[i])
      procs.append(processes.Proc(
          ["-m", "tests.support.multihost_worker", "--port", str(port), "--num-processes", str(n),
           "--process-id", str(i), "--run-root", run_root, "--tcp-host", address, "--job", job,
           "--mode", mode, *extra], cwd=REPO))
    yield procs
  finally:
    for p in procs:
      p.__exit__(None, None, None)


def run_job(n_save, n_restore, *restore_extra, machines=None, save_machines=None):
  with processes.agent_sandbox() as (root, job):
    with launch(n_save, root, job, "save", machines=save_machines) as savers:
      for p in savers:
        p.wait_for("SAVED [2, 3]", 400)
    assert len(processes.agent_pids(root)) == n_save      # the agents live on
    with launch(n_restore, root, job, "restore", *restore_extra, machines=machines) as restorers:
      for p in restorers:
        assert "OK 3 host" in p.finish(400)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_processes_killed_and_restarted():
  run_job(2, 2)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_four_processes_restart_with_another_device_mapping():
  run_job(4, 4, "--permute")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_processes_restarted_on_each_others_machines_find_every_agent_through_the_job():
  # Process 0 restarts on machine 1 and process 1 on machine 0: each finds the other
  # machine's agents only through jax.distributed's key-value store.
  run_job(2, 2, machines=[1, 0])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fewer_processes_read_pieces_from_every_agent():
  # Four processes on two machines (two agents in each private run root), restarted as one
  # process per machine: each reads the other machine's two agents through the job.
  run_job(4, 2, save_machines=[0, 0, 1, 1], machines=[0, 1])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_lost_machine_is_rebuilt_from_parity_exchanged_between_private_run_roots():
  with processes.agent_sandbox() as (root, job):
    with launch(4, root, job, "save", "--parity", "1") as savers:
      for p in savers:
        p.wait_for("PROTECTED 3", 400)
    lost_root, _ = machine(root, 2)                # machine 2 is gone: its agent and memory
    for pid in processes.agent_pids(lost_root):
      os.kill(pid, signal.SIGKILL)
      processes.wait_gone(pid, 10, "the agent of machine 2")
    shutil.rmtree(lost_root)
    with launch(4, root, job, "restore", "--parity", "1") as restorers:
      for p in restorers:
        assert "OK 3 parity" in p.finish(400)


def _loop_then_lose_a_host(root, job, *extra):
  """Four processes run the loop (default options, parity m=1, storage): each takes
  the same steps; machine 2 is then lost, and the relaunched job restores the
  newest step every host took, rebuilt from parity."""
  with launch(4, root, job, "loop", "--parity", "1", *extra) as loopers:
    taken = {p.wait_for("STEPS", 400).split("STEPS", 1)[1].strip() for p in loopers}
    assert len(taken) == 1, f"the processes took different steps: {taken}"
    steps = [int(s) for s in taken.pop().strip("[]").split(",")]
    for p in loopers:
      p.wait_for(f"PROTECTED {steps[-1]}", 400)
  lost_root, _ = machine(root, 2)
  for pid in processes.agent_pids(lost_root):
    os.kill(pid, signal.SIGKILL)
    processes.wait_gone(pid, 10, "the agent of machine 2")
  shutil.rmtree(lost_root)
  with launch(4, root, job, "restore", "--parity", "1", *extra) as restorers:
    for p in restorers:
      assert f"OK {steps[-1]} parity" in p.finish(400)
  return steps


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("storage", ["every 5 steps", "none"])
def test_every_process_takes_the_same_steps_and_a_lost_host_restores_the_newest(storage):
  # The job: copies (a 48 MiB ballast per process) slower than the loop, which calls
  # save() every step without waiting; storage every 5 steps, or the defaults (no storage).
  with processes.agent_sandbox() as (root, job):
    extra = (["--directory", os.path.join(root, "storage"), "--persist-interval", "5"]
             if storage != "none" else [])
    steps = _loop_then_lose_a_host(root, job, "--steps", "20", "--ballast-mib", "48", *extra)
    if storage != "none":
      assert {5, 10} <= set(steps)            # due for storage: never skipped

"""Multi-process jobs on loopback under faults: a lost process 0,
deletes far apart, a process that never wrote its part, a damaged newest step
(:mod:`tests.support.job_worker` runs each process's side)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import uuid

import pytest

from jaxckpt.testing import processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def machine(root: str, m: int) -> tuple[str, str]:
  """Machine ``m``'s own run root and loopback address (nothing shared between machines)."""
  return os.path.join(root, f"machine{m}"), f"127.0.1.{m + 1}"


@contextlib.contextmanager
def launch(n: int, root: str, job: str, scenario: str, directory: str = "", variant: str = "",
           *, stdin: bool = False):
  """``n`` processes of one job running ``scenario`` (``stdin``: the test writes to
  theirs); each is killed on exit."""
  port = processes.free_port()
  procs = []
  try:
    for i in range(n):
      run_root, address = machine(root, i)
      procs.append(processes.Proc(
          ["-m", "tests.support.job_worker", "--port", str(port), "--num-processes", str(n),
           "--process-id", str(i), "--run-root", run_root, "--tcp-host", address, "--job", job,
           "--directory", directory, "--scenario", scenario, "--variant", variant], cwd=REPO,
          stdin=stdin))
    yield procs
  finally:
    for p in procs:
      p.__exit__(None, None, None)


def finish(procs, timeout: float = 300) -> list[str]:
  """Every process's output once it printed DONE (an ERROR line fails the test)."""
  outs = []
  for i, p in enumerate(procs):
    try:
      outs.append(p.finish(timeout))
    except (TimeoutError, RuntimeError) as e:
      for q in procs:
        q.kill()
      raise AssertionError(f"process {i}: {e}\n" + "\n".join(
          f"--- process {j}:\n" + q.p.stdout.read()[-3000:] for j, q in enumerate(procs)
          if j != i)) from None
  for i, out in enumerate(outs):
    assert "DONE" in out and not lines(out, "ERROR"), f"process {i}:\n{out[-4000:]}"
  return outs


def wait_all(procs, needle: str, timeout: float = 300) -> None:
  """Waits for every process to print ``needle``; on failure, every one's output."""
  try:
    for p in procs:
      p.wait_for(needle, timeout)
  except TimeoutError:
    for p in procs:
      p.kill()
    raise AssertionError("\n".join(
        f"--- process {i}:\n" + "".join(p.lines)[-3000:] + p.p.stdout.read()[-3000:]
        for i, p in enumerate(procs))) from None


def lines(out: str, word: str) -> list[str]:
  return [ln[len(word) + 1:] for ln in out.splitlines() if ln.startswith(word + " ")]


def lose_machine(root: str, job: str, m: int) -> None:
  """SIGKILLs machine ``m``'s agent (by pid: it is ours) and removes its run root."""
  run_root, _ = machine(root, m)
  for pid in processes.agent_pids(run_root):
    os.kill(pid, signal.SIGKILL)
    processes.wait_gone(pid, 30, f"the agent of machine {m}")
  shutil.rmtree(run_root)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("lost, stored", [(0, True), (1, False)])
def test_a_job_comes_back_after_losing_any_host_with_default_options(tmp_path, lost, stored):
  # The job's secret was process 0's; losing host 0 with its run root must not stop
  # every relaunch. The replaced host describes and restores (a Composite)
  # a step that only the survivors' parity holds for it (no storage to fall back on).
  directory = str(tmp_path / "ckpt") if stored else ""
  with processes.agent_sandbox("jl") as (root, job):
    with launch(2, root, job, "save_protected", directory) as procs:
      wait_all(procs, "PROTECTED 3")
    lose_machine(root, job, lost)
    with launch(2, root, job, "relaunch_after_loss", directory) as procs:
      outs = finish(procs)
    for i, out in enumerate(outs):
      meta, = lines(out, "METADATA")
      assert meta.split()[:2] == ["3", "parity" if i == lost else "host"], (i, meta)
      assert lines(out, "COMPOSITE") == ["3 parity ok"], (i, out[-3000:])
    # the survivors' secret was kept: the lost host's new run root holds the same one
    secrets = {open(os.path.join(machine(root, m)[0], job, "secret")).read() for m in (0, 1)}
    assert len(secrets) == 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_delete_is_final_on_every_process_whatever_the_order_and_gap(tmp_path):
  # Step 2 is due for storage and protected by parity; process 0 deletes it, and
  # process 1 two seconds later; step 4 the other way round. A peer's cancelled persist
  # never stops a delete, and no tier of any process holds the step after the first.
  directory = str(tmp_path / "ckpt")
  with processes.agent_sandbox("jd") as (root, job):
    with launch(2, root, job, "deletes_far_apart", directory) as procs:
      outs = finish(procs)
  text = "\n".join(outs)
  for step, older in ((2, 1), (4, 3)):
    first, = [ln for ln in lines(text, "FIRST_DELETED") if ln.startswith(f"{step} ")]
    seen, = [ln for ln in lines(text, "SEEN_BEFORE_MINE") if ln.startswith(f"{step} ")]
    assert str(step) not in re.findall(r"\d+", first.split("STEPS")[1]), first
    assert str(step) not in re.findall(r"\d+", seen.split("STEPS")[1]), seen
    assert f"{step}" in lines(text, "SECOND_DELETED"), text[-4000:]
    for out in outs:
      after, = [ln for ln in lines(out, "AFTER") if ln.startswith(f"{step} ")]
      assert str(step) not in re.findall(r"\d+", after.split(" ", 1)[1]), after
      restored, = [ln for ln in lines(out, "RESTORED") if ln.startswith(f"{step} ")]
      assert restored.split()[1] == str(older) and restored.endswith(" ok"), restored


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", ["in-process", "agent"])
def test_a_wait_that_times_out_names_the_process_whose_part_is_missing(tmp_path, variant):
  # Process 1 died before writing its part of step 1.
  with processes.agent_sandbox("jw") as (root, job):
    with launch(2, root, job, "wait_blame", str(tmp_path / "ckpt"), variant) as procs:
      out = procs[0].finish(200)
  said, = lines(out, "TIMEOUT")
  assert "processes [1] of 2" in said and "did not write their part" in said, said
  assert "of process 0 did not persist" not in said, said


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_damaged_newest_step_is_skipped_by_every_process_alike(tmp_path):
  # Only process 1 reads the damaged chunk of step 70; both restore step 60,
  # and an explicit restore of step 70 still raises.
  with processes.agent_sandbox("jc") as (root, job):
    with launch(2, root, job, "damaged_newest", str(tmp_path / "ckpt")) as procs:
      outs = finish(procs)
  for out in outs:
    assert lines(out, "RESTORED") == ["60 storage ok SKIPPED [70]"], out[-3000:]
    assert lines(out, "EXPLICIT_RAISED") == ["CorruptSnapshotError"], out[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_step_whose_snapshot_died_before_its_persist_is_not_listed_and_the_new_agent_serves(
    tmp_path, s3_server):
  # The soak's killed agent (seed 0, step 5): process 1's agent dies after committing a
  # step due for storage, before its part is written (storage stopped answering) and
  # with no parity: nothing can restore that step. Process 0's own persist of it still
  # waits for process 1's part, yet it must not list it (it listed it as on its way to
  # storage, and latest_step() named it); and every process reaches process 1's new
  # agent (process 0 kept asking the dead one, waiting out each request, and never saw
  # step 2 held whole).
  del tmp_path
  directory = s3_server.url("killed-" + uuid.uuid4().hex[:8])
  with processes.agent_sandbox("jk") as (root, job):
    with launch(2, root, job, "agent_killed_while_persisting", directory, stdin=True) as procs:
      wait_all(procs, "READY")
      with s3_server.paused():
        for p in procs:
          p.send("GO")
        wait_all(procs, "SAVED 1")
        pid, = processes.agent_pids(machine(root, 1)[0])
        os.kill(pid, signal.SIGKILL)
        processes.wait_gone(pid, 30, "process 1's agent")
      for p in procs:
        p.send("NEXT")
      outs = finish(procs)
  for i, out in enumerate(outs):
    assert lines(out, "STEPS") == ["2 LATEST 2"], (i, out[-4000:])
    assert lines(out, "RESTORED") == ["2 host ok"], (i, out[-4000:])
  told, = lines(outs[1], "TOLD")
  assert "persisting step 1 " in told and "died before step 1 was on storage" in told, told

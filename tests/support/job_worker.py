"""One process of a small ``jax.distributed`` job on loopback that runs one named
scenario (the multi-process tests of issue 32: a lost process 0, deletes far
apart, a wait's blame, a damaged newest step).

  python -m tests.support.job_worker --port P --num-processes N --process-id I \
      --run-root R --tcp-host 127.0.1.M --job J --directory D --scenario NAME

Each process is a "machine" of its own (its own run root and loopback address,
so its own snapshot agent). It prints one line per finding (``SAY ...``),
``DONE`` at the end, or ``ERROR type: message`` (then it exits 3); the test
reads them. The state is a ``(rows, 6)`` float32 sharded over every device of
the job, a replicated leaf and a non-array one, all a function of the step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable

import numpy as np

from jaxckpt.testing import processes

SCENARIOS: dict[str, Callable[..., None]] = {}


def scenario(fn: Callable[..., None]) -> Callable[..., None]:
  SCENARIOS[fn.__name__] = fn
  return fn


def say(*words: object) -> None:
  print(*words, flush=True)


def expected(step: int) -> dict[str, np.ndarray]:
  w = np.arange(16 * 6, dtype=np.float32).reshape(16, 6) + 1000 * step
  return {"w": w, "rep": np.full((5,), step, np.int32)}


class Job:
  """This process's view of the job: its options, state and barriers."""

  def __init__(self, a: argparse.Namespace) -> None:
    import jax  # pylint: disable=import-outside-toplevel
    from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
    self.a, self.jax = a, jax
    self.me, self.n = jax.process_index(), jax.process_count()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    self.shardings = {"w": NamedSharding(mesh, P("x")), "rep": NamedSharding(mesh, P())}

  def options(self, **kw: Any) -> Any:
    import jaxckpt as jc  # pylint: disable=import-outside-toplevel
    agent = kw.pop("agent", True)
    parity = kw.pop("parity", True)
    return jc.CheckpointOptions(
        handle_sigterm=False, timeout_secs=kw.pop("timeout_secs", 60.0),
        agent=jc.AgentOptions(job_name=self.a.job, run_root=self.a.run_root,
                              tcp_host=self.a.tcp_host) if agent else None,
        parity=jc.ParityOptions(group_size=self.n, parity=1) if parity and agent else None,
        **kw)

  def state(self, step: int) -> dict[str, Any]:
    vals = expected(step)
    out = {k: self.jax.make_array_from_callback(v.shape, self.shardings[k], lambda i, v=v: v[i])
           for k, v in vals.items()}
    return {**out, "data": {"position": step}}

  def check(self, out: dict[str, Any], step: int) -> str:
    """"ok" if ``out`` is ``step``'s state bit for bit, else what differs."""
    return processes.differs(out, expected(step), {"position": step})

  def barrier(self, name: str) -> None:
    processes.barrier(name)


# -- scenarios ------------------------------------------------------------------------------

@scenario
def wait_blame(job: Job) -> None:
  """Process 1 never writes its part of step 1 (it died before): process 0's
  wait_until_finished times out naming process 1."""
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  agent = job.a.variant == "agent"
  mgr = jc.CheckpointManager(job.a.directory, job.options(agent=agent, parity=False,
                                                         persist_interval_steps=1))
  if job.me == 0:
    assert mgr.save(1, job.state(1))
    try:
      mgr.wait_until_finished(timeout_secs=6)
      say("NO_TIMEOUT")
    except jc.errors.SnapshotTimeoutError as e:
      say("TIMEOUT", str(e).replace("\n", " "))
  job.barrier("blamed")
  os._exit(0)                 # (process 0's persist still waits for the part: no close)


@scenario
def deletes_far_apart(job: Job) -> None:
  """Step 2 (due for storage, protected by parity) deleted by process 0, then by
  process 1 seconds later; step 4 the other way round. After each first delete
  and after both, what every process can list and restore."""
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  mgr = jc.CheckpointManager(job.a.directory, job.options(persist_interval_steps=2))
  target = job.state(0)
  for first, (older, step) in ((0, (1, 2)), (1, (3, 4))):
    for s in (older, step):
      assert mgr.save(s, job.state(s))
    if job.me == first:
      mgr.wait_until_finished()         # committed on storage; the other may still wait for it
    mgr.wait_until_snapshotted()
    mgr.wait_until_protected(step)
    job.barrier(f"saved{step}")
    if job.me == first:
      mgr.delete(step)
      say("FIRST_DELETED", step, "STEPS", mgr.all_steps())
    job.barrier(f"first{step}")
    if job.me != first:
      time.sleep(2.0)
      say("SEEN_BEFORE_MINE", step, "STEPS", mgr.all_steps())
      try:
        mgr.delete(step)
        say("SECOND_DELETED", step)
      except Exception as e:  # pylint: disable=broad-except
        say("SECOND_DELETE_FAILED", step, f"{type(e).__name__}: {e}".replace("\n", " "))
    job.barrier(f"second{step}")
    time.sleep(0.5)
    say("AFTER", step, "STEPS", mgr.all_steps(), "STORED", jc.universal.all_steps(job.a.directory))
    out = mgr.restore(target=target)
    say("RESTORED", step, mgr.last_restore.step, mgr.last_restore.tier,
        job.check(out, mgr.last_restore.step))
  mgr.close()


@scenario
def save_protected(job: Job) -> None:
  """Saves steps 1-3 (a Composite), waits until step 3 is protected, then holds:
  the test loses a machine, and ``relaunch_after_loss`` goes on."""
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  mgr = jc.CheckpointManager(job.a.directory or None, job.options())
  for s in (1, 2, 3):
    assert mgr.save(s, args=ocp.args.Composite(state=ocp.args.StandardSave(job.state(s))))
    mgr.wait_until_finished()
  mgr.wait_until_protected(3)
  say("PROTECTED", 3)
  time.sleep(3600)


@scenario
def relaunch_after_loss(job: Job) -> None:
  """After a machine was lost: the job starts with default options, every process
  describes step 3 and restores it (a Composite, then the plain tree) bit for bit."""
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  mgr = jc.CheckpointManager(job.a.directory or None, job.options())
  say("STARTED")
  meta = mgr.metadata(3)
  say("METADATA", meta.step, meta.tier, sorted(meta.tree["state"]))
  out = mgr.restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore(job.state(0))))
  say("COMPOSITE", mgr.last_restore.step, mgr.last_restore.tier, job.check(out["state"], 3))
  mgr.close()


@scenario
def damaged_newest(job: Job) -> None:
  """Steps 60 and 70 on storage; one chunk of step 70 that only process 1 reads is
  damaged. A new manager's restore(None) takes step 60 on every process and
  says it skipped 70; restore(step=70) still raises."""
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  from jaxckpt.testing import damage  # pylint: disable=import-outside-toplevel
  opts = job.options(agent=False, persist_interval_steps=10)
  with jc.CheckpointManager(job.a.directory, opts) as mgr:
    for s in (60, 70):
      assert mgr.save(s, job.state(s))
      mgr.wait_until_finished()
  job.barrier("stored")
  if job.me == 0:                           # a row only process 1 reads
    damage.flip_stored_byte(job.a.directory, 70, "['w']", (12, 0))
  job.barrier("damaged")
  with jc.CheckpointManager(job.a.directory, opts) as mgr:
    out = mgr.restore(target=job.state(0))
    r = mgr.last_restore
    say("RESTORED", r.step, r.tier, job.check(out, r.step), "SKIPPED",
        [s for s, _ in r.skipped])
    try:
      mgr.restore(step=70, target=job.state(0))
      say("EXPLICIT_OK")
    except jc.errors.CorruptSnapshotError as e:
      say("EXPLICIT_RAISED", type(e).__name__)


@scenario
def late_commit(job: Job) -> None:
  """Process 0 saves step 1 five seconds after process 1: process 1's
  wait_until_finished returns only once the step is committed on storage."""
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  mgr = jc.CheckpointManager(job.a.directory, job.options(
      agent=job.a.variant == "agent", parity=False, persist_interval_steps=1, on_busy="wait"))
  if job.me == 0:
    time.sleep(5.0)
  assert mgr.save(1, job.state(1))
  t0 = time.monotonic()
  mgr.wait_until_finished()
  say("WAITED", job.me, round(time.monotonic() - t0, 2), "COMMITTED",
      1 in jc.universal.all_steps(job.a.directory))
  mgr.close()


@scenario
def options_differ(job: Job) -> None:
  """Process 1 was given other options (``--variant`` NAME=VALUE): every process is
  refused at construction, naming the option, both values and the processes."""
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  name, value = job.a.variant.split("=")
  kw = {name: int(value)} if job.me == 1 else {}
  try:
    jc.CheckpointManager(job.a.directory or None, job.options(agent=False, **kw)).close()
    say("ACCEPTED")
  except jc.errors.InvalidArgumentError as e:
    say("REFUSED", str(e).replace("\n", " "))


@scenario
def deleted_elsewhere(job: Job) -> None:
  """Steps 1 and 2 stored; process 0's machine runs ``jaxckpt delete DIR --step 1`` (as the
  guide has it: beside a running job, through its agents); then step 3 is saved and
  every process waits for it (WAITED, or TIMEOUT with the message)."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  mgr = jc.CheckpointManager(job.a.directory, job.options(parity=False, persist_interval_steps=1,
                                                         on_busy="wait", timeout_secs=15))
  for s in (1, 2):
    assert mgr.save(s, job.state(s))
  mgr.wait_until_finished()
  job.barrier("stored")
  if job.me == 0:
    done = subprocess.run([sys.executable, "-m", "jaxckpt", "delete", job.a.directory,
                           "--step", "1", "--run-root", job.a.run_root, "--job-name", job.a.job],
                          capture_output=True, text=True, check=False, timeout=120)
    say("CLI", done.returncode, (done.stdout + done.stderr).replace("\n", " ")[-300:])
  job.barrier("deleted")
  assert mgr.save(3, job.state(3))
  for what, call in (("WAITED", mgr.wait_until_finished), ("CLOSED", mgr.close)):
    try:
      call()
      say(what, jc.universal.all_steps(job.a.directory))
    except jc.errors.SnapshotTimeoutError as e:
      say("TIMEOUT", str(e).replace("\n", " "))
  job.barrier("closed")


@scenario
def agent_killed_while_persisting(job: Job) -> None:
  """Step 1 is saved for storage while storage does not answer (the test stops it,
  then says GO on stdin); the test SIGKILLs process 1's agent (then says NEXT): no
  tier holds step 1 any more, and process 1's part of it was never written. Process
  1's save of step 2 starts a new agent. Every process then lists its steps
  (STEPS), restores the newest (RESTORED) and says how process 1 heard of its loss
  (TOLD); process 0's persist of step 1 still waits for process 1's part."""
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  mgr = jc.CheckpointManager(job.a.directory, job.options(parity=False, persist_interval_steps=1))
  say("READY")
  sys.stdin.readline()                     # GO: storage stopped answering
  assert mgr.save(1, job.state(1))
  mgr.wait_until_snapshotted()
  say("SAVED", 1)
  sys.stdin.readline()                     # NEXT: process 1's agent is gone
  told: list[str] = []
  deadline = time.monotonic() + 60
  # Process 1 hears of its lost step 1 from one of these calls (a save that raised an
  # earlier step's failure did not start: it is called again); it asks until it has.
  for call in (lambda: mgr.save(2, job.state(2)), mgr.wait_until_snapshotted,
               *[mgr.check_for_errors] * (job.me == 1)):
    while True:
      try:
        call()
      except jc.errors.AgentUnavailableError as e:
        told.append(str(e))
        if time.monotonic() > deadline:
          raise
        continue
      if call is not mgr.check_for_errors or told or time.monotonic() > deadline:
        break
      time.sleep(0.05)
  job.barrier("saved2")
  say("STEPS", ",".join(map(str, mgr.all_steps())) or "-", "LATEST", mgr.latest_step())
  out = mgr.restore(target=job.state(0))
  say("RESTORED", mgr.last_restore.step, mgr.last_restore.tier, job.check(out, mgr.last_restore.step))
  say("TOLD", " | ".join(told).replace("\n", " ") or "-")
  job.barrier("looked")
  say("DONE")
  os._exit(0)                 # (process 0's persist of step 1 still waits: no close)


@scenario
def ahead_when_killed(job: Job) -> None:
  """Steps 1-4 on every process (``--variant parity``: step 4 protected), then the
  processes drift as a job's do between two collectives: process 0 commits 5, 6 and 7,
  processes 1 and 2 commit 5 and 6, the last process 5 only (its copy of 6 was still
  running). Says HELD, then waits to be SIGKILLed (the test kills them all, as a
  scheduler stops the job; the agents stay)."""
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  mgr = jc.CheckpointManager(None, job.options(parity=job.a.variant == "parity",
                                               on_busy="wait"))
  for s in range(1, 5):
    assert mgr.save(s, job.state(s))
    mgr.wait_until_snapshotted()
  if job.a.variant == "parity":
    mgr.wait_until_protected(4)
  job.barrier("four")
  last = 7 if job.me == 0 else 5 if job.me == job.n - 1 else 6
  for s in range(5, last + 1):
    assert mgr.save(s, job.state(s))
    mgr.wait_until_snapshotted()
  job.barrier("drifted")
  say("HELD", last)
  time.sleep(3600)


@scenario
def relaunched(job: Job) -> None:
  """A relaunch of the job: every process restores the newest step the job holds
  (RESTORED step tier check), or says NOTHING if it lists none."""
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  with jc.CheckpointManager(None, job.options(parity=job.a.variant == "parity",
                                              on_busy="wait")) as mgr:
    if mgr.latest_step() is None:
      say("NOTHING")
      return
    out = mgr.restore(target=job.state(0))
    r = mgr.last_restore
    say("RESTORED", r.step, r.tier, job.check(out, r.step))


@scenario
def last_saves(job: Job) -> None:
  """A loop much faster than its copies saves every step to 10, then waits
  (wait_until_finished, wait_until_protected): NEWEST, the stats and the WARNING lines
  said. Then steps 11-20, the last with force=True: FORCED NEWEST."""
  import logging  # pylint: disable=import-outside-toplevel
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  warned: list[str] = []

  class Catch(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
      if record.levelno >= logging.WARNING:
        warned.append(record.getMessage().replace("\n", " "))
  logging.getLogger("jaxckpt").addHandler(Catch())
  full = np.ones((job.n * 512, 4096), np.float32)    # 8 MiB a process: copies take ms
  big = job.jax.make_array_from_callback(full.shape, job.shardings["w"], lambda i: full[i])
  with jc.CheckpointManager(None, job.options()) as mgr:
    for s in range(1, 11):
      mgr.save(s, {"w": big, "step": s})
    mgr.wait_until_finished()
    mgr.wait_until_protected()
    st = mgr.stats
    say("NEWEST", mgr.latest_step(), "SKIPPED_PLAN", st.skipped_plan, "REASONS",
        sum(st.skip_reasons.values()))
    for w in warned:
      say("WARNED", w)
    for s in range(11, 21):
      mgr.save(s, {"w": big, "step": s}, force=s == 20)
    mgr.wait_until_finished()
    mgr.wait_until_protected()
    say("FORCED", mgr.latest_step(), "PROTECTED", mgr.protected_steps()[-1:])


def _every(n: int) -> Callable[[int], bool]:
  """A save policy that a per-host configuration file parametrizes (a closure: its
  name is the same whatever ``n`` is)."""
  def should_save(step: int) -> bool:
    return step % n == 0
  return should_save


def _option(name: str, value: str) -> Any:
  """``--variant`` values as the option takes them (``int`` for the plain ones)."""
  import datetime  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  n = int(value)
  policies = ocp.checkpoint_managers
  return {"keep_time_interval": lambda: datetime.timedelta(hours=n),
          "should_save_fn": lambda: _every(n),
          "preservation_policy": lambda: policies.AnyPreservationPolicy([policies.LatestN(n)]),
          }.get(name, lambda: n)()


@scenario
def options_differ_in_value(job: Job) -> None:
  """For each NAME=V0,V1 of ``--variant`` (separated by ``;``) a manager whose process
  ``i`` is given option NAME's ``i``-th value: each is refused at construction on every
  process, naming the option (REFUSED), or ACCEPTED."""
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  for item in job.a.variant.split(";"):
    name, values = item.split("=")
    kw = {name: _option(name, values.split(",")[job.me])}
    try:
      jc.CheckpointManager(job.a.directory or None, job.options(agent=False, **kw)).close()
      say("ACCEPTED", name)
    except jc.errors.InvalidArgumentError as e:
      say("REFUSED", str(e).replace("\n", " "))


class Every:
  """A per-host configuration object's save schedule (``should_save_fn=Every(n).due``:
  one bound method whatever ``n`` is)."""

  def __init__(self, n: int) -> None:
    self.n = n

  def due(self, step: int, latest: int | None) -> bool:
    del latest
    return step % self.n == 0


SAVE_EVERY = 1           # a per-host setting a module function reads (set per process)


def due_by_setting(step: int, latest: int | None) -> bool:
  del latest
  return step % SAVE_EVERY == 0


@scenario
def schedules_differ(job: Job) -> None:
  """Process 0 saves every 2 steps, process 1 every 3 (``--variant``: ``bound``, a
  per-host ``Every(n).due``; ``global``, a module function reading a per-host
  setting; ``forced``, both every 2 steps, and process 0 alone saves step 3 with
  ``force=True``, not asking should_save: its DECIDED says ``3:-1``): each process says
  what should_save and save answer for steps 1-8 (DECIDED), what the job then holds
  (STEPS), and the warnings it logged (WARNED); or REFUSED at construction."""
  import logging  # pylint: disable=import-outside-toplevel
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  global SAVE_EVERY  # pylint: disable=global-statement
  n = 2 if job.a.variant == "forced" else (2, 3)[job.me]
  SAVE_EVERY = n
  fn = Every(n).due if job.a.variant == "bound" else due_by_setting
  warned: list[str] = []

  class Catch(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
      if record.levelno >= logging.WARNING and "should_save_fn" in record.getMessage():
        warned.append(record.getMessage())
  logging.getLogger("jaxckpt").addHandler(Catch())
  try:
    mgr = jc.CheckpointManager(job.a.directory, job.options(
        parity=False, max_snapshots=8, persist_interval_steps=100, on_busy="wait",
        should_save_fn=fn))
  except jc.errors.InvalidArgumentError as e:
    say("REFUSED", str(e).replace("\n", " "))
    say("DONE")
    return
  decided = []
  for s in range(1, 9):
    if job.a.variant == "forced" and job.me == 0 and s == 3:
      decided.append(f"{s}:-{int(mgr.save(s, job.state(s), force=True))}")
      continue
    asked = mgr.should_save(s)
    decided.append(f"{s}:{int(asked)}{int(mgr.save(s, job.state(s)))}")
  mgr.wait_until_snapshotted()
  job.barrier("saved")
  say("DECIDED", " ".join(decided))
  say("STEPS", mgr.all_steps())
  for w in warned:
    say("WARNED", w.replace("\n", " "))
  job.barrier("looked")
  mgr.close()
  say("DONE")


@scenario
def rollback_killed(job: Job) -> None:
  """The guide's rollback on every process (21-30 saved with parity, 30 persisted,
  ``restore(25)``, then 26-28): each process SIGKILLs itself at the K-th crash point of
  the rollback (``--variant K``, :mod:`jaxckpt.util._crash`); DONE if it passed them all."""
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  os.environ["JAXCKPT_CRASH_AT"] = f"rollback:{job.a.variant}"
  mgr = jc.CheckpointManager(job.a.directory, job.options(
      max_snapshots=10, persist_interval_steps=10, on_busy="wait"))
  for s in range(21, 31):
    assert mgr.save(s, job.state(s))
  mgr.wait_until_finished()
  mgr.wait_until_protected(30)
  out = mgr.restore(25, target=job.state(0))
  say("RESTORED", mgr.last_restore.step, job.check(out, 25))
  job.barrier("restored")
  for s in (26, 27, 28):
    assert mgr.save(s, job.state(s))
  mgr.wait_until_finished()
  job.barrier("rolled")
  mgr.close()
  say("DONE")


@scenario
def after_rollback(job: Job) -> None:
  """The relaunch of ``rollback_killed``: every process lists (STEPS, STORED) and
  restores the newest step (RESTORED step tier check)."""
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  mgr = jc.CheckpointManager(job.a.directory, job.options(
      max_snapshots=10, persist_interval_steps=10, on_busy="wait"))
  say("STEPS", mgr.all_steps())
  say("STORED", jc.universal.all_steps(job.a.directory))
  out = mgr.restore(target=job.state(0))
  r = mgr.last_restore
  say("RESTORED", r.step, r.tier, job.check(out, r.step))
  job.barrier("looked")
  mgr.close()
  say("DONE")


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser()
  processes.add_job_arguments(p)
  processes.add_machine_arguments(p)
  p.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
  p.add_argument("--variant", default="")
  a = p.parse_args(argv)
  processes.run_job(a, lambda: SCENARIOS[a.scenario](Job(a)))
  return 0


if __name__ == "__main__":
  sys.exit(main())

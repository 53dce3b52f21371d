"""The chaos soak: a 4-process job under a seeded schedule of faults, every restore checked.

A job of four processes (``jax.distributed`` on CPU, :mod:`tests.support.soak_worker`),
each on a "machine" of its own (its own run root and loopback address
127.0.1.N, so its own snapshot agent), parity m=1 over the four, saving every
step and persisting every 5th to a real SeaweedFS, runs to a fixed step while
faults are injected one at a time:

- ``kill_trainer``: SIGKILL one trainer. The others hang in the next
  collective (MEASURED.md), so the job is restarted: every trainer killed, the
  agents kept, all relaunched.
- ``kill_agent``: SIGKILL one agent. The trainers go on (the next save of that
  host starts a new agent); a few steps later the job is killed and relaunched.
- ``lose_host``: SIGKILL one machine's trainer and agent and remove its run
  root (its shared memory, the job's secret with it); the job is relaunched with
  an empty machine there. The lost machines go round from machine 0 (process 0's,
  which the short form loses), and a long run loses every machine at least once.
- ``s3_pause``: SIGSTOP the S3 server for 20-30 s (less in the short form)
  while the job runs, then SIGCONT.
- ``s3_errors``: for 6-9 s (20-30 s in a long run) storage answers a share of the
  requests itself (:mod:`tests.support.faulty_s3`, the proxy every request of the
  soak goes through): every 3rd PUT ``503 SlowDown``, every 4th GET ``500``, every
  7th PUT a connection reset. The job goes on; its persists are retried.
- ``delete``: every trainer stops at the next step due for storage and deletes it
  after its snapshot, each at another time (seeded delays of 0-3 s, in a seeded
  order: a peer's persist may wait for a commit that process 0's delete
  cancelled), closes and exits; no trainer may see the step after its own delete,
  nor the relaunched job ever (counted as *resurrected*).
- ``restart``: every trainer stops after the same step, closes and exits; the
  job is relaunched.
- ``second_manager``, ``damage_newest``, ``impossible_newest``, ``truncate_slots``,
  ``dead_claim`` and ``stray_tcp``: see :mod:`tests.support.soak_faults` (a
  second manager beside a running one must be refused; a damaged or impossible
  newest step on storage must be skipped by the relaunch's restore; truncated slot
  files are damage, never SIGBUS; a killed writer's claim lapses; a trainer's
  requests over tcp are refused).

Each relaunch restores the newest step, and each trainer compares every shard it
restored with the reference (:class:`soak_worker.Reference`, the same seed)
bit for bit. At the end every step on storage is read back and compared too, and
every step due for storage whose save returned True and whose snapshot committed
on every host (a *version*: the incarnation of the job that saved it, and the
step) is accounted for. Right after every fault that can destroy a snapshot
(a relaunch's restore, or a killed agent's replacement) every trainer says what
any tier could restore (``mgr.all_steps()``: held on every host, rebuildable from
parity, or stored). A version is *deleted*; *destroyed by a fault* when the first
such look after it, right after a killed agent or a lost host, found no tier
holding it (every copy went before it was persisted); *persisted* when its step
is on storage at the end; else *lost*: it could still be restored after the
fault (or no fault that destroys snapshots came before the look that missed it),
yet it never reached storage. Every trainer and the nemesis also record their history
(:mod:`jaxckpt.testing.history`, in the log directory's ``history/``), and at the end
:mod:`tests.support.checker` holds it to the model of docs/reliability.md: the
result's ``history`` gives, per fault kind, its count, the steps lost and the
recovery seconds (median, max), and every violation. Only
processes this module started (the trainers, and the agents they spawned under
this soak's run root) are ever killed, by pid, and everything is cleaned up when
the soak fails too.

>>> result = run(steps=SHORT_STEPS, seed=0, short=True)      # doctest: +SKIP
>>> result["due_steps"]["lost"], result["wrong_restores"], result["resurrected"]   # doctest: +SKIP
(0, 0, 0)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import random
import shutil
import signal
import tempfile
import time
import uuid
from typing import Any

import psutil

from jaxckpt.testing import history, processes
from tests.support import checker, faulty_s3, soak_faults
from tests.support.soak_job import (HOSTS, PERSIST_INTERVAL, Job, SoakError, TrainerDied,
                                    _endpoint)
from tests.support.soak_worker import Reference

KINDS = ("kill_trainer", "kill_agent", "lose_host", "s3_pause", "s3_errors", "delete", "restart",
         "second_manager", "damage_newest", "impossible_newest", "truncate_slots",
         "dead_claim", "stray_tcp")
# The faults that can destroy a committed snapshot: the others leave every agent alive.
DESTRUCTIVE = ("kill_agent", "lose_host", "damage_newest", "impossible_newest",
               "truncate_slots")
# The faults after which the job goes on without a relaunch.
IN_PLACE = ("s3_pause", "s3_errors", "kill_agent", "second_manager", "dead_claim", "stray_tcp")
SHORT_STEPS = 125           # the short form's length (CI; benchmarks/soak.py --quick): 13 kinds


@dataclasses.dataclass
class Fault:
  kind: str
  host: int
  gap: int                  # steps every trainer has gone past since the last recovery
  lead: int                 # the trainers run on at most this many steps past that
  pause_secs: float = 0.0


def plan(seed: int, n_faults: int, *, short: bool) -> list[Fault]:
  """The seeded fault schedule: every kind once (shuffled), then kinds drawn at random."""
  rng = random.Random(seed)
  kinds = list(KINDS)
  rng.shuffle(kinds)
  if not short:                 # a long run loses every machine at least once
    for _ in range(min(HOSTS - 1, max(0, n_faults - len(kinds)))):
      kinds.insert(rng.randrange(len(kinds) + 1), "lose_host")
  kinds += [rng.choice(KINDS) for _ in range(max(0, n_faults - len(kinds)))]
  out, lost = [], 0
  for kind in kinds:
    pause = rng.uniform(6.0, 9.0) if short else rng.uniform(20.0, 30.0)
    gap = rng.randint(3, 6) if short else rng.randint(6, 14)
    host = rng.randrange(HOSTS)
    if kind == "lose_host":     # machines 0, 1, 2, ... in turn: process 0's first
      host, lost = lost % HOSTS, lost + 1
    out.append(Fault(kind, host, gap, rng.randint(1, 3),
                     round(pause, 1) if kind in ("s3_pause", "s3_errors") else 0.0))
  return out


class Soak:
  """Runs the schedule; see the module docstring. Use :func:`run`."""

  def __init__(self, *, steps: int, seed: int, short: bool, rows: int, cols: int,
               log_dir: str, n_faults: int | None = None) -> None:
    self.steps, self.seed, self.short = steps, seed, short
    self.rows, self.cols = rows, cols
    self.log_dir = log_dir
    # every process's history (jaxckpt.testing.history), checked at the end (tests/support/checker.py)
    self.history_dir = os.path.join(log_dir, "history")
    self.nemesis = history.History(self.history_dir, "nemesis", role="nemesis")
    self.fault_ids = 0
    self.faults = plan(seed, n_faults or len(KINDS), short=short)
    self.job_name = "soak" + uuid.uuid4().hex[:8]
    self.root = tempfile.mkdtemp(prefix="jaxckpt-soak-",
                                 dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    self.directory = ""
    self.s3 = None
    self.job: Job | None = None
    self.incarnation = 0
    self.base = 0                     # where the job stood after the last fault's recovery
    self.reference = Reference(seed, rows, cols)
    # accounting
    self.versions: dict[tuple[int, int], set[int]] = {}   # (incarnation, due step) -> savers
    self.deleted: set[tuple[int, int]] = set()
    self.rolled_back: dict[tuple[int, int], int] = {}   # version -> the incarnation that went back
    # What any tier could restore right after each fault (mgr.all_steps() of every trainer):
    # (incarnation, newest step of it the sample covers (None: the earlier ones only),
    #  steps, the fault before it)
    self.samples: list[tuple[int, int | None, set[int], str]] = []
    self.injected: collections.Counter[str] = collections.Counter()
    self.tiers: collections.Counter[str] = collections.Counter()
    self.log: list[dict[str, Any]] = []         # the faults and unplanned failures, in order
    self.recoveries: list[dict[str, Any]] = []  # every relaunch's restore
    self.redone = 0
    self.wrong: list[str] = []
    self.behind: list[str] = []
    self.unplanned: list[str] = []
    self.save_errors: list[str] = []
    self.reported: set[tuple[int, int]] = set()   # (incarnation, step) an error said was lost
    self.delete_violations: list[str] = []
    self.resurrected: list[str] = []            # a deleted step seen again
    self.damaged: set[tuple[int, int]] = set()  # versions damaged on storage on purpose
    self.damaged_skipped = 0                    # relaunches that skipped them, as they should
    self.second_tries = 0
    self.second_managers: collections.Counter[str] = collections.Counter()
    self.persist_interval = PERSIST_INTERVAL
    self.truncations: collections.Counter[str] = collections.Counter()   # truncate_slots
    self.dead_claims: collections.Counter[str] = collections.Counter()   # dead_claim
    self.stray: collections.Counter[str] = collections.Counter()         # stray_tcp
    self.skipped = 0
    self.agent_restarts = 0
    self.restart_secs: list[float] = []
    self.pause_progress: list[int] = []
    self.checks: dict[str, Any] = {}
    self.history: dict[str, Any] = {}
    self.proxy = None
    self.s3_errors_served = 0

  def keep_agent_logs(self, i: int, tag: str) -> None:
    """Copies machine ``i``'s agent logs into the log directory (before its run root goes)."""
    d = os.path.join(self.machine(i)[0], self.job_name)
    with contextlib.suppress(OSError):
      for name in os.listdir(d):
        if name.endswith(".log"):
          shutil.copy(os.path.join(d, name),
                      os.path.join(self.log_dir, f"agent-machine{i}-{tag}-{name}"))

  def machine(self, i: int) -> tuple[str, str]:
    """Machine ``i``'s own run root and loopback address (nothing shared between them)."""
    return os.path.join(self.root, f"machine{i}"), f"127.0.1.{i + 1}"

  # -- incarnations ---------------------------------------------------------

  def launch(self, *, fresh: bool, cause: str, expect_min: int | None = None,
             expect_not: int | None = None, progress: int = 0) -> None:
    """Starts a new incarnation; without ``fresh`` waits for every trainer's restore
    and records it (tier, bit-exactness, steps re-done, what it rolled back)."""
    for tries_left in (2, 1, 0):
      self.incarnation += 1 if self.job is not None else 0
      self.job = job = Job(self, self.incarnation, fresh=fresh)
      try:
        job.wait(lambda: all(t.fresh or t.available is not None for t in job.trainers), 600,
                 "every trainer's restore" if not fresh else "every trainer to start fresh")
        break
      except TrainerDied:
        # Another program took the coordinator's port between our pick and its bind: not
        # a fault of the job's; start it again on another port.
        if not tries_left or not any("Failed to add port" in line for t in job.trainers
                                     for line in t.tail):
          raise
        job.kill()
        job.close()
    if fresh:
      self.base = 0
      return
    self.restart_secs.append(time.monotonic() - job.t0)
    got = {t.restored[0] for t in job.trainers}
    tiers = [t.restored[1] for t in job.trainers]
    step = self.base = min(got)
    entry = {"cause": cause, "incarnation": self.incarnation, "restored_step": step,
             "tiers": sorted(set(tiers)), "steps_redone": max(0, progress - step)}
    self.samples.append((self.incarnation, None,
                         set().union(*(t.available for t in job.trainers)), cause))
    self.recoveries.append(entry)
    self.tiers[tiers[0]] += 1
    self.redone += max(0, progress - step)
    if len(got) != 1:
      self.wrong.append(f"{cause}: trainers restored different steps {sorted(got)}")
    for t in job.trainers:
      if t.restored[2] != "ok":
        self.wrong.append(f"{cause}: trainer {t.index} restored step {t.restored[0]} from "
                          f"{t.restored[1]}: {t.restored[2]}")
    if expect_not is not None and step == expect_not:
      self.wrong.append(f"{cause}: restored step {step}, which was deleted")
    if expect_min is not None and step < expect_min:
      self.behind.append(f"{cause}: restored step {step}, older than step {expect_min} that "
                         "every host had committed (a host that skipped later saves keeps it "
                         "while the others' keep rule may drop it)")
    from jaxckpt import universal  # pylint: disable=import-outside-toplevel
    stored = set(universal.all_steps(self.directory))
    for v in self.versions:                     # versions after the restored step: abandoned
      if v[0] < self.incarnation and v[1] > step and v not in self.rolled_back:
        self.rolled_back[v] = self.incarnation
        if v[1] in stored and v not in self.deleted:
          self.behind.append(f"{cause}: restored step {step} although step {v[1]} was on "
                             "storage")

  def sample(self, upto: int, cause: str) -> None:
    """Asks every trainer what any tier could restore now (steps <= ``upto`` of this
    incarnation and every earlier one count) and records it."""
    job = self.job
    with job.cond:
      for t in job.trainers:
        t.available = None
    job.send("AVAIL")
    job.wait(lambda: all(t.available is not None for t in job.trainers), 300,
             "every trainer's restorable steps")
    self.samples.append((job.incarnation, upto,
                         set().union(*(t.available for t in job.trainers)), cause))

  def absorb(self) -> None:
    """Records the ending incarnation's saves (before it is replaced)."""
    job = self.job
    if job is None:
      return
    for s in {s for t in job.trainers for s in t.saved}:
      if s % PERSIST_INTERVAL == 0:
        savers = {t.index for t in job.trainers if t.saved.get(s)}
        self.versions[(job.incarnation, s)] = savers
    for t in job.trainers:
      self.save_errors += [f"incarnation {job.incarnation}: {e}" for e in t.save_errors]
      for e in t.save_errors:
        if "persisting step " in e:
          self.reported.add((job.incarnation, int(e.split("persisting step ")[1].split()[0])))
    self.skipped += sum(t.skipped for t in job.trainers)
    self.agent_restarts += sum(t.agent_restarts for t in job.trainers)

  def kill_job(self) -> int:
    """SIGKILLs every trainer (their agents live on); returns how far the job had got."""
    furthest = self.job.furthest()
    self.job.kill()
    self.absorb()
    self.job.close()
    return furthest

  def relaunch_after_kill(self, cause: str, *, expect_min: int | None) -> None:
    progress = self.kill_job()
    self.launch(fresh=False, cause=cause, expect_min=expect_min, progress=progress)

  # -- faults ---------------------------------------------------------------

  def agent_pid(self, host: int) -> int:
    pids = processes.agent_pids(self.machine(host)[0])
    if len(pids) != 1:
      raise SoakError(f"machine {host} has agents {pids}, not one")
    return pids[0]

  def inject(self, fault: Fault, *, relaunch: bool = True) -> dict[str, Any]:
    """Injects ``fault`` and recovers (``relaunch``: a killed agent's job is also
    relaunched, when no later fault would restore it)."""
    job, h = self.job, fault.host
    at = job.progress()
    # room to run through the fault (an S3 stop lets the job run into its held slots)
    job.send(f"GO {min(self.steps, at + (15 if self.short else 40))}")
    info: dict[str, Any] = {"kind": fault.kind, "at_step": at}
    if fault.kind in ("kill_trainer", "kill_agent", "lose_host"):
      info["host"] = h
    in_place = fault.kind in IN_PLACE and not (fault.kind == "kill_agent" and relaunch)
    fid = self.record_fault(fault.kind, h, at, relaunch=not in_place)
    self.injected[fault.kind] += 1
    newest = (job.complete_steps() or [None])[-1]
    if fault.kind == "kill_trainer":
      job.trainers[h].kill()
      self.relaunch_after_kill("kill_trainer", expect_min=newest)
    elif fault.kind == "kill_agent":
      pid = self.agent_pid(h)
      self.keep_agent_logs(h, f"killed{self.incarnation:02d}")
      os.kill(pid, signal.SIGKILL)
      processes.wait_gone(pid, 30, f"the agent of machine {h}")
      t = job.trainers[h]
      before = t.agent_restarts
      job.wait(lambda: t.agent_restarts > before, 300,
               f"trainer {h} to replace its killed agent")
      self.sample(at, "kill_agent")
      target = job.progress() + 3
      job.wait(lambda: job.progress() >= target, 300, f"the job to reach step {target}")
      info["agent_replaced_by_step"] = job.progress()
      if relaunch:          # else the trainers go on; the next fault's restore checks them
        self.relaunch_after_kill("kill_agent", expect_min=job.complete_steps()[-1])
    elif fault.kind == "lose_host":
      root = self.machine(h)[0]
      pid = self.agent_pid(h)
      job.trainers[h].kill()
      os.kill(pid, signal.SIGKILL)
      processes.wait_gone(pid, 30, f"the agent of machine {h}")
      self.keep_agent_logs(h, f"lost{self.incarnation:02d}")
      shutil.rmtree(root)
      self.relaunch_after_kill("lose_host", expect_min=None)
    elif fault.kind == "s3_errors":
      info["pause_secs"] = fault.pause_secs
      faults = (faulty_s3.Fault("503", method="PUT", every=3),
                faulty_s3.Fault("500", method="GET", every=4),
                faulty_s3.Fault("reset", method="PUT", every=7))
      self.proxy.fail(*faults)
      try:
        deadline = time.monotonic() + fault.pause_secs
        with job.cond:
          while time.monotonic() < deadline:
            job.cond.wait(deadline - time.monotonic())
      finally:
        self.proxy.heal()
      info["failed_requests"] = {f.how: f.served for f in faults}
      self.s3_errors_served += sum(f.served for f in faults)
    elif fault.kind == "s3_pause":
      info["pause_secs"] = fault.pause_secs
      before = job.progress()
      deadline = time.monotonic() + fault.pause_secs
      with self.s3.paused():
        with job.cond:
          while time.monotonic() < deadline:
            job.cond.wait(deadline - time.monotonic())
        info["steps_while_paused"] = job.progress() - before
      self.pause_progress.append(info["steps_while_paused"])
    elif fault.kind in ("restart", "delete"):
      rng = random.Random(f"{self.seed}-{self.incarnation}")     # the deletes' order
      delays = [round(rng.uniform(0.0, 3.0), 1) for _ in job.trainers]
      progress, complete = job.furthest(), job.complete_steps()
      stop = self.stop_job(fault.kind if fault.kind == "restart"
                           else f"delete {','.join(map(str, delays))}")
      progress, complete = max(progress, stop), job.complete_steps()
      expect_not = None
      if fault.kind == "delete":
        info.update(deleted_step=stop, delete_delays=delays)
        complete = [s for s in complete if s % PERSIST_INTERVAL == 0]  # older ones may be dropped
        self.deleted.add((job.incarnation, stop))
        self._check_deleted(job, stop)
        expect_not, expect_min = stop, max([s for s in complete if s < stop], default=None)
      else:
        expect_min = max(complete, default=None)
      self.launch(fresh=False, cause=fault.kind, expect_min=expect_min, expect_not=expect_not,
                  progress=progress)
      if expect_not is not None and expect_not in self.samples[-1][2]:
        self.resurrected.append(f"the job relaunched after deleting step {stop} can restore "
                                f"it again: {sorted(self.samples[-1][2])}")
    elif fault.kind == "second_manager":
      soak_faults.second_manager(self, info)
    elif fault.kind == "damage_newest":
      soak_faults.damage_newest(self, info)
    elif fault.kind == "impossible_newest":
      soak_faults.impossible_newest(self, info)
    elif fault.kind == "truncate_slots":
      soak_faults.truncate_slots(self, info, h)
    elif fault.kind == "dead_claim":
      soak_faults.dead_claim(self, info)
    elif fault.kind == "stray_tcp":
      soak_faults.stray_tcp(self, info)
    if in_place:
      self.base = self.job.progress()
      self.nemesis.record("recovered", id=fid, incarnation=self.incarnation,
                          restored_step=None, at_step=None)
    else:
      info.update({k: self.recoveries[-1][k] for k in ("restored_step", "tiers", "steps_redone")})
      self.record_recovered(fid)
    return info

  def record_fault(self, kind: str, host: int | None, at: int, *, relaunch: bool) -> int:
    """The nemesis's history: a fault begins (``relaunch``: the next incarnation's
    restore is its recovery)."""
    self.fault_ids += 1
    self.nemesis.record("fault", id=self.fault_ids, kind=kind, host=host, at_step=at,
                        incarnation=self.incarnation, relaunch=relaunch)
    return self.fault_ids

  def record_recovered(self, fid: int) -> None:
    """The nemesis's history: the relaunch after fault ``fid`` restored (every trainer)."""
    r = self.recoveries[-1]
    self.nemesis.record("recovered", id=fid, incarnation=r["incarnation"],
                        restored_step=r["restored_step"],
                        at_step=r["restored_step"] + r["steps_redone"])

  def stop_job(self, how: str) -> int:
    """``STOP how``: every trainer stops after the same step, closes its manager and
    exits; returns that step (the job's saves recorded, its trainers reaped)."""
    job = self.job
    job.send(f"STOP {how}")
    job.wait(lambda: all(t.stopped is not None for t in job.trainers), 600,
             f"every trainer to stop ({how})")
    stops = {t.stopped for t in job.trainers}
    for t in job.trainers:
      t.p.wait(timeout=120)
      t.expect_exit = True
    if len(stops) != 1:
      raise SoakError(f"{how}: trainers stopped at different steps {sorted(stops)}")
    self.absorb()
    job.close()
    return stops.pop()

  def _check_deleted(self, job: Job, step: int) -> None:
    """Every trainer deleted ``step``, none could restore it after its own delete, and
    storage no longer holds it."""
    from jaxckpt import universal  # pylint: disable=import-outside-toplevel
    if {t.deleted for t in job.trainers} != {step}:
      self.delete_violations.append(f"not every trainer deleted step {step}")
    for t in job.trainers:
      if step in t.after_delete:
        self.resurrected.append(f"trainer {t.index} can restore step {step} after deleting "
                                f"it: {sorted(t.after_delete)}")
    if step in universal.all_steps(self.directory):
      self.resurrected.append(f"step {step} is on storage after every delete() and close()")

  # -- the run --------------------------------------------------------------

  def _continue_after_failure(self, e: TrainerDied) -> None:
    """A trainer died unplanned: kill the job, relaunch it, go on (counted)."""
    while True:
      self.unplanned.append(str(e)[:600])
      if len(self.unplanned) > 4:
        raise SoakError("more than 4 unplanned failures; the last:\n" + self.job.tails()) from e
      self.log.append({"kind": "unplanned", "at_step": self.job.progress(),
                       "what": str(e)[:300]})
      fid = self.record_fault("unplanned", None, self.job.progress(), relaunch=True)
      try:
        self.relaunch_after_kill("unplanned", expect_min=None)
        self.record_recovered(fid)
        self.log[-1].update({k: self.recoveries[-1][k]
                             for k in ("restored_step", "tiers", "steps_redone")})
        return
      except TrainerDied as again:
        e = again

  def run(self) -> dict[str, Any]:
    from tests.support.s3 import SeaweedS3  # pylint: disable=import-outside-toplevel
    t0 = time.monotonic()
    with SeaweedS3() as s3, faulty_s3.FaultyS3Proxy(s3.endpoint) as proxy, \
        _endpoint(proxy.endpoint):            # every request of the soak through the proxy
      self.s3, self.proxy = s3, proxy
      self.directory = s3.url("soak-" + uuid.uuid4().hex[:8])
      self.launch(fresh=True, cause="start")
      faults = list(self.faults)
      while True:
        try:
          if faults:
            fault = faults[0]
            target = self.base + fault.gap
            if target + fault.lead >= self.steps - 2:
              raise SoakError(f"--steps {self.steps} is too few for the schedule: fault "
                              f"{fault.kind} would come at step {target}")
            job = self.job
            job.send(f"GO {target + fault.lead}")
            job.wait(lambda: job.progress() >= target, 600, f"the job to reach step {target}")
            faults.pop(0)         # injected once, even if a trainer dies meanwhile
            later = {f.kind for f in faults} - set(IN_PLACE)
            self.log.append(self.inject(fault, relaunch=not later))
          else:
            job = self.job
            job.send(f"GO {self.steps}")
            job.wait(lambda: all(t.done for t in job.trainers), 900,
                     f"every trainer to finish step {self.steps}")
            for t in job.trainers:
              t.p.wait(timeout=120)
              t.expect_exit = True
            self.absorb()
            job.close()
            break
        except TrainerDied as e:
          self._continue_after_failure(e)
      self.checks = soak_faults.run_checks()
      verified, storage_wrong = self.verify_storage()
      self.nemesis.record("end", stored=verified)
      self.nemesis.close()
      self.history = checker.check_run(self.history_dir).to_json()
      wall = time.monotonic() - t0
    return self.result(verified, storage_wrong, wall)

  def verify_storage(self) -> tuple[list[int], list[str]]:
    """Reads every step on storage back (one process, numpy) and compares it with the reference."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import jax  # pylint: disable=import-outside-toplevel
    import jaxckpt as jc  # pylint: disable=import-outside-toplevel
    wrong = []
    with jc.CheckpointManager(self.directory, jc.CheckpointOptions(handle_sigterm=False)) as m:
      steps = jc.universal.all_steps(self.directory)
      for s in steps:
        out = m.restore(s, target=None)
        want = self.reference.arrays(s)
        for k, v in want.items():
          if np.asarray(out[k]).tobytes() != v.tobytes():
            wrong.append(f"storage step {s}: {k} differs")
        key = np.asarray(jax.random.key_data(out["key"]))
        if key.tobytes() != self.reference.key_data(s).tobytes():
          wrong.append(f"storage step {s}: key differs")
        if out["data"] != {"position": s}:
          wrong.append(f"storage step {s}: data {out['data']}")
    return steps, wrong

  def result(self, stored: list[int], storage_wrong: list[str], wall: float) -> dict[str, Any]:
    committed = {v: s for v, s in self.versions.items() if len(s) == HOSTS}
    fates: dict[str, list[list[int]]] = collections.defaultdict(list)
    destroyed_by: collections.Counter[str] = collections.Counter()
    for v in sorted(committed):
      # the first later restore at which no tier could restore it: a fault had destroyed
      # every copy of it (a restore that went back before it is one such)
      # Destroyed: no tier could restore it at the first look after a fault hit it
      # (a look comes right after every fault that can destroy a snapshot). Lost: it
      # was there then, yet never reached storage.
      first = next((smp for smp in self.samples if smp[0] > v[0]
                    or (smp[0] == v[0] and smp[1] is not None and v[1] <= smp[1])), None)
      if v in self.deleted:
        fates["deleted"].append(list(v))
      elif v in self.damaged:
        fates["damaged_on_purpose"].append(list(v))
      elif first is not None and v[1] not in first[2] and first[3] in DESTRUCTIVE:
        fates["destroyed_by_fault"].append(list(v))
        destroyed_by[first[3]] += 1
      elif v[1] in stored:
        fates["persisted"].append(list(v))
      else:
        fates["lost"].append(list(v))
    return {
        "steps": self.steps, "seed": self.seed, "short": self.short,
        "processes": HOSTS, "parity": {"group_size": HOSTS, "parity": 1},
        "persist_interval_steps": PERSIST_INTERVAL,
        "state_bytes": self.rows * self.cols * 8 + 16 * 4,
        "faults_injected": dict(sorted(self.injected.items())),
        "recoveries_by_tier": dict(sorted(self.tiers.items())),
        "restores": sum(self.tiers.values()),
        "steps_redone": self.redone,
        "due_steps": {"committed": len(committed), "persisted": len(fates["persisted"]),
                      "deleted": len(fates["deleted"]),
                      "damaged_on_purpose": len(fates["damaged_on_purpose"]),
                      "destroyed_by_fault": len(fates["destroyed_by_fault"]),
                      "destroyed_by_fault_kind": dict(destroyed_by),
                      "lost": len(fates["lost"])},
        "lost_steps": fates["lost"],
        # lost ones whose loss the trainer heard of (AgentUnavailableError: the agent
        # that was persisting them died), as (incarnation, step)
        "lost_steps_reported": [v for v in fates["lost"] if tuple(v) in self.reported],
        "destroyed_steps": fates["destroyed_by_fault"],
        "wrong_restores": len(self.wrong), "wrong_restore_details": self.wrong,
        "restores_older_than_newest_complete": self.behind,
        "delete_violations": self.delete_violations,
        "resurrected": len(self.resurrected), "resurrected_details": self.resurrected,
        "second_managers": {"tries": self.second_tries, **dict(self.second_managers)},
        "damaged_newest": {"damaged": len(self.damaged), "damaged_steps": sorted(self.damaged),
                           "skipped_by_the_relaunch": self.damaged_skipped},
        "truncated_slots": dict(self.truncations),
        "dead_claims": dict(self.dead_claims),
        "stray_tcp": dict(self.stray),
        "checks": self.checks,
        "storage_steps_verified": len(stored), "storage_wrong": storage_wrong,
        "unplanned_failures": self.unplanned,
        "agent_unavailable_errors_reported": len(self.save_errors),
        "save_error_details": self.save_errors[:10],
        "saves_skipped": self.skipped, "agent_restarts": self.agent_restarts,
        "steps_progressed_while_s3_paused": self.pause_progress,
        "s3_requests_failed_on_purpose": self.s3_errors_served,
        "relaunch_to_restored_secs": [round(x, 1) for x in self.restart_secs],
        "schedule": self.log,
        # the whole history, checked (tests/support/checker.py, docs/reliability.md): per
        # fault kind its count, steps lost (median, max), recovery secs; every violation
        "history": self.history,
        "wall_secs": round(wall, 1),
    }

  def cleanup(self) -> None:
    """Kills every process this soak started (trainers, then the agents they spawned
    under this soak's run root, found by the root in their command line) by pid,
    and removes the run root (every machine's shared memory)."""
    self.nemesis.close()
    if self.job is not None:
      with contextlib.suppress(Exception):
        self.job.close()
    for i in range(HOSTS):
      self.keep_agent_logs(i, "end")
    ours = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
      with contextlib.suppress(psutil.Error, TypeError):
        if any(self.root in arg for arg in proc.info["cmdline"] or ()):
          ours.append(proc.info["pid"])
    ours += processes.agent_pids(self.root)
    for pid in set(ours):
      if pid != os.getpid():
        with contextlib.suppress(ProcessLookupError):
          os.kill(pid, signal.SIGKILL)
    for pid in set(ours):
      with contextlib.suppress(TimeoutError):
        processes.wait_gone(pid, 30, "a soak process")
    shutil.rmtree(self.root, ignore_errors=True)


def run(steps: int, seed: int, *, short: bool = False, rows: int = 256, cols: int = 512,
        n_faults: int | None = None, log_dir: str | None = None) -> dict[str, Any]:
  """Runs the soak and returns its figures (see the module docstring).

  ``log_dir`` keeps every trainer's output (default: a temporary directory,
  removed when the soak passed, kept and named in the error when it failed).
  """
  own_logs = log_dir is None
  log_dir = log_dir or tempfile.mkdtemp(prefix="jaxckpt-soak-logs-")
  soak = Soak(steps=steps, seed=seed, short=short, rows=rows, cols=cols, log_dir=log_dir,
              n_faults=n_faults)
  try:
    out = soak.run()
  except BaseException as e:
    raise SoakError(f"the soak failed (trainer logs kept in {log_dir}): {e}") from e
  finally:
    soak.cleanup()
  if own_logs:
    shutil.rmtree(log_dir, ignore_errors=True)
  return out

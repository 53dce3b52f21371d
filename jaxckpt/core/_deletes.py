"""Deleting steps from every tier: ``delete()``, the keep policy's drops, and a rollback.

A step is deleted from every tier in one order: fenced and discarded on the host
tier first (a queued persist never runs, a running one never commits, and the
discard returns once none runs; with agents it reaches every agent of the job,
parity included), then removed from storage by process 0 (or by any process,
where the agents fence the whole job), its commit marker first. The keep policy's
drops leave the host tier and storage's listing in the save that drops them (a
relaunch never finds them again) and their data goes off the loop's path. A
rollback's steps go as one: recorded first (storage's ``rollback.json``, the agents'
record of the one request that discards them there), so that a crash at any point
leaves it for the next manager to complete (``Deletes.resume``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import uuid
from typing import Any

from jaxckpt import errors, universal
from jaxckpt.universal import _rollbacks
from jaxckpt.core._ledger import Ledger
from jaxckpt.core._policy import DirectoryRules, Policy
from jaxckpt.host.store import HostStore
from jaxckpt.restore import _tiers
from jaxckpt.util import _crash, _wait

logger = logging.getLogger("jaxckpt.manager")


class Deletes:
  """One manager's deletes (see the module docstring).

  Args:
    store: the manager's HostStore.
    ledger: the manager's ledger (what is dropped, persisting, on storage).
    directory: its storage directory (None: none).
    process: (this process's index, the job's process count).
    rules: the directory's rules (read-only, ``todelete_subdir``).
    policy: whether a save may start a new timeline (``rollback``).
    timeout_secs: the longest a discard waits for a running persist to stop.
  """

  def __init__(self, store: HostStore, ledger: Ledger, directory: str | None,
               process: tuple[int, int], rules: DirectoryRules, policy: Policy,
               timeout_secs: float) -> None:
    self.store, self.ledger, self.directory = store, ledger, directory
    self.process, self.rules, self.policy, self.timeout = process, rules, policy, timeout_secs
    self._janitor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxckpt-delete")
    self._deleting: dict[int, concurrent.futures.Future] = {}

  @property
  def _clears_storage(self) -> bool:
    """Whether this process removes deleted steps from storage."""
    return (self.directory is not None and not self.rules.read_only
            and (self.process[0] == 0 or self.store.fences_job))

  @property
  def _clears_rollback(self) -> bool:
    """Whether this process records a rollback on storage and deletes its steps there
    (process 0: one writer, whose record the others' relaunch waits on)."""
    return self.directory is not None and not self.rules.read_only and self.process[0] == 0

  def delete(self, step: int) -> None:
    """``delete(step)``: from every tier, now (StepNotFoundError if none held it)."""
    self.drain()
    held, stored, fenced = self.everywhere(step)
    if not (held or stored or fenced):
      raise errors.StepNotFoundError(f"delete(): step {step} is not held on any tier")
    logger.info("deleted step %d (host: %s, storage: %s)", step, held, stored)

  def everywhere(self, step: int, *, listed_before: bool = False) -> tuple[bool, bool, bool]:
    """Deletes ``step`` from this host and, from process 0, storage; says what held it
    (``listed_before``: storage held it before its marker was removed)."""
    held = self.store.discard(step, timeout_secs=self.timeout)   # fenced first
    fenced = self.ledger.fence(step)
    stored = listed_before or (self.directory is not None
                               and step in _tiers.storage_steps(self.directory))
    if stored and self._clears_storage:
      universal.discard_step(self.directory, step, todelete_subdir=self.rules.todelete_subdir)
    self.ledger.forget(step)
    return held, stored, fenced

  def collect(self, *, in_flight: set[int], all_ended: bool = False) -> None:
    """Deletes the dropped steps whose persist has ended (see the module docstring)."""
    dropped = set(self.ledger.dropped()) - set(self._deleting)
    if not dropped:
      return
    busy = in_flight | (set() if all_ended else set(self.store.persist_status().pending))
    ready = sorted(dropped - busy)
    for step in ready:
      self.store.discard(step, timeout_secs=self.timeout)
      self.ledger.fence(step)
    if ready and self._clears_storage:
      universal.unlist_steps(self.directory, ready)
    for step in ready:
      self._deleting[step] = self._janitor.submit(self._drop, step)

  def _drop(self, step: int) -> None:
    try:
      self.everywhere(step, listed_before=self.directory is not None)
    except Exception as e:  # pylint: disable=broad-except  (raised by the next call that asks)
      logger.error("step %d: deleting it (the keep policy dropped it) failed: %s", step, e)
      self.ledger.fail(e)
    finally:
      self._deleting.pop(step, None)

  def drain(self) -> None:
    """Waits for the deletes running off the loop's path."""
    for fut in list(self._deleting.values()):
      fut.result(timeout=self.timeout)

  def close(self) -> None:
    self._janitor.shutdown(wait=True)

  def timeline(self, step: int) -> None:
    """A save of a step not newer than every step the run holds: after ``restore`` of an
    older step it starts a new timeline, and the steps of the abandoned one (those
    newer than the restored step) are deleted from every tier, for good (their
    markers first, so a crash never leaves one listed). Without such a restore a
    newer step on storage refuses the save: the run would mix two timelines."""
    led = self.ledger
    if led.high is None or step > led.high:
      led.high, led.restored = step, None     # forward: a restore before it is history now
      return
    if not self.policy.rollback:
      return
    fork = led.restored if led.restored is not None and led.restored < step else None
    stored = set(_tiers.storage_steps(self.directory, timeout_secs=self.timeout))
    if fork is None:
      newer = sorted(s for s in stored if s > step)
      if newer:
        how = (f"step {step} is the step restore() gave back: save the next one (the "
               f"newer steps are deleted then)" if led.restored == step else
               "to roll back, restore(step=...) the step to go back to first (the newer "
               "steps are then deleted), or delete them, or save into another directory")
        raise errors.InvalidArgumentError(
            f"save(step={step}): {self.directory!r} holds newer steps {newer} of this run, "
            f"so step {step} would start another timeline beside them; {how}")
      return
    abandoned = sorted(s for s in stored | set(self.store.steps()) | set(led.attempts())
                       | set(_tiers.complete_steps(self.store)) if s > fork)
    logger.warning("step %d starts a new timeline from step %d (restored): steps %s of the "
                   "abandoned timeline are deleted from every tier", step, fork, abandoned)
    self.drain()
    self._roll_back({"id": self._rollback_id(), "fork": fork, "step": step,
                     "steps": abandoned}, stored)
    led.restored, led.high = None, step

  def _rollback_id(self) -> str:
    """A new rollback's id, the job's (process 0's): every process's rollback of the
    job is one on every agent, applied there once."""
    if self.process[1] == 1:
      return uuid.uuid4().hex
    from jaxckpt.net import _kv  # pylint: disable=import-outside-toplevel  (JAX: a job's)
    return _kv.broadcast_from_0("rollback", lambda: uuid.uuid4().hex,
                                timeout_secs=self.timeout)

  def _roll_back(self, record: dict[str, Any], stored: set[int]) -> None:
    """Deletes the abandoned timeline's steps (``record``) from every tier, atomic against
    a crash at any point: recorded first (on storage, by process 0; on the agents, by
    the one request that discards them on each), so that whoever comes next completes
    it (:meth:`resume`). The agent's host memory, its peers' and their parity go in one
    request per agent; storage's markers, newest first, then their data (process 0);
    then the record. ``stored``: the steps storage lists. A crash point
    (:mod:`jaxckpt.util._crash`) follows each step a crash could interrupt."""
    steps = record["steps"]
    recorded = self._clears_rollback
    if recorded:
      _rollbacks.record_rollback(self.directory, record)
      _crash.point("rollback")
    self.store.rollback(record["id"], steps, timeout_secs=self.timeout)   # fenced first
    self._complete(record, stored)
    if recorded:
      _rollbacks.clear_rollback(self.directory)
      _crash.point("rollback")

  def _complete(self, record: dict[str, Any], stored: set[int]) -> None:
    """Storage's and the ledger's part of rollback ``record`` (its host part done)."""
    steps = record["steps"]
    for s in steps:
      self.ledger.fence(s)
    if self._clears_rollback:
      for s in sorted(stored & set(steps), reverse=True):   # none listed, whatever comes
        universal.unlist_steps(self.directory, [s])
        _crash.point("rollback")
      for s in steps:
        universal.discard_step(self.directory, s, todelete_subdir=self.rules.todelete_subdir)
        if s in stored:               # (a step never listed: its data only, nothing to see)
          _crash.point("rollback")
    for s in steps:
      self.ledger.forget(s)

  def resume(self) -> None:
    """At start: completes the rollback a crash interrupted (see :meth:`_roll_back`),
    as its record on storage or on the job's agents has it: its steps deleted from
    every tier (an agent that applied it already discards nothing more: a step of the
    new timeline is never deleted by it), then the record removed."""
    self.store.complete_rollbacks(timeout_secs=self.timeout)   # on the agents that missed one
    if self.directory is None:
      return
    record = _rollbacks.rollback_record(self.directory)
    if record is None:
      return
    logger.warning("completing the rollback that a crash interrupted: steps %s of the timeline "
                   "abandoned at step %s (restored step %s) are deleted from every tier",
                   record["steps"], record["step"], record["fork"])
    self.store.rollback(record["id"], record["steps"], timeout_secs=self.timeout)
    if not self._clears_rollback:     # process 0 completes storage's part: listed once it has
      _wait.until(lambda: _rollbacks.rollback_record(self.directory) is None,
                  timeout_secs=self.timeout, poll_secs=0.05, late=lambda: (
                      f"process {self.process[0]}: process 0 did not complete the rollback "
                      f"recorded in {self.directory!r} (steps {record['steps']}) within "
                      f"{self.timeout} s"))
    self._complete(record, set(_tiers.storage_steps(self.directory, timeout_secs=self.timeout)))
    if self._clears_rollback:
      _rollbacks.clear_rollback(self.directory)

"""A trainer's view of its persists: their errors, and the waits for them.

The persists themselves run in the store (:mod:`jaxckpt.host._persist`: in the
agent, or a thread of the in-process store). The trainer names each one with
an attempt id that every process of the job gives alike (the ledger's), raises
each failure once, as the jaxckpt error it was, and waits, bounded, for what it
was asked: every saved step's persist to end and, as the whole job sees it, the
step to be committed on storage (process 0 commits; every process waits for
that commit, not only for its own part).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from jaxckpt import errors, universal
from jaxckpt.core._ledger import Ledger
from jaxckpt.host import _persist
from jaxckpt.host.store import HostStore
from jaxckpt.util import _wait

logger = logging.getLogger("jaxckpt.manager")


class Persists:
  """The persists of one manager (see the module docstring).

  Args:
    ledger: the manager's ledger (attempts, what was raised, what is on storage).
    directory: where it persists (None: nowhere).
    process: (this process's index, the job's process count).
    where: the store, as messages name it (this process's, or its snapshot agent).
  """

  def __init__(self, ledger: Ledger, directory: str | None, process: tuple[int, int],
               where: str) -> None:
    self.ledger, self.directory, self.process, self.where = ledger, directory, process, where

  def persist_newest(self, store: HostStore, what: str) -> None:
    """Puts the store's newest snapshot on storage if no persist of it was asked and
    host memory ends with the manager (``HostStore.persist_held``: the in-process
    store); its end is waited for as a due step's."""
    newest = max(store.steps(), default=None)
    if (self.directory is None or newest is None or newest in self.ledger.stored
        or newest in self.ledger.attempts()):
      return
    if store.persist_held(newest, self.ledger.new_attempt(newest)):
      self.ledger.persisting_from(newest, 0)
      logger.info("step %d: persisted at %s (the newest snapshot; host memory ends with "
                  "this manager)", newest, what)

  def refuse_existing(self, step: int, store: HostStore,
                      error: Callable[[str], Exception]) -> None:
    """Raises ``error(message)`` if ``step`` is committed on storage or on its way there: a
    step saved again never leaves two tiers holding different bytes."""
    led, directory = self.ledger, self.directory
    if directory is None or (step not in led.stored and step not in led.attempts()):
      return
    universal.check_not_orbax(directory, step, error=error)    # a step orbax wrote there
    if step in universal.all_steps(directory):
      where = (f"is already committed in {directory!r} (persist attempt "
               f"{universal.committed_by(directory, step)!r})")
    elif (step in store.persist_status(ask=False).pending        # (or its snapshot, then its
          or any(r.step == step for r in led.persisting())):      # persist, is on its way)
      where = "is already being persisted (its first save)"
    else:                                     # deleted since (gc, delete), or never stored
      led.stored.discard(step)
      return
    raise error(f"save(step={step}): step {step} {where}: step {step} already exists; a step is saved once (no two tiers "
                f"may hold different bytes under one step), so nothing was saved. Delete it "
                f"first (mgr.delete({step}) or `jaxckpt delete DIR --step {step}`), or save "
                "another step")

  def raise_errors(self, store: HostStore, *, ask_agent: bool = True) -> None:
    """Raises the first error of a background persist (this process's or its agent's).

    Without ``ask_agent`` (``save()``: no request on the save path) an agent's
    errors are those its commit replies brought back.
    """
    if self.directory is not None:
      self.raise_failed(store.persist_errors(ask=ask_agent))

  def raise_failed(self, failed: list[_persist.PersistError]) -> None:
    led = self.ledger
    new = led.untold(e.attempt for e in failed)                # raised once only
    failed = [e for e in failed if e.attempt in new]
    earlier = [e for e in failed if not _persist.of_run(e.attempt, led.run_id)]
    for e in earlier:         # an earlier run's (its agent outlived it): not this run's save
      logger.error("a persist of step %d by an earlier run (attempt %s) failed: %s; that "
                   "step is not on storage", e.step, e.attempt, e.message)
    failed = [e for e in failed if e not in earlier]
    if failed:
      where = f"process {self.process[0]}" + ("" if "agent" not in self.where
                                               else ", in its snapshot agent")
      first = failed[0].exception(f"{where}, to {self.directory!r}")
      for other in failed[1:]:
        logger.error("also: persisting step %d failed: %s", other.step, other.message)
      raise first

  def wait_ended(self, store: HostStore, timeout: float, what: str) -> None:
    """Waits until the store's persists of the steps this manager saved for storage
    have ended (persisted, failed or fenced) and, in a job of several processes,
    until process 0 committed them; then raises the first failure."""
    want = self.ledger.unanswered()
    failed: list[_persist.PersistError] = []

    def ended() -> bool:
      failed.extend(store.persist_errors())
      return not set(want) & set(store.persist_status().pending)

    def late() -> str:
      self.raise_failed(failed)          # a failure said first: it is why, not the wait
      left = sorted(set(want) & set(store.persist_status(ask=False).pending))
      return (f"{what}: steps {left} were not persisted to {self.directory!r} within "
              f"{timeout} s: {self._who(left, want)} ({self.where} of process "
              f"{self.process[0]} goes on trying)")
    if want:
      _wait.until(ended, timeout_secs=timeout, late=late)
      failed.extend(store.persist_errors())   # (one said as the last persist ended)
    self.raise_failed(failed)
    if want and self.process[0] != 0:
      self._wait_committed(store, want, timeout, what)
    self.ledger.told.update(want.values())    # settled: never waited for again

  def _wait_committed(self, store: HostStore, want: dict[int, str], timeout: float,
                      what: str) -> None:
    """Waits until process 0 committed the attempts ``want`` (its part written, this
    process's persist ended before the step is on storage)."""
    directory = self.directory
    left = dict(want)
    deadline = time.monotonic() + timeout
    unanswered: list[Exception] = []

    def committed() -> bool:
      self.raise_errors(store)
      try:                                # asked for at most the time left
        stored = set(universal.all_steps(directory, timeout_secs=_left(deadline)))
      except errors.StorageError as e:
        unanswered[:] = [e]
        return False
      dropped = self.ledger.dropped()
      for step, attempt in list(left.items()):
        if attempt in self.ledger.told or step in dropped:   # fenced, deleted or dropped
          del left[step]                  # (every process drops alike: process 0 deletes it)
          continue
        if step not in stored:
          continue
        by = universal.committed_by(directory, step)
        if by is not None and by != attempt:
          self.ledger.told.add(attempt)
          raise errors.StepExistsError(
              f"{what}: step {step} is committed in {directory!r} by persist attempt {by!r}, "
              f"not this run's ({attempt!r}): another writer got there first")
        self.ledger.on_storage(step)
        del left[step]
      return not left

    def late() -> str:
      why = (f"storage did not answer ({unanswered[0]})" if unanswered
             else self._who(sorted(left), left))
      return (f"{what}: steps {sorted(left)} are not committed on {directory!r} within "
              f"{timeout} s: {why}")
    _wait.until(committed, timeout_secs=timeout, late=late, poll_secs=0.02, max_poll_secs=0.5)

  def _who(self, steps: list[int], attempts: dict[int, str]) -> str:
    return "; ".join(universal.who_is_late(self.directory, s, attempts[s], self.process[1])
                     for s in steps if s in attempts)

  def wait_stored(self, store: HostStore, step: int, timeout: float) -> None:
    """Waits until ``step`` is committed on storage by this manager's attempt.

    Raises:
      StepExistsError: another writer committed ``step`` first.
      StepNotFoundError: this manager never saved ``step`` for storage and it is not there.
      SnapshotTimeoutError: naming the processes whose part is missing.
    """
    led, directory = self.ledger, self.directory
    attempt = led.attempts().get(step)
    deadline = time.monotonic() + timeout
    unanswered: list[Exception] = []

    def stored() -> bool:
      self.raise_errors(store)
      try:                                # asked for at most the time left
        listed = universal.all_steps(directory, timeout_secs=_left(deadline))
      except errors.StorageError as e:
        unanswered[:] = [e]
        return False
      if step in listed:
        by = universal.committed_by(directory, step)
        if attempt is None or by == attempt:
          return True
        led.told.add(attempt)
        raise errors.StepExistsError(
            f"step {step} is already committed in {directory!r} by persist attempt "
            f"{by!r}, not by this manager's ({attempt!r}): another writer got there first; "
            "this manager's snapshot of it was not stored")
      if attempt is None:
        raise errors.StepNotFoundError(
            f"wait_until_persisted(step={step}): this manager never saved step {step} for "
            f"storage and it is not on {directory!r}")
      return False

    def late() -> str:
      who = universal.who_is_late(directory, step, attempt, self.process[1])
      return (f"step {step} was not persisted to {directory!r} within {timeout} s: {who} "
              f"(persist attempt {attempt!r})")
    _wait.until(stored, timeout_secs=timeout, late=late)
    led.on_storage(step)
    _wait.until(lambda: step not in store.persist_status().pending,   # its job's end
                timeout_secs=timeout, late=lambda: (
                    f"step {step} is on {directory!r} but {self.where} still reports its "
                    f"persist as running after {timeout} s"))


def _left(deadline: float) -> float:
  """The time left until ``deadline`` for one storage question (at least 0.1 s)."""
  return max(0.1, deadline - time.monotonic())

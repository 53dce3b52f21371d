"""Which steps a manager saves, and what a saved step carries for the keep policy.

:class:`SaveDecisions` asks the policy (through the job's decisions where a decision
runs the user's code or reads what one process sees: process 0's, see
:class:`jaxckpt.core._policy.JobDecisions`) whether a step is saved, and notes a
saved step's time and metrics in the ledger as the policy ranks them. It is given its
inputs; :class:`jaxckpt.core._manager.CoreManager` holds one.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, Callable

from jaxckpt.core import _policy
from jaxckpt.core._ledger import Ledger
from jaxckpt.net import _kv

logger = logging.getLogger("jaxckpt.manager")


class SaveDecisions:
  """The save decisions of one manager.

  Args:
    policy: which steps are saved and kept.
    rules: how the directory is treated (read-only, metrics written, ...).
    directory: the manager's directory (named in a read-only skip's WARNING).
    ledger: the manager's step ledger.
    process: ``(process index, process count)``.
    timeout_secs: how long a process waits for process 0's decision or save time.
    saving: whether a save is in progress (asked only by a policy that reads it).
    preempted: whether ``step`` reached a preemption point (likewise).
  """

  def __init__(self, policy: _policy.Policy, rules: _policy.DirectoryRules,
               directory: str | None, ledger: Ledger, process: tuple[int, int],
               timeout_secs: float, *, saving: Callable[[], bool],
               preempted: Callable[[int], bool]) -> None:
    self.policy, self._rules, self._directory, self._ledger = policy, rules, directory, ledger
    self._process, self._timeout_secs = process, timeout_secs
    self._saving, self._preempted = saving, preempted
    self.job = None if policy.decided_by is None or process[1] == 1 else (
        _policy.JobDecisions(process=process, what=policy.decided_by,
                             compare=not policy.asks_progress, timeout_secs=timeout_secs,
                             channel=_kv.Channel("decisions", timeout_secs=timeout_secs)))

  def may_save(self, step: int, force: bool) -> bool:
    """Whether the policy saves ``step`` (``force``: whatever it says, unless read-only)."""
    if self._rules.read_only:
      logger.warning("%s is read only: save(%d) is skipped", self._directory, step)
      return False
    if force:
      if self.job is not None:
        self.job.forced(step)         # process 0's: the job's decision of it is True
      return True
    if self.policy_saves(step):
      return True
    self._ledger.skipped_interval()
    return False

  def policy_saves(self, step: int) -> bool:
    p = self.policy

    def own() -> bool:
      saving = p.asks_progress and self._saving()        # (an agent request)
      preempted = p.asks_preemption and self._preempted(step)
      return p.should_save(step, self._ledger.kept() if p.reads_kept else (), saving, preempted)
    return own() if self.job is None else self.job.decide(step, own)

  def restored(self) -> None:
    if self.job is not None:
      self.job.restored()             # an older step's save next starts a new timeline

  def record(self, step: int, metadata: dict[str, Any] | None, metrics: Any,
             due: bool) -> dict[str, Any] | None:
    """``metadata`` with the step's time and metrics, as the policy ranks them; the
    step noted in the ledger (kept, if it is a checkpoint: saved for storage)."""
    led = self._ledger
    led.undrop(step)
    led.listed.add(step)
    if not self.policy.records and metrics is None:
      return metadata                 # nothing to rank the step by
    when = datetime.datetime.now(tz=datetime.timezone.utc)
    if self.policy.uses_time and self._process[1] > 1:    # one time for the job: process 0's
      when = datetime.datetime.fromtimestamp(float(_kv.broadcast_from_0(
          f"save_time/{step}", lambda: repr(when.timestamp()),
          timeout_secs=self._timeout_secs)), tz=datetime.timezone.utc)
    return led.saving(step, metadata, when=when, metrics=metrics, due=due,
                      write_metrics=self._rules.write_metrics)

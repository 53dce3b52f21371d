"""What a manager lists: the restorable steps of its run, across the tiers, as the ledger
knows them.

``all_steps()`` is the step in flight, the steps the job holds complete on the host
tier (or can rebuild from parity), and the stored steps this manager knows
(those on storage when it started or was reloaded, and those it stored since),
with the steps this manager saved for storage from their save on while their
persist runs (another process may commit them a little later), less the steps the
keep policy dropped. A step on its way to storage that the job has gone past (a newer
step is held complete) while no tier holds it is not listed: every host committed it
before the newer one, so a host lost its snapshot (its agent died before parity
protected it), and only storage can restore it now, if its persist still commits it. The
stored steps' time and metrics are read once, at start and on ``reload()``, for the
keep policy to rank.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, Callable

from jaxckpt import errors, universal
from jaxckpt.universal import _layout
from jaxckpt.core._ledger import EPOCH, METRICS_KEY, TIME_KEY, Ledger, StepInfo
from jaxckpt.core._policy import Policy
from jaxckpt.host.store import HostStore
from jaxckpt.restore import _read, _tiers

logger = logging.getLogger("jaxckpt.manager")

_LISTING_TRIES = 3


class Listing:
  """One manager's listing (see the module docstring).

  Args:
    store: the manager's HostStore; ledger: its ledger; directory: its storage (None:
      none); policy: its policy (whether steps carry time and metrics to rank).
    parity: whether steps rebuildable from parity are listed.
    settle: waits for the snapshot in flight (a step being saved is described once held).
  """

  def __init__(self, store: HostStore, ledger: Ledger, directory: str | None, policy: Policy,
               *, parity: bool, settle: Callable[[], None]) -> None:
    self.store, self.ledger, self.directory, self.policy = store, ledger, directory, policy
    self.parity, self.settle = parity, settle
    self._unlisted = False            # storage's listing did not answer last time

  def all_steps(self) -> list[int]:
    """The listing (see the module docstring). The tiers are read, then the ledger updated
    from what they said, unless another thread saved or deleted a step meanwhile: then
    they are read again (three times at most, then answered from the last reading)."""
    led = self.ledger
    for attempt in range(_LISTING_TRIES):
      since = led.version() if attempt < _LISTING_TRIES - 1 else None
      flight = led.in_flight()          # first: once it is done, the host tier holds it
      held = set(_tiers.complete_steps(self.store))
      if self.parity:
        held |= set(_tiers.rebuildable_steps(sorted(held), self.store))
      stored = self._stored()
      pending = set(self.store.persist_status().pending)
      out = led.list_steps(since=since, flight=flight, stored=stored, held=held,
                           pending=pending)
      if out is not None:
        return out
    raise AssertionError("unreachable: the last reading always answers")

  def _stored(self) -> set[int]:
    """The stored steps: storage's listing, asked for at most ``LATE_PROBE_SECS``; while
    storage does not answer, the ledger's record of them (said at WARNING, once an outage)."""
    try:
      stored = set(_tiers.storage_steps(self.directory, timeout_secs=_layout.LATE_PROBE_SECS))
    except errors.StorageError as e:
      if not self._unlisted:
        logger.warning("storage does not answer its listing (%s); the steps are listed as this "
                       "manager last knew them until it does", e)
      self._unlisted = True
      return set(self.ledger.listed)
    self._unlisted = False
    return stored

  def best_step(self) -> int | None:
    """The best kept step by ``best_fn``, else the newest; None if none has metrics."""
    if self.policy.best_key is None:
      steps = self.all_steps()
      return steps[-1] if steps else None
    return self.policy.best(self.ledger.kept())

  def metrics(self, step: int) -> Any:
    """The metrics given to ``save(step, ..., metrics=...)``, or None."""
    rec = self.ledger.get(step)
    if rec is not None and rec.metrics is not None:
      return rec.metrics
    try:
      return self.step_metadata(step)[2].get(METRICS_KEY)
    except errors.StepNotFoundError:
      return None

  def step_metadata(self, step: int) -> tuple[str, dict[str, _read.LeafMetadata], dict]:
    """The tier that describes ``step``, its leaves by path and its metadata."""
    if step == self.ledger.flight_step:
      self.settle()                   # the step being saved: once it is held
    return _tiers.step_metadata(self.store, self.directory, step)

  def load(self) -> None:
    """The stored steps, and the checkpoints among them and the held ones (a relaunch),
    with their time and metrics (what orbax reads at start)."""
    led = self.ledger
    stored = _tiers.storage_steps(self.directory)
    held = _tiers.complete_steps(self.store)
    led.loaded(stored, held)
    if self.policy.records:
      infos = [self._info(s) for s in sorted(set(stored) | set(held)) if s not in led.dropped()]
      led.found(i for i in infos if i is not None and (i.step in stored or i.time is not EPOCH))
    if self.policy.to_remove is not None:   # what the run's keep policy dropped stays dropped
      led.drop(self.policy.to_remove(led.kept()), "retention")
    found = universal.orbax_found(self.directory)
    if found:
      logger.info("%s", found)

  def _info(self, step: int) -> StepInfo | None:
    """``step``'s time and metrics (a damaged step's: none); None if storage refused or
    did not answer now: such a step is left out of the keep policy's ranking (never
    dropped for it), and ranked at the next reload."""
    try:
      meta = self.step_metadata(step)[2]
    except errors.StorageError as e:
      logger.warning("step %d: its time and metrics cannot be read now (%s); it is kept, "
                     "and left out of the keep policy's ranking until a reload()", step, e)
      return None
    except (errors.StepNotFoundError, errors.CorruptSnapshotError, errors.ManifestError) as e:
      logger.warning("step %d: its time and metrics cannot be read (%s)", step, e)
      return StepInfo(step, EPOCH, None)
    t = meta.get(TIME_KEY)
    when = EPOCH if t is None else datetime.datetime.fromtimestamp(t, tz=datetime.timezone.utc)
    return StepInfo(step, when, meta.get(METRICS_KEY))

"""The persists a trainer's store rebuilds from parity (``AgentStore.repersist``):
the steps due for storage that this host's agent held when it died, or that the job
persists and this host's new agent never held (``recover``); each rebuilt piece is
written as the job's attempt on a thread of its own, fenced by a delete or a rollback."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import TYPE_CHECKING, Callable

from jaxckpt import errors
from jaxckpt.agent import _requests
from jaxckpt.agent.commands.jobs import same_directory
from jaxckpt.host import _persist
from jaxckpt.host.store import PersistError, PersistStatus

if TYPE_CHECKING:
  from jaxckpt.agent.trainer.client import AgentStore

logger = logging.getLogger("jaxckpt.agent.trainer.client")


class _Fenced(Exception):
  """A rebuilt persist of a step deleted meanwhile: it must not commit."""


class Repersister:
  """Rebuilds and persists ``store``'s lost pieces of steps due for storage."""

  def __init__(self, store: AgentStore) -> None:
    self.store = store
    self.lock = threading.Lock()
    # (step, attempt) of the persists rebuilt here that run, and of those fenced (deleted
    # or rolled back: they must not commit)
    self.running: set[tuple[int, str]] = set()
    self.fenced: set[tuple[int, str]] = set()

  def rebuilding(self, step: int) -> bool:
    """Whether a rebuilt persist of ``step`` still runs here."""
    with self.lock:
      return any(s == step for s, _ in self.running)

  def recover(self, process_index: int, *, run_id: str | None = None) -> None:
    """Finishes the persists the job started that this host's agent can no longer
    take part in: it is a new agent holding nothing (the machine was lost, or the
    agent died while no trainer ran). For each step due for storage whose persist
    the job's other agents still run (one attempt: theirs, which a rollback or a
    delete would have fenced), saved by a job of this one's size (``discover``), and
    that is not committed, this process's piece is
    rebuilt from parity and written as the same attempt, and process 0 commits
    it: on a thread of its own, fenced by a delete or a rollback of this run. An
    agent that holds steps outlived the last run: a step it lacks it dropped on
    purpose, and nothing is recovered. Runs once the job's agents are known
    (``discover``); a no-op without parity or a persist directory.

    Each peer's persist runs until process 0 has committed the step
    (``_persist.persist_part``), so a lost process 0 is found too. Not
    recovered: a step whose peers' persists all ended without a commit (they
    waited ``PersistConfig.timeout_secs``), since only storage then knows the
    attempt, and an attempt found there cannot be told from an abandoned one;
    nor an attempt of this run (``run_id``): a peer that ran ahead of this
    process is persisting its own new save, which this process saves too; nor
    an attempt to another directory than this trainer's (of an earlier run's
    persist options: this trainer knows neither its timeout nor its hold)."""
    if not (self.store.parity_options and self.store.persist_options) or self.store.steps():
      return
    from jaxckpt import universal  # pylint: disable=import-outside-toplevel  (JAX: the trainer's side)
    directory = self.store.persist_options["directory"]
    pending: dict[int, set[str]] = {}
    with self.store.job.clients() as clients:
      for c in clients.values():
        if c.pid == self.store.pid:
          continue
        try:
          status = c.call(_requests.Persisted(errors=False))[0].persist or PersistStatus()
          counts = {s: n for s, _, n in c.call(_requests.Held())[0].held}
        except errors.AgentUnavailableError as e:
          logger.warning("recovering persists: %s", e)
          continue
        for s, a, where in ((p.step, p.attempt, p.directory) for p in status.attempts):
          size = self.store.job.size
          if size is not None and counts.get(s, size) != size:
            logger.warning("step %d: not recovering its persist (attempt %s): a job of %d "
                           "processes saved it, this one has %d", s, a, counts[s],
                           self.store.job.size)
          elif where and not same_directory(where, directory):
            logger.warning("step %d: not recovering its persist to %s (attempt %s, an earlier "
                           "run's options): this trainer persists to %s", s, where, a, directory)
          elif not _persist.of_run(a, run_id):
            pending.setdefault(s, set()).add(a)
    lost = []
    for step, attempts in sorted(pending.items()):
      if universal.committed_by(directory, step) is not None:
        continue
      if len(attempts) != 1:
        logger.warning("step %d: not recovering its persist: attempts %s disagree", step,
                       sorted(attempts))
        continue
      attempt, = attempts
      if process_index == 0 or universal.missing_parts(directory, step, attempt,
                                                       of=[process_index]):
        lost.append((step, attempt))
    if lost:
      logger.warning("steps %s: the job persists them and this host's new agent does not "
                     "hold them; rebuilding this host's piece from parity",
                     [s for s, _ in lost])
      self.start(lost)

  def start(self, lost: list[tuple[int, str]]) -> None:
    with self.lock:
      self.running.update(lost)
    threading.Thread(target=self._persist_lost, args=(lost,), daemon=True,
                     name="jaxckpt-repersist").start()

  def check(self, step: int, attempt: str) -> None:
    with self.lock:
      if (step, attempt) in self.fenced:
        raise _Fenced(step)

  def fence(self, fenced: Callable[[int], bool]) -> None:
    """Fences the rebuilt persists of the steps ``fenced`` says (a delete, a rollback)."""
    if not self.running:          # (every commit asks: almost always nothing runs)
      return
    with self.lock:
      self.fenced.update(j for j in self.running if fenced(j[0]))

  def _persist_lost(self, lost: list[tuple[int, str]]) -> None:
    for step, attempt in lost:
      try:
        self._persist_rebuilt(step, attempt)
        logger.warning("step %d: rebuilt from parity and persisted after %s died", step,
                       self.store.who)
      except _Fenced:
        logger.info("step %d: its rebuilt persist was fenced (deleted)", step)
      except Exception as e:  # pylint: disable=broad-except  (handed to the trainer, typed)
        self.store.failed(PersistError(
            step, attempt, "AgentUnavailableError",
            f"{self.store.who} died before step {step} was on storage, and its piece could not "
            f"be rebuilt from parity ({type(e).__name__}: {e}); restore an earlier step, or "
            "save it again"))
      finally:
        with self.lock:
          self.running.discard((step, attempt))
          self.fenced.discard((step, attempt))

  def _persist_rebuilt(self, step: int, attempt: str) -> None:
    if not (self.store.parity_options and self.store.persist_options):
      raise errors.UnrecoverableLossError("parity is off: nothing else holds the piece")
    config = _persist.PersistConfig(**self.store.persist_options)
    from jaxckpt import universal  # pylint: disable=import-outside-toplevel  (JAX: the trainer's side)
    if universal.committed_by(config.directory, step) is not None:
      return        # it ended on storage before its agent died (the status was stale)
    if self.store.process != 0 and not universal.missing_parts(config.directory, step, attempt,
                                                         of=[self.store.process]):
      return        # the dead agent wrote this process's part; process 0 commits it
    check = functools.partial(self.check, step, attempt)
    with contextlib.ExitStack() as stack:
      pieces = self.store.job.other_pieces(step, None, rebuild=True, have=[], stack=stack)
      # this process's piece, rebuilt here (another lost one's is its own process's to write)
      piece = next((p for p in pieces if p.rebuilt
                    and p.manifest.process_index == self.store.process), None)
      if piece is None:
        raise errors.UnrecoverableLossError(f"process {self.store.process}'s piece of step {step} "
                                            "was not rebuilt")
      buffer = piece.whole()
      check()
      _persist.persist_part(config, piece.manifest, buffer, attempt, check,
                            storage=universal)


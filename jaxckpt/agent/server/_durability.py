"""What the agent does for a committed step beyond holding it (``Agent.durable``):
its persist to storage and its parity, the glue between them and the slot table
(the persist thread's pinned reads, the keep rule's holds and protection), and each
step's manifest parsed once for all of them."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any

from jaxckpt import errors
from jaxckpt.agent import _parity_config, _requests
from jaxckpt.agent.server import _parity_worker
from jaxckpt.agent.server._slot_files import SlotReader
from jaxckpt.host import _persist, _slots

if TYPE_CHECKING:
  from jaxckpt.agent.server._server import Agent

logger = logging.getLogger("jaxckpt.agent")


def _storage() -> _persist.PersistStorage:
  """The universal format, where this agent persists: imported by the persist thread
  when a persist runs (it imports JAX), never by an agent that does not persist."""
  from jaxckpt import universal  # pylint: disable=import-outside-toplevel
  return universal


class Durability:
  """``agent``'s persists (``persister``) and parity (``parity``): this part owns both
  (the agent reads them, ``Agent.persister``/``Agent.parity``, and never sets them)."""

  def __init__(self, agent: Agent) -> None:
    self.agent = agent
    self.persister: _persist.Persister | None = None   # once a trainer asks for persists
    self.parity: _parity_worker.ParityWorker | None = None   # once a trainer asks for parity

  def configure_persist(self, persist: dict[str, Any]) -> None:
    """Starts the persister with a trainer's options, or gives it new ones."""
    if self.persister is None:
      self.persister = _persist.Persister(_persist.PersistConfig(**persist), self.pinned,
                                          self.release_held, storage=_storage)
    elif self.persister.config.to_obj() != persist:
      # A trainer relaunched with other options: the persists queued and running keep
      # theirs, in the same queue (its status, fences and errors cover them all).
      self.persister.configure(_persist.PersistConfig(**persist))

  def configure_parity(self, parity: dict[str, Any]) -> None:
    """Starts the parity thread, or gives it a trainer's options for later steps: the
    parity already held keeps the options it was made with (a job relaunched with
    other options, or on another number of processes, rebuilds what it restores)."""
    config = _parity_config.ParityConfig(**parity)
    if self.parity is None:
      self.parity = _parity_worker.ParityWorker(self.agent, config)
    elif self.parity.config != config:
      if self.parity.config.options != config.options:
        logger.info("parity options changed from %s to %s for later steps; the parity held "
                    "keeps its own", self.parity.config.options, config.options)
      self.parity.reconfigure(config)

  def reply(self, errors: bool = True) -> dict[str, Any]:
    """The persist status (and, with ``errors``, the errors since the last ask)."""
    p = self.agent.persister
    if p is None:
      return {"persist": None, "persist_errors": []}
    return {"persist": p.status(), "persist_errors": p.take_errors() if errors else []}

  def held_for_persist(self, step: int) -> bool:
    """Whether committed ``step`` is held until its persist ends."""
    with self.agent.lock:
      s = self.agent.table.committed(step)
      return s is not None and s.held

  def protected(self, step: int) -> None:
    """Every host of ``step``'s parity group holds its parity (parity thread): the
    keep rule keeps it while it is the newest such step."""
    with self.agent.lock:
      self.agent.dropped(self.agent.table.protect(step))

  def release_held(self, step: int, attempt: str | None = None) -> None:
    """The persist ``attempt`` of ``step`` ended: the keep rule may drop it now
    (persist thread)."""
    with self.agent.lock:
      self.agent.dropped(self.agent.table.release(step, attempt))

  @contextlib.contextmanager
  def pinned(self, step: int, attempt: str | None = None):
    """Pins a committed step (the one held for persist ``attempt``, an earlier run's
    too) for the persist thread while it reads the slot."""
    me = -os.getpid()                   # a pin owner that reap() never treats as dead
    with self.agent.lock:
      s = self.agent.table.pin(step, me, attempt)
      if s is None and attempt is None:
        s = self.agent.slot_of(step)    # (raises StepNotFoundError)
      if s is None:                     # (never another run's step of that number)
        raise errors.StepNotFoundError(f"agent of job {self.agent.job!r} host {self.agent.host} "
                                       f"holds step {step} for no persist attempt {attempt!r}")
    reader = None
    try:
      manifest = s.parsed()               # (once per commit, shared with the parity thread)
      if not s.size:
        yield manifest, b""
      else:           # read through the file, never a map: a truncated slot is no SIGBUS
        reader = SlotReader(self.agent.files.of(s.index).path, s.size, step)
        yield manifest, reader
    finally:
      if reader is not None:
        reader.close()
      with self.agent.lock:
        self.agent.table.unpin(s.index, me)

  def op_persisted(self, errors: bool = True) -> _requests.Persisted.Reply:
    """The persist status, and (``errors``) the persist errors since the last
    ask, each reported once."""
    return _requests.Persisted.Reply(**self.reply(errors))

  def op_parity_done(self, step: int, peer: int, digest: str) -> _requests.Done:
    """Group peer ``peer`` finished its parity of ``step`` (``ParityWorker.peer_done``)."""
    if self.agent.parity is not None:
      self.agent.parity.peer_done(int(step), int(peer), str(digest))
    return _requests.Done()

  def op_parity_status(self) -> _requests.ParityStatus.Reply:
    if self.agent.parity is None:
      return _requests.ParityStatus.Reply(steps=[], bytes=0, config=None)
    return _requests.ParityStatus.Reply(**self.agent.parity.status())

  def op_parity_info(self, step: int) -> _requests.ParityInfo.Reply:
    return _requests.ParityInfo.Reply(**self.worker().info(step))

  def worker(self) -> Any:
    if self.agent.parity is None:
      raise errors.StepNotFoundError(
          f"agent of job {self.agent.job!r} host {self.agent.host} holds no parity (no trainer "
          "asked for it: CheckpointOptions(parity=ParityOptions(...)))")
    return self.agent.parity

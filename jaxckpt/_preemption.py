"""Preemption notices: SIGTERM becomes a flag the training loop polls."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import jax

logger = logging.getLogger(__name__)


class Notice:
  """Remembers that SIGTERM arrived (and restores the old handler on uninstall)."""

  def __init__(self, *, install: bool) -> None:
    self.event = threading.Event()
    self._previous: Any = None
    self._installed = False
    if install and threading.current_thread() is threading.main_thread():
      current = signal.getsignal(signal.SIGTERM)
      if current in (signal.SIG_DFL, None):
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True
      else:
        logger.info("SIGTERM already handled by %r; relying on it for preemption", current)

  def _on_sigterm(self, signum: int, frame: Any) -> None:
    del signum, frame
    logger.warning("SIGTERM received: preemption notice; snapshot and exit at the next step")
    self.event.set()

  def reached(self, step: int) -> bool:
    if self.event.is_set():
      return True
    if jax.process_count() > 1:
      try:
        from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
        return bool(multihost_utils.reached_preemption_sync_point(step))
      except (RuntimeError, AttributeError):
        return False   # no preemption service in this job
    return False

  def uninstall(self) -> None:
    if self._installed and threading.current_thread() is threading.main_thread():
      signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
      self._installed = False

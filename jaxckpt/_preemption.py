"""Preemption notices: SIGTERM becomes a flag the training loop polls."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

import jax

logger = logging.getLogger(__name__)


class Notice:
  """Remembers that SIGTERM arrived (and restores the old handler on uninstall).

  A loop that never asks ``reached_preemption`` must still die on SIGTERM: if
  nobody acknowledges the notice within ``grace_secs``, or a second SIGTERM
  arrives, the default action (terminate) is taken.
  """

  def __init__(self, *, install: bool, grace_secs: float = 60.0) -> None:
    self.event = threading.Event()
    self.grace_secs = grace_secs
    self._timer: threading.Timer | None = None
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
    if self.event.is_set():            # a second SIGTERM, or the grace period ran out
      signal.signal(signal.SIGTERM, signal.SIG_DFL)
      os.kill(os.getpid(), signal.SIGTERM)
      return
    logger.warning("SIGTERM received: preemption notice; snapshot and exit at the next "
                   "step (terminating in %.0f s if reached_preemption is never asked)",
                   self.grace_secs)
    self.event.set()
    self._timer = threading.Timer(self.grace_secs, self._die)
    self._timer.daemon = True
    self._timer.start()

  def _die(self) -> None:
    """Runs on the timer thread: the handler (main thread) then takes the default action."""
    logger.error("preemption notice not acted on within %.0f s; terminating", self.grace_secs)
    os.kill(os.getpid(), signal.SIGTERM)

  def reached(self, step: int) -> bool:
    if self.event.is_set():
      if self._timer is not None:      # the loop saw it: it owns the exit now
        self._timer.cancel()
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

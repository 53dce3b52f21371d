"""Preemption notices: SIGTERM becomes a flag the training loop polls, with a deadline.

A scheduler that preempts a job sends SIGTERM and, a grace period later, SIGKILL (Kubernetes
waits 30 s by default, Slurm's ``KillWait`` 30 s, a GCE preemption notice 30 s). A loop that
asks ``reached_preemption(step)`` sees the notice, takes its last snapshot and exits on its own.
A loop that never asks must still end, and end cleanly, before the SIGKILL:

* until ``poll_secs`` after SIGTERM the loop may still ask, and then owns the exit;
* then the deadline callbacks run (the manager's ``close``: the snapshot in flight is committed,
  the newest snapshot persisted where host memory ends with the process, and persists end), in the main thread when it runs Python (the loop is paused there, so
  no ``save`` runs beside them), else on the notice's thread;
* as soon as they return, and at ``grace_secs`` after SIGTERM at the latest, the process ends
  by SIGTERM's default action (killed by SIGTERM, exit status -15), whatever the main thread
  is doing, even inside a long XLA computation.

A second SIGTERM before the deadline takes the default action at once.
"""

from __future__ import annotations

import _thread
import ctypes
import logging
import os
import signal
import threading
import time
import weakref
from typing import Any, Callable

from jax.experimental import multihost_utils

logger = logging.getLogger(__name__)

DEFAULT_GRACE_SECS = 25.0
"""The default ``CheckpointOptions.sigterm_grace_secs``: inside the 30 s that Kubernetes, Slurm
and GCE give between SIGTERM and SIGKILL, with 5 s to spare."""

MAX_FINISH_SECS = 10.0
"""The longest share of the grace kept for the deadline callbacks (half the grace when shorter)."""

PICKUP_SECS = 1.0
"""How long the deadline waits for the main thread to run the callbacks before running them on
its own thread (the main thread is then inside native code)."""


def finish_secs(grace_secs: float) -> float:
  """The part of ``grace_secs`` kept for the deadline callbacks: ``min(10 s, grace / 2)``.

  >>> finish_secs(25.0), finish_secs(4.0)
  (10.0, 2.0)
  """
  return min(MAX_FINISH_SECS, grace_secs / 2)


class Notice:
  """Remembers that SIGTERM arrived; ends the process if nobody acts on it in time.

  Args:
    install: install the SIGTERM handler (only from the main thread, and only if SIGTERM has
      its default action: another handler, e.g. JAX's preemption service, is left alone).
    grace_secs: the longest the process lives after SIGTERM when ``reached`` is never asked.
    on_deadline: called when the loop did not ask ``reached`` within :attr:`poll_secs`, before
      the process ends (see the module docstring); more with :meth:`add_deadline_callback`.
  """

  def __init__(self, *, install: bool, grace_secs: float = DEFAULT_GRACE_SECS,
               on_deadline: Callable[[], Any] | None = None) -> None:
    self.event = threading.Event()
    self.grace_secs = grace_secs
    self._callbacks: list[Callable[[], Any]] = [] if on_deadline is None else [on_deadline]
    self._lock = threading.RLock()   # the Python handler may run while the main thread holds it
    self._timer: threading.Timer | None = None
    self._heard: dict[str, int] = {}
    self._sigterms = 0
    self._deadline = False             # the deadline began: the process is ending
    self._claimed = False              # a thread runs the callbacks
    self._done = threading.Event()     # they returned
    self._previous: Any = None
    self._installed = False
    self._wakeup: tuple[int, int] | None = None
    if install and threading.current_thread() is threading.main_thread():
      current = signal.getsignal(signal.SIGTERM)
      if current in (signal.SIG_DFL, None) and _c_handler(signal.SIGTERM) not in (0, None):
        # A handler installed below Python (JAX's preemption service, by
        # jax.distributed.initialize): Python does not see it, and replacing it would
        # leave the job's other processes deaf to this one's notice.
        logger.info("SIGTERM already handled in C (JAX's preemption service?); relying on "
                    "it for preemption")
      elif current in (signal.SIG_DFL, None):
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True
        _INSTALLED.add(self)
        self._watch()
      else:
        logger.info("SIGTERM already handled by %r; relying on it for preemption", current)

  @property
  def poll_secs(self) -> float:
    """How long after SIGTERM the loop may still ask ``reached`` and own the exit."""
    return self.grace_secs - finish_secs(self.grace_secs)

  def add_deadline_callback(self, fn: Callable[[], Any]) -> None:
    """Calls ``fn()`` at the deadline (see :class:`Notice`); its errors are logged."""
    self._callbacks.append(fn)

  # -- hearing SIGTERM ------------------------------------------------------

  def _watch(self) -> None:
    """Hears SIGTERM at once, on a thread of its own.

    A Python signal handler runs in the main thread between bytecodes, so a main thread inside
    a long native call (an XLA computation) would hear of the notice only when the call returns.
    Python's C-level handler also writes each signal's number to the wakeup fd as the signal
    arrives; a thread reading it acts then. If something else (an asyncio loop) owns the
    wakeup fd, it is left alone and the Python handler acts instead.
    """
    r, w = os.pipe()
    os.set_blocking(w, False)
    if signal.set_wakeup_fd(w, warn_on_full_buffer=False) != -1:
      signal.set_wakeup_fd(signal.set_wakeup_fd(-1))   # not ours: put it back
      os.close(r)
      os.close(w)
      return
    self._wakeup = (r, w)
    threading.Thread(target=self._read_wakeups, args=(r,), daemon=True,
                     name="jaxckpt-sigterm").start()

  def _read_wakeups(self, fd: int) -> None:
    while True:
      try:
        data = os.read(fd, 64)
      except OSError:
        return                         # uninstalled
      if not data:
        return
      for signum in data:
        if signum == signal.SIGTERM:
          self._count("wakeup fd")

  def _on_sigterm(self, signum: int, frame: Any) -> None:
    del signum, frame
    if self._deadline:                 # the deadline asks the main thread to finish
      self._finish()
      terminate("SIGTERM's grace period ended")
      return
    self._count("handler")

  def _count(self, source: str) -> None:
    """One SIGTERM, as heard by ``source`` (the wakeup fd's thread or the Python handler).

    Each SIGTERM reaches both (the handler once the main thread runs Python again), or only
    the handler if another owner took the wakeup fd; the SIGTERMs so far are the larger of the
    two counts.
    """
    with self._lock:
      if self._deadline:
        return                         # ending already (the deadline's own interrupt, too)
      self._heard[source] = self._heard.get(source, 0) + 1
      sigterms = max(self._heard.values())
      if sigterms == self._sigterms:
        return
      self._sigterms = sigterms
      first = sigterms == 1
      if first:
        self._timer = threading.Timer(self.poll_secs, self._on_deadline)
        self._timer.daemon = True
        self.event.set()
        self._timer.start()
    # Logged outside the lock: the Python handler runs in the main thread, which may be
    # inside a logging call (holding its handler's lock) when the signal lands, while the
    # wakeup thread logs here too: under the lock, each waited for the other's lock.
    if first:
      logger.warning("SIGTERM received: preemption notice; snapshot and exit at the next step "
                     "(reached_preemption); if it is not asked within %.1f s, the newest "
                     "snapshot is committed and the process ends by %.1f s", self.poll_secs,
                     self.grace_secs)
      return
    terminate("a second SIGTERM")

  # -- the deadline -----------------------------------------------------------

  def _on_deadline(self) -> None:
    """On the timer's thread: has the callbacks run, bounded by a watchdog, then ends."""
    with self._lock:
      if self._timer is None:          # reached() took it meanwhile
        return
      self._deadline = True
    finish = self.grace_secs - self.poll_secs
    logger.error("preemption notice not acted on within %.1f s; committing and terminating "
                 "(at most %.1f s)", self.poll_secs, finish)
    watchdog = threading.Timer(finish, terminate, args=(f"the grace of {self.grace_secs} s ran out",))
    watchdog.daemon = True
    watchdog.start()
    _thread.interrupt_main(signal.SIGTERM)          # the main thread's handler: _finish there
    if not self._done.wait(min(PICKUP_SECS, finish / 4)):
      self._finish()                   # no-op if the main thread claimed them meanwhile
    self._done.wait()
    terminate("SIGTERM's grace period ended")

  def _finish(self) -> None:
    """Runs the callbacks in this thread if no other thread does, else waits for them."""
    with self._lock:
      claimed, self._claimed = self._claimed, True
    if claimed:
      self._done.wait()
      return
    for fn in list(self._callbacks):
      try:
        fn()
      except BaseException:  # pylint: disable=broad-except  (the process ends either way)
        logger.exception("preemption deadline callback %r failed", fn)
    self._done.set()

  def reached(self, step: int) -> bool:
    if self.event.is_set():
      with self._lock:
        if self._timer is not None and not self._deadline:
          self._timer.cancel()         # the loop saw it in time: it owns the exit now
          self._timer = None
      return True
    try:      # JAX's preemption service (jax.distributed), the same step on every process
      return bool(multihost_utils.reached_preemption_sync_point(step))
    except (RuntimeError, AttributeError):
      return False   # no preemption service in this job

  def uninstall(self) -> None:
    if self._installed and threading.current_thread() is threading.main_thread():
      signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
      self._installed = False
      _INSTALLED.discard(self)
      if self._wakeup is not None:
        if signal.set_wakeup_fd(-1) != self._wakeup[1]:
          logger.warning("the signal wakeup fd was replaced while the preemption notice held it")
        for fd in self._wakeup:
          os.close(fd)                 # the watcher's read ends: it returns
        self._wakeup = None


_INSTALLED: "weakref.WeakSet[Notice]" = weakref.WeakSet()


def _forget_in_child() -> None:
  """A forked child (a data loader's worker, a pool's) inherits the handler and the wakeup fd:
  a SIGTERM sent to it (``Pool.terminate()``) would start the parent's grace through the shared
  pipe, and the child would outlive it. The notice is the parent's: the child gets SIGTERM's
  default action back and its copies of the pipe are closed."""
  for notice in list(_INSTALLED):
    _INSTALLED.discard(notice)
    notice._installed = False      # pylint: disable=protected-access
    try:
      signal.signal(signal.SIGTERM, signal.SIG_DFL)
      if notice._wakeup is not None:  # pylint: disable=protected-access
        signal.set_wakeup_fd(-1)
        for fd in notice._wakeup:     # pylint: disable=protected-access
          os.close(fd)
    except (ValueError, OSError):
      pass
    notice._wakeup = None          # pylint: disable=protected-access


os.register_at_fork(after_in_child=_forget_in_child)


def _c_handler(signum: int) -> int | None:
  """The C library's handler of ``signum``: 0 for the default action, 1 for ignored,
  else its address; None where the C library cannot be asked."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sigaction.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    old = ctypes.create_string_buffer(512)   # a struct sigaction (its handler first), and room
    if libc.sigaction(signum, None, old) != 0:
      return None
    return ctypes.c_void_p.from_buffer(old).value or 0
  except (OSError, AttributeError):
    return None


_TERMINATING = threading.Lock()    # held by the one thread that ends the process (said once)


def terminate(why: str) -> None:
  """Ends this process by SIGTERM's default action, from any thread.

  ``signal.signal`` works only in the main thread, which may be inside a long native call;
  this resets SIGTERM's action in the C library instead and sends SIGTERM, which the kernel
  acts on at once.
  """
  if not _TERMINATING.acquire(blocking=False):     # another thread ends it already
    time.sleep(5.0)
    os._exit(128 + signal.SIGTERM)  # pylint: disable=protected-access
  logger.error("terminating on SIGTERM: %s", why)
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal.restype = ctypes.c_void_p
    libc.signal(signal.SIGTERM, None)              # SIG_DFL
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5.0)                                # the signal ends the process first
  except Exception:  # pylint: disable=broad-except  (no C library to ask: exit as SIGTERM would)
    logger.exception("could not take SIGTERM's default action; exiting with status 143")
  os._exit(128 + signal.SIGTERM)  # pylint: disable=protected-access

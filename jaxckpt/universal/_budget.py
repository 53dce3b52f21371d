"""The one cap on bytes in flight between host memory and storage (reads and writes)."""

from __future__ import annotations

import re
import threading
from typing import Any, Callable

from jaxckpt import errors
from jaxckpt.universal import _layout as lay

DEFAULT_MAX_INFLIGHT_BYTES = 1 << 30
TIMEOUT_SECS = 600.0


class ByteBudget:
  """Caps the bytes read from or handed to storage and not yet done with.

  ``acquire(n, what)`` waits until ``n`` more bytes fit (a request larger than
  the whole budget goes alone, so nothing waits forever); ``release(n)`` gives
  them back. ``track(future, n, what)`` acquires and releases when the
  tensorstore ``future`` is done, remembering its error for :meth:`drain`,
  which waits until every tracked byte is back and raises the first error.

  >>> b = ByteBudget(10, what="demo")
  >>> b.acquire(8, "a"); b.release(8); b.in_flight
  0
  """

  def __init__(self, max_bytes: int, *, what: str, timeout_secs: float = TIMEOUT_SECS,
               on_done: Callable[[int], None] | None = None) -> None:
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
      raise errors.InvalidArgumentError(
          f"max_inflight_bytes must be a positive int, got {max_bytes!r}")
    self._max, self._what, self._timeout = max_bytes, what, timeout_secs
    self._on_done = on_done
    self._used = 0
    self._error: BaseException | None = None
    self._cv = threading.Condition()

  @property
  def max_bytes(self) -> int:
    return self._max

  @property
  def in_flight(self) -> int:
    with self._cv:
      return self._used

  def acquire(self, n: int, what: str, *, own: int = 0) -> None:
    """Waits until ``n`` more bytes fit, or every byte in flight is the caller's
    own (``own`` of them: a caller that holds bytes never waits for itself)."""
    with self._cv:
      ok = self._cv.wait_for(lambda: self._used <= own or self._used + n <= self._max,
                             timeout=self._timeout)
      if not ok:
        raise errors.SnapshotTimeoutError(
            f"{self._what}: {what} waited {self._timeout} s for {n} bytes of the in-flight "
            f"budget ({self._used} of {self._max} bytes held by storage I/O that did not "
            "finish); check the storage backend")
      self._used += n

  def try_acquire(self, n: int) -> bool:
    """Takes ``n`` bytes if they fit now (or nothing is in flight); never waits."""
    with self._cv:
      if self._used and self._used + n > self._max:
        return False
      self._used += n
      return True

  def release(self, n: int) -> None:
    with self._cv:
      self._used -= n
      self._cv.notify_all()

  def track(self, future: Any, n: int, what: str) -> None:
    """Acquires ``n`` bytes for a tensorstore future; released when it is done."""
    self.acquire(n, what)

    def done(f: Any) -> None:
      try:
        f.result()
        if self._on_done is not None:
          self._on_done(n)
      except BaseException as e:  # pylint: disable=broad-except  (raised by drain)
        with self._cv:
          if self._error is None:
            self._error = _with_context(e, what)
      self.release(n)

    future.add_done_callback(done)

  def drain(self) -> None:
    """Waits until every tracked byte is released; raises the first tracked error."""
    with self._cv:
      ok = self._cv.wait_for(lambda: self._used == 0, timeout=self._timeout)
      err, self._error = self._error, None
    if err is not None:
      raise err
    if not ok:
      raise errors.SnapshotTimeoutError(
          f"{self._what}: storage I/O of {self._used} bytes did not finish within "
          f"{self._timeout} s; check the storage backend")


def _with_context(e: BaseException, what: str) -> BaseException:
  """A storage error as the jaxckpt error that fits it, naming ``what``."""
  if isinstance(e, errors.JaxckptError):
    return e
  code = re.search(r"os_error_code='(\d+)'", str(e))
  msg = f"writing {what} to storage failed: {lay.ts_error(e)}"
  err = errors.StorageError(int(code.group(1)), msg) if code else errors.StorageError(msg)
  err.__cause__ = e
  return err

"""One way to wait: a condition, a deadline, and who was late.

>>> until(lambda: 42, timeout_secs=1.0, late=lambda: "nobody")
42
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

from jaxckpt import errors

T = TypeVar("T")


def until(ready: Callable[[], T], *, timeout_secs: float, late: Callable[[], str],
          poll_secs: float = 0.02, max_poll_secs: float | None = None) -> T:
  """Calls ``ready()`` until it returns something true, and returns that.

  ``ready`` may raise to end the wait at once (a failure it learned of). After
  ``timeout_secs`` a SnapshotTimeoutError says ``late()``: what was waited for
  and who did not deliver it, computed only then. With ``max_poll_secs`` the
  pause doubles from ``poll_secs`` up to it (a condition asked of a remote store).
  """
  deadline = time.monotonic() + timeout_secs
  pause = poll_secs
  while True:
    got = ready()
    if got:
      return got
    if time.monotonic() >= deadline:
      raise errors.SnapshotTimeoutError(late())
    time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
    if max_poll_secs is not None:
      pause = min(pause * 2, max_poll_secs)

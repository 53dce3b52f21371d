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
          poll_secs: float = 0.02) -> T:
  """Calls ``ready()`` until it returns something true, and returns that.

  ``ready`` may raise to end the wait at once (a failure it learned of). After
  ``timeout_secs`` a SnapshotTimeoutError says ``late()``: what was waited for
  and who did not deliver it, computed only then.
  """
  deadline = time.monotonic() + timeout_secs
  while True:
    got = ready()
    if got:
      return got
    if time.monotonic() >= deadline:
      raise errors.SnapshotTimeoutError(late())
    time.sleep(min(poll_secs, max(0.0, deadline - time.monotonic())))

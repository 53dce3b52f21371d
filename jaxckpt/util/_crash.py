"""Crash points: where a test SIGKILLs the process to show that what it was doing is
whole against a crash there (a real kill of a real process, not a simulated one).

``JAXCKPT_CRASH_AT=NAME:K`` kills this process at the K-th crash point named NAME it
passes (``rollback:3``: the third of a rollback's). Unset (every real run), a point
costs one lookup of the environment. A test iterates K from 1 until the process
passes every point and ends on its own: a kill at each point of the operation.
"""

from __future__ import annotations

import collections
import os
import signal
import sys

ENV = "JAXCKPT_CRASH_AT"
_passed: collections.Counter[str] = collections.Counter()


def point(name: str) -> None:
  """One crash point of operation ``name`` (see the module)."""
  spec = os.environ.get(ENV)
  if not spec:
    return
  want, _, k = spec.rpartition(":")
  if want != name:
    return
  _passed[name] += 1
  if _passed[name] == int(k):
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)

"""The commit of a step costs O(processes x leaves): a ratio at two sizes, not a wall clock."""

from __future__ import annotations

import functools
import time

from jaxckpt.testing.scale import simulated_commit_secs

# CPU seconds of this process (its tensorstore threads included): a loaded machine
# stretches wall time, not this.
_cpu = functools.partial(simulated_commit_secs, leaves=20, clock=time.process_time)


def test_commit_cost_per_process_stays_flat_from_32_to_256_processes():
  _cpu(8)                                                      # imports, caches
  small = min(_cpu(32) for _ in range(3)) / 32
  large = min(_cpu(256) for _ in range(3)) / 256
  # linear is 1x; the quadratic merge this guards against was 4x here and 50x at 1,024
  assert large / small < 2.5, (small, large)

"""The commit of a step costs O(processes x leaves): a ratio at two sizes, not a wall clock."""

from __future__ import annotations

from jaxckpt.testing.scale import simulated_commit_secs


def test_commit_cost_per_process_stays_flat_from_32_to_256_processes():
  simulated_commit_secs(8, leaves=20)                          # imports, caches
  small = min(simulated_commit_secs(32, leaves=20) for _ in range(3)) / 32
  large = min(simulated_commit_secs(256, leaves=20) for _ in range(3)) / 256
  # linear is 1x; the quadratic merge this guards against was 4x here and 50x at 1,024
  assert large / small < 2.5, (small, large)

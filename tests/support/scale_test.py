"""``benchmarks/scale.py``'s bytes and real-process curves in their tiniest form, and
jaxckpt's persist cost per GiB kept flat (a ratio at two sizes, not a wall clock)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.support.scale import persist_secs

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "benchmarks", "scale.py")


def _scale(*args: str) -> dict[str, Any]:
  p = subprocess.run([sys.executable, SCRIPT, "--leaves", "--processes", "--repeats", "1",
                      *args], capture_output=True, text=True, timeout=240, check=False)
  assert p.returncode == 0, p.stderr[-3000:]
  return json.loads(p.stdout)


def _numbers(tree: Any) -> list[float]:
  if isinstance(tree, dict):
    return [x for v in tree.values() for x in _numbers(v)]
  return [tree] if isinstance(tree, (int, float)) else []


def test_bytes_curve_times_jaxckpt_orbax_and_tensorstore_side_by_side():
  out = _scale("--bytes-mib", "16", "32")
  assert [r["mib"] for r in out["bytes"]] == [16, 32] and out["real_processes"] == []
  for row in out["bytes"]:
    assert set(row["jaxckpt"]) == set(row["orbax"]) == {
        "persist_secs", "persist_cpu_secs", "restore_secs", "restore_rss_gb_per_gb",
        "secs_per_gib"}, row
    assert set(row["tensorstore"]) == {"persist_secs", "persist_cpu_secs", "secs_per_gib"}
    assert set(row["ratio_jaxckpt_over_orbax"]) == {"persist", "restore", "restore_rss"}
    assert set(row["ratio_jaxckpt_over_tensorstore"]) == {"persist"}
    assert row["gib"] > 0 and all(x > 0 for x in _numbers(row)), row
    # the restored arrays themselves are resident: at least about 1 GB per GB
    assert row["jaxckpt"]["restore_rss_gb_per_gb"] > 0.5, row
  for key in ("jaxckpt_persist_secs_per_gib", "orbax_persist_secs_per_gib",
              "tensorstore_persist_secs_per_gib", "jaxckpt_restore_secs_per_gib",
              "orbax_restore_secs_per_gib"):
    assert isinstance(out["slopes"][key], float), (key, out["slopes"])


@pytest.mark.slow
def test_real_processes_curve_saves_and_restores_with_every_process():
  out = _scale("--real-processes", "2", "--real-mib", "16")
  (row,) = out["real_processes"]
  assert row["processes"] == 2 and row["mib"] == 16 and out["bytes"] == []
  for tool in ("jaxckpt", "orbax"):
    assert set(row[tool]) == {"persist_secs", "restore_secs"}, row
  assert set(row["ratio_jaxckpt_over_orbax"]) == {"persist", "restore"}
  assert all(x > 0 for x in _numbers(row)), row
  assert out["slopes"]["jaxckpt_real_persist_ms_per_process"] is None    # one size only


def test_jaxckpt_persist_cost_per_gib_stays_flat_from_32_to_128_mib():
  # Onto tmpfs: jaxckpt's own cost, not the disk's. Each size keeps its fastest of 5 saves
  # to storage, in two rounds taken in turns. The first saves of a process touch its fresh
  # snapshot slots (3 with max_snapshots=2), and on this VM, after the suite's earlier
  # tests, touching fresh memory was 3x slower for a while (CI and the full suite both
  # measured 128 MiB at 2.9-3.2 s/GiB, then 0.9 s/GiB minutes later): the 4th and 5th
  # saves reuse touched slots, which is what a training loop's persists do.
  shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
  small, large = float("inf"), float("inf")
  for _ in range(2):
    small = min(small, *persist_secs("jaxckpt", 32, 5, under=shm))
    large = min(large, *persist_secs("jaxckpt", 128, 5, under=shm))
  small, large = small / (32 / 1024), large / (128 / 1024)
  # linear is 1x (below 1 while fixed costs weigh at 32 MiB)
  assert large / small <= 1.5, (small, large)

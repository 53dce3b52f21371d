"""What a user's metrics tool gets from ``CheckpointManager(logger=...)``."""

from __future__ import annotations

import time

import numpy as np

import jaxckpt as jc


def test_logger_entries_start_time_is_wall_clock_time(tmp_path):
  """orbax's logger entries carry wall-clock times (time.time()): a metrics tool puts them on
  its time axis beside the loop's own logs, whatever the event and the thread it came from."""
  entries = []
  before = time.time()
  with jc.CheckpointManager(str(tmp_path), jc.CheckpointOptions(), logger=entries.append) as m:
    m.save(1, {"w": np.ones(1000, np.float32)})
    m.wait_until_finished()
    m.save(2, {"w": np.ones(1000, np.float32)}, force=True)   # its commit sees step 1's persist end
    m.wait_until_finished()
    m.restore(2)
  after = time.time()
  kinds = {e["event_type"] for e in entries}
  assert {"save", "snapshot", "persist", "restore"} <= kinds, kinds
  for e in entries:
    assert before - 1 <= e["start_time"] <= after, (e, before, after)

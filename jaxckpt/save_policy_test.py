"""Tests of which saves happen: should_save, and due-for-storage saves never skipped."""

from __future__ import annotations

import dataclasses
import logging
import threading

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt import errors, universal
from jaxckpt.host.store import InProcessStore


class GatedStore(InProcessStore):
  """An in-process store whose commits wait for ``gate`` (a snapshot that stays busy)."""

  def __init__(self, **kw):
    super().__init__(**kw)
    self.gate = threading.Event()

  def commit(self, slot, manifest, **kw):
    assert self.gate.wait(60), "test gate never opened"
    super().commit(slot, manifest, **kw)


def test_should_save_follows_interval():
  opts = jc.CheckpointOptions(max_snapshots=1, save_interval_steps=5)
  mgr = jc.CheckpointManager(options=opts)
  assert [s for s in range(12) if mgr.should_save(s)] == [0, 5, 10]
  with pytest.raises(errors.InvalidArgumentError, match=r"should_save\(step=5.0\)"):
    mgr.should_save(5.0)
  mgr.close()
  assert not mgr.should_save(5)


def test_a_busy_skip_is_a_warning_at_the_1st_2nd_4th_skip(caplog):
  # Every skipped save loses a step a crash would have kept: a WARNING (the guide says
  # so), with the running count; said at the 1st, 2nd, 4th, 8th... only, not each.
  opts = jc.CheckpointOptions(max_snapshots=2, on_busy="skip", timeout_secs=60)
  store = GatedStore(max_snapshots=2, host_memory_limit_bytes=1 << 26)
  mgr = jc.CheckpointManager(options=opts, store=store)
  x = np.arange(1000, dtype=np.float32)
  try:
    store.gate.set()
    for step in range(1, 8):
      assert mgr.save(step, {"w": x + step})
      mgr.wait_until_snapshotted()
    with caplog.at_level(logging.DEBUG, logger="jaxckpt.manager"):
      for step in (8, 12, 16, 20):
        store.gate.clear()
        assert mgr.save(step, {"w": x + step})     # its copy stays busy
        assert not mgr.save(step + 1, {"w": x + step + 1})   # skipped
        store.gate.set()
        for s in (step + 2, step + 3):             # the two after a skip wait for the copy
          assert mgr.save(s, {"w": x + s})
          mgr.wait_until_snapshotted()
    said = {r.getMessage().split(":")[0]: r.levelno for r in caplog.records
            if "save skipped" in r.getMessage()}
    assert said == {"step 9": logging.WARNING, "step 13": logging.WARNING,
                    "step 17": logging.DEBUG, "step 21": logging.WARNING}, said
    assert mgr.stats.skipped_busy == 4
  finally:
    store.gate.set()
    mgr.close()


def test_a_forced_save_waits_for_the_busy_copy_instead_of_skipping():
  # Without a directory no save is due for storage; force=True still asks for this step
  # (a loop's last one): it waits for the previous copy (bounded), it is never skipped.
  opts = jc.CheckpointOptions(max_snapshots=2, on_busy="skip", timeout_secs=60)
  store = GatedStore(max_snapshots=2, host_memory_limit_bytes=1 << 26)
  mgr = jc.CheckpointManager(options=opts, store=store)
  x = np.arange(1000, dtype=np.float32)
  try:
    assert mgr.save(1, {"w": x + 1})               # its copy stays busy
    assert not mgr.save(2, {"w": x + 2})           # skipped
    threading.Timer(0.2, store.gate.set).start()   # the copy finishes while step 3 waits
    assert mgr.save(3, {"w": x + 3}, force=True)
    mgr.wait_until_finished()
    assert mgr.all_steps() == [1, 3] and mgr.stats.skipped_busy == 1
    np.testing.assert_array_equal(mgr.restore(3, {"w": x})["w"], x + 3)
  finally:
    store.gate.set()
    mgr.close()


def test_due_save_waits_instead_of_skipping(tmp_path, caplog):
  opts = jc.CheckpointOptions(max_snapshots=2, save_interval_steps=1, persist_interval_steps=4,
                              on_busy="skip", timeout_secs=0.5)
  store = GatedStore(max_snapshots=2, host_memory_limit_bytes=1 << 26, storage=universal)
  mgr = jc.CheckpointManager(str(tmp_path), opts, store=store)
  try:
    x = np.arange(1000, dtype=np.float32)
    assert mgr.save(1, {"w": x})
    with caplog.at_level(logging.WARNING, logger="jaxckpt.manager"):
      assert not mgr.save(2, {"w": x + 2})         # not due for storage: skipped, loudly
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step 2: save skipped" in m and "1 of 2 saves skipped so far" in m for m in msgs), msgs
    with pytest.raises(errors.SnapshotTimeoutError,      # never a run of skips: it waits
                       match=r"save of step 3 \(the save of step 2 was skipped while a copy "
                             r"ran: on_busy='skip' skips no save of the next two: never "
                             r"skipped\): the background snapshot copy"):
      mgr.save(3, {"w": x + 3})
    assert mgr.stats.skipped_busy == 1
    with pytest.raises(errors.SnapshotTimeoutError,
                       match=r"save of step 4 \(due for storage: never skipped\): the background "
                             r"snapshot copy of process 0 did not finish within 0.5 s"):
      mgr.save(4, {"w": x + 4})                   # due: waited (bounded), not skipped
    threading.Timer(0.2, store.gate.set).start()     # the copy finishes while step 4 waits
    mgr._core.options = mgr._core._flow.options = dataclasses.replace(   # a longer bound
        mgr.options, timeout_secs=60.0)
    assert mgr.save(4, {"w": x + 4})
    mgr.wait_until_persisted(4, timeout_secs=60)
    assert mgr.stats.skipped_busy == 1
  finally:
    store.gate.set()
    mgr.close()
  with jc.CheckpointManager(str(tmp_path), jc.CheckpointOptions(max_snapshots=1)) as m2:
    out = m2.restore(4, {"w": x})
    assert m2.last_restore.tier == "storage"
    np.testing.assert_array_equal(out["w"], x + 4)

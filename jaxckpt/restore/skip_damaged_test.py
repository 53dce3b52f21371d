"""restore(step=None) takes the newest step that can be restored: a damaged newer
step is skipped loudly and set aside, so a relaunched job resumes and saves that
step again; an explicit restore of it still raises."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.testing import damage


def state(step: int) -> dict:
  return {"w": np.arange(4096, dtype=np.float32).reshape(64, 64) + step, "step": step}


def target() -> dict:
  return {"w": np.zeros((64, 64), np.float32), "step": 0}


def _opts() -> jc.CheckpointOptions:
  return jc.CheckpointOptions(persist_interval_steps=10, handle_sigterm=False)


def test_a_damaged_newest_step_is_skipped_loudly_and_the_job_resumes(storage_dir, caplog):
  with jc.CheckpointManager(storage_dir, _opts()) as m:
    for s in (60, 70):
      assert m.save(s, state(s))
      m.wait_until_finished()
  damage.flip_stored_byte(storage_dir, 70, "['w']", (5, 7))
  with jc.CheckpointManager(storage_dir, _opts()) as m:     # a relaunch: storage only
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
      out = m.restore(target=target())
    assert (m.last_restore.step, m.last_restore.tier) == (60, "storage")
    np.testing.assert_array_equal(out["w"], state(60)["w"])
    (step, why), = m.last_restore.skipped
    assert step == 70 and "CorruptSnapshotError" in why and "['w']" in why
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step 70 cannot be restored" in w and "['w']" in w for w in warned), warned
    with pytest.raises(errors.CorruptSnapshotError, match="step 70"):
      m.restore(step=70, target=target())                  # asked for by name: still raises
    for s in range(61, 71):                                # the job goes on, step 70 again
      assert m.save(s, state(s), force=True) or s % 10
    m.wait_until_finished()
    out = m.restore(target=target())
    assert m.last_restore.step == 70 and m.last_restore.skipped == ()
    np.testing.assert_array_equal(out["w"], state(70)["w"])
  assert jc.universal.all_steps(storage_dir) == [60, 70]


def test_an_explicit_restore_of_a_damaged_step_raises_and_sets_nothing_aside(tmp_path):
  d = str(tmp_path / "ckpt")
  with jc.CheckpointManager(d, _opts()) as m:
    for s in (60, 70):
      assert m.save(s, state(s))
      m.wait_until_finished()
  damage.flip_stored_byte(d, 70, "['w']", (0, 0))
  with jc.CheckpointManager(d, _opts()) as m:
    with pytest.raises(errors.CorruptSnapshotError, match=r"step 70: leaf \"\['w'\]\""):
      m.restore(step=70, target=target())
    assert m.all_steps() == [60, 70]


def test_when_every_step_is_damaged_the_newest_damage_is_raised(tmp_path):
  d = str(tmp_path / "ckpt")
  with jc.CheckpointManager(d, _opts()) as m:
    assert m.save(10, state(10))
    m.wait_until_finished()
  damage.flip_stored_byte(d, 10, "['w']", (0, 0))
  with jc.CheckpointManager(d, _opts()) as m:
    with pytest.raises(errors.CorruptSnapshotError, match="step 10"):
      m.restore(target=target())

"""What restore(step=None) sets aside when it skips a damaged newest step: only proven
damage is set aside on storage, never by a manager
that may not write, and every form of restore skips it."""

from __future__ import annotations

import logging
import os

import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.testing import damage


def state(step: int) -> dict:
  return {"w": np.arange(256, dtype=np.float32).reshape(16, 16) + step}


def _opts() -> jc.CheckpointOptions:
  return jc.CheckpointOptions(persist_interval_steps=10, handle_sigterm=False)


def _saved(directory: str, steps=(10, 20)) -> None:
  with jc.CheckpointManager(directory, _opts()) as m:
    for s in steps:
      assert m.save(s, state(s))
      m.wait_until_finished()


def _as_newer_version(directory: str, step: int) -> None:
  """Rewrites ``step`` as a newer jaxckpt would have written it: its manifest says
  version 2, and its commit marker carries that manifest's checksum (nothing damaged)."""
  damage.reseal_manifest(directory, step, lambda doc, marker: doc.update(version=2))


def test_a_step_written_by_another_version_is_skipped_but_never_set_aside(tmp_path, caplog):
  # An older reader (an evaluation job, a rolled-back trainer) meets a step a newer
  # jaxckpt wrote. It cannot read it, but the step is not damaged: setting it aside
  # would hide a good checkpoint from the job that wrote it, for good.
  d = str(tmp_path / "ckpt")
  _saved(d)
  _as_newer_version(d, 20)
  with jc.CheckpointManager(d, _opts()) as m:
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
      out = m.restore(target={"w": np.zeros((16, 16), np.float32)})
    assert m.last_restore.step == 10
    np.testing.assert_array_equal(out["w"], state(10)["w"])
    (step, why), = m.last_restore.skipped
    assert step == 20 and "ManifestError" in why
  assert jc.universal.all_steps(d) == [10, 20]          # still there for the newer version
  assert jc.universal.quarantined(d, 20) is None


def test_a_read_only_manager_skips_a_damaged_step_and_writes_nothing(tmp_path):
  # orbax's read_only: "save and delete are skipped"; a reader (an evaluator of a
  # running training job) must not move the job's commit markers either.
  d = str(tmp_path / "ckpt")
  _saved(d)
  damage.flip_stored_byte(d, 20, "['w']", (1, 2))
  with jc.CheckpointManager(d, ocp.CheckpointManagerOptions(read_only=True)) as m:
    out = m.restore(None, target={"w": np.zeros((16, 16), np.float32)})
    assert m.last_restore.step == 10 and [s for s, _ in m.last_restore.skipped] == [20]
    np.testing.assert_array_equal(out["w"], state(10)["w"])
  assert jc.universal.all_steps(d) == [10, 20]
  assert not os.path.exists(os.path.join(d, "quarantine"))


@pytest.mark.parametrize("form", ["as_saved", "standard_restore"])
def test_every_form_of_restore_skips_a_damaged_newest_step(tmp_path, form):
  # restore() with no target (the tree as saved) and orbax's args= forms pick the
  # newest step too: a damaged one must not stop every relaunch there either.
  d = str(tmp_path / "ckpt")
  _saved(d)
  damage.flip_stored_byte(d, 20, "['w']", (3, 4))
  with jc.CheckpointManager(d, _opts()) as m:
    if form == "as_saved":
      out = m.restore()
    else:
      out = m.restore(None, args=ocp.args.StandardRestore(
          {"w": np.zeros((16, 16), np.float32)}))
    assert m.last_restore.step == 10 and [s for s, _ in m.last_restore.skipped] == [20]
    np.testing.assert_array_equal(np.asarray(out["w"]), state(10)["w"])
    with pytest.raises(errors.CorruptSnapshotError, match="step 20"):
      m.restore(20)                                    # asked for by name: still raises

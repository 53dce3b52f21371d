"""orbax's CheckpointManager verbs on jaxckpt: best_step, metrics, reload,
is_saving_in_progress, check_for_errors, item_metadata, step and root metadata,
restore(directory=), directory as a path."""

from __future__ import annotations

import os
import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath

import jaxckpt as jc
import jaxckpt.universal as u
from jaxckpt import errors
from jaxckpt.util import _wait


def _args(step):
  return ocp.args.StandardSave({"w": np.full(3, float(step), np.float32), "step": step})


def test_best_step_and_metrics_by_best_fn_and_by_recency(tmp_path):
  opts = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")
  with jc.CheckpointManager(tmp_path / "best", opts) as m:
    assert m.best_step() is None
    m.save(1, args=_args(1))                                   # no metrics
    assert m.best_step() is None and m.metrics(1) is None
    m.save(2, args=_args(2), metrics={"loss": np.float32(0.5)})
    m.save(3, args=_args(3), metrics={"loss": 0.75})
    assert m.best_step() == 2 and m.metrics(2) == {"loss": 0.5}
  with jc.CheckpointManager(tmp_path / "best", opts) as m:     # read back from storage
    assert m.best_step() == 2 and m.metrics(3) == {"loss": 0.75}
    assert m.metadata(3).metrics == {"loss": 0.75}
  with jc.CheckpointManager(tmp_path / "latest") as m:         # no best_fn: the newest
    m.save(1, _args(1).item, metrics={"loss": 1.0})
    m.wait_until_snapshotted()          # (jaxckpt's own options skip a save while one is copied)
    m.save(2, _args(2).item)
    assert m.best_step() == 2 == m.latest_step() and m.metrics(1) == {"loss": 1.0}


def test_another_writer_s_steps_are_listed_after_reload(tmp_path):
  first = jc.CheckpointManager(tmp_path, ocp.CheckpointManagerOptions())
  try:
    first.save(0, args=_args(0))
    first.wait_until_finished()
    with jc.CheckpointManager(tmp_path, ocp.CheckpointManagerOptions()) as second:
      assert second.all_steps() == [0]
      second.save(1, args=_args(1))
    assert first.all_steps() == [0] and first.latest_step() == 0
    first.reload()
    assert first.all_steps() == [0, 1] and first.restore(None)["step"] == 1
  finally:
    first.close()


def test_is_saving_in_progress_and_check_for_errors(tmp_path):
  """A save is in progress until its step is on storage; a persist that failed is raised by
  check_for_errors() (without waiting), once."""
  directory = tmp_path / "ckpt"
  opts = ocp.CheckpointManagerOptions(async_options=ocp.options.AsyncOptions(timeout_secs=2))
  with jc.CheckpointManager(directory, opts) as m:       # a storage error is retried 2 s
    assert not m.is_saving_in_progress()
    m.save(0, args=_args(0))
    assert m.is_saving_in_progress()
    m.wait_until_finished()
    assert not m.is_saving_in_progress()
    m.check_for_errors()                                        # nothing failed
    shutil.rmtree(directory)
    directory.write_text("not a directory")                     # storage breaks
    m.save(1, args=_args(1))
    _wait.until(lambda: not m.is_saving_in_progress(), timeout_secs=60,
                late=lambda: "the persist of step 1 did not end")
    with pytest.raises(errors.StorageError, match="persisting step 1"):
      m.check_for_errors()
    m.check_for_errors()                                        # raised once
    directory.unlink()


def test_step_metadata_has_orbax_s_fields(tmp_path):
  with jc.CheckpointManager(tmp_path) as m:
    m.save(1, args=ocp.args.Composite(state=_args(1), cfg=ocp.args.JsonSave({"lr": 0.1})),
           custom_metadata={"run": "a"}, metrics={"loss": 2.0})
    m.wait_until_snapshotted()          # (jaxckpt's own options skip a save while one is copied)
    m.save(2, args=ocp.args.Composite(state=_args(2)))
    md = m.metadata(1)
    assert md.custom_metadata == {"run": "a"} and md.metrics == {"loss": 2.0}
    assert sorted(md.item_metadata) == ["cfg", "state"]
    assert md.item_metadata.state["w"].shape == (3,) and md.item_metadata["cfg"].kind == "scalar"
    assert m.item_metadata(2) == m.metadata(2).item_metadata and list(m.item_metadata(2)) == ["state"]
    with pytest.raises(errors.InvalidArgumentError, match="per step"):
      m.item_metadata(None)


def test_root_metadata_is_written_once_and_never_overwritten(tmp_path):
  with jc.CheckpointManager(tmp_path, metadata={"version": 1}) as m:
    assert m.metadata() == ocp.metadata.RootMetadata(custom_metadata={"version": 1})
  with jc.CheckpointManager(tmp_path, metadata={"version": 2}) as m:
    assert m.metadata().custom_metadata == {"version": 1}
  with jc.CheckpointManager(tmp_path / "none") as m:
    assert m.metadata().custom_metadata == {} and not os.listdir(tmp_path / "none")
  with jc.CheckpointManager(tmp_path / "off", ocp.CheckpointManagerOptions(
      save_root_metadata=False), metadata={"version": 1}) as m:
    assert m.metadata().custom_metadata == {}


def test_restore_from_another_directory(tmp_path):
  with jc.CheckpointManager(tmp_path / "pretrained") as m:
    m.save(5, args=ocp.args.Composite(state=_args(5)))
  with jc.CheckpointManager(tmp_path / "run") as m:
    with pytest.raises(FileNotFoundError):
      m.restore(5, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    out = m.restore(None, args=ocp.args.Composite(state=ocp.args.StandardRestore()),
                    directory=epath.Path(tmp_path / "pretrained"))
    assert out.state["step"] == 5 and m.all_steps() == []


def test_directory_is_a_path_and_delete_leaves_nothing(tmp_path):
  with jc.CheckpointManager(str(tmp_path)) as m:
    assert isinstance(m.directory, epath.Path) and m.directory == epath.Path(tmp_path)
    m.save(0, args=ocp.args.JsonSave({"a": 1}))
    m.wait_until_finished()
    m.delete(0)
    assert m.all_steps() == [] and list(m.directory.iterdir()) == []
    assert u.all_steps(str(tmp_path)) == []
  assert jc.CheckpointManager().directory is None

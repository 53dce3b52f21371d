"""import-orbax as an orbax user runs it: a best_fn run's steps, and the paths a user mistypes."""

import datetime
import logging
import os

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxckpt as jc
from jaxckpt import cli, errors
from jaxckpt.core import _ledger
from jaxckpt.orbax import interop as ox


def _opts():
  return ocp.CheckpointManagerOptions(max_to_keep=3, best_fn=lambda m: m["loss"], best_mode="min")


@pytest.fixture(scope="module")
def best_run(tmp_path_factory):
  """An orbax run that tracks the best step: each step holds `default` and orbax's `metrics`."""
  d = str(tmp_path_factory.mktemp("orbax_best"))
  with ocp.CheckpointManager(d, options=_opts()) as m:
    for step, loss in ((1, 0.5), (2, 0.2), (3, 0.9)):
      m.save(step, args=ocp.args.StandardSave({"w": jnp.full(3, float(step))}),
             metrics={"loss": loss}, custom_metadata={"note": f"s{step}"})
    m.wait_until_finished()
  assert {"default", "metrics"} <= set(os.listdir(os.path.join(d, "3")))
  return d


def test_a_best_fn_run_imports_as_its_one_item_with_its_metrics(best_run, tmp_path):
  """orbax's `metrics` item is the step's metrics, not an item of the user's: the ported loop
  restores with StandardRestore, and best_step(), metrics() and custom_metadata are orbax's."""
  dst = str(tmp_path / "ck")
  for step in (1, 2, 3):
    ox.import_orbax(best_run, dst, step=step)
  with jc.CheckpointManager(dst, _opts()) as m:
    assert m.all_steps() == [1, 2, 3]
    out = m.restore(2, args=ocp.args.StandardRestore({"w": jnp.zeros(3)}))
    np.testing.assert_array_equal(np.asarray(out["w"]), np.full(3, 2.0, np.float32))
    assert m.best_step() == 2
    assert m.metrics(2) == {"loss": 0.2}
    assert m.metadata(3).custom_metadata["note"] == "s3"


def test_imported_steps_keep_orbax_s_save_times(best_run, tmp_path):
  """keep_time_interval ranks steps by their save time: an import keeps orbax's."""
  dst = str(tmp_path / "ck")
  ox.import_orbax(best_run, dst, step=1)
  opts = ocp.CheckpointManagerOptions(max_to_keep=1, keep_time_interval=datetime.timedelta(days=1))
  with ocp.CheckpointManager(best_run, options=opts) as m:
    want = m.metadata(1).init_timestamp_nsecs / 1e9
  with jc.CheckpointManager(dst, opts) as m:
    got = m.metadata(1).metadata.get(_ledger.TIME_KEY, 0.0)    # what the policy ranks by
  assert abs(got - want) < 1.0, (got, want)


def test_import_orbax_of_a_jaxckpt_checkpoint_says_so(tmp_path, capsys):
  d = str(tmp_path / "ck")
  with jc.CheckpointManager(d, ocp.CheckpointManagerOptions()) as m:
    m.save(70, args=ocp.args.StandardSave({"w": np.ones(3)}))
  assert cli.main(["import-orbax", d, str(tmp_path / "out")]) == 2
  err = capsys.readouterr().err
  assert "is a jaxckpt checkpoint" in err and "no import" in err, err
  with pytest.raises(errors.InvalidArgumentError, match="jaxckpt checkpoint"):
    ox.import_orbax(d, str(tmp_path / "out"))


def test_import_orbax_of_an_orbax_step_or_item_directory_names_the_root(tmp_path, capsys):
  src = str(tmp_path / "orbax")
  with ocp.CheckpointManager(src) as m:
    m.save(7, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": jnp.ones(3)}),
                                      cfg=ocp.args.JsonSave({"a": 1})))
  for given, want in ((os.path.join(src, "7"), f"import-orbax {src} DST --step 7"),
                      (os.path.join(src, "7", "cfg"),
                       f"import-orbax {src} DST --step 7 --item cfg")):
    assert cli.main(["import-orbax", given, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert want in err, err
  assert not os.path.exists(tmp_path / "out")


def test_importing_a_composite_step_logs_no_warning(tmp_path, caplog):
  """orbax's checkpointer warns that an item directory has no step metadata: nothing a user
  can act on, so the import reads each item with orbax's handler instead."""
  src = str(tmp_path / "orbax")
  with ocp.CheckpointManager(src) as m:
    m.save(7, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": jnp.ones(3)}),
                                      cfg=ocp.args.JsonSave({"a": 1})))
  with caplog.at_level(logging.WARNING):
    assert ox.import_orbax(src, str(tmp_path / "ck")) == 7
  assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

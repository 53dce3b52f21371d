"""orbax's CheckpointManagerOptions on jaxckpt: every field an orbax user sets, with orbax's
meaning, through the manager (storage and host tiers) with orbax's own option and policy
objects."""

from __future__ import annotations

import datetime
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint import checkpoint_managers as cm

import jaxckpt as jc
import jaxckpt.universal as u
from jaxckpt import errors
from jaxckpt.orbax import _options
from jaxckpt.core import _policy
from jaxckpt.orbax import _policies
from jaxckpt.core._ledger import StepInfo


def _tree(step):
  return {"w": np.full((4, 3), float(step), np.float32), "step": step}


def _save_all(m, steps, metrics=None):
  return [m.save(s, args=ocp.args.StandardSave(_tree(s)),
                 metrics=None if metrics is None else metrics[s]) for s in steps]


def test_a_jaxckpt_options_object_passes_through_and_anything_else_is_refused():
  opts = jc.CheckpointOptions(max_snapshots=3)
  assert _options.translate(opts) == (opts, _policy.DirectoryRules())
  with pytest.raises(errors.InvalidArgumentError, match="ocp.CheckpointManagerOptions"):
    jc.CheckpointManager(options={"max_to_keep": 2})


def test_the_save_decision_is_orbax_s(tmp_path):
  """save_interval_steps (the first step of an empty manager is saved, off the interval, as
  orbax's InitialSavePolicy says), save_on_steps, force, and should_save()."""
  opts = ocp.CheckpointManagerOptions(save_interval_steps=4, save_on_steps=[6])
  with jc.CheckpointManager(tmp_path, opts) as m:
    assert _save_all(m, range(1, 10)) == [s in (1, 4, 6, 8) for s in range(1, 10)]
    assert not m.should_save(8) and not m.should_save(10) and m.should_save(12)
    assert m.save(9, args=ocp.args.StandardSave(_tree(9)), force=True)
    m.wait_until_finished()
    assert m.all_steps() == [1, 4, 6, 8, 9] == u.all_steps(str(tmp_path))


def test_should_save_fn_and_a_save_decision_policy_replace_the_interval(tmp_path):
  opts = ocp.CheckpointManagerOptions(save_interval_steps=1, should_save_fn=lambda s, last: (
      s % 3 == 0 and (last is None or s - last >= 6)))
  with jc.CheckpointManager(tmp_path / "fn", opts) as m:
    assert [s for s, ok in zip(range(1, 20), _save_all(m, range(1, 20))) if ok] == [3, 9, 15]
  policy = cm.AnySavePolicy([cm.FixedIntervalPolicy(5), cm.SpecificStepsPolicy(steps=[7])])
  opts = ocp.CheckpointManagerOptions(save_interval_steps=1, save_decision_policy=policy)
  with jc.CheckpointManager(tmp_path / "policy", opts) as m:
    assert [s for s, ok in zip(range(1, 12), _save_all(m, range(1, 12))) if ok] == [5, 7, 10]


def test_continuous_checkpointing_waits_its_minimum_interval():
  """ContinuousCheckpointingPolicy decides from the previous step's time (a pure function of
  the steps kept and the clock) and never while a save is in progress."""
  rules = _policies.from_options(_options.translate(ocp.CheckpointManagerOptions(
      save_decision_policy=cm.ContinuousCheckpointingPolicy(minimum_interval_secs=60)))[0])
  now = datetime.datetime.now(tz=datetime.timezone.utc)
  just_now = [StepInfo(1, now - datetime.timedelta(seconds=5))]
  long_ago = [StepInfo(1, now - datetime.timedelta(seconds=120))]
  assert rules.asks_progress and not _policies.from_options(
      _options.translate(ocp.CheckpointManagerOptions())[0]).asks_progress
  assert rules.should_save(2, [], False, False)
  assert not rules.should_save(2, just_now, False, False)
  assert rules.should_save(2, long_ago, False, False)
  assert not rules.should_save(2, long_ago, True, False)        # a save in progress


@pytest.mark.parametrize("max_to_keep,kept", [(None, [0, 1, 2, 3, 4]), (2, [3, 4]), (0, [])])
def test_max_to_keep_drops_steps_from_every_tier(tmp_path, max_to_keep, kept):
  """None keeps all, N the newest N, 0 none (each step is saved, then dropped), as orbax: at
  once from all_steps(), and from host memory and storage once the persist has ended."""
  with jc.CheckpointManager(tmp_path, ocp.CheckpointManagerOptions(max_to_keep=max_to_keep)) as m:
    assert all(_save_all(m, range(5)))
    assert m.all_steps() == kept
    m.wait_until_finished()
    assert m.all_steps() == kept == u.all_steps(str(tmp_path))
    for step in set(range(5)) - set(kept):
      with pytest.raises(errors.StepNotFoundError):          # not in host memory either
        m.restore(step)
    if kept:
      assert m.restore(None, args=ocp.args.StandardRestore())["step"] == kept[-1]


def test_keep_period_and_keep_time_interval_keep_more(tmp_path):
  opts = ocp.CheckpointManagerOptions(max_to_keep=2, keep_period=4, save_interval_steps=2)
  with jc.CheckpointManager(tmp_path, opts) as m:
    _save_all(m, range(12))
    m.wait_until_finished()
    assert m.all_steps() == [0, 4, 8, 10] == u.all_steps(str(tmp_path))
  # keep_time_interval ranks by the steps' save times (orbax's EveryNSeconds): hourly saves
  rules = _policies.from_options(_options.translate(ocp.CheckpointManagerOptions(
      max_to_keep=2, keep_time_interval=datetime.timedelta(hours=3)))[0])
  t0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
  kept: list[StepInfo] = []
  for step in range(10):
    kept.append(StepInfo(step, t0 + datetime.timedelta(hours=step)))
    dropped = set(rules.to_remove(kept))
    kept = [i for i in kept if i.step not in dropped]
  assert rules.uses_time and [i.step for i in kept] == [0, 3, 6, 8, 9]


@pytest.mark.parametrize("mode,kept,best", [("min", [1, 5], 5), ("max", [1, 3], 1)])
def test_best_fn_keeps_the_best_across_a_restart(tmp_path, mode, kept, best):
  """best_fn/best_mode with max_to_keep keep the best steps by their metrics, which are
  stored with each step: a restarted manager ranks the old steps with the new ones."""
  loss = {0: 5, 1: 2, 2: 4, 3: 3, 4: 7, 5: 1, 6: 10, 7: 9}
  acc = {0: 30, 1: 95, 2: 70, 3: 90, 4: 60, 5: 40, 6: 45, 7: 75}
  metrics = {s: {"loss": loss[s], "acc": np.float32(acc[s])} for s in loss}
  opts = ocp.CheckpointManagerOptions(
      max_to_keep=2, best_mode=mode,
      best_fn=(lambda m: m["loss"]) if mode == "min" else (lambda m: m["acc"]))
  with jc.CheckpointManager(tmp_path, opts) as m:
    _save_all(m, range(4), metrics)
  with jc.CheckpointManager(tmp_path, opts) as m:
    _save_all(m, range(4, 8), metrics)
    m.wait_until_finished()
    assert m.all_steps() == kept == u.all_steps(str(tmp_path))
    assert m.best_step() == best and m.metrics(best) == {"loss": loss[best], "acc": acc[best]}
    with pytest.raises(errors.StepNotFoundError):
      m.restore(7)                                      # the newest, but not among the best


def test_steps_without_metrics_are_kept_unless_told(tmp_path):
  metrics = {0: {"loss": 3}, 1: None, 2: {"loss": 4}, 3: None, 4: {"loss": 1}, 5: {"loss": 2}}
  for keep, kept in ((True, [1, 3, 4, 5]), (False, [4, 5])):
    opts = ocp.CheckpointManagerOptions(max_to_keep=2, best_fn=lambda m: m["loss"],
                                        best_mode="min", keep_checkpoints_without_metrics=keep)
    with jc.CheckpointManager(tmp_path / str(keep), opts) as m:
      _save_all(m, range(6), metrics)
      m.wait_until_finished()
      assert m.all_steps() == kept and m.best_step() == 4


def test_a_preservation_policy_of_orbax_s_objects(tmp_path):
  loss = [5, 2, 4, 3, 7, 10, 11, 9, 8, 6, 12, 1]
  policy = cm.AnyPreservationPolicy([
      cm.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=2),
      cm.EveryNSteps(interval_steps=4), cm.CustomSteps(steps=[3])])
  with jc.CheckpointManager(tmp_path, ocp.CheckpointManagerOptions(
      preservation_policy=policy)) as m:
    _save_all(m, range(12), {s: {"loss": v} for s, v in enumerate(loss)})
    m.wait_until_finished()
    assert m.all_steps() == [0, 1, 3, 4, 8, 11] == u.all_steps(str(tmp_path))
  with pytest.raises(errors.InvalidArgumentError, match="mutually exclusive"):
    jc.CheckpointManager(tmp_path, ocp.CheckpointManagerOptions(preservation_policy=policy,
                                                                max_to_keep=1))


def test_todelete_subdir_moves_dropped_steps_aside(tmp_path):
  opts = ocp.CheckpointManagerOptions(max_to_keep=1, todelete_subdir="ttl=1h")
  with jc.CheckpointManager(tmp_path, opts) as m:
    _save_all(m, range(3))
    m.wait_until_finished()
    m.delete(2)
    assert m.all_steps() == [] and u.all_steps(str(tmp_path)) == []
  assert sorted(os.listdir(tmp_path / "ttl=1h")) == [f"step_{s:010d}" for s in range(3)]


def test_enable_async_checkpointing_false_returns_with_the_step_on_storage(tmp_path):
  calls = []
  opts = ocp.CheckpointManagerOptions(
      enable_async_checkpointing=False,
      async_options=ocp.options.AsyncOptions(timeout_secs=77,
                                             post_finalization_callback=lambda: calls.append(1)))
  with jc.CheckpointManager(tmp_path, opts) as m:
    assert m.options.timeout_secs == 77
    for step in range(3):
      assert m.save(step, args=ocp.args.StandardSave(_tree(step)))
      assert u.all_steps(str(tmp_path)) == list(range(step + 1))   # no wait needed
      assert not m.is_saving_in_progress()
    assert calls == [1, 1, 1]


def test_read_only_saves_and_deletes_nothing_and_restores(tmp_path):
  with jc.CheckpointManager(tmp_path) as m:
    m.save(1, args=ocp.args.StandardSave(_tree(1)))
  before = sorted(p for p, _, _ in os.walk(tmp_path))
  opts = ocp.CheckpointManagerOptions(read_only=True, max_to_keep=1)
  with jc.CheckpointManager(tmp_path, opts, metadata={"a": 1}) as m:
    assert not m.should_save(2) and not m.save(2, args=ocp.args.StandardSave(_tree(2)))
    m.delete(1)                                         # skipped, as orbax does
    assert m.all_steps() == [1] and m.restore(1)["step"] == 1
    assert m.metadata().custom_metadata == {"a": 1}    # given, never written
  assert sorted(p for p, _, _ in os.walk(tmp_path)) == before


def test_create_false_makes_no_directory(tmp_path):
  with jc.CheckpointManager(tmp_path / "no", ocp.CheckpointManagerOptions(create=False)):
    pass
  assert not (tmp_path / "no").exists()
  with jc.CheckpointManager(tmp_path / "yes", ocp.CheckpointManagerOptions(create=True)):
    pass
  assert (tmp_path / "yes").is_dir()


def test_cleanup_tmp_directories_removes_an_unfinished_save(tmp_path):
  with jc.CheckpointManager(tmp_path) as m:
    m.save(1, args=ocp.args.StandardSave(_tree(1)))
  (tmp_path / "step_0000000002" / "attempts").mkdir(parents=True)   # a save that crashed
  with jc.CheckpointManager(tmp_path, ocp.CheckpointManagerOptions()):
    assert (tmp_path / "step_0000000002").exists()                  # off by default
  with jc.CheckpointManager(tmp_path, ocp.CheckpointManagerOptions(
      cleanup_tmp_directories=True)) as m:
    assert not (tmp_path / "step_0000000002").exists() and m.all_steps() == [1]


def test_fields_of_orbax_s_file_layout_are_accepted(tmp_path):
  """Step naming, atomicity, threads and barriers have no meaning for jaxckpt's format:
  accepted, and saves and restores work the same."""
  opts = ocp.CheckpointManagerOptions(
      step_prefix="checkpoint", step_format_fixed_length=8, enable_background_delete=True,
      num_deletion_threads=2, single_host_load_and_broadcast=False, lightweight_initialize=True,
      file_options=ocp.options.FileOptions(path_permission_mode=0o750), max_to_keep=1,
      multiprocessing_options=ocp.options.MultiprocessingOptions(barrier_sync_key_prefix="x"))
  with jc.CheckpointManager(tmp_path, opts) as m:
    _save_all(m, range(3))
    m.wait_until_finished()
    assert m.all_steps() == [2] and m.restore(2)["step"] == 2


def test_saving_a_held_step_is_orbax_s_step_already_exists_error(tmp_path):
  from orbax.checkpoint import checkpoint_manager as ocm  # pylint: disable=import-outside-toplevel
  with jc.CheckpointManager(tmp_path, ocp.CheckpointManagerOptions()) as m:
    assert m.save(0, args=ocp.args.StandardSave(_tree(0)))
    assert not m.save(0, args=ocp.args.StandardSave(_tree(9)))     # not newer: not saved
    with pytest.raises(ocm.StepAlreadyExistsError, match="step 0 already exists") as e:
      m.save(0, args=ocp.args.StandardSave(_tree(9)), force=True)
    assert isinstance(e.value, (ValueError, errors.StepAlreadyExistsError, errors.JaxckptError))
    m.wait_until_finished()
    assert m.restore(0)["w"][0, 0] == 0 and u.open_step(str(tmp_path), 0).read("['w']")[0, 0] == 0


def test_a_jaxckpt_manager_never_holds_two_versions_of_a_step(tmp_path):
  """jaxckpt's own options: a step on storage, or on its way there, is refused when saved
  again (before, host memory took the new bytes while storage kept the old)."""
  x = jax.numpy.ones((256, 256))
  with jc.CheckpointManager(tmp_path, jc.CheckpointOptions(max_snapshots=3)) as m:
    m.save(1, {"w": x})
    with pytest.raises(errors.StepAlreadyExistsError, match="step 1 is already"):
      m.save(1, {"w": x * 2})                                      # persisting, or stored
    m.wait_until_finished()
    with pytest.raises(errors.StepAlreadyExistsError, match="step 1 is already committed"):
      m.save(1, {"w": x * 3}, force=True)
    assert float(m.restore(1, {"w": x})["w"][0, 0]) == 1.0
    np.testing.assert_array_equal(u.open_step(str(tmp_path), 1).read("['w']"), np.ones((256, 256)))


def test_a_manager_made_with_item_names_writes_every_saved_step_as_orbax_does(tmp_path):
  # orbax's test_all_steps_reload: a manager made as orbax's (item_names=, no options)
  # has orbax's defaults, so a second manager on the directory sees every saved step.
  # jaxckpt's own defaults write the newest steps to storage as it keeps up (step 1
  # stayed in host memory, and the second manager saw [0]).
  with jc.CheckpointManager(str(tmp_path), item_names=("params",)) as m:
    for step in (0, 1):
      assert m.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(_tree(step))))
    m.wait_until_finished()
    assert m.options.persist_interval_steps == 1
  with jc.CheckpointManager(str(tmp_path), item_names=("params",)) as again:
    assert again.all_steps() == [0, 1]
    out = again.restore(1, args=ocp.args.Composite(params=ocp.args.StandardRestore(_tree(0))))
  np.testing.assert_array_equal(np.asarray(out.params["w"]), np.asarray(_tree(1)["w"]))
  with jc.CheckpointManager(str(tmp_path)) as native:      # jaxckpt's own form: its defaults
    assert native.options.persist_interval_steps is None

"""orbax's retention beside the agent: CheckpointOptions takes orbax's fields, and a step
the keep policy drops is gone from every tier, through a kill and a relaunch."""

from __future__ import annotations

import os
import signal
import textwrap

import numpy as np
import orbax.checkpoint as ocp

import jaxckpt as jc
from jaxckpt import universal
from jaxckpt.testing import processes

LOSSES = {2: 5.0, 4: 3.0, 6: 4.0, 8: 1.0, 10: 6.0, 12: 2.0}


def _state(step: int) -> dict:
  return {"w": np.full((16, 4), step, np.float32), "b": np.arange(4, dtype=np.int32) + step}


def _best_fn(metrics: dict) -> float:
  return metrics["loss"]


def _orbax_run(directory: str) -> tuple[list[int], int | None]:
  """orbax's own manager on the same calls."""
  opts = ocp.CheckpointManagerOptions(max_to_keep=2, best_fn=_best_fn, best_mode="min",
                                      save_interval_steps=2)
  with ocp.CheckpointManager(directory, options=opts) as m:
    for s in range(2, 13):
      m.save(s, args=ocp.args.StandardSave(_state(s)), metrics={"loss": LOSSES.get(s, 9.0)})
    m.wait_until_finished()
    return list(m.all_steps()), m.best_step()


def _jaxckpt_options(root: str, job: str) -> jc.CheckpointOptions:
  return jc.CheckpointOptions(
      max_to_keep=2, best_fn=_best_fn, best_mode="min", save_interval_steps=2,
      persist_interval_steps=2, max_snapshots=3, on_busy="wait",
      agent=jc.AgentOptions(job_name=job, run_root=root))


_TRAINER = """
import sys, numpy as np, jaxckpt as jc
from jaxckpt.retention_test import _state, _best_fn, _jaxckpt_options, LOSSES
root, job, directory = sys.argv[1:4]
m = jc.CheckpointManager(directory, _jaxckpt_options(root, job))
for s in range(2, 13):
  m.save(s, _state(s), metrics={"loss": LOSSES.get(s, 9.0)})
m.wait_until_finished()
print("SAVED", m.all_steps(), m.best_step(), flush=True)
import time; time.sleep(600)
"""


def test_a_ported_loop_with_orbax_retention_and_the_agent_survives_a_kill(tmp_path):
  want_steps, want_best = _orbax_run(str(tmp_path / "orbax"))
  assert want_steps == [8, 12] and want_best == 8          # (orbax's answer, for the record)
  directory = str(tmp_path / "jaxckpt")
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with processes.agent_sandbox() as (root, job):
    with processes.Proc(["-c", textwrap.dedent(_TRAINER), root, job, directory],
                        cwd=repo) as trainer:
      line = trainer.wait_for("SAVED", 240)
      assert line.split(None, 1)[1].strip() == f"{want_steps} {want_best}", line
      os.kill(trainer.p.pid, signal.SIGKILL)                # the trainer dies; its agent lives
      trainer.p.wait(timeout=30)
    with jc.CheckpointManager(directory, _jaxckpt_options(root, job)) as m:
      assert m.all_steps() == want_steps and m.best_step() == want_best
      assert universal.all_steps(directory) == want_steps    # dropped: gone from storage ...
      assert m._core._store.steps() == [8, 12]  # pylint: disable=protected-access  (... and the agent: 10 was dropped)
      out = m.restore(m.best_step(), _state(0))
      assert m.last_restore.tier == "host"
      np.testing.assert_array_equal(out["w"], _state(8)["w"])
      assert m.metrics(8) == {"loss": 1.0}
      m.save(14, _state(14), metrics={"loss": 0.5})             # the policy goes on ranking
      m.wait_until_finished()
      assert m.all_steps() == [8, 14] == universal.all_steps(directory)
      assert m.best_step() == 14


def test_jaxckpt_s_own_options_take_orbax_s_retention_fields():
  opts = jc.CheckpointOptions(max_to_keep=3, keep_period=10, best_fn=_best_fn, best_mode="min",
                              save_on_steps=[7], keep_checkpoints_without_metrics=False)
  assert opts.save_on_steps == frozenset({7}) and opts.best_mode == "min"
  for bad, msg in ((dict(best_mode="lowest"), "best_mode must be 'max' or 'min'"),
                   (dict(keep_period=0), "keep_period must be >= 1"),
                   (dict(keep_time_interval=3600), "keep_time_interval must be a datetime.timedelta"),
                   (dict(best_fn="loss"), "best_fn must be a function"),
                   (dict(max_to_keep=2, preservation_policy=object()), "mutually exclusive|must be None beside it")):
    try:
      jc.CheckpointOptions(**bad)
    except jc.errors.InvalidArgumentError as e:
      assert any(m in str(e) for m in msg.split("|")), (bad, e)
    else:
      raise AssertionError(f"{bad} was taken")

"""A loss that goes NaN or infinite: its step persists, its metrics come back exactly after a
relaunch (from storage, from the agent), and ``best_fn`` ranks it as orbax's own manager does."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxckpt as jc
from jaxckpt import universal
from jaxckpt.testing import processes

NAN, INF = float("nan"), float("inf")
LOSSES = {1: NAN, 2: INF, 3: -INF, 4: 1.5}


def _state(step: int) -> dict:
  return {"w": np.full((8,), step, np.float32)}


def _exact(got: object, want: float) -> bool:
  """``got`` is the float ``want`` (NaN for NaN, the infinity of its sign)."""
  return type(got) is float and (math.isnan(got) if math.isnan(want) else got == want)


def _best_fn(metrics: dict) -> float:
  return metrics["loss"]


@pytest.mark.parametrize("with_agent", [False, True], ids=["no_agent", "agent"])
def test_non_finite_metrics_persist_and_come_back_exactly_after_a_relaunch(storage_dir, with_agent):
  with contextlib.ExitStack() as stack:
    agent = None
    if with_agent:
      root, job = stack.enter_context(processes.agent_sandbox())
      agent = jc.AgentOptions(job_name=job, run_root=root)
    opts = jc.CheckpointOptions(agent=agent)
    with jc.CheckpointManager(storage_dir, opts) as m:
      for step, loss in LOSSES.items():
        m.save(step, _state(step), metrics={"loss": loss}, force=True)
      m.wait_until_finished()              # (raised ManifestError: every persist failed)
    assert universal.all_steps(storage_dir) == sorted(LOSSES)
    for step, loss in LOSSES.items():      # the manifest on storage holds them
      meta = universal.open_step(storage_dir, step).metadata
      assert _exact(meta["jaxckpt.metrics"]["loss"], loss), (step, meta)
    with jc.CheckpointManager(storage_dir, opts) as m:   # the relaunch (the agent's host tier)
      assert m.all_steps() == sorted(LOSSES)
      for step, loss in LOSSES.items():
        got = m.metrics(step)
        assert set(got) == {"loss"} and _exact(got["loss"], loss), (step, got)


def _orbax(directory: str, mode: str, losses: dict[int, float]) -> tuple[list[int], int | None]:
  opts = ocp.CheckpointManagerOptions(max_to_keep=2, best_fn=_best_fn, best_mode=mode)
  with ocp.CheckpointManager(directory, options=opts) as m:
    for step, loss in losses.items():
      m.save(step, args=ocp.args.StandardSave(_state(step)), metrics={"loss": loss})
    m.wait_until_finished()
    return list(m.all_steps()), m.best_step()


@pytest.mark.parametrize("mode", ["min", "max"])
def test_best_fn_keeps_and_drops_non_finite_steps_as_orbax_does(tmp_path, mode):
  losses = {1: 3.0, 2: NAN, 3: 1.0, 4: INF, 5: -INF, 6: 2.0, 7: NAN}
  first = dict(list(losses.items())[:5])
  later = dict(list(losses.items())[5:])
  want = _orbax(str(tmp_path / "orbax"), mode, first)
  want_after = _orbax(str(tmp_path / "orbax"), mode, later)      # orbax relaunched
  opts = jc.CheckpointOptions(max_to_keep=2, best_fn=_best_fn, best_mode=mode, on_busy="wait",
                              persist_interval_steps=1)   # (each save a checkpoint, as orbax's)
  directory = str(tmp_path / "jaxckpt")
  with jc.CheckpointManager(directory, opts) as m:
    for step, loss in first.items():
      m.save(step, _state(step), metrics={"loss": loss})
    m.wait_until_finished()
    assert (m.all_steps(), m.best_step()) == want
  assert universal.all_steps(directory) == want[0]
  with jc.CheckpointManager(directory, opts) as m:   # relaunched: ranked from storage's metrics
    assert (m.all_steps(), m.best_step()) == want
    for step, loss in later.items():
      m.save(step, _state(step), metrics={"loss": loss})
    m.wait_until_finished()
    assert (m.all_steps(), m.best_step()) == want_after
  assert universal.all_steps(directory) == want_after[0]

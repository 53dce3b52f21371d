"""A loss that goes NaN or infinite: its step persists, its metrics come back exactly after a
relaunch (from storage, from the agent), and ``best_fn`` ranks it as orbax's own manager does."""

from __future__ import annotations

import contextlib
import math
import os
import struct

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


# Every kind of float a metric can be: the non-finite ones, a negative zero, the smallest
# subnormal, the largest finite, and one that only its 17 digits say.
EVERY_FLOAT = {"nan": NAN, "inf": INF, "-inf": -INF, "-0.0": -0.0, "subnormal": 5e-324,
               "max": 1.7976931348623157e308, "0.1+0.2": 0.1 + 0.2}


def _bits(x: float) -> bytes:
  return struct.pack("<d", x)


def _same_floats(got: dict, want: dict) -> bool:
  """Each of ``got`` is a float of ``want``'s bits (any NaN for a NaN)."""
  return set(got) == set(want) and all(
      type(got[k]) is float and (math.isnan(got[k]) if math.isnan(v) else _bits(got[k]) == _bits(v))
      for k, v in want.items())


def test_every_float_kind_of_a_metric_crosses_the_manifest_and_the_wire_exactly(tmp_path):
  """A step's manifest (its metadata holds the metrics) as the agent holds it: its JSON,
  a Commit request's field, sealed and checked as the agent takes it, and the Manifest
  reply a relaunched trainer reads it back by, parsed once by the slot's record."""
  from jaxckpt.agent import _protocol, _requests   # pylint: disable=import-outside-toplevel
  from jaxckpt.agent.server import _server
  from jaxckpt.host.snapshot import SnapshotManifest        # pylint: disable=import-outside-toplevel
  from jaxckpt.net import _wire                             # pylint: disable=import-outside-toplevel
  meta = {"jaxckpt.metrics": dict(EVERY_FLOAT)}
  manifest = SnapshotManifest(step=3, leaves=(), nbytes=0, metadata=meta)
  assert _same_floats(SnapshotManifest.from_json(manifest.to_json()).metadata["jaxckpt.metrics"],
                      EVERY_FLOAT)
  secret, directory = b"k" * 32, tmp_path / "j" / "host0"
  directory.mkdir(parents=True)
  agent = _server.Agent(job="j", host=0, directory=str(directory), max_snapshots=1,
                        limit_bytes=1 << 20, idle_timeout_secs=60.0, secret=secret)
  try:
    def ask(req):
      reply = _wire.unpack(_server.handle(agent, _protocol.request(secret, req, 10.0))[0])
      assert reply["ok"], reply
      return _requests.decode_reply(type(req), reply, "agent", "in-process")

    ask(_requests.Hello(pid=os.getpid()))
    slot = ask(_requests.Reserve(pid=os.getpid(), step=3, nbytes=0))
    ask(_requests.Commit(index=slot.index, manifest=manifest.to_json(), step=3, nbytes=0,
                         process=[0, 1]))
    assert _same_floats(agent.manifest_of(3).metadata["jaxckpt.metrics"], EVERY_FLOAT)
    back = SnapshotManifest.from_json(ask(_requests.Manifest(step=3)).manifest)
    assert _same_floats(back.metadata["jaxckpt.metrics"], EVERY_FLOAT)
  finally:
    agent.cleanup()


def test_every_float_kind_of_a_metric_comes_back_exactly_from_storage(storage_dir):
  with jc.CheckpointManager(storage_dir, jc.CheckpointOptions()) as m:
    m.save(1, _state(1), metrics=dict(EVERY_FLOAT), force=True)
    m.wait_until_finished()
  assert _same_floats(universal.open_step(storage_dir, 1).metadata["jaxckpt.metrics"], EVERY_FLOAT)
  with jc.CheckpointManager(storage_dir, jc.CheckpointOptions()) as m:   # relaunched
    assert _same_floats(m.metrics(1), EVERY_FLOAT)

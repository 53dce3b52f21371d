"""Three example trainers as replica groups: SIGKILL one, restart it, it catches up from an agent."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import tempfile
import time
from datetime import timedelta

import numpy as np
import pytest

from jaxckpt.ft import Lighthouse, LighthouseOptions
from jaxckpt.testing.processes import Proc, agent_sandbox

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 150           # the others must still train when the restarted group is up (~20 s)
SNAPSHOT_EVERY = 5     # so a catch-up usually replays ring steps on top of the snapshot
GROUPS = ("g0", "g1", "g2")
LIGHTHOUSE = LighthouseOptions(min_replicas=2, heartbeat_timeout=timedelta(seconds=2),
                               join_timeout=timedelta(seconds=0.5),
                               straggler_timeout=timedelta(seconds=10))
STEP_RE = re.compile(r"train_flax step (\d+) loss")


def spawn(lighthouse: Lighthouse, group: str, run_root: str, job: str, out: pathlib.Path,
          cache: pathlib.Path) -> Proc:
  args = [str(ROOT / "examples" / "train_flax.py"), "--lighthouse", lighthouse.address, "--group-id", group,
          "--job-name", job, "--agent-run-root", run_root, "--steps", str(STEPS), "--devices", "2",
          "--layers", "1", "--d-model", "32", "--seq-len", "16", "--batch", "8",
          "--max-snapshots", "3", "--snapshot-interval", str(SNAPSHOT_EVERY),
          "--ring-size", "8", "--ft-timeout", "4",
          "--sleep-per-step", "0.2", "--dump", str(out / f"{group}.json")]
  env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "JAX_COMPILATION_CACHE_DIR": str(cache),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "PYTHONPATH": str(ROOT),
         "JAXCKPT_JOB_SECRET": lighthouse.secret}
  return Proc(args, env=env, cwd=str(ROOT))


def wait_step(proc: Proc, step: int, timeout_secs: float) -> int:
  """Reads ``proc``'s log until it commits a step >= ``step``; returns that step."""
  deadline = time.monotonic() + timeout_secs
  while True:
    line = proc.wait_for("train_flax step ", max(0.1, deadline - time.monotonic()))
    got = int(STEP_RE.search(line).group(1))
    if got >= step:
      return got


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_killed_group_catches_up_from_an_agent_and_ends_bit_identical(tmp_path):
  cache = pathlib.Path(tempfile.gettempdir()) / f"jaxckpt-test-jax-cache-{os.getuid()}"  # kept across runs
  lighthouse = Lighthouse("127.0.0.1:0", LIGHTHOUSE).start()
  procs: list[Proc] = []
  try:
    with agent_sandbox() as (run_root, job):
      start = lambda g: procs.append(spawn(lighthouse, g, run_root, job, tmp_path, cache)) or procs[-1]
      g0 = start("g0")
      g0.wait_for("compiled in", 120)          # the others then load its programs from the cache
      g1, g2 = start("g1"), start("g2")
      at_kill = wait_step(g2, 8, 90)
      os.kill(g2.p.pid, signal.SIGKILL)
      g2.p.wait(timeout=30)
      wait_step(g0, at_kill + 3, 60)           # the others keep training without g2
      wait_step(g1, at_kill + 3, 60)
      g2b = start("g2")
      fetched = g2b.wait_for("from the snapshot agent(s) of job", 90)
      assert f"{job}-g" in fetched and f"{job}-g2" not in fetched, fetched
      caught = g2b.wait_for("caught up to step", 60)
      joined_at, replayed, snap = map(int, re.search(
          r"caught up to step (\d+) in \S+ \((\d+) steps replayed, snapshot (\d+)\)", caught).groups())
      assert joined_at >= at_kill + 3 and snap % SNAPSHOT_EVERY == 0, caught
      assert f"snapshot of step {snap} " in fetched and replayed == joined_at - snap, (fetched, caught)
      outputs = {g: p.finish(120) for g, p in zip(GROUPS, (g0, g1, g2b))}
      for g, out in outputs.items():
        assert f"done: group {g} at step {STEPS}" in out, out[-2000:]
      after = [int(s) for s in STEP_RE.findall(outputs["g2"])]
      # The healthy groups never wait for g2: a replay slower than their steps leaves it a step
      # or two behind, and it chases (one ring entry each time) until it asks in sync.
      last = int(re.findall(r"caught up to step (\d+)", outputs["g2"])[-1])
      assert joined_at <= last <= joined_at + 6, (joined_at, last)
      assert after == list(range(last + 1, STEPS + 1)), after   # every step from the join on
      params = {g: dict(np.load(tmp_path / f"{g}.json.npz")) for g in GROUPS}
      assert params["g0"].keys() == params["g2"].keys() and params["g0"]
      for g in ("g1", "g2"):
        for k, v in params["g0"].items():
          np.testing.assert_array_equal(params[g][k], v, err_msg=f"{g} {k}")
      assert any("contributors g0,g1\n" in line for line in g0.lines), "g0 never trained without g2"
  finally:
    for p in procs:
      with contextlib.suppress(Exception):
        p.kill()
    lighthouse.stop()

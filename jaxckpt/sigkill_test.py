"""A trainer SIGKILLed at any step resumes at that step or the one before, with the
default options, however slow storage is (issue 41)."""

from __future__ import annotations

import random

import pytest

from jaxckpt.testing import processes
from jaxckpt.testing.crash_worker import Trainer
from jaxckpt.testing.throttle import ThrottledProxy


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_a_trainer_killed_at_any_step_resumes_at_it_however_slow_storage_is(s3_server, seed):
  """Default options (a snapshot every step, the first one persisted, the next as storage
  keeps up) with the snapshot agent, storage at 100 kB/s: no persist of the 4 MiB state
  ends while the test runs. A trainer SIGKILLs itself right after the save of a random
  step, in its snapshot's copy; the next resumes from host memory at that step or the one
  before, bit-exact, and persists its own first snapshot while the killed one's persist
  still runs (two persists in flight); it is killed in turn at a random step, and the
  third resumes at that step or the one before too: no save was skipped for a slot. The
  loop waits for each snapshot (its step is at least the copy's, however loaded the
  machine)."""
  rng = random.Random(seed)
  with processes.agent_sandbox() as (root, job), ThrottledProxy(s3_server.endpoint, 1e5) as slow:
    where = {"run_root": root, "job": job, "directory": s3_server.url(), "seed": seed,
             "env": {"AWS_ENDPOINT_URL": slow.endpoint}, "snapshotted": True}
    killed = None
    for kill_after in (rng.randint(2, 6), rng.randint(6, 16), None):
      with Trainer(**where, kill_after=kill_after or 1000) as t:
        back = t.next("resumed", 300)
        if killed is None:
          assert back["resumed"] is None, back
        else:
          assert back["tier"] == "host" and back["exact"], back
          assert killed - 1 <= back["resumed"] <= killed, (back, killed)
        if kill_after is None:
          break
        t.next("ready", 300)
        t.go()
        said = t.next("killing", 300)
        t.wait_killed(60)
      killed = said["killing"]
      assert said["stats"]["skipped_busy"] == 0, said           # nothing skipped
      assert said["stats"]["persists_pending"] >= 1, said       # (storage is that slow)

"""A writer killed while it commits step N leaves its claim on N behind; the relaunched
writer's save(N) goes on within seconds, not after timeout_secs: a
claim is renewed while its writer lives and lapses soon after it dies. A live writer's
claim is still respected however long it holds it, and the wait is logged naming it."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt.testing import processes
from jaxckpt.universal import _commit
from tests.support import fixtures as _fixtures
from jaxckpt.universal import _layout as lay

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
W = np.arange(256, dtype=np.float32)

# A writer that takes the commit claim on step 3 (as a commit does, just before it writes
# the marker) and is SIGKILLed there.
HOLDER = textwrap.dedent("""
    import sys, time
    from jaxckpt.universal import _commit
    from jaxckpt.universal import _layout as lay
    d = sys.argv[1]
    with _commit._claimed(lay.open_kvstore(d), d, 3, "w-killed-mid-commit", 300.0):
      print("HELD", flush=True)
      time.sleep(600)
""")


def _kill_a_writer_holding_the_claim(d: str) -> None:
  proc = subprocess.Popen([sys.executable, "-c", HOLDER, d], stdout=subprocess.PIPE, text=True,
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
  try:
    assert proc.stdout.readline().strip() == "HELD"
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
  kv = lay.open_kvstore(d)
  assert kv.list(lay.prefix_range(lay.claims_prefix(3))).result()   # left behind


@pytest.mark.parametrize("store", ["in-process", "agent"])
def test_a_relaunched_writer_saves_the_step_a_killed_writer_claimed(tmp_path, store, caplog):
  d = str(tmp_path / "ck")
  with contextlib.ExitStack() as stack:
    agent = None
    if store == "agent":
      root, job = stack.enter_context(processes.agent_sandbox("jtc"))
      agent = jc.AgentOptions(job_name=job, run_root=root)
    opts = jc.CheckpointOptions(handle_sigterm=False, persist_interval_steps=1, agent=agent)
    with jc.CheckpointManager(d, opts) as m:
      for s in (1, 2):
        assert m.save(s, {"w": W + s})
        m.wait_until_finished()
    _kill_a_writer_holding_the_claim(d)
    caplog.set_level(logging.WARNING)
    t0 = time.monotonic()
    with jc.CheckpointManager(d, opts) as m:            # the relaunch resumes from 2, saves 3
      np.testing.assert_array_equal(m.restore()["w"], W + 2)
      assert m.save(3, {"w": W + 3})
      m.wait_until_finished()
    took = time.monotonic() - t0
  assert took < _commit.CLAIM_LAPSE_SECS + 20, f"the relaunch waited {took:.0f} s"
  assert jc.universal.all_steps(d) == [1, 2, 3]
  with jc.CheckpointManager(d, jc.CheckpointOptions(handle_sigterm=False)) as m:
    np.testing.assert_array_equal(m.restore(3)["w"], W + 3)
  if store == "in-process":                              # (the agent logs to its own file)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "w-killed-mid-commit" in said and "died" in said, said


def test_a_live_writer_s_claim_is_waited_for_past_its_lapse_and_the_wait_is_logged(tmp_path,
                                                                                   caplog):
  d = _fixtures.stored_steps(str(tmp_path / "ck"), 1)
  held, release = threading.Event(), threading.Event()

  def hold() -> None:                                   # a live writer, slow to commit
    with _commit._claimed(lay.open_kvstore(d), d, 2, "w-slow-but-alive", 300.0):
      held.set()
      release.wait(60)

  holder = threading.Thread(target=hold)
  holder.start()
  try:
    assert held.wait(30)
    threading.Timer(_commit.CLAIM_LAPSE_SECS + 2.0, release.set).start()
    caplog.set_level(logging.WARNING)
    t0 = time.monotonic()
    _fixtures.stored_steps(d, 2)                        # commits once the holder lets go
    took = time.monotonic() - t0
  finally:
    release.set()
    holder.join(60)
  assert took >= _commit.CLAIM_LAPSE_SECS + 1.0, f"the live claim was taken after {took:.1f} s"
  said = " ".join(r.getMessage() for r in caplog.records)
  assert "waiting" in said and "w-slow-but-alive" in said, said
  assert "died" not in said, said
  assert jc.universal.all_steps(d) == [1, 2]

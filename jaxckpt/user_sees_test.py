"""What a user sees: current stats after a wait, INFO lines with rates, a quiet small loop."""

from __future__ import annotations

import glob
import logging
import re
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt as jc
from jaxckpt.testing import processes


@pytest.fixture(params=["in-process", "agent"])
def agent(request):
  if request.param == "in-process":
    yield None
    return
  with processes.agent_sandbox() as (root, job):
    yield jc.AgentOptions(job_name=job, run_root=root)


def _state(step: int, n: int = 64) -> dict:
  mesh = jax.make_mesh((8,), ("x",))
  return {"w": jax.device_put(np.full((n, n), step, np.float32), NamedSharding(mesh, P("x"))),
          "step": step}


def test_stats_are_current_when_a_wait_returns(tmp_path, agent):
  with jc.CheckpointManager(str(tmp_path), jc.CheckpointOptions(agent=agent)) as m:
    assert m.save(1, _state(1))
    m.wait_until_finished()
    st = m.stats
    assert (st.persists_pending, st.oldest_unpersisted_step, st.persist_lag_steps) == (0, None, 0)
    assert m.save(2, _state(2), force=True)
    m.wait_until_persisted(2)
    assert (m.stats.persists_pending, m.stats.oldest_unpersisted_step) == (0, None)


def test_persist_and_restore_say_bytes_seconds_and_rate_at_info(tmp_path, caplog, agent):
  with caplog.at_level(logging.INFO, logger="jaxckpt"):
    with jc.CheckpointManager(str(tmp_path), jc.CheckpointOptions(agent=agent)) as m:
      assert m.save(1, _state(1, 256))
      m.wait_until_finished()
      m.save(2, _state(2, 256), force=True)          # its commit hears the first persist end
      m.wait_until_finished()
      m.restore(step=2, target=_state(0, 256))
  text = "\n".join(r.getMessage() for r in caplog.records)
  rate = r"\(?[\d.e+-]+ GB/s"
  if agent is None:              # the in-process store persists in this process: its own line
    assert re.search(r"step 1 persisted to .*: 0\.2 MiB in [\d.]+ s " + rate, text), text
  else:                          # the agent's line is in its log; the trainer says it too
    assert re.search(r"step 1 is on storage: 0\.2 MiB persisted by the snapshot agent within "
                     r"[\d.]+ s of its snapshot " + rate, text), text
  said = text if agent is None else "\n".join(    # (the agent commits: its log says it)
      open(f).read() for f in glob.glob(f"{agent.run_root}/**/*.log", recursive=True))
  assert re.search(r"step 1 committed in .* by attempt \S+ \(2 leaves, 1 process\)", said), said
  assert re.search(r"restored step 2 from host: 256\.0 KiB in [\d.]+ s \(" + rate, text), text


def test_a_small_loop_with_default_options_and_a_directory_logs_no_warning(tmp_path, caplog,
                                                                             agent):
  """Nothing to warn of (host memory has room for the persists' slots, no lag); a save
  skipped because a loaded machine held its copy up is the one warning it may say."""
  with caplog.at_level(logging.WARNING, logger="jaxckpt"):
    with jc.CheckpointManager(str(tmp_path), jc.CheckpointOptions(agent=agent)) as m:
      for step in range(1, 21):
        m.save(step, _state(step))
        time.sleep(0.02)                  # the loop's own step
      m.wait_until_finished()
  said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert not [w for w in said if "save skipped: the previous snapshot is still being" not in w]
  assert len(said) <= m.stats.skipped_busy
  assert 1 in jc.universal.all_steps(str(tmp_path))


def test_a_persist_that_storage_holds_up_says_its_progress_every_5_s(s3_server, caplog, agent):
  """Storage stops answering during a persist: a progress line each 5 s all the same,
  in this process's log (in-process store) or the agent's."""
  d = s3_server.url()
  pattern = (rf"persisting step 1 to {d}: 0 B of 64\.0 KiB written \(0%\) in ([\d.]+) s, "
             r"0 GB/s")

  def said() -> list[str]:
    if agent is None:
      text = "\n".join(r.getMessage() for r in caplog.records)
    else:
      text = "\n".join(open(f).read() for f in glob.glob(f"{agent.run_root}/**/*.log",
                                                          recursive=True))
    return re.findall(pattern, text)

  with caplog.at_level(logging.INFO, logger="jaxckpt"):
    with jc.CheckpointManager(d, jc.CheckpointOptions(agent=agent)) as m:
      with s3_server.paused():
        assert m.save(1, _state(1, 128))           # the first save: persisted
        deadline = time.monotonic() + 60
        while len(said()) < 2:
          assert time.monotonic() < deadline, f"no two progress lines within 60 s: {said()}"
          time.sleep(0.2)
      m.wait_until_finished()
  secs = [float(s) for s in said()[:2]]
  assert 5 <= secs[0] < secs[1] and secs[1] - secs[0] >= 4.9, secs
  assert jc.universal.all_steps(d) == [1]

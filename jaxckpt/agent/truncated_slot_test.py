"""A slot file truncated or replaced under a live trainer (a /dev/shm cleaner, a full
tmpfs) is damage, never SIGBUS: a restore reads the next tier and
the trainer lives; a save into such a slot allocates its file again; the agent answers
a read of it with an error and lives."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.agent import _paths, _protocol
from jaxckpt.testing import processes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The trainer, in a process of its own (a SIGBUS kills it, not the test): saves step 1
# to its agent and storage, damages the agent's slot files as HOW says, then restores.
TRAINER = r"""
import glob, json, os, sys
import numpy as np
import jaxckpt as jc
from jaxckpt.agent import _paths
root, job, d, how = sys.argv[1:5]
opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root),
                            persist_interval_steps=1, handle_sigterm=False,
                            max_snapshots=1 if how in ("save", "relaunch") else 2)
W = np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32)
slots = lambda: sorted(glob.glob(os.path.join(_paths.agent_dir(root, job, 0), "slot*.bin")))
said = {}
if how == "relaunch":                  # an earlier trainer filled both slots and exited
  with jc.CheckpointManager(d, opts) as m:
    for step in (1, 2):
      assert m.save(step, {"w": W + (step - 1)})
      m.wait_until_finished()
with jc.CheckpointManager(d, opts) as m:
  for step in (1, 2) if how == "save" else () if how == "relaunch" else (1,):
    assert m.save(step, {"w": W + (step - 1)})
    m.wait_until_finished()
  if how == "after a restore":          # the restore's lent map is kept for the next one
    assert np.array_equal(m.restore(None)["w"], W) and m.last_restore.tier == "host"
  for path in slots():
    if how == "replaced":
      with open(path + ".new", "wb") as f:
        f.write(os.urandom(os.path.getsize(path)))
      os.replace(path + ".new", path)
    else:
      os.truncate(path, os.path.getsize(path) // 2 if how == "half" else 0)
  if how == "relaunch":                 # this trainer maps the short files afresh
    assert np.array_equal(m.restore(None)["w"], W + 1) and m.last_restore.tier == "storage"
  if how in ("save", "relaunch"):      # into step 1's slot, through the kept map or afresh
    assert m.save(3, {"w": W + 3})
    m.wait_until_finished()
    out = m.restore(3)
    said["save_tier"] = m.last_restore.tier
    said["save_equal"] = bool(np.array_equal(out["w"], W + 3))
  else:
    out = m.restore(None)
    said["tier"], said["step"] = m.last_restore.tier, m.last_restore.step
    said["equal"] = bool(np.array_equal(out["w"], W))
print(json.dumps(said))
"""


@pytest.mark.parametrize("how", ["truncated", "half", "after a restore", "replaced", "save",
                                 "relaunch"])
def test_a_damaged_slot_file_is_read_from_storage_and_the_trainer_lives(tmp_path, how):
  with processes.agent_sandbox("jtr") as (root, job):
    p = subprocess.run([sys.executable, "-c", TRAINER, root, job, str(tmp_path / "ck"), how],
                       capture_output=True, text=True, timeout=240, cwd=REPO, check=False)
  assert p.returncode == 0, (p.returncode, p.stderr[-3000:])   # -7: SIGBUS
  said = json.loads(p.stdout.strip().splitlines()[-1])
  if how in ("save", "relaunch"):   # the slot's file allocated again: the new step is held
    assert said == {"save_tier": "host", "save_equal": True}, said
  else:
    assert said == {"tier": "storage", "step": 1, "equal": True}, said
    assert "restore another tier" in p.stderr or "checksum" in p.stderr, p.stderr[-3000:]


def test_an_agent_answers_a_read_of_a_truncated_slot_with_an_error_and_lives():
  with processes.agent_sandbox("jtr") as (root, job):
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root),
                                handle_sigterm=False)
    w = np.arange(1 << 14, dtype=np.float32)
    with jc.CheckpointManager(options=opts) as m:
      assert m.save(1, {"w": w})
      m.wait_until_finished()
      with open(_paths.address_file(_paths.agent_dir(root, job, 0))) as f:
        info = json.load(f)
      client = _protocol.Client.of(info, who="a remote reader", timeout_secs=30,
                                   secret=_paths.job_secret(root, job))
      try:
        data, = client.read("snapshot", 1, [(0, w.nbytes)])     # the agent keeps its map
        np.testing.assert_array_equal(data.view(np.float32), w)
        for path in glob.glob(os.path.join(_paths.agent_dir(root, job, 0), "slot*.bin")):
          os.truncate(path, 0)
        with pytest.raises(errors.JaxckptError, match="truncated"):
          client.read("snapshot", 1, [(0, w.nbytes)])
      finally:
        client.close()
      assert processes.pid_alive(info["pid"]), "the agent died (SIGBUS)"
      assert m.save(2, {"w": w + 1})
      m.wait_until_finished()
      np.testing.assert_array_equal(m.restore(2)["w"], w + 1)



@pytest.mark.slow
def test_a_slot_truncated_while_it_is_persisted_fails_that_persist_and_the_agent_lives(
    s3_server, monkeypatch):
  """Storage at 2 kB/s: the agent's persist of step 1 (48 leaves) has pinned its slot and
  is creating the leaves' arrays on storage (tens of seconds) when the slot file is
  truncated; it reads the shards after that. It reads them through the file, never
  through a map taken at its start (past the file's new end: SIGBUS): that persist fails
  with an error that reaches the trainer (never a success), nothing is committed, and
  the agent lives on and takes the next save."""
  from tests.support.throttle import ThrottledProxy  # pylint: disable=import-outside-toplevel
  from jaxckpt.util import _wait  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(4)
  state = {f"w{i:02d}": rng.standard_normal(1024).astype(np.float32) for i in range(48)}
  url = s3_server.url(f"trunc-{os.getpid()}")
  with processes.agent_sandbox("jtp") as (root, job), ThrottledProxy(s3_server.endpoint,
                                                                      2e3) as slow:
    monkeypatch.setenv("AWS_ENDPOINT_URL", slow.endpoint)     # (the agent it starts, too)
    agent = jc.AgentOptions(job_name=job, run_root=root)
    opts = jc.CheckpointOptions(agent=agent, persist_interval_steps=1, handle_sigterm=False)
    with jc.CheckpointManager(url, opts) as m:
      assert m.save(1, state)
      m.wait_until_snapshotted()
      pid = processes.agent_address(root, job)["pid"]
      _wait.until(lambda: slow.forwarded > 1500, timeout_secs=120, late=lambda: (
          f"the agent's persist sent only {slow.forwarded} bytes to storage"))
      for path in glob.glob(os.path.join(_paths.agent_dir(root, job, 0), "slot*.bin")):
        os.truncate(path, 0)                                    # mid-persist
      with pytest.raises(errors.JaxckptError, match="truncated") as e:
        m.wait_until_finished()
      assert "step 1" in str(e.value), e.value
      assert processes.pid_alive(pid), "the agent died (SIGBUS) while persisting"
    assert jc.universal.all_steps(url) == []                  # never committed
    with jc.CheckpointManager(options=jc.CheckpointOptions(agent=agent,
                                                           handle_sigterm=False)) as m:
      assert m.save(2, {"w": W2})
      m.wait_until_finished()
      np.testing.assert_array_equal(m.restore(2)["w"], W2)
      assert m.last_restore.tier == "host" and processes.agent_address(root, job)["pid"] == pid


W2 = np.arange(4096, dtype=np.float32)

"""`jaxckpt delete DIR --step N` deletes a step for good, as CheckpointManager.delete()
does: the persists of it that the job's agents run (found from this machine) are fenced
first, so none commits it afterwards."""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np

import jaxckpt as jc
import jaxckpt.universal as u
from jaxckpt.agent import _requests
from jaxckpt.agent.trainer.client import AgentStore
from jaxckpt.host._persist import PersistConfig
from jaxckpt.host.snapshot import LeafRecord, ShardRecord, SnapshotManifest, checksum
from jaxckpt.testing import processes
from tests.support.fixtures import run_cli, stored_steps


def test_delete_a_stored_step(tmp_path, capsys):
  d = stored_steps(str(tmp_path / "run"), 1, 2, 3)
  out = run_cli(capsys, "delete", d, "--step", "2", "--run-root", str(tmp_path / "no-agents"))
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == f"deleted step 2 of {d} (storage)"
  assert u.all_steps(d) == [1, 3] and not os.path.exists(os.path.join(d, "step_0000000002"))
  np.testing.assert_array_equal(u.open_step(d, 3).read("['w']"), np.arange(8.0) * 3)
  out = run_cli(capsys, "delete", d, "--step", "2", "--run-root", str(tmp_path / "no-agents"))
  assert out.returncode == 2 and out.stderr.strip() == (
      f"jaxckpt delete: {d!r} holds no committed step 2 (committed steps: [1, 3]), and no "
      f"snapshot agent under {tmp_path / 'no-agents'} holds or persists step 2")
  out = run_cli(capsys, "delete", str(tmp_path / "nothing"), "--step", "2",
              "--run-root", str(tmp_path))
  assert out.returncode == 2 and out.stderr.strip() == (
      f"jaxckpt delete: {str(tmp_path / 'nothing')!r} does not exist, and no snapshot agent "
      f"under {tmp_path} holds or persists step 2")
  out = run_cli(capsys, "delete", os.path.join(d, "step_0000000003"), "--step", "3")
  assert out.returncode == 2 and f"pass the root: jaxckpt delete {d} --step 3" in out.stderr


@contextlib.contextmanager
def _two_hosts(persist: dict, *, max_snapshots: int):
  """Two hosts' agents, each its own machine (run root, loopback address), that know
  each other; yields (root, job, [their stores])."""
  with processes.agent_sandbox() as (root, job), contextlib.ExitStack() as stack:
    stores = []
    for h in range(2):
      run_root = os.path.join(root, f"machine{h}")
      os.makedirs(run_root)
      s = AgentStore(jc.AgentOptions(job_name=job, run_root=run_root, tcp_host=f"127.0.1.{h + 1}",
                                     secret="the-delete-test-secret"),
                     host=h, max_snapshots=max_snapshots, limit_bytes=64 << 20, persist=persist)
      stack.callback(s.close)
      stores.append(s)
    peers = {str(h): s.info for h, s in enumerate(stores)}
    for s in stores:
      s.call(_requests.Peers(peers=peers))
    yield root, job, stores


def _write(store: AgentStore, host: int, step: int, hosts: int = 2) -> None:
  n = 1024
  data = np.full(n, step + 10 * host, np.uint8)
  slot = store.reserve(step, n, timeout_secs=30)
  np.asarray(slot.buffer)[:n] = data
  shard = ShardRecord(((host * n, (host + 1) * n),), 0, n, checksum(data))
  manifest = SnapshotManifest(step=step, leaves=(LeafRecord("['x']", "numpy", (hosts * n,), "uint8",
                                                            (shard,)),),
                              nbytes=n, process_index=host, process_count=hosts)
  store.commit(slot, manifest, persist_attempt=f"r-s{step}-1")


def _wait(cond, what, secs=120):
  deadline = time.monotonic() + secs
  while not cond():
    assert time.monotonic() < deadline, what
    time.sleep(0.05)


def test_delete_fences_a_persist_in_flight_on_every_host(tmp_path, capsys):
  """Two hosts, each its own machine (run root, address). Host 0's persist of step 2 waits
  for host 1's part when `jaxckpt delete` runs; afterwards host 1's part arrives (its trainer
  was late), and step 4 is persisted whole: step 2 never commits, on any tier."""
  d = str(tmp_path / "ckpt")
  persist = PersistConfig(directory=d, interval_steps=2, timeout_secs=300).to_obj()
  with _two_hosts(persist, max_snapshots=2) as (root, job, stores):
    _write(stores[0], 0, 2)
    _wait(lambda: os.path.isdir(d) and not u.missing_parts(d, 2, "r-s2-1", of=[0]),
          "host 0's part of step 2 written: its persist waits for host 1's to commit")
    out = run_cli(capsys, "delete", d, "--step", "2", "--run-root", os.path.join(root, "machine1"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"deleted step 2 of {d} (its uncommitted data on storage)",
        f"  job {job}: 2 agents told; hosts [0] dropped it from host memory; the persist of "
        "hosts [0] stopped uncommitted"]
    assert stores[0].steps() == [] and 2 not in stores[0].persist_status().pending
    _write(stores[1], 1, 2)                       # the late part of step 2
    _wait(lambda: 2 in stores[1].persist_status().persisted, "host 1's part of step 2")
    for h, s in enumerate(stores):
      _write(s, h, 4)
    _wait(lambda: 4 in u.all_steps(d), "step 4 committed")     # persists run in order
    assert u.all_steps(d) == [4]


def test_delete_refuses_when_an_agent_that_persists_there_does_not_answer(tmp_path, capsys):
  d = str(tmp_path / "ckpt")
  persist = PersistConfig(directory=d, interval_steps=2).to_obj()
  with _two_hosts(persist, max_snapshots=1) as (root, job, stores):
    os.kill(stores[1].pid, 9)
    processes.wait_gone(stores[1].pid, 10, "host 1's agent")
    stored_steps(d, 6)
    argv = ["delete", d, "--step", "6", "--run-root", os.path.join(root, "machine0"),
            "--timeout-secs", "1"]
    out = run_cli(capsys, *argv)
    assert out.returncode == 2 and u.all_steps(d) == [6]
    assert out.stderr.startswith(f"jaxckpt delete: agents of job {job!r} persist to {d!r}, and "
                                 f"these did not answer: host 1 pid {stores[1].pid} at ")
    assert out.stderr.strip().endswith("pass --ignore-unreachable if they are gone for good")
    out = run_cli(capsys, *argv, "--ignore-unreachable")
    assert out.returncode == 0, out.stderr
    assert u.all_steps(d) == []

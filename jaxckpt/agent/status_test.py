"""`jaxckpt status` on a job of three hosts, each its own machine: its own run root and
loopback address, real agent processes that persist to one directory."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt.agent import _requests
from jaxckpt.agent.commands import jobs, status_cli
from jaxckpt.agent.trainer.client import AgentStore
from jaxckpt.host._persist import PersistConfig
from jaxckpt.host.snapshot import LeafRecord, ShardRecord, SnapshotManifest, checksum
from jaxckpt.testing import processes

HOSTS = 3
N = 4096                       # bytes each host snapshots
SECRET = "s3cret-of-the-status-test-job"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def machine(root: str, m: int) -> tuple[str, str]:
  return os.path.join(root, f"machine{m}"), f"127.0.1.{m + 1}"


def write(store: AgentStore, host: int, step: int) -> None:
  """Host ``host``'s piece of ``step``: bytes [host * N, (host + 1) * N) of leaf ['x']."""
  data = np.full(N, step * 10 + host, np.uint8)
  slot = store.reserve(step, N, timeout_secs=30)
  assert slot is not None
  np.asarray(slot.buffer)[:N] = data
  shard = ShardRecord(((host * N, (host + 1) * N),), 0, N, checksum(data))
  leaf = LeafRecord("['x']", "numpy", (HOSTS * N,), "uint8", (shard,))
  manifest = SnapshotManifest(step=step, leaves=(leaf,), nbytes=N, process_index=host,
                              process_count=HOSTS)
  store.commit(slot, manifest, persist_attempt=f"status-test-s{step}-1" if step % 2 == 0 else None)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
  """Steps 1-3 on every host (step 2 persisted before step 3), step 4 on hosts 0 and 1 only:
  host 0's persist of step 4 (due for storage every 2 steps) waits for host 2's part, a
  persist lag."""
  directory = str(tmp_path_factory.mktemp("status") / "ckpt")
  persist = PersistConfig(directory=directory, interval_steps=2, timeout_secs=300).to_obj()
  with processes.agent_sandbox() as (root, name), contextlib.ExitStack() as stack:
    stores = []
    for h in range(HOSTS):
      run_root, address = machine(root, h)
      os.makedirs(run_root)
      store = AgentStore(jc.AgentOptions(job_name=name, run_root=run_root, tcp_host=address,
                                         secret=SECRET),
                         host=h, max_snapshots=2, limit_bytes=64 << 20, persist=persist)
      stack.callback(store.close)
      stores.append(store)
    peers = {str(h): s.info for h, s in enumerate(stores)}     # what discover() tells them
    for s in stores:
      s.call(_requests.Peers(peers=peers))
    for step in (1, 2):
      for h, s in enumerate(stores):
        write(s, h, step)
    wait_for(lambda: all(2 in s.persist_status().persisted for s in stores), "step 2 persisted")
    for h, s in enumerate(stores):
      write(s, h, 3)
    for h in (0, 1):
      write(stores[h], h, 4)
    wait_for(lambda: 4 in stores[1].persist_status().persisted, "host 1's part of step 4")
    yield root, name, directory, stores


def wait_for(cond, what, timeout_secs=120):
  deadline = time.monotonic() + timeout_secs
  while not cond():
    assert time.monotonic() < deadline, f"{what}: not within {timeout_secs} s"
    time.sleep(0.05)


def jaxckpt(*argv, timeout=120):
  return subprocess.run([sys.executable, "-m", "jaxckpt", *argv], capture_output=True, text=True,
                        timeout=timeout, env=dict(os.environ, PYTHONPATH=REPO))


@pytest.mark.parametrize("m", [0, 2])
def test_status_from_any_machine_shows_every_host(job, m):
  root, name, directory, stores = job
  out = jaxckpt("status", "--run-root", machine(root, m)[0], "--json")
  assert out.returncode == 0, out.stderr
  view, = json.loads(out.stdout)["jobs"]
  assert view["job"] == name
  agents = view["agents"]
  assert [(a["host"], a["pid"], a["address"]) for a in agents] == [
      (h, s.pid, s.info["tcp"]) for h, s in enumerate(stores)]
  assert [a["address"].split(":")[1] for a in agents] == ["//127.0.1.1", "//127.0.1.2",
                                                         "//127.0.1.3"]
  assert [a["local"] for a in agents] == [h == m for h in range(HOSTS)]
  assert all(a["alive"] and a["error"] is None for a in agents)
  assert [a["held"] for a in agents] == [s.steps() for s in stores] == [[3, 4], [3, 4], [2, 3]]
  assert all(jobs.same_directory(a["directory"], directory) for a in agents)
  assert [2 in a["persisted"] for a in agents] == [True, True, True]
  host0, host1, host2 = agents
  assert host0["pending"] == [4] and host0["lag_steps"] == 0 and host0["lag_secs"] > 0
  assert host1["pending"] == [] and host2["pending"] == []
  for a in agents:
    assert a["limit_bytes"] == 64 << 20 and a["bytes"] >= 2 * N and a["trainers"]


def test_the_table_shows_each_host_and_its_lag(job):
  root, name, directory, stores = job
  out = jaxckpt("status", "--run-root", machine(root, 1)[0], "--job-name", name)
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert lines[0].startswith(f"job {name}: 3 agents (1 on this machine, found from "
                             f"{machine(root, 1)[0]}), persisting to ")
  assert lines[1].split() == ["host", "pid", "address", "alive", "held", "protected",
                              "persisted", "pending", "lag", "memory"]
  rows = {int(line.split()[0]): line for line in lines[2:5]}
  for h, s in enumerate(stores):
    assert f" {s.pid} " in rows[h] and s.info["tcp"] in rows[h] and " yes " in rows[h]
  held = ", ".join(map(str, stores[0].steps()))
  assert f" {held} " in rows[0] and " 0 steps, " in rows[0] and "/ 64.0 MiB" in rows[0]


def test_watch_refreshes_as_plain_tables_or_json_lines(job):
  root, name, _, _ = job
  run_root = machine(root, 0)[0]
  out = jaxckpt("status", "--run-root", run_root, "--watch", "0.1", "--count", "2")
  assert out.returncode == 0, out.stderr
  assert out.stdout.count(f"job {name}: 3 agents") == 2
  assert "(every 0.1 s; Ctrl-C ends)" in out.stdout
  out = jaxckpt("status", "--run-root", run_root, "--watch", "0.1", "--count", "3", "--json")
  docs = [json.loads(line) for line in out.stdout.splitlines()]
  assert len(docs) == 3 and all(len(d["jobs"][0]["agents"]) == 3 for d in docs)


def test_watch_on_a_terminal_is_a_live_table(job):
  root, name, _, stores = job
  leader, follower = pty.openpty()               # a terminal for the command's stdout
  proc = subprocess.Popen(
      [sys.executable, "-m", "jaxckpt", "status", "--run-root", machine(root, 0)[0],
       "--watch", "0.1", "--count", "2"], stdin=subprocess.DEVNULL, stdout=follower,
      stderr=follower, env=dict(os.environ, PYTHONPATH=REPO, COLUMNS="200", TERM="xterm"))
  os.close(follower)
  out = b""
  try:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
      if select.select([leader], [], [], 1.0)[0]:
        try:
          chunk = os.read(leader, 65536)
        except OSError:                          # the command closed the terminal
          break
        if not chunk:
          break
        out += chunk
      elif proc.poll() is not None:
        break
    assert proc.wait(timeout=60) == 0, out.decode(errors="replace")
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    os.close(leader)
  text = out.decode(errors="replace")
  assert "\x1b[" in text                          # drawn with terminal control codes
  assert f"job {name}: 3 agents" in text and str(stores[2].pid) in text and "127.0.1.3" in text


def test_an_agent_that_does_not_answer_is_named_and_exit_is_1(tmp_path):
  """A second job: host 1's agent is killed; the status from machine 0 names it."""
  with processes.agent_sandbox() as (root, name), contextlib.ExitStack() as stack:
    stores = []
    for h in range(2):
      run_root, address = machine(root, h)
      os.makedirs(run_root)
      store = AgentStore(jc.AgentOptions(job_name=name, run_root=run_root, tcp_host=address,
                                         secret=SECRET), host=h, max_snapshots=1,
                         limit_bytes=64 << 20)
      stack.callback(store.close)
      stores.append(store)
    peers = {str(h): s.info for h, s in enumerate(stores)}
    for s in stores:
      s.call(_requests.Peers(peers=peers))
    os.kill(stores[1].pid, signal.SIGKILL)
    processes.wait_gone(stores[1].pid, 10, "host 1's agent")
    out = jaxckpt("status", "--run-root", machine(root, 0)[0], "--timeout-secs", "1")
    assert out.returncode == 1, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("1 "))
    assert str(stores[1].pid) in row and " NO" in row
    assert f"! host 1 (pid {stores[1].pid}, {stores[1].info['tcp']}): " in out.stdout
    assert "did not answer 'status' within 1.0 s" in out.stdout


def test_no_agent_here_is_a_clear_error(tmp_path):
  out = jaxckpt("status", "--run-root", str(tmp_path))
  assert out.returncode == 2 and "Traceback" not in out.stderr
  assert out.stderr.strip() == (
      f"jaxckpt status: no snapshot agent runs on this machine under {tmp_path}; a job's agents "
      "are found from the run root of a machine that runs one of them: run this there, or pass "
      "--run-root (AgentOptions.run_root)")


def test_the_guide_shows_what_status_prints(job):
  """docs/guide.md's `jaxckpt status` example has the command's title, header and rows (its
  pids, ports and paths are an example's)."""
  root, name, _, _ = job
  guide = open(os.path.join(REPO, "docs", "guide.md"), encoding="utf-8").read()
  shown = guide.split("```text\n$ jaxckpt status\n", 1)[1].split("```", 1)[0].splitlines()
  real = jaxckpt("status", "--run-root", machine(root, 0)[0]).stdout.splitlines()
  title = re.compile(r"job \S+: 3 agents \(1 on this machine, found from \S+\), persisting to \S+$")
  assert title.match(shown[0]) and title.match(real[0])
  cells = lambda line: re.split(r"\s{2,}", line.strip())  # pylint: disable=unnecessary-lambda-assignment
  assert cells(shown[1]) == cells(real[1]) == list(status_cli.COLUMNS)
  assert len(shown) == len(real) == 5
  for s, r in zip(shown[2:], real[2:]):
    s, r = cells(s), cells(r)
    lag = lambda c: c[8].split(", ")[0]                    # pylint: disable=unnecessary-lambda-assignment
    assert len(s) == len(r) == 10 and s[0] == r[0] and s[3:8] == r[3:8] and s[9] == r[9], (s, r)
    assert lag(s) == lag(r), (s, r)


def test_the_lag_is_never_negative_when_a_step_commits_between_the_two_requests():
  # The held steps and the pending persists are two requests: a due step committed
  # between them is pending and not yet held ('-1 steps' was shown).
  view = jobs.AgentView(host=0, pid=1, address="tcp://127.0.0.1:1", local=True, alive=True,
                        held=[9, 10], pending=[11])
  view.lag_steps = jobs.lag_steps(view.held, view.pending)
  assert view.lag_steps == 0 and status_cli.row(view)["lag"] == "0 steps"
  assert jobs.lag_steps([9, 10, 11], [5, 11]) == 6 and jobs.lag_steps([4], []) == 0

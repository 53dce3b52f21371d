"""`jaxckpt agent status|stop` find this machine's agents of a job by themselves."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys

import psutil

from jaxckpt.agent.commands import jobs
from jaxckpt.testing import processes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_status_and_stop_find_every_agent_of_the_job_with_no_host_id():
  """Agents of hosts 3 and 5 (per-process run roots: no host 0 here) are found by job alone."""
  with processes.agent_sandbox() as (root, job):
    def agent(*argv):
      return subprocess.run([sys.executable, "-m", "jaxckpt.agent", *argv, "--job-name", job,
                             "--run-root", root], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=REPO))
    started = {h: json.loads(agent("start", "--host-id", str(h)).stdout) for h in (3, 5)}
    out = agent("status")
    assert out.returncode == 0, out.stderr
    replies = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["running"], r["host"], r["pid"]) for r in replies] == [
        (True, h, started[h]["pid"]) for h in (3, 5)]
    one, = (json.loads(line) for line in agent("status", "--host-id", "5").stdout.splitlines())
    assert one["host"] == 5
    out = agent("stop")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"stopped agent pid {started[h]['pid']} of job {job!r} host {h}" for h in (3, 5)]
    for h in (3, 5):
      processes.wait_gone(started[h]["pid"], 10, f"agent of host {h}")
    out = agent("status")
    assert out.returncode == 1 and json.loads(out.stdout) == {
        "running": False, "job": job, "host": None, "run_root": root}
    assert agent("stop").stdout.strip() == f"no agent of job {job!r} is running under {root}"


def _jaxckpt(*argv):
  return subprocess.run([sys.executable, "-m", "jaxckpt", *argv], capture_output=True, text=True,
                        timeout=120, env=dict(os.environ, PYTHONPATH=REPO))


def test_agent_list_shows_every_agent_of_the_user_and_stop_all_stops_them():
  """Agents of two jobs under two run roots: `agent list` shows both (job, host, memory,
  idle time, run root) whatever the run root; `agent stop --all` stops every one (here
  limited to the test's run roots: other agents of this user on the machine are not the
  test's) and frees their shared memory."""
  with processes.agent_sandbox() as (root_a, job_a), processes.agent_sandbox() as (root_b, job_b):
    def start(root, job, host):
      out = _jaxckpt("agent", "start", "--job-name", job, "--run-root", root, "--host-id",
                     str(host), "--idle-timeout-secs", "600", "--limit-bytes", str(64 << 20))
      assert out.returncode == 0, out.stderr
      return json.loads(out.stdout)["pid"]
    pids = {(job_a, 0): start(root_a, job_a, 0), (job_b, 2): start(root_b, job_b, 2)}
    out = _jaxckpt("agent", "list", "--json")
    seen = {(a["job"], a["host"]): a for a in map(json.loads, out.stdout.splitlines())}
    for (job, host), pid in pids.items():
      a = seen[job, host]
      assert (a["pid"], a["answered"], a["error"], a["limit_bytes"], a["trainers"]) == (
          pid, True, None, 64 << 20, []), a
      assert 0 <= a["idle_secs"] < 120 and a["idle_timeout_secs"] == 600 and a["rss_bytes"] > 0
    assert seen[job_a, 0]["run_root"] == root_a and seen[job_b, 2]["run_root"] == root_b
    table = _jaxckpt("agent", "list").stdout.splitlines()
    assert table[0].split() == ["pid", "job", "host", "held", "memory", "rss", "trainers",
                                "idle", "run", "root"]
    row = next(line for line in table if f" {job_a} " in line)
    assert row.startswith(str(pids[job_a, 0])) and "0 B / 64.0 MiB (0%)" in row, row
    assert " (exits in 9 min) " in row or " (exits in 10 min) " in row, row
    assert row.endswith(root_a), row
    said = ""
    for root in (root_a, root_b):
      out = _jaxckpt("agent", "stop", "--all", "--run-root", root)
      assert out.returncode == 0, out.stderr
      said += out.stdout
    for (job, host), pid in pids.items():
      assert f"stopped agent pid {pid} of job {job!r} host {host} (" in said, said
    for pid in pids.values():
      processes.wait_gone(pid, 30, "a stopped agent")
    assert not os.listdir(root_a) and not os.listdir(root_b)          # their memory is freed
    listed = {(a["job"], a["host"]) for a in map(json.loads, _jaxckpt(
        "agent", "list", "--json").stdout.splitlines())}
    assert not listed & set(pids)
    bad = _jaxckpt("agent", "stop", "--all", "--job-name", job_a)
    assert bad.returncode == 2 and "give --job-name JOB" in bad.stderr


def test_agent_list_suggests_for_each_job_the_command_that_stops_only_its_agents():
  # It suggested `jaxckpt agent stop --all` beneath agents of other jobs of the same user,
  # started elsewhere (another run root, maybe serving trainers): the suggestion read as if it
  # stopped what the reader meant. Each job's line must stop that job's agents and no other.
  with processes.agent_sandbox() as (root_a, job_a), processes.agent_sandbox() as (root_b, job_b):
    def start(root, job, host):
      out = _jaxckpt("agent", "start", "--job-name", job, "--run-root", root, "--host-id",
                     str(host), "--idle-timeout-secs", "600")
      assert out.returncode == 0, out.stderr
      return json.loads(out.stdout)["pid"]
    a0, a1, b0 = start(root_a, job_a, 0), start(root_a, job_a, 1), start(root_b, job_b, 0)
    try:
      out = _jaxckpt("agent", "list")
      lines = out.stdout.splitlines()
      footer = lines[lines.index(next(line for line in lines if line.endswith("; to stop them:"))):]
      line_a = next(line for line in footer if f"--job-name {job_a} " in line)
      line_b = next(line for line in footer if f"--job-name {job_b} " in line)
      assert line_a.split("#")[1].strip() == f"job {job_a}'s 2 agents: no trainer attached", line_a
      assert f"--run-root {root_a}" in line_a and f"--run-root {root_b}" in line_b, footer
      assert any(line.strip().startswith("jaxckpt agent stop --all   ") and "listed" in line
                 for line in footer), footer
      cmd = shlex.split(line_a.split("#")[0])
      assert cmd[:3] == ["jaxckpt", "agent", "stop"], cmd
      ran = _jaxckpt(*cmd[1:])
      assert ran.returncode == 0, ran.stderr
      for pid in (a0, a1):
        processes.wait_gone(pid, 30, f"an agent of job {job_a}")
      assert psutil.pid_exists(b0) and psutil.Process(b0).status() != psutil.STATUS_ZOMBIE
      listed = {a["job"] for a in map(json.loads, _jaxckpt("agent", "list", "--json").stdout.splitlines())}
      assert job_b in listed and job_a not in listed
      ran = _jaxckpt(*shlex.split(line_b.split("#")[0])[1:])
      assert ran.returncode == 0, ran.stderr
      processes.wait_gone(b0, 30, f"the agent of job {job_b}")
    finally:
      for pid in (a0, a1, b0):
        with contextlib.suppress(psutil.NoSuchProcess):
          psutil.Process(pid).kill()


def test_agent_list_takes_only_jaxckpt_agents_for_agents():
  # Another program whose arguments read 'agent serve --job-name ...' is not listed (nor
  # stopped by stop --all); `python -m jaxckpt agent serve` and `jaxckpt agent serve` are.
  other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", "agent",
                            "serve", "--job-name", "notours"], stdin=subprocess.PIPE)
  try:
    proc = psutil.Process(other.pid)
    assert jobs.agent_of(proc) is None
    assert "notours" not in _jaxckpt("agent", "list", "--json").stdout
  finally:
    other.kill()
    other.wait(30)
  for argv in (["/usr/bin/python3", "-m", "jaxckpt", "agent", "serve", "--job-name", "j"],
               ["/venv/bin/jaxckpt", "agent", "serve", "--job-name", "j", "--host-id", "2"],
               ["python", "-m", "jaxckpt.agent", "serve", "--job-name", "j", "--run-root", "/r"]):
    a = jobs.parse_agent_command(argv)
    assert a is not None and a[0] == "j", argv
  assert jobs.parse_agent_command(["python", "-c", "x", "agent", "serve", "--job-name", "j"]) is None

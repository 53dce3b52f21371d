"""A test session's snapshot agents are stopped however it ends: a failed test, Ctrl-C
(SIGINT), SIGTERM (``timeout``); another session's agents are left alone."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from jaxckpt.testing import processes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A test that starts an agent under its own run root and does not stop it (a leak).
LEAKS = textwrap.dedent("""
    import json, subprocess, sys, time

    def test_leaks_an_agent():
        out = subprocess.run([sys.executable, "-m", "jaxckpt", "agent", "start", "--job-name",
                              "{job}", "--run-root", "{root}", "--limit-bytes", "1048576"],
                             capture_output=True, text=True, timeout=120, check=True)
        print("STARTED", json.loads(out.stdout)["pid"], flush=True)
        {end}
""")


@pytest.mark.parametrize("end", ["a failed test", "SIGINT", "SIGTERM"])
def test_the_agents_a_session_started_are_stopped_however_it_ends(tmp_path, end):
  with processes.agent_sandbox() as (root, job):
    body = ("assert False, 'the test fails'" if end == "a failed test" else
            "time.sleep(600)  # until the session is signalled")
    test = tmp_path / "leak_test.py"
    test.write_text(LEAKS.format(job=job, root=root, end=body))
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                          "-p", "jaxckpt.testing.pytest_agents", str(test)], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, PYTHONPATH=REPO))
    pid = None
    try:
      lines = []
      for line in p.stdout:
        lines.append(line)
        if line.startswith("STARTED"):
          pid = int(line.split()[1])
          break
      assert pid is not None, "".join(lines)
      if end != "a failed test":
        p.send_signal(getattr(signal, end))
      rest, _ = p.communicate(timeout=120)
    finally:
      if p.poll() is None:
        p.kill()
        p.wait(30)
    said = "".join(lines) + rest
    assert p.returncode in (1, 2), said               # failed, or interrupted
    processes.wait_gone(pid, 30, "the agent the session left running")
    assert f"jaxckpt: stopped 1 snapshot agent this test session left running (pids [{pid}]" \
        in said, said
    assert not os.listdir(root), os.listdir(root)     # its shared memory and files are gone


def test_another_sessions_agents_are_left_alone(tmp_path):
  with processes.agent_sandbox() as (root, job):
    out = subprocess.run([sys.executable, "-m", "jaxckpt", "agent", "start", "--job-name", job,
                          "--run-root", root, "--limit-bytes", "1048576"], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    pid = json.loads(out.stdout)["pid"]              # (this session's: the sandbox stops it)
    test = tmp_path / "nothing_test.py"
    test.write_text("def test_nothing():\n  pass\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                          "jaxckpt.testing.pytest_agents", str(test)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert run.returncode == 0, run.stdout + run.stderr
    assert processes.pid_alive(pid) and "jaxckpt: stopped" not in run.stdout + run.stderr

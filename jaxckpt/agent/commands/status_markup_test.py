"""`jaxckpt status --watch` on a terminal shows directory names as they are, never as
rich markup: `runs/sweep[lr=0.001,bs=64]` was shown as `runs/sweep`,
and a directory `exp[/b]` crashed the view with MarkupError."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

import numpy as np

import jaxckpt as jc
from jaxckpt.testing import processes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def _on_a_terminal(argv: list[str], timeout_secs: float = 120) -> tuple[int, str]:
  """``jaxckpt ARGV`` with a pseudo-terminal as its stdout: its exit code and output."""
  leader, follower = pty.openpty()
  proc = subprocess.Popen([sys.executable, "-m", "jaxckpt", *argv], stdin=subprocess.DEVNULL,
                          stdout=follower, stderr=follower,
                          env=dict(os.environ, PYTHONPATH=REPO, COLUMNS="400", TERM="xterm"))
  os.close(follower)
  out = b""
  try:
    deadline = time.monotonic() + timeout_secs
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
    code = proc.wait(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    os.close(leader)
  return code, out.decode(errors="replace")


def test_watch_shows_bracketed_directory_names_as_they_are(tmp_path):
  directory = str(tmp_path / "runs" / "sweep[lr=0.001,bs=64]" / "exp[" / "b]")
  with processes.agent_sandbox("jts") as (root, job):
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root),
                                persist_interval_steps=1, handle_sigterm=False)
    with jc.CheckpointManager(directory, opts) as m:
      assert m.save(1, {"w": np.arange(64, dtype=np.float32)})
      m.wait_until_finished()
      code, out = _on_a_terminal(["status", "--run-root", root, "--watch", "0.1", "--count", "1"])
  assert code == 0, out
  assert "MarkupError" not in out and "Traceback" not in out, out
  assert "\x1b[" in out                           # drawn live, with terminal control codes
  text = _ANSI.sub("", out)
  assert "sweep[lr=0.001,bs=64]/exp[/b]" in text, text

"""docs/local_job.md's script, as a user runs it: a job of 3 processes on localhost, one
killed, relaunched from host memory, a host lost, relaunched from parity."""

import os
import re
import subprocess
import sys

import pytest

from jaxckpt.agent.commands import jobs

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "local_job.py")


@pytest.mark.slow
def test_the_local_job_resumes_from_host_memory_then_from_parity(tmp_path):
  job = f"localjob{os.getpid()}"
  out = subprocess.run([sys.executable, SCRIPT, "--processes", "3", "--steps", "6", "--kill-at",
                        "3", "--job", job], capture_output=True, text=True, timeout=900,
                       cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.path.dirname(
                           os.path.dirname(SCRIPT))})
  said = out.stdout + out.stderr
  assert out.returncode == 0, said[-5000:]
  killed = int(re.search(r"== SIGKILLed process 2 at step (\d+)\.", said).group(1))
  first, second = said.split("== lost the host of process 2")
  resumed = re.findall(r"process (\d): resumed at step (\d+) from tier (\w+) in [\d.]+ s "
                       r"\(bit-exact\)", first)
  assert sorted(p for p, _, _ in resumed) == ["0", "1", "2"], first[-3000:]
  steps = {int(s) for _, s, _ in resumed}
  assert len(steps) == 1 and killed - 1 <= steps.pop() <= killed, resumed    # the same step
  assert {t for _, _, t in resumed} == {"host"}
  assert sorted(re.findall(r"process (\d): done at step 6\n", first)) == ["0", "1", "2"]
  rebuilt = re.findall(r"process (\d): resumed at step 6 from tier parity in [\d.]+ s "
                       r"\(bit-exact\)", second)
  assert sorted(rebuilt) == ["0", "1", "2"], second[-3000:]
  assert "== the job's agents are stopped and their shared memory freed" in said
  assert not [a for a in jobs.local_agents(ask=False) if a.job == job]    # none left running

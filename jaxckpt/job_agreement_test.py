"""A job is one unit: its processes agree on their options at start, and every process's
wait_until_finished returns once the step is committed on storage (real processes of
one jax.distributed job on loopback: :mod:`jaxckpt.testing.job_worker`)."""

from __future__ import annotations

import pytest

from jaxckpt.job_faults_test import finish, launch, lines
from jaxckpt.testing import processes


@pytest.mark.parametrize("variant", ["", "agent"], ids=["in_process", "agent"])
def test_every_process_waits_for_the_commit(tmp_path, variant):
  """Process 0 is five seconds late: process 1's wait_until_finished returned after
  0.6-0.8 s, its own part written and the step not committed; now it returns once the
  step is on storage."""
  with processes.agent_sandbox() as (root, job):
    with launch(2, root, job, "late_commit", str(tmp_path / "ckpt"), variant) as procs:
      outs = finish(procs, timeout=240)
  for i, out in enumerate(outs):
    (waited,) = lines(out, "WAITED")
    assert waited.endswith("COMMITTED True"), (i, waited)
  secs = float(lines(outs[1], "WAITED")[0].split()[1])
  assert secs > 3.0, secs          # it waited for process 0's commit, not only its own part


@pytest.mark.parametrize("variant", ["save_interval_steps=2", "persist_interval_steps=3"])
def test_processes_with_other_options_are_refused_at_start(tmp_path, variant):
  """Before, process 1's save() returned True for steps the job did not hold whole
  (save_interval_steps), or nothing was ever committed (persist_interval_steps)."""
  name, value = variant.split("=")
  with processes.agent_sandbox() as (root, job):
    with launch(2, root, job, "options_differ", str(tmp_path / "ckpt"), variant) as procs:
      outs = finish(procs, timeout=240)
  for i, out in enumerate(outs):
    (refused,) = lines(out, "REFUSED")
    assert f"process {i}:" in refused and "the 2 processes of this job" in refused, refused
    assert f"{name}: process 0 has None, processes [1] have {value}" in refused or (
        f"{name}: process 0 has 1, processes [1] have {value}" in refused), refused
    assert "Give every process the same CheckpointOptions" in refused

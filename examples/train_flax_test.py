"""The example training loop: a rollback replays the original loss trajectory."""

import json
import os
import pathlib
import subprocess
import sys

import logging

import numpy as np
import pytest

import jaxckpt.universal as u
from jaxckpt.testing import processes
from examples import train_flax


def _run(tmp_path, name, *extra, steps=10):
  out = str(tmp_path / name)
  assert train_flax.main(["--steps", str(steps), "--layers", "1", "--d-model", "32",
                          "--max-snapshots", "3", "--dump", out, *extra]) == 0
  with open(out) as f:
    losses = json.load(f)["losses"]
  return losses, dict(np.load(out + ".npz"))


@pytest.mark.slow
def test_rollback_replays_the_same_losses_and_params(tmp_path):
  base_losses, base_params = _run(tmp_path, "base.json")
  rb_losses, rb_params = _run(tmp_path, "rb.json", "--rollback-at", "8", "--rollback-to", "6")
  assert not np.isnan(base_losses).any()
  assert base_losses == rb_losses                 # bit-equal floats
  assert base_params.keys() == rb_params.keys()
  for k in base_params:
    np.testing.assert_array_equal(base_params[k], rb_params[k])


def test_first_lines_are_the_example_not_jax_backend_noise(tmp_path):
  script = pathlib.Path(__file__).with_name("train_flax.py")
  out = subprocess.run([sys.executable, str(script), "--steps", "1", "--layers", "1", "--d-model", "16",
                        "--devices", "2"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(script.parent.parent)})
  assert out.returncode == 0, out.stderr[-3000:]
  lines = (out.stdout + out.stderr).splitlines()
  assert " train_flax step 1 loss " in lines[0], lines[:3]
  assert not any("libtpu" in l or "Unable to initialize backend" in l for l in lines), lines


def test_directory_persists_the_run(tmp_path):
  d = tmp_path / "ckpt"
  assert train_flax.main(["--steps", "3", "--layers", "1", "--d-model", "16", "--directory", str(d)]) == 0
  stored = u.all_steps(str(d))               # the first, the last, and what storage kept up with
  assert stored[0] == 1 and stored[-1] == 3, stored


@pytest.mark.slow
def test_a_run_resumed_with_more_steps_goes_on_where_it_stopped(tmp_path, caplog):
  """--steps 10, then --steps 15 --resume (the losses leaf is longer now): resumes at
  step 10 from the agent's host memory, and ends bit-equal to a run of 15 steps."""
  with processes.agent_sandbox() as (root, job):
    agent = ["--job-name", job, "--agent-run-root", root]
    first, _ = _run(tmp_path, "first.json", *agent)
    with caplog.at_level(logging.INFO, logger="train_flax"):
      resumed, resumed_params = _run(tmp_path, "resumed.json", *agent, "--resume", steps=15)
    assert "resumed at step 10 from tier host" in caplog.text
  straight, straight_params = _run(tmp_path, "straight.json", steps=15)
  assert len(resumed) == 15 and not np.isnan(resumed).any()
  assert resumed[:10] == first and resumed == straight          # bit-equal floats
  for k in straight_params:
    np.testing.assert_array_equal(resumed_params[k], straight_params[k])


def test_resume_with_nothing_to_resume_from_says_why_and_starts_at_step_0(tmp_path, caplog):
  with caplog.at_level(logging.WARNING, logger="train_flax"):
    losses, _ = _run(tmp_path, "run.json", "--resume", steps=2)
  assert ("--resume: no snapshot to resume from (without --job-name or --directory the "
          "snapshots of a run live in its own process and end with it); starting at step 0"
          in caplog.text)
  assert not np.isnan(losses).any()

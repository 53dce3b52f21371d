"""The example training loop: a rollback replays the original loss trajectory."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np

import jaxckpt.universal as u
from examples import train_flax


def _run(tmp_path, name, *extra):
  out = str(tmp_path / name)
  assert train_flax.main(["--steps", "10", "--layers", "1", "--d-model", "32",
                          "--max-snapshots", "3", "--dump", out, *extra]) == 0
  with open(out) as f:
    losses = json.load(f)["losses"]
  return losses, dict(np.load(out + ".npz"))


import pytest


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

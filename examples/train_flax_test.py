"""The example training loop: a rollback replays the original loss trajectory."""

import json

import numpy as np

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

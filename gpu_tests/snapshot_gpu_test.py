"""The snapshot scenarios on real GPUs (run on a GPU machine: python -m pytest gpu_tests)."""

import jax
import pytest

from jaxckpt.testing import processes, scenarios


def _gpus():
  try:
    return jax.devices("gpu")
  except RuntimeError:
    return []


pytestmark = pytest.mark.skipif(not _gpus(), reason="needs a CUDA GPU: jax found no 'gpu' backend")


def test_sharded_snapshot_round_trip():
  scenarios.sharded_snapshot_round_trip(_gpus())


def test_snapshot_survives_donation():
  scenarios.snapshot_survives_donation(_gpus())


def test_restore_onto_another_mesh():
  scenarios.restore_onto_another_mesh(_gpus())


def test_agent_restart():
  with processes.agent_sandbox() as (root, job):
    scenarios.agent_restart(_gpus(), root, job)

"""The snapshot scenarios on real TPUs (run on a TPU VM: python -m pytest tpu_tests)."""

import jax
import pytest

from jaxckpt.testing import processes, scenarios


def _tpus():
  try:
    return jax.devices("tpu")
  except RuntimeError:
    return []


pytestmark = pytest.mark.skipif(not _tpus(), reason="needs a TPU: jax found no 'tpu' backend")


def test_sharded_snapshot_round_trip():
  scenarios.sharded_snapshot_round_trip(_tpus())


def test_snapshot_survives_donation():
  scenarios.snapshot_survives_donation(_tpus())


def test_restore_onto_another_mesh():
  scenarios.restore_onto_another_mesh(_tpus())


def test_agent_restart():
  with processes.agent_sandbox() as (root, job):
    scenarios.agent_restart(_tpus(), root, job)

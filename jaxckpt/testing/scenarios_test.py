"""The shipped platform scenarios, on the 8 emulated CPU devices."""

import jax

from jaxckpt.testing import processes, scenarios


def test_sharded_snapshot_round_trip():
  scenarios.sharded_snapshot_round_trip(jax.devices("cpu"))


def test_snapshot_survives_donation():
  scenarios.snapshot_survives_donation(jax.devices("cpu"))


def test_restore_onto_another_mesh():
  scenarios.restore_onto_another_mesh(jax.devices("cpu"))


def test_agent_restart():
  with processes.agent_sandbox() as (root, job):
    scenarios.agent_restart(jax.devices("cpu"), root, job)

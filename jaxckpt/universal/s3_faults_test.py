"""S3 that fails chosen requests (tests/support/faulty_s3.py in front of SeaweedFS):
503 SlowDown, 500 InternalError and connection resets on a share of a persist's
requests are retried and the step commits, bit for bit; storage that refuses every
write of a step fails that persist loudly, commits nothing, and the next persist,
once storage is back, commits."""

from __future__ import annotations

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt import errors
from tests.support.faulty_s3 import Fault, FaultyS3Proxy


def state(step: int) -> dict:
  rng = np.random.default_rng(step)
  return {"w": rng.integers(0, 2**32, (128, 256), dtype=np.uint32),
          "b": rng.standard_normal(33).astype(np.float32)}


def same(a: dict, b: dict) -> bool:
  return all(np.asarray(a[k]).tobytes() == b[k].tobytes() for k in b)


@pytest.fixture
def proxy(s3_server, monkeypatch):
  with FaultyS3Proxy(s3_server.endpoint) as p:
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
    yield p


OPTS = jc.CheckpointOptions(handle_sigterm=False, persist_interval_steps=1, timeout_secs=120)


@pytest.mark.timeout(600)
def test_slowdowns_errors_and_resets_on_some_requests_are_retried_and_the_step_commits(
    s3_server, proxy):
  d = s3_server.url()
  faults = (Fault("503", method="PUT", every=2), Fault("500", method="GET", every=3),
            Fault("reset", method="PUT", every=5))
  proxy.fail(*faults)
  with jc.CheckpointManager(d, OPTS) as m:
    m.save(1, state(1))
    m.wait_until_finished()
  proxy.heal()
  assert sum(f.served for f in faults) >= 3, [(f.how, f.served) for f in faults]
  assert jc.universal.all_steps(d) == [1]
  with jc.CheckpointManager(d, OPTS) as m:
    assert same(m.restore(1, target=None), state(1))


@pytest.mark.timeout(600)
def test_storage_refusing_every_write_of_a_step_commits_nothing_and_the_next_step_commits(
    s3_server, proxy):
  d = s3_server.url()
  opts = jc.CheckpointOptions(handle_sigterm=False, persist_interval_steps=1, timeout_secs=20)
  with jc.CheckpointManager(d, opts) as m:
    m.save(1, state(1))
    m.wait_until_finished()
    refuse = Fault("500", method="PUT", path="step_0000000002")
    proxy.fail(refuse)
    m.save(2, state(2))
    # tensorstore retries a 500 with backoff: the wait ends at its timeout, naming the step
    with pytest.raises((errors.StorageError, errors.SnapshotTimeoutError)) as got:
      m.wait_until_finished()
    assert "step 2" in str(got.value) or "steps [2]" in str(got.value), got.value
    assert refuse.served >= 1
    assert jc.universal.all_steps(d) == [1]          # nothing of step 2 committed
    proxy.heal()      # (its persist goes on trying: it may commit now, whole)
    m.save(3, state(3))
    m.wait_until_persisted(3)
  steps = jc.universal.all_steps(d)
  assert {1, 3} <= set(steps) <= {1, 2, 3}, steps
  with jc.CheckpointManager(d, opts) as m:
    for step in steps:
      assert same(m.restore(step, target=None), state(step)), step

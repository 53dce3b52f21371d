"""A step is owned by the manager that saved it: a second live manager of the same
job and host is refused at construction, naming the first, in this process as in
any other, and the first one's close hands the lease on."""

from __future__ import annotations

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.agent import _requests
from jaxckpt.testing import processes

A = {"w": np.full((16, 4), 1.0, np.float32)}
B = {"w": np.full((16, 4), 2.0, np.float32)}


@pytest.fixture
def opts():
  with processes.agent_sandbox("jl") as (root, job):
    yield jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root),
                               max_snapshots=2, handle_sigterm=False)


def test_a_second_manager_in_the_same_process_is_refused_naming_the_first(opts):
  a = jc.CheckpointManager(options=opts)
  try:
    assert a.save(5, A)
    a.wait_until_finished()
    with pytest.raises(errors.PermissionDeniedError) as e:
      jc.CheckpointManager(options=opts)
    msg = str(e.value)
    assert "held by another live manager in this process" in msg
    assert a._core._store.owner in msg      # names the first  # pylint: disable=protected-access
    assert "close that manager first" in msg
    out = a.restore(5, target={"w": np.zeros((16, 4), np.float32)})   # A's step, untouched
    np.testing.assert_array_equal(out["w"], A["w"])
    assert a.save(6, A)                          # and A goes on
    a.wait_until_finished()
  finally:
    a.close()
  with jc.CheckpointManager(options=opts) as b:  # A's close handed the lease on
    out = b.restore(6, target={"w": np.zeros((16, 4), np.float32)})
    np.testing.assert_array_equal(out["w"], A["w"])
    assert b.save(7, B)
    b.wait_until_finished()
    assert b.all_steps() == [6, 7]


def test_a_refused_manager_changes_nothing_and_a_closed_one_cannot_release_anothers_lease(opts):
  with jc.CheckpointManager(options=opts) as a:
    assert a.save(1, A)
    a.wait_until_finished()
    for _ in range(2):
      with pytest.raises(errors.PermissionDeniedError):
        jc.CheckpointManager(options=jc.CheckpointOptions(
            agent=opts.agent, max_snapshots=1, handle_sigterm=False))
    store = a._core._store                             # pylint: disable=protected-access
    status = store.call(_requests.Status())
    assert status.max_snapshots == 2 and status.lease["owner"] == store.owner
    assert a.save(2, A)
    a.wait_until_finished()
    assert a.all_steps() == [1, 2]

"""The agent at the in-process store's speed: ratios measured in one run, interleaved.

The issue's bar is 0.8x (benchmarks/accelerator.py prints the figures: 0.88-1.13x
at 512 MiB); these tests fail below 0.6x, a margin for a loaded 2-core CI machine
(where single runs at 128 MiB ranged 0.69-0.88), still above where the agent was
(restore 0.085x, snapshot 0.54x, first save 38x).
"""

from __future__ import annotations

import contextlib
import statistics
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt as jc
from jaxckpt.testing import processes

MiB = 1 << 20


def _abstract(mib: int) -> dict:
  mesh = jax.make_mesh((8,), ("x",))
  rows = mib * MiB // 4 // 8 // 1024
  return {f"w{i}": jax.ShapeDtypeStruct((rows, 1024), np.float32,
                                        sharding=NamedSharding(mesh, P("x"))) for i in range(8)}


def _make(abstract: dict, seed: int) -> dict:
  keys = jax.random.split(jax.random.key(seed), len(abstract))
  return {k: jax.device_put(jax.random.normal(key, a.shape, a.dtype), a.sharding)
          for key, (k, a) in zip(keys, abstract.items())}


@contextlib.contextmanager
def _managers(**kw):
  with processes.agent_sandbox() as (root, job):
    agent = jc.AgentOptions(job_name=job, run_root=root)
    with jc.CheckpointManager(options=jc.CheckpointOptions(**kw)) as inproc, \
        jc.CheckpointManager(options=jc.CheckpointOptions(agent=agent, **kw)) as agent_mgr:
      yield {"inproc": inproc, "agent": agent_mgr}


@pytest.mark.slow
def test_the_agent_snapshots_and_restores_at_the_in_process_speed():
  # 128 MiB, each step restored twice: at 64 MiB a restore's fixed cost (~2 ms of
  # requests and dispatch) held the ratio at 0.72-0.77 over 15 steps, and one run in
  # a few fell under 0.7; at 128 MiB it is 0.82-0.88 (the benchmark's 512 MiB: 0.88-1.13).
  abstract = _abstract(128)
  nbytes = 128 * MiB
  with _managers(max_snapshots=2) as mgrs:
    for m in mgrs.values():
      m.prepare(_make(abstract, 0))
    snap, rest = {k: [] for k in mgrs}, {k: [] for k in mgrs}
    for rep in range(1, 8):                     # interleaved: both see the same load
      state = _make(abstract, rep)
      for name, m in mgrs.items():
        assert m.save(rep, state, force=True)
        m.wait_until_finished()
        snap[name].append(m.stats.last_snapshot_secs)
      for _ in range(2):
        for name, m in mgrs.items():
          t0 = time.perf_counter()
          out = jax.block_until_ready(m.restore(step=rep, target=abstract))
          rest[name].append(time.perf_counter() - t0)
          assert m.last_restore.tier == "host"
          np.testing.assert_array_equal(np.asarray(out["w3"]), np.asarray(state["w3"]))
          del out
    gbps = {f"{what} {k}": nbytes / statistics.median(v[len(v) // 4:]) / 1e9  # warm: last 3/4
            for what, d in (("snapshot", snap), ("restore", rest)) for k, v in d.items()}
  for what in ("snapshot", "restore"):
    ratio = gbps[f"{what} agent"] / gbps[f"{what} inproc"]
    assert ratio >= 0.6, (what, ratio, gbps)


@pytest.mark.slow
def test_a_first_save_into_the_agent_blocks_as_briefly_as_into_this_process():
  abstract = _abstract(256)     # an agent that allocated its slot in save() blocked ~60 ms
  blocked = {}
  with _managers(max_snapshots=1) as mgrs:
    state = _make(abstract, 1)
    for name, m in mgrs.items():
      jax.block_until_ready(state)
      t0 = time.perf_counter()
      assert m.save(1, state)
      blocked[name] = time.perf_counter() - t0
      m.wait_until_finished()
      np.testing.assert_array_equal(np.asarray(m.restore(target=abstract)["w0"]),
                                    np.asarray(state["w0"]))
  assert blocked["agent"] <= max(5 * blocked["inproc"], 0.02), blocked

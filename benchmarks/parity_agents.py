"""Parity across snapshot agents (issue 4): memory, committed -> protected, recovery.

Four "hosts" (agents 0..3 of one job, one parity group) each hold a quarter of
a float32 matrix (the job's state, ``--size-mib`` in all); one process writes
their per-process snapshots, as four trainers would. Measured side by side in
the same run:

  (a) parity memory each agent holds, against the m / (g - m) figure of its
      snapshot;
  (b) seconds from the last host's commit until every agent holds its parity
      (the step is protected), and each agent's own commit -> parity stored,
      against encoding the same bytes in this process (the codec's floor);
  (c) ``restore()`` of the whole state with one host lost (SIGKILLed agent,
      shared memory wiped, empty replacement): tier "parity", against the same
      restore with nothing lost (tier "host").

The first step after agents start touches fresh shared memory (slow here) and
is reported separately; figures are medians over ``--repeats`` steps, each
losing a different host.

  python benchmarks/parity_agents.py [--quick] [--size-mib 1024] [--repeats 5]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import time
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # pylint: disable=wrong-import-position
from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=wrong-import-position

import jaxckpt as jc  # pylint: disable=wrong-import-position
from jaxckpt.agent import _parity_config, _paths, _requests  # pylint: disable=wrong-import-position
from jaxckpt.agent.trainer.client import AgentStore  # pylint: disable=wrong-import-position
from jaxckpt.host.snapshot import (LeafRecord, ShardRecord, SnapshotManifest,  # pylint: disable=wrong-import-position
                              checksum)
from jaxckpt.testing import processes  # pylint: disable=wrong-import-position

HOSTS = 4
COLS = 1024


class Job:
  """Four hosts' agent stores holding row blocks of one (rows, COLS) float32 matrix."""

  def __init__(self, root: str, job: str, size_mib: float, parity: int) -> None:
    self.root, self.job = root, job
    self.rows = max(HOSTS * 8, int(size_mib * 2**20 / 4 / COLS) // (HOSTS * 8) * HOSTS * 8)
    self.per_host = self.rows // HOSTS
    self.options = jc.ParityOptions(group_size=HOSTS, parity=parity)
    self.config = _parity_config.ParityConfig(HOSTS, parity, 600.0).to_obj()
    rng = np.random.default_rng(0)
    self.base = rng.standard_normal((self.per_host, COLS), dtype=np.float32)
    self.stores = [self._store(h) for h in range(HOSTS)]

  def _store(self, h: int) -> AgentStore:
    return AgentStore(jc.AgentOptions(job_name=self.job, run_root=self.root), host=h,
                      max_snapshots=1, limit_bytes=1 << 40, parity=self.config)

  def block(self, step: int, h: int) -> np.ndarray:
    return self.base + np.float32(step * HOSTS + h)

  def save(self, step: int) -> float:
    """Every host snapshots ``step``; returns the time the last commit returned."""
    for h in range(HOSTS):
      data = self.block(step, h)
      slot = self.stores[h].reserve(step, data.nbytes, timeout_secs=60)
      np.copyto(slot.buffer[:data.nbytes], data.view(np.uint8).reshape(-1))
      box = ((h * self.per_host, (h + 1) * self.per_host), (0, COLS))
      leaf = LeafRecord(path="['w']", kind="jax", shape=(self.rows, COLS), dtype="float32",
                        shards=(ShardRecord(box, 0, data.nbytes, checksum(data)),))
      self.stores[h].commit(slot, SnapshotManifest(step=step, leaves=(leaf,), nbytes=data.nbytes,
                                                   process_index=h, process_count=HOSTS))
    return time.perf_counter()

  def wait_protected(self, step: int, committed_at: float) -> tuple[float, list[float]]:
    """Seconds from ``committed_at`` until every agent holds its parity of ``step``,
    and each agent's own commit -> stored seconds."""
    deadline = time.monotonic() + 600
    while True:
      states = [{s[0]: s for s in st.call(_requests.ParityStatus()).steps}.get(step)
                for st in self.stores]
      if all(s is not None and s[1] == "done" for s in states):
        return time.perf_counter() - committed_at, [s[2] for s in states]
      failed = [s for s in states if s is not None and s[1] == "failed"]
      if failed or time.monotonic() > deadline:
        raise RuntimeError(f"step {step} not protected: {states}")
      time.sleep(0.002)

  def lose(self, h: int) -> None:
    pid = self.stores[h].pid
    self.stores[h].close()
    os.kill(pid, signal.SIGKILL)
    processes.wait_gone(pid, 30, f"agent of host {h}")
    shutil.rmtree(_paths.agent_dir(self.root, self.job, h))
    self.stores[h] = self._store(h)

  def restore(self, step: int) -> tuple[float, str]:
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=self.job, run_root=self.root,
                                                      host_id=0),
                                parity=self.options, handle_sigterm=False)
    sharding = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
    target = {"w": jax.ShapeDtypeStruct((self.rows, COLS), np.float32, sharding=sharding)}
    with jc.CheckpointManager(options=opts) as mgr:
      t0 = time.perf_counter()
      out = mgr.restore(step=step, target=target)
      secs = time.perf_counter() - t0
      tier = mgr.last_restore.tier
    got = np.asarray(out["w"])
    for h in range(HOSTS):
      if not np.array_equal(got[h * self.per_host:(h + 1) * self.per_host], self.block(step, h)):
        raise AssertionError(f"step {step}: host {h}'s rows differ after a {tier} restore")
    return secs, tier

  def parity_bytes(self) -> list[int]:
    return [st.call(_requests.Status()).parity_bytes for st in self.stores]

  def close(self) -> None:
    for st in self.stores:
      st.close()


def encode_floor(job: Job) -> float:
  """Seconds to encode one host's parity share in this process (k chunks -> m blocks)."""
  k, m = HOSTS - job.options.parity, job.options.parity
  chunk = job.base.nbytes // k
  data = [job.base.view(np.uint8).reshape(-1)[i * chunk:(i + 1) * chunk] for i in range(k)]
  rs = jc.parity.ReedSolomon(k, m)
  out = [np.empty(chunk, np.uint8) for _ in range(m)]
  rs.encode_into(data, out)                                    # warm-up / first touch
  times = []
  for _ in range(3):
    t0 = time.perf_counter()
    rs.encode_into(data, out)
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * m       # a host holds m blocks, each from an encode


def run(size_mib: float, repeats: int, parity: int) -> dict[str, Any]:
  with processes.agent_sandbox("pb") as (root, name):
    job = Job(root, name, size_mib, parity)
    try:
      step = 1
      first_protect, first_agent = job.wait_protected(step, job.save(step))
      snap = job.base.nbytes
      pbytes = job.parity_bytes()
      protect, agent_secs, rec, host = [], [], [], []
      for r in range(repeats):
        step += 1
        secs, per_agent = job.wait_protected(step, job.save(step))
        protect.append(secs)
        agent_secs.append(statistics.median(per_agent))
        host_secs, tier = job.restore(step)
        assert tier == "host", tier
        host.append(host_secs)
        job.lose(r % HOSTS)
        secs, tier = job.restore(step)
        assert tier == "parity", tier
        rec.append(secs)
      floor = encode_floor(job)
    finally:
      job.close()
  med = statistics.median
  k = HOSTS - parity
  return {
      "group_size": HOSTS, "parity": parity, "job_mib": round(HOSTS * snap / 2**20, 1),
      "snapshot_mib_per_host": round(snap / 2**20, 2),
      "parity_mib_per_host": [round(b / 2**20, 3) for b in pbytes],
      "parity_over_snapshot_measured": round(med(pbytes) / snap, 4),
      "parity_over_snapshot_expected_m_over_g_minus_m": round(parity / k, 4),
      "committed_to_protected_s": round(med(protect), 4),
      "agent_commit_to_parity_stored_s": round(med(agent_secs), 4),
      "encode_only_in_process_s": round(floor, 4),
      "first_step_committed_to_protected_s": round(first_protect, 4),
      "first_step_agent_commit_to_parity_stored_s": round(med(first_agent), 4),
      "restore_one_host_lost_parity_s": round(med(rec), 4),
      "restore_nothing_lost_host_s": round(med(host), 4),
      "parity_over_host_restore": round(med(rec) / med(host), 3),
      "repeats": repeats,
  }


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="32 MiB, 2 repeats, parity 1 (CI smoke)")
  p.add_argument("--size-mib", type=float, default=1024)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--parity", type=int, nargs="+", default=[1, 2])
  args = p.parse_args()
  if args.quick:
    args.size_mib, args.repeats, args.parity = 32, 2, [1]
  results = [run(args.size_mib, args.repeats, m) for m in args.parity]
  print(json.dumps({"benchmark": "parity_agents", "machine_cores": os.cpu_count(),
                    "runs": results}, indent=1))


if __name__ == "__main__":
  main()

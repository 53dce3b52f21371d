"""Snapshots on whatever devices this host has (1..N GPUs, or the CPU): issues 15 and 30.

Runs on every device of the default backend (``jax.devices()``): on a GPU host
that is the GPUs; on a CPU-only host the CPU device(s) (``--quick`` keeps it
small). One Adam-like float32 tree (params, mu, nu: 16 leaves each) sharded
over a 1-D mesh of all devices; side by side in one run:

  host:      copy + hash throughput of this host against threads (the host-side
             limit of a snapshot: numpy copy and xxh3 both release the GIL), of
             the tree's own shards (the limit the ratio uses) and of one
             contiguous allocation (the best case);
  snapshot:  ``save()`` blocking (first save of a fresh manager, cold and after
             ``prepare()``, and warm),
             save -> committed snapshot in GB/s, restore onto the devices in
             GB/s, for the in-process store and the snapshot agent, against
             orbax's async save / restore to local disk;
  loop:      a donating jitted step (``--step-ms`` of work) with ``save()``
             every step (``on_busy="skip"``): median, p95 and worst step,
             achieved snapshot interval (steps per committed snapshot) and
             skipped saves, for no manager, the in-process store and the agent;
  ratios:    the agent over the in-process store (snapshot and restore GB/s,
             first and warm ``save()`` blocking), the in-process snapshot over
             the host's copy+hash limit, jaxckpt's first save over orbax's;
  job:       ``--processes`` (default 4) CPU processes of one jax.distributed
             job on loopback, each with its own run root, agent and address
             (default options, parity m=1, storage): the steps each process's
             save() took and the newest step every host holds.

  python benchmarks/accelerator.py [--quick] [--size-mib 6144] [--repeats 5]
      [--loop-steps 25] [--step-ms 260] [--copy-threads N] [--processes 4]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # pylint: disable=wrong-import-position
import _repo  # noqa: F401  pylint: disable=wrong-import-position  (the repository root on the path: tests.support)

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
import orbax.checkpoint as ocp  # pylint: disable=wrong-import-position
from jax.sharding import Mesh, PartitionSpec as P  # pylint: disable=wrong-import-position

from jaxckpt.host.snapshot import copy_and_hash  # pylint: disable=wrong-import-position

STORES = ("inproc", "agent")
TARGETS = {"save_blocking_max_s": 0.020, "inproc_snapshot_min_GBps": 20.0,
           "agent_snapshot_min_GBps": 15.0, "restore_min_GBps": 20.0,
           "loop_step_overhead_max": 0.05, "loop_interval": 1.0,
           "agent_over_inproc_min": 0.8, "inproc_over_host_limit_min": 0.8}


def host_pipeline(nbytes: int, reps: int, tree: Any) -> dict[str, Any]:
  """Copy + hash GB/s against threads, into one destination buffer: of the snapshot
  tree's own shards as host arrays (the limit of a snapshot of this tree: separately
  allocated buffers, as the device's are), and of ``nbytes`` in 32 contiguous pieces
  of one allocation (the machine's best case: one mapping, huge pages)."""
  shards = [np.asarray(s.data).reshape(-1).view(np.uint8)
            for x in jax.tree.leaves(tree) for s in x.addressable_shards]
  src = np.ones(nbytes, np.uint8)
  step = -(-nbytes // 32)
  pieces = [src[lo:lo + step] for lo in range(0, nbytes, step)]
  threads = sorted({1, 2, 4, 8, os.cpu_count() or 1} & set(range(1, (os.cpu_count() or 1) + 1)))
  out: dict[str, Any] = {}
  for name, sources in (("copy_and_hash_GBps_by_threads", shards),
                        ("contiguous_copy_and_hash_GBps_by_threads", pieces)):
    total = sum(p.nbytes for p in sources)
    offsets = np.cumsum([0] + [p.nbytes for p in sources]).tolist()
    dst = np.zeros(total, np.uint8)
    out[name] = {}
    for n in threads:
      with concurrent.futures.ThreadPoolExecutor(n) as pool:
        secs = []
        for _ in range(reps + 1):
          t0 = time.perf_counter()
          list(pool.map(lambda i: copy_and_hash(sources[i], dst[offsets[i]:offsets[i + 1]]),
                        range(len(sources))))
          secs.append(time.perf_counter() - t0)
      out[name][str(n)] = round(total / statistics.median(secs[1:]) / 1e9, 2)
  out.update(shards=len(shards), bytes=nbytes)
  return out


def job_figures(processes: int, steps: int, ballast_mib: int) -> dict[str, Any]:
  """A loop of ``processes`` CPU processes (tests.support.multihost_worker, loop
  mode): the steps each took, and the newest step the job holds on every host."""
  from jaxckpt.testing import processes as procs  # pylint: disable=import-outside-toplevel
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out: dict[str, Any] = {"processes": processes, "steps": steps}
  with procs.agent_sandbox("bj") as (root, job):
    port, running = procs.free_port(), []
    try:
      for i in range(processes):
        running.append(procs.Proc(
            ["-m", "tests.support.multihost_worker", "--port", str(port), "--num-processes",
             str(processes), "--process-id", str(i), "--run-root",
             os.path.join(root, f"machine{i}"), "--tcp-host", f"127.0.1.{i + 1}", "--job", job,
             "--mode", "loop", "--parity", "1", "--steps", str(steps), "--ballast-mib",
             str(ballast_mib), "--directory", os.path.join(root, "storage")],
            cwd=repo, env={"JAX_PLATFORMS": "cpu"}))
      taken = [json.loads(p.wait_for("STEPS", 600).split("STEPS", 1)[1]) for p in running]
      held = [json.loads(p.wait_for("HELD", 600).split("HELD", 1)[1]) for p in running]
      for p in running:
        p.wait_for("PROTECTED", 600)
    finally:
      for p in running:
        p.__exit__(None, None, None)
  out["steps_taken_by_process"] = taken
  out["same_steps_on_every_process"] = all(t == taken[0] for t in taken)
  out["newest_step_every_host_holds"] = max(set.intersection(*map(set, held)), default=None)
  out["newest_step_taken"] = max(taken[0], default=None)
  return out


def make_abstract(size_mib: float) -> dict[str, Any]:
  mesh = Mesh(np.array(jax.devices()), ("d",))
  return c.abstract_tree(size_mib, mesh, (P("d"),))


def snapshot_figures(args, abstract, make) -> tuple[dict[str, list[float]], dict[str, float]]:
  raw: dict[str, list[float]] = {}
  first: dict[str, float] = {}
  add = lambda k, v: raw.setdefault(k, []).append(v)
  seed = 0
  root = tempfile.mkdtemp(prefix="bench_accel_")
  try:
    for store in STORES:
      with _manager(store, args.copy_threads) as mgr:     # a cold first save
        seed += 1
        tree = make(seed)
        t0 = time.perf_counter()
        assert mgr.save(seed, tree, force=True), mgr.stats
        first[f"{store}_cold_blocking_s"] = time.perf_counter() - t0
        mgr.wait_until_finished()
        first[f"{store}_cold_snapshot_s"] = mgr.stats.last_snapshot_secs
        del tree
      with _manager(store, args.copy_threads) as mgr:     # prepare(), then the first save
        t0 = time.perf_counter()
        mgr.prepare(make(0))
        first[f"{store}_prepare_s"] = time.perf_counter() - t0
        for rep in range(args.repeats + 1):
          seed += 1
          tree = make(seed)
          t0 = time.perf_counter()
          assert mgr.save(seed, tree, force=True), mgr.stats
          block = time.perf_counter() - t0
          mgr.wait_until_finished()
          snap = mgr.stats.last_snapshot_secs
          if rep == 0:
            first[f"{store}_blocking_s"], first[f"{store}_snapshot_s"] = block, snap
          else:
            add(f"{store}_blocking_s", block)
            add(f"{store}_snapshot_s", snap)
          del tree
        for rep in range(args.repeats + 1):
          t0 = time.perf_counter()
          out = jax.block_until_ready(mgr.restore(step=seed, target=abstract))
          if rep:
            add(f"{store}_restore_s", time.perf_counter() - t0)
          del out
    with ocp.CheckpointManager(os.path.join(root, "orbax"), options=ocp.CheckpointManagerOptions(
        max_to_keep=2, enable_async_checkpointing=True)) as omgr:
      for rep in range(args.repeats + 1):
        seed += 1
        tree = make(seed)
        t0 = time.perf_counter()
        omgr.save(seed, args=ocp.args.StandardSave(tree))
        block = time.perf_counter() - t0
        omgr.wait_until_finished()
        done = time.perf_counter() - t0
        if rep == 0:
          first["orbax_blocking_s"], first["orbax_save_complete_s"] = block, done
        else:
          add("orbax_blocking_s", block)
          add("orbax_save_complete_s", done)
        del tree
      for rep in range(args.repeats + 1):
        t0 = time.perf_counter()
        out = jax.block_until_ready(omgr.restore(seed, args=ocp.args.StandardRestore(abstract)))
        if rep:
          add("orbax_restore_s", time.perf_counter() - t0)
        del out
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return raw, first


@contextlib.contextmanager
def _manager(store: str, copy_threads: int | None):
  if store == "none":
    yield None
    return
  with c.manager(store, copy_threads=copy_threads) as mgr:
    yield mgr


def loop_figures(args, abstract, make) -> dict[str, Any]:
  """A donating step with ``--step-ms`` of work and save() every step, per mode."""
  n = 512 if args.quick else 2048
  w = jnp.ones((n, n), jnp.float32) / n

  def burn(k, x):
    return jax.lax.fori_loop(0, k, lambda _, y: jnp.tanh(y @ w), x)

  @jax.jit
  def probe(x):
    return burn(8, x)
  x0 = jnp.ones((n, n), jnp.float32)
  probe(x0).block_until_ready()
  t0 = time.perf_counter()
  probe(x0).block_until_ready()
  per = (time.perf_counter() - t0) / 8
  iters = max(1, int(args.step_ms / 1000 / per))

  def step(state, x):
    y = burn(iters, x)
    return jax.tree.map(lambda a: a * 0.999 + 0.001, state), y
  step = jax.jit(step, donate_argnums=(0,))
  out = {}
  for mode in ("none", *STORES):
    with _manager(mode, args.copy_threads) as mgr:
      state, x = make(1000), x0
      state, x = step(state, x)
      jax.block_until_ready(state)
      times = []
      for s in range(args.loop_steps):
        t0 = time.perf_counter()
        state, x = step(state, x)
        if mgr is not None:
          mgr.save(s + 1, state)
        float(x[0, 0])          # the loop's own host sync (a loss fetched to the host)
        times.append(time.perf_counter() - t0)
      if mgr is not None:
        mgr.wait_until_finished()
      out[mode] = {"median_step_s": round(statistics.median(times), 4),
                   "p95_step_s": round(float(np.percentile(times, 95)), 4),
                   "worst_step_s": round(max(times), 4)}
      if mgr is not None:
        out[mode].update(committed=mgr.stats.committed, skipped_busy=mgr.stats.skipped_busy,
                         achieved_interval=round(args.loop_steps / max(1, mgr.stats.committed), 2))
      del state
  for mode in STORES:
    for k in ("median", "p95"):
      out[mode][f"{k}_over_none"] = round(out[mode][f"{k}_step_s"] / out["none"][f"{k}_step_s"], 3)
  out["work_iters"] = iters
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="64 MiB tree, 2 repeats, 8 loop steps")
  p.add_argument("--size-mib", type=float, default=None, help="tree size (default 6144)")
  p.add_argument("--repeats", type=int, default=None, help="warm repeats (default 5)")
  p.add_argument("--loop-steps", type=int, default=None, help="steps per loop mode (default 25)")
  p.add_argument("--step-ms", type=float, default=260.0, help="work per loop step")
  p.add_argument("--loop-size-mib", type=float, default=None,
                 help="state of the loop (default half of --size-mib)")
  p.add_argument("--copy-threads", type=int, default=None,
                 help="CheckpointOptions.copy_threads (default: the library's default)")
  p.add_argument("--host-mib", type=int, default=None, help="bytes of the host pipeline test")
  p.add_argument("--processes", type=int, default=4,
                 help="processes of the multi-process loop (0: skip it)")
  p.add_argument("--job-steps", type=int, default=20, help="steps of the multi-process loop")
  args = p.parse_args()
  args.size_mib = args.size_mib or (64 if args.quick else 6144)
  args.repeats = args.repeats or (2 if args.quick else 5)
  args.loop_steps = args.loop_steps or (8 if args.quick else 25)
  loop_mib = args.loop_size_mib or args.size_mib / 2
  abstract = make_abstract(args.size_mib)
  make = c.make_tree_fn(abstract)
  nbytes = c.tree_nbytes(make(0))
  host = host_pipeline((args.host_mib or (64 if args.quick else 1024)) << 20, args.repeats,
                       make(0))
  raw, first = snapshot_figures(args, abstract, make)
  med = {k: statistics.median(v) for k, v in raw.items()}
  gbps = {f"{s}_snapshot_GBps": nbytes / med[f"{s}_snapshot_s"] / 1e9 for s in STORES}
  gbps.update({f"{s}_restore_GBps": nbytes / med[f"{s}_restore_s"] / 1e9
               for s in (*STORES, "orbax")})
  gbps["orbax_save_GBps"] = nbytes / med["orbax_save_complete_s"] / 1e9
  loop_abstract = make_abstract(loop_mib)
  loop = loop_figures(args, loop_abstract, c.make_tree_fn(loop_abstract))
  limit = max(host["copy_and_hash_GBps_by_threads"].values())
  ratios = {
      "agent_over_inproc_snapshot": gbps["agent_snapshot_GBps"] / gbps["inproc_snapshot_GBps"],
      "agent_over_inproc_restore": gbps["agent_restore_GBps"] / gbps["inproc_restore_GBps"],
      "inproc_snapshot_over_host_limit": gbps["inproc_snapshot_GBps"] / limit,
      "agent_over_inproc_warm_blocking": med["agent_blocking_s"] / med["inproc_blocking_s"],
      "agent_first_blocking_over_orbax": first["agent_cold_blocking_s"]
                                         / first["orbax_blocking_s"],
      "inproc_first_blocking_over_orbax": first["inproc_cold_blocking_s"]
                                          / first["orbax_blocking_s"],
  }
  job = (job_figures(args.processes, args.job_steps, 8 if args.quick else 48)
         if args.processes > 1 else None)
  met = {
      "agent_snapshot_ge_0.8x_inproc": ratios["agent_over_inproc_snapshot"]
                                       >= TARGETS["agent_over_inproc_min"],
      "agent_restore_ge_0.8x_inproc": ratios["agent_over_inproc_restore"]
                                      >= TARGETS["agent_over_inproc_min"],
      "inproc_snapshot_ge_0.8x_host_limit": ratios["inproc_snapshot_over_host_limit"]
                                            >= TARGETS["inproc_over_host_limit_min"],
      "first_save_le_orbax": max(ratios["agent_first_blocking_over_orbax"],
                                 ratios["inproc_first_blocking_over_orbax"]) <= 1.0,
      "every_save_le_20ms": all(max(raw[f"{s}_blocking_s"] + [first[f"{s}_blocking_s"]])
                                <= TARGETS["save_blocking_max_s"] for s in STORES),
      "inproc_snapshot_ge_20GBps": gbps["inproc_snapshot_GBps"] >= TARGETS["inproc_snapshot_min_GBps"],
      "agent_snapshot_ge_15GBps": gbps["agent_snapshot_GBps"] >= TARGETS["agent_snapshot_min_GBps"],
      "restore_ge_20GBps": min(gbps[f"{s}_restore_GBps"] for s in STORES)
                           >= TARGETS["restore_min_GBps"],
      "loop_every_step": all(loop[s]["achieved_interval"] <= TARGETS["loop_interval"]
                             for s in STORES),
      "loop_median_within_5pct": all(loop[s]["median_over_none"]
                                     <= 1 + TARGETS["loop_step_overhead_max"] for s in STORES),
  }
  if job is not None:
    met["job_same_steps"] = job["same_steps_on_every_process"]
  print(json.dumps({
      "devices": [str(d) for d in jax.devices()], "platform": jax.devices()[0].platform,
      "cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
      "bytes": nbytes, "loop_bytes": int(loop_mib * 2**20), "repeats": args.repeats,
      "copy_threads": args.copy_threads, "host": host,
      "host_copy_and_hash_limit_GBps": limit,
      "seconds": {k: c.summary(v) for k, v in sorted(raw.items())},
      "first_save_seconds": {k: round(v, 4) for k, v in first.items()},
      "GBps": {k: round(v, 2) for k, v in gbps.items()},
      "loop": loop, "ratios": {k: round(v, 3) for k, v in ratios.items()}, "job": job,
      "targets": TARGETS, "targets_met": met,
  }, indent=1))


if __name__ == "__main__":
  main()

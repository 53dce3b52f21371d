"""Host-snapshot save and restore vs orbax and vs a plain memory copy (issues 2 and 3).

Same run, same ~1 GiB Adam-like tree (params, mu, nu: 16 float32 leaves each,
sharded over a (2, 4) CPU mesh with four PartitionSpecs), measured side by side:

  (a) how long ``save()`` blocks the caller: jaxckpt in-process store, jaxckpt
      snapshot agent, orbax ``CheckpointManager`` async save to local disk;
  (b) ``save()`` call to committed snapshot, against ``np.copyto`` of the same
      shard bytes into preallocated, already-touched memory (the copy bound);
  (c) restore onto the saved shardings and onto another mesh/sharding, against
      orbax restore from local disk (``StandardRestore`` of the same abstract
      target) and against the same copy bound.

Each repeat saves a fresh tree (jax caches host copies on an array) with every
saver in turn, so the savers see the same machine load. Warm-up saves fill all
snapshot slots first (first touch of memory is slow here); their figures are
reported separately.

  python benchmarks/snapshot.py [--quick] [--size-mib 1024] [--repeats 5]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # pylint: disable=wrong-import-position

import jax  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
import orbax.checkpoint as ocp  # pylint: disable=wrong-import-position

STORES = ("inproc", "agent")
TARGETS = {"blocking_max_s": 0.005, "snapshot_over_copy_max": 2.0,
           "restore_speedup_over_orbax_min": 5.0, "agent_over_inproc_snapshot_max": 1.2}


def shard_views(tree: Any) -> list[np.ndarray]:
  """Zero-copy views of every replica-0 shard (what a snapshot stores)."""
  out = []
  for x in jax.tree.leaves(tree):
    seen = set()
    for s in x.addressable_shards:
      key = tuple((i.start, i.stop) for i in s.index)
      if s.replica_id == 0 and key not in seen:
        seen.add(key)
        out.append(np.asarray(s.data).reshape(-1).view(np.uint8))
  return out


def copy_bound(views: list[np.ndarray], dst: np.ndarray) -> float:
  t0 = time.perf_counter()
  off = 0
  for v in views:
    np.copyto(dst[off:off + v.size], v)
    off += v.size
  return time.perf_counter() - t0


SETTLE_SECS = 0.2


def fresh_copy(views: list[np.ndarray]) -> float:
  """A numpy copy of the same bytes into new memory (what any restore must write)."""
  t0 = time.perf_counter()
  out = [np.array(v, copy=True) for v in views]
  secs = time.perf_counter() - t0
  del out
  return secs


def jaxckpt_save(mgr, step: int, tree: Any) -> tuple[float, float]:
  jax.block_until_ready(tree)  # a train step's outputs are computed by the time one saves
  time.sleep(SETTLE_SECS)      # let the runtime free the previous tree first
  t0 = time.perf_counter()
  if not mgr.save(step, tree, force=True):
    raise RuntimeError(f"save of step {step} was skipped: {mgr.stats}")
  block = time.perf_counter() - t0
  mgr.wait_until_finished()
  return block, mgr.stats.last_snapshot_secs


def orbax_save(mgr, step: int, tree: Any) -> tuple[float, float]:
  jax.block_until_ready(tree)
  time.sleep(SETTLE_SECS)
  t0 = time.perf_counter()
  mgr.save(step, args=ocp.args.StandardSave(tree))
  block = time.perf_counter() - t0
  mgr.wait_until_finished()
  return block, time.perf_counter() - t0


def timed_restore(fn) -> float:
  t0 = time.perf_counter()
  out = fn()
  jax.block_until_ready(out)
  secs = time.perf_counter() - t0
  del out
  return secs


def parse_args() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="48 MiB tree, 3 repeats (CI smoke)")
  p.add_argument("--size-mib", type=float, default=None, help="tree size (default 1024)")
  p.add_argument("--repeats", type=int, default=None, help="timed repeats (default 5)")
  p.add_argument("--dir", default=None, help="orbax directory parent (default: a temp dir)")
  return p.parse_args()


def main() -> None:
  args = parse_args()
  size = args.size_mib or (48 if args.quick else 1024)
  reps = args.repeats or (3 if args.quick else 5)
  mesh, other = c.save_mesh(), c.reshard_mesh()
  abstract = c.abstract_tree(size, mesh, c.SAVE_SPECS)
  targets = {"same": abstract, "reshard": c.abstract_tree(size, other, c.RESHARD_SPECS)}
  make = c.make_tree_fn(abstract)
  raw: dict[str, list[float]] = {}
  first: dict[str, float] = {}
  add = lambda k, v: raw.setdefault(k, []).append(v)
  root = tempfile.mkdtemp(prefix="bench_snapshot_", dir=args.dir)
  seed = 0
  with contextlib.ExitStack() as stack:
    mgrs = {s: stack.enter_context(c.manager(s)) for s in STORES}
    omgr = stack.enter_context(ocp.CheckpointManager(
        os.path.join(root, "orbax"),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)))
    tree = make(seed)
    nbytes = c.tree_nbytes(tree)
    dst = np.ones(nbytes, np.uint8)                      # touched: the copy bound's target
    # Warm-up: fill every snapshot slot (max_snapshots + 1) and compile/open everything.
    for w in range(3):
      for s, m in mgrs.items():
        seed += 1
        b, t = jaxckpt_save(m, seed, make(seed))
        if w == 0:
          first[f"{s}_blocking_s"], first[f"{s}_snapshot_s"] = b, t
    seed += 1
    b, t = orbax_save(omgr, seed, make(seed))
    first["orbax_blocking_s"], first["orbax_save_complete_s"] = b, t
    os.sync()
    copy_bound(shard_views(tree), dst)
    for rep in range(reps):
      for s in STORES[rep % 2:] + STORES[:rep % 2]:      # alternate who goes first
        seed += 1
        b, t = jaxckpt_save(mgrs[s], seed, make(seed))
        add(f"{s}_blocking_s", b)
        add(f"{s}_snapshot_s", t)
      seed += 1
      b, t = orbax_save(omgr, seed, make(seed))
      add("orbax_blocking_s", b)
      add("orbax_save_complete_s", t)
      os.sync()          # flush orbax's dirty pages now, not during the next measurement
      views = shard_views(make(seed))
      time.sleep(SETTLE_SECS)
      add("copy_bound_s", copy_bound(views, dst))
      add("fresh_copy_s", fresh_copy(views))
      del views
    del tree
    # (c) restores of the newest step of each, onto the same and another sharding.
    steps = {s: m.latest_step() for s, m in mgrs.items()}
    ostep = omgr.latest_step()
    for rep in range(reps + 1):                          # rep 0: warm-up
      for name, tgt in targets.items():
        for s, m in mgrs.items():
          secs = timed_restore(lambda: m.restore(step=steps[s], target=tgt))
          if rep:
            add(f"{s}_restore_{name}_s", secs)
        secs = timed_restore(lambda: omgr.restore(ostep, args=ocp.args.StandardRestore(tgt)))
        if rep:
          add(f"orbax_restore_{name}_s", secs)
  shutil.rmtree(root, ignore_errors=True)
  print(json.dumps(report(raw, first, nbytes, size, reps), indent=1))


def report(raw: dict[str, list[float]], first: dict[str, float], nbytes: int,
           size: float, reps: int) -> dict[str, Any]:
  med = {k: c.summary(v)["median"] for k, v in raw.items()}
  ratios, met = {}, {}
  for s in STORES:
    ratios[f"{s}_blocking_over_orbax"] = med[f"{s}_blocking_s"] / med["orbax_blocking_s"]
    ratios[f"{s}_snapshot_over_copy_bound"] = med[f"{s}_snapshot_s"] / med["copy_bound_s"]
    met[f"{s}_blocking_le_5ms"] = med[f"{s}_blocking_s"] <= TARGETS["blocking_max_s"]
    met[f"{s}_blocking_le_orbax"] = med[f"{s}_blocking_s"] <= med["orbax_blocking_s"]
    met[f"{s}_snapshot_within_2x_copy"] = (ratios[f"{s}_snapshot_over_copy_bound"]
                                           <= TARGETS["snapshot_over_copy_max"])
    for name in ("same", "reshard"):
      r = med[f"orbax_restore_{name}_s"] / med[f"{s}_restore_{name}_s"]
      ratios[f"{s}_restore_{name}_speedup_over_orbax"] = r
      ratios[f"{s}_restore_{name}_over_copy_bound"] = (med[f"{s}_restore_{name}_s"]
                                                        / med["copy_bound_s"])
      ratios[f"{s}_restore_{name}_over_fresh_copy"] = (med[f"{s}_restore_{name}_s"]
                                                        / med["fresh_copy_s"])
      met[f"{s}_restore_{name}_ge_5x_orbax"] = r >= TARGETS["restore_speedup_over_orbax_min"]
  ratios["agent_over_inproc_snapshot"] = med["agent_snapshot_s"] / med["inproc_snapshot_s"]
  met["agent_snapshot_le_1.2x_inproc"] = (ratios["agent_over_inproc_snapshot"]
                                          <= TARGETS["agent_over_inproc_snapshot_max"])
  return {
      "bytes": nbytes, "size_mib": size, "leaves": 49, "repeats": reps,
      "devices": len(jax.devices()), "cpu_count": os.cpu_count(),
      "load_avg_1m": round(os.getloadavg()[0], 2),
      "seconds": {k: c.summary(v) for k, v in sorted(raw.items())},
      "copy_bound_GBps": round(nbytes / med["copy_bound_s"] / 1e9, 2),
      "fresh_copy_GBps": round(nbytes / med["fresh_copy_s"] / 1e9, 2),
      "ratios": {k: round(v, 3) for k, v in ratios.items()},
      "targets": TARGETS, "targets_met": met,
      "first_run_seconds": {k: round(v, 4) for k, v in first.items()},
      "notes": "medians of the timed repeats after warm-up; restore 'reshard' targets a "
               "(4,2) mesh in reverse device order with other specs; copy bound = np.copyto "
               "of the same shard bytes into touched memory; fresh copy = np.array copy "
               "into new memory; each save and the copy bound start after a "
               f"{SETTLE_SECS} s settle (the runtime frees the previous tree)",
  }


if __name__ == "__main__":
  main()

"""The snapshot agent at the in-process store's speed: ratios measured in one run, interleaved.

One tree of random float32 (8 leaves sharded over 8 CPU devices, ``--size-mib`` in all) is
saved and restored by two managers side by side, the in-process store and a fresh agent,
interleaved step by step so that both see the same load:

  snapshot:   save -> committed snapshot (``stats.last_snapshot_secs``) in GB/s;
  restore:    ``restore()`` from the host tier onto the devices, in GB/s, each step
              restored ``--restores`` times (every restore checked bit-exact, tier "host");
  first save: ``save()`` blocking in a manager's first save, a fresh pair of managers
              each time (an agent that allocated its slot in ``save()`` blocked ~60 ms).

Figures are medians of the warm steps (the last three quarters) and of the first-save
repeats; the ratios are the agent's over the in-process store's. The bars are issue 30's:
the agent at 0.8x the in-process store or better, and its first save blocking no more than
5x the in-process store's (or 20 ms). ``--check`` exits 1 when a ratio misses its bar.

  python benchmarks/agent_speed.py [--size-mib 128] [--steps 7] [--restores 2]
      [--first-saves 3] [--check]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any, Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # pylint: disable=wrong-import-position

import jax  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=wrong-import-position

MiB = 1 << 20
STORES = ("inproc", "agent")
BARS = {"agent_over_inproc_min": 0.8, "first_save_agent_over_inproc_max": 5.0,
        "first_save_agent_floor_s": 0.020}


def abstract_tree(mib: int) -> dict[str, jax.ShapeDtypeStruct]:
  mesh = jax.make_mesh((8,), ("x",))
  rows = max(8, mib * MiB // 4 // 8 // 1024 // 8 * 8)
  return {f"w{i}": jax.ShapeDtypeStruct((rows, 1024), np.float32,
                                        sharding=NamedSharding(mesh, P("x"))) for i in range(8)}


def make_tree(abstract: dict[str, jax.ShapeDtypeStruct], seed: int) -> dict[str, jax.Array]:
  keys = jax.random.split(jax.random.key(seed), len(abstract))
  return jax.block_until_ready(
      {k: jax.device_put(jax.random.normal(key, a.shape, a.dtype), a.sharding)
       for key, (k, a) in zip(keys, abstract.items())})


@contextlib.contextmanager
def managers(max_snapshots: int) -> Iterator[dict[str, Any]]:
  with contextlib.ExitStack() as stack:
    yield {s: stack.enter_context(c.manager(s, max_snapshots=max_snapshots)) for s in STORES}


def check_exact(out: dict[str, jax.Array], state: dict[str, jax.Array]) -> None:
  for k, v in state.items():
    if np.asarray(out[k]).tobytes() != np.asarray(v).tobytes():
      raise AssertionError(f"leaf {k} restored with other bytes than were saved")


def throughput(abstract: dict[str, Any], steps: int, restores: int) -> dict[str, Any]:
  """Snapshot and restore GB/s of both stores, interleaved; warm medians."""
  nbytes = sum(a.size * a.dtype.itemsize for a in abstract.values())
  snap: dict[str, list[float]] = {s: [] for s in STORES}
  rest: dict[str, list[float]] = {s: [] for s in STORES}
  with managers(2) as mgrs:
    for m in mgrs.values():
      m.prepare(make_tree(abstract, 0))
    for step in range(1, steps + 1):
      state = make_tree(abstract, step)
      for name, m in mgrs.items():
        assert m.save(step, state, force=True)
        m.wait_until_finished()
        snap[name].append(m.stats.last_snapshot_secs)
      for _ in range(restores):
        for name, m in mgrs.items():
          t0 = time.perf_counter()
          out = jax.block_until_ready(m.restore(step=step, target=abstract))
          rest[name].append(time.perf_counter() - t0)
          assert m.last_restore.tier == "host", (name, m.last_restore)
          check_exact(out, state)
          del out

  def gbps(secs: list[float]) -> dict[str, float]:
    warm = secs[len(secs) // 4:]
    return c.summary([nbytes / s / 1e9 for s in warm], 3)
  out = {"snapshot_GBps": {s: gbps(snap[s]) for s in STORES},
         "restore_GBps": {s: gbps(rest[s]) for s in STORES}}
  out["agent_over_inproc"] = {
      what: round(out[f"{what}_GBps"]["agent"]["median"] / out[f"{what}_GBps"]["inproc"]["median"], 3)
      for what in ("snapshot", "restore")}
  return out


def first_saves(abstract: dict[str, Any], repeats: int) -> dict[str, Any]:
  """``save()`` blocking in each store's first save, a fresh pair of managers each time."""
  blocked: dict[str, list[float]] = {s: [] for s in STORES}
  for rep in range(repeats):
    state = make_tree(abstract, 100 + rep)
    with managers(1) as mgrs:
      for name, m in mgrs.items():
        t0 = time.perf_counter()
        assert m.save(1, state)
        blocked[name].append(time.perf_counter() - t0)
        m.wait_until_finished()
        check_exact(m.restore(target=abstract), state)
  med = {s: statistics.median(v) for s, v in blocked.items()}
  return {"first_save_blocking_s": {s: c.summary(v, 4) for s, v in blocked.items()},
          "first_save_agent_over_inproc": round(med["agent"] / med["inproc"], 2),
          "first_save_agent_bar_s": round(max(BARS["first_save_agent_over_inproc_max"] * med["inproc"],
                                              BARS["first_save_agent_floor_s"]), 4)}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--size-mib", type=int, default=128, help="the tree's size (default 128)")
  parser.add_argument("--steps", type=int, default=7, help="interleaved steps (default 7)")
  parser.add_argument("--restores", type=int, default=2, help="restores per step (default 2)")
  parser.add_argument("--first-saves", type=int, default=3,
                      help="fresh manager pairs whose first save is timed (default 3)")
  parser.add_argument("--check", action="store_true", help="exit 1 when a ratio misses its bar")
  args = parser.parse_args()
  abstract = abstract_tree(args.size_mib)
  out: dict[str, Any] = {"benchmark": "agent_speed", "size_mib": args.size_mib,
                         "steps": args.steps, "restores_per_step": args.restores,
                         "cpus": os.cpu_count(), "load_avg_1min": round(os.getloadavg()[0], 2),
                         "bars": BARS}
  out.update(throughput(abstract, args.steps, args.restores))
  out.update(first_saves(abstract, args.first_saves))
  first = out["first_save_blocking_s"]["agent"]["median"]
  out["within_bars"] = {
      "snapshot": out["agent_over_inproc"]["snapshot"] >= BARS["agent_over_inproc_min"],
      "restore": out["agent_over_inproc"]["restore"] >= BARS["agent_over_inproc_min"],
      "first_save": first <= out["first_save_agent_bar_s"]}
  out["load_avg_1min_after"] = round(os.getloadavg()[0], 2)
  print(json.dumps(out, indent=1))
  return 1 if args.check and not all(out["within_bars"].values()) else 0


if __name__ == "__main__":
  sys.exit(main())

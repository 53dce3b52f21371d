"""Fault-tolerant all-reduce: overhead against a plain in-process mean, and stall during a peer failure.

Three replica groups run as threads of this process, each on its own 2 of 8 CPU
devices, against an in-process lighthouse on loopback. Prints one JSON object
(medians after a warm-up). ``--quick`` finishes in well under a minute.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from datetime import timedelta

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # pylint: disable=wrong-import-position
from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=wrong-import-position

from jaxckpt.ft import Lighthouse, LighthouseOptions, ReplicaGroup, ReplicaGroupOptions  # pylint: disable=wrong-import-position
from jaxckpt.ft import _toy  # pylint: disable=wrong-import-position
from jaxckpt.testing.fault_injection import EventInjector, InjectedFailure  # pylint: disable=wrong-import-position

GROUPS = ("g0", "g1", "g2")
OPTS = ReplicaGroupOptions(heartbeat_interval=timedelta(milliseconds=100), max_groups=4)


def _grads(k: int, nbytes: int, seed: int) -> dict[str, jax.Array]:
  mesh = _toy.make_mesh(jax.devices()[2 * k:2 * k + 2])
  n = nbytes // 4 // 4
  rng = np.random.default_rng(seed)
  return {f"w{i}": jax.device_put(rng.standard_normal((n // 256, 256), dtype=np.float32),
                                  NamedSharding(mesh, P("fsdp"))) for i in range(4)}


def overhead(nbytes: int, steps: int) -> dict[str, float]:
  times: dict[str, list[float]] = {g: [] for g in GROUPS}
  grads = [_grads(k, nbytes, k) for k in range(3)]
  with Lighthouse("127.0.0.1:0", LighthouseOptions(min_replicas=3)) as lh:
    def run(k: int) -> None:
      with ReplicaGroup(lighthouse=lh.address, group_id=GROUPS[k], timeout=timedelta(seconds=10),
                        options=OPTS) as ft:
        for _ in range(steps):
          ft.start_step()
          t0 = time.perf_counter()
          jax.block_until_ready(ft.allreduce(grads[k]))
          times[GROUPS[k]].append(time.perf_counter() - t0)
    threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
  host = [jax.tree.map(lambda x: jax.device_put(x, jax.devices()[6]), g) for g in grads]
  mean = jax.jit(lambda a, b, c: jax.tree.map(lambda x, y, z: (x + y + z) / 3, a, b, c))
  plain = []
  for _ in range(steps):
    t0 = time.perf_counter()
    jax.block_until_ready(mean(*host))
    plain.append(time.perf_counter() - t0)
  ft_median = statistics.median(t for g in GROUPS for t in times[g][2:])
  plain_median = statistics.median(plain[2:])
  return {"grad_bytes": nbytes, "ft_allreduce_median_s": ft_median,
          "plain_mean_median_s": plain_median, "overhead_s": ft_median - plain_median}


def stall(steps: int, fail_step: int, timeout_s: float, pace_s: float) -> dict[str, float]:
  records: dict[str, list[tuple[float, float]]] = {g: [] for g in GROUPS}
  failed_at: list[float] = []
  lh_opts = LighthouseOptions(min_replicas=2, heartbeat_timeout=timedelta(seconds=1),
                              join_timeout=timedelta(seconds=0.5))
  with Lighthouse("127.0.0.1:0", lh_opts) as lh:
    def run(k: int) -> None:
      gid = GROUPS[k]
      state = _toy.init_state(_toy.make_mesh(jax.devices()[2 * k:2 * k + 2]))
      jax.block_until_ready(_toy.apply_fn(state, _toy.grad_fn(state, *_toy.batch(0))))
      injector = EventInjector().fail_at("g2", fail_step)
      try:
        with ReplicaGroup(lighthouse=lh.address, group_id=gid, timeout=timedelta(seconds=timeout_s),
                          options=OPTS, injector=injector) as ft:
          while ft.step < steps:
            t0 = time.monotonic()
            state = ft.start_step(state, _toy.apply_fn, grads_like=state["params"])
            time.sleep(pace_s)
            grads = ft.allreduce(_toy.grad_fn(state, *_toy.batch(ft.batch_index())))
            if ft.should_commit():
              state = _toy.apply_fn(state, grads)
            records[gid].append((t0, time.monotonic()))
      except InjectedFailure:
        failed_at.append(time.monotonic())
    threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
  fail = failed_at[0]
  healthy = [r for g in ("g0", "g1") for r in records[g][3:]]
  durations = [t1 - t0 for t0, t1 in healthy]
  median = statistics.median(durations)
  inside = [t1 - t0 for t0, t1 in healthy if t1 >= fail and t0 <= fail + timeout_s]
  outside = [(t1 - t0, t0 - fail) for t0, t1 in healthy if not (t1 >= fail and t0 <= fail + timeout_s)]
  worst = max(outside)
  return {"timeout_s": timeout_s, "step_median_s": median, "worst_step_in_failure_window_s": max(inside),
          "worst_step_outside_window_s": worst[0], "worst_outside_starts_s_after_failure": worst[1],
          "worst_outside_over_median": worst[0] / median,
          "p99_outside_over_median": float(np.percentile([d for d, _ in outside], 99)) / median,
          "target_outside_over_median": 2.0}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--quick", action="store_true")
  args = p.parse_args()
  sizes = [1 << 20] if args.quick else [1 << 20, 16 << 20]
  steps = 10 if args.quick else 30
  result = {"device": "cpu, 3 groups x 2 devices, threads of one process",
            "overhead": [overhead(n, steps) for n in sizes],
            "stall": stall(steps=40 if args.quick else 80, fail_step=15, timeout_s=2.0, pace_s=0.05)}
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()

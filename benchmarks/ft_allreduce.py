"""Fault-tolerant all-reduce: against a raw-socket ring, a plain in-process mean, and a peer failure.

``ring``: G = 2, 4, 8 replica groups as processes (host gradients of 1 to 64
MiB), each step timed from ``allreduce`` to its return, side by side with a
raw-socket ring (the same reduce-scatter and all-gather over plain TCP sockets
between as many processes, no fault tolerance, no digest), in the same run;
bytes sent per member against ``2 (G - 1) / G x |grad|``.
``overhead`` and ``stall``: three groups as threads of this process, each on
its own 2 of 8 CPU devices. Prints one JSON object (medians after a warm-up).
``--quick`` finishes in about a minute.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import threading
import time
from datetime import timedelta
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # pylint: disable=wrong-import-position
from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=wrong-import-position

from jaxckpt.ft import Lighthouse, LighthouseOptions, ReplicaGroup, ReplicaGroupOptions  # pylint: disable=wrong-import-position
import _repo  # noqa: F401  (the repository root on the path: tests.support)
from tests.support import ft_toy as _toy  # pylint: disable=wrong-import-position
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
      with ReplicaGroup(lighthouse=lh.address, group_id=GROUPS[k], timeout=timedelta(seconds=10), secret=lh.secret,
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
        with ReplicaGroup(lighthouse=lh.address, group_id=gid, timeout=timedelta(seconds=timeout_s), secret=lh.secret,
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


def _ft_member(address: str, secret: str, gid: str, nbytes: int, steps: int, out: mp.Queue) -> None:
  os.environ["JAX_PLATFORMS"] = "cpu"
  from jaxckpt.ft import ReplicaGroup as Group  # pylint: disable=import-outside-toplevel,reimported
  rng = np.random.default_rng(int(gid[1:]))
  grads = [rng.standard_normal(nbytes // 4 // 4, dtype=np.float32) for _ in range(4)]
  times, sent = [], []
  # ring_size 4: the group's flat buffers are reused from step 6 on (WARM_STEPS skips them).
  opts = ReplicaGroupOptions(heartbeat_interval=timedelta(milliseconds=100), ring_size=4)
  with Group(lighthouse=address, group_id=gid, timeout=timedelta(seconds=60), secret=secret,
             options=opts) as ft:
    for _ in range(steps):
      ft.start_step()
      before = ft.bytes_sent
      t0 = time.perf_counter()
      ft.allreduce(grads)
      if ft.should_commit():
        times.append(time.perf_counter() - t0)
        sent.append(ft.bytes_sent - before)
  out.put((gid, times, sent, ft.counters.failed_attempts))


def _raw_member(rank: int, size: int, ports: list[int], nbytes: int, steps: int,
                barrier: Any, out: mp.Queue) -> None:
  from jaxckpt.ft import _allreduce  # pylint: disable=import-outside-toplevel
  srv = socket.create_server(("127.0.0.1", ports[rank]))
  barrier.wait()
  right = socket.create_connection(("127.0.0.1", ports[(rank + 1) % size]))
  left, _ = srv.accept()
  for sk in (left, right):
    sk.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  flat0 = np.random.default_rng(rank).standard_normal(nbytes // 4, dtype=np.float32)
  chunks_b = _allreduce.bounds(flat0.size, size)
  times = []

  def exchange(send: np.ndarray, into: np.ndarray) -> None:
    t = threading.Thread(target=right.sendall, args=(memoryview(send).cast("B"),))
    t.start()
    view, got = memoryview(into).cast("B"), 0
    while got < len(view):
      got += left.recv_into(view[got:])
    t.join()

  for _ in range(steps):
    barrier.wait()
    t0 = time.perf_counter()
    acc = flat0.copy()
    chunks = [acc[lo:hi] for lo, hi in chunks_b]
    tmp = np.empty(max(hi - lo for lo, hi in chunks_b), np.float32)
    for s in range(size - 1):
      c = (rank - s - 1) % size
      exchange(chunks[(rank - s) % size], tmp[:chunks[c].size])
      np.add(chunks[c], tmp[:chunks[c].size], out=chunks[c])
    own = (rank + 1) % size
    np.divide(chunks[own], size, out=chunks[own])
    for s in range(size - 1):
      exchange(chunks[(rank + 1 - s) % size], chunks[(rank - s) % size])
    times.append(time.perf_counter() - t0)
  out.put((rank, times))
  for sk in (left, right, srv):
    sk.close()


def ring(size: int, nbytes: int, steps: int) -> dict[str, Any]:
  """The replica groups' all-reduce and a raw-socket ring, ``size`` processes each."""
  ctx = mp.get_context("spawn")
  out = ctx.Queue()

  def run_all(target: Any, args: list[tuple]) -> list[Any]:
    procs = [ctx.Process(target=target, args=a) for a in args]
    for p in procs:
      p.start()
    got = [out.get(timeout=600) for _ in procs]
    for p in procs:
      p.join()
    return got

  with Lighthouse("127.0.0.1:0", LighthouseOptions(min_replicas=size)) as lh:
    ft = run_all(_ft_member, [(lh.address, lh.secret, f"g{k}", nbytes, steps, out)
                              for k in range(size)])
  ports = [_free_port() for _ in range(size)]
  barrier = ctx.Barrier(size)
  raw = run_all(_raw_member, [(r, size, ports, nbytes, steps, barrier, out) for r in range(size)])
  warm = WARM_STEPS
  ft_med = statistics.median(t for _, ts, *_ in ft for t in ts[warm:])
  raw_med = statistics.median(t for _, ts in raw for t in ts[warm:])
  sent = statistics.median(b for _, _, bs, _ in ft for b in bs)
  ideal = 2 * (size - 1) / size * nbytes
  return {"groups": size, "grad_bytes": nbytes, "ft_ring_median_s": ft_med,
          "raw_socket_ring_median_s": raw_med, "ft_over_raw": ft_med / raw_med,
          "bytes_sent_per_member": sent, "ideal_bytes_2(G-1)/G": ideal,
          "sent_over_ideal": sent / ideal, "committed_steps": min(len(ts) for _, ts, *_ in ft),
          "failed_attempts": {gid: n for gid, *_, n in sorted(ft) if n}}   # (their reasons: stderr)


WARM_STEPS = 8


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--quick", action="store_true")
  p.add_argument("--only", choices=["ring", "overhead", "stall"], action="append",
                 help="run only these parts (repeatable; default all)")
  p.add_argument("--groups", default=None, help="ring: comma-separated G values (default 2,4,8)")
  p.add_argument("--sizes-mib", default=None, help="ring: comma-separated sizes (default 1,16,64)")
  args = p.parse_args()
  parts = set(args.only or ["ring", "overhead", "stall"])
  sizes = [1 << 20] if args.quick else [1 << 20, 16 << 20]
  steps = 10 if args.quick else 30
  groups = [int(g) for g in (args.groups or ("2,4" if args.quick else "2,4,8")).split(",")]
  ring_sizes = [int(m) << 20 for m in (args.sizes_mib or ("1,16" if args.quick else "1,16,64")).split(",")]
  result: dict[str, Any] = {"host_cores": os.cpu_count()}
  if "ring" in parts:
    result["ring"] = [ring(g, n, WARM_STEPS + (6 if args.quick else 15)) for g in groups
                      for n in ring_sizes]
  if "overhead" in parts:
    result["overhead_device"] = "cpu, 3 groups x 2 devices, threads of one process"
    result["overhead"] = [overhead(n, steps) for n in sizes]
  if "stall" in parts:
    result["stall"] = stall(steps=40 if args.quick else 80, fail_step=15, timeout_s=2.0, pace_s=0.05)
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()

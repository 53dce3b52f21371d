"""One replica group of the toy job, as a process: ``python -m tests.support.ft_worker ...``.

Used by the multi-process tests and the benchmark. Sets 2 CPU devices before
JAX starts, trains :mod:`tests.support.ft_toy` with a ReplicaGroup, and appends one
JSON line per step attempt to ``--out``.

With ``--coordinator HOST:PORT --num-processes N --process-id I`` the group is a
``jax.distributed`` job of N such processes (its mesh spans all their devices);
each process writes its own ``--out`` and, with ``--dump``, its final params.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from datetime import timedelta


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--lighthouse", required=True)
  p.add_argument("--group", required=True)
  p.add_argument("--steps", type=int, required=True)
  p.add_argument("--steps-file", default=None, help="if it exists, its integer replaces --steps (reread every step)")
  p.add_argument("--out", required=True)
  p.add_argument("--timeout", type=float, default=2.0)
  p.add_argument("--step-secs", type=float, default=0.0, help="extra simulated compute per step")
  p.add_argument("--snapshot-every", type=int, default=5)
  p.add_argument("--ring-size", type=int, default=16)
  p.add_argument("--injector", default="[]")
  p.add_argument("--coordinator", default=None, help="HOST:PORT of this group's jax.distributed job")
  p.add_argument("--num-processes", type=int, default=1)
  p.add_argument("--process-id", type=int, default=0)
  p.add_argument("--dump", default=None, help="write the final params (whole values) to this .npz")
  p.add_argument("--host", default="127.0.0.1", help="this machine's address (127.0.1.M in tests)")
  p.add_argument("--max-groups", type=int, default=4)
  p.add_argument("--data-order", default="default")
  args = p.parse_args(argv)

  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_num_cpu_devices", 2)
  if args.coordinator:
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id, initialization_timeout=120,
                               heartbeat_timeout_seconds=20)
  from tests.support import ft_toy as _toy  # pylint: disable=import-outside-toplevel
  from jaxckpt.ft import InMemorySnapshotSource, ReplicaGroup, ReplicaGroupOptions  # pylint: disable=import-outside-toplevel
  from jaxckpt.testing.fault_injection import EventInjector  # pylint: disable=import-outside-toplevel
  logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                      format=f"%(asctime)s {args.group} %(name)s %(levelname)s %(message)s")

  mesh = _toy.make_mesh(jax.devices())
  state = _toy.init_state(mesh)
  jax.block_until_ready(_toy.apply_fn(state, _toy.grad_fn(state, *_toy.batch(0))))  # compile first
  source = InMemorySnapshotSource() if jax.process_count() == 1 else None  # it is single-process only
  options = ReplicaGroupOptions(heartbeat_interval=timedelta(milliseconds=100), ring_size=args.ring_size,
                                max_groups=args.max_groups, data_order=args.data_order,
                                lighthouse_timeout=timedelta(seconds=30), host=args.host)
  with open(args.out, "a", encoding="utf-8") as out, ReplicaGroup(
      lighthouse=args.lighthouse, group_id=args.group, timeout=timedelta(seconds=args.timeout),
      options=options, snapshot_source=source, injector=EventInjector.from_json(args.injector)) as ft:
    while ft.step < _target(args):
      t0 = time.time()
      state = ft.start_step(state, _toy.apply_fn, grads_like=state["params"])
      index = ft.batch_index()
      time.sleep(args.step_secs)
      grads = ft.allreduce(_toy.grad_fn(state, *_toy.batch(index)))
      if ft.should_commit():
        state = _toy.apply_fn(state, grads)
        if source is not None and ft.step % args.snapshot_every == 0:
          source.put(ft.step, state)
      m = ft.metrics
      out.write(json.dumps({
          "group": args.group, "step": ft.step, "committed": m.committed, "attempt": m.attempt,
          "batch": index, "contributed": args.group in m.contributors, "quorum_size": m.quorum_size,
          "contributors": m.contributors, "dropped": m.dropped_groups,
          "caught_up_steps": m.caught_up_steps, "snapshot_step": m.snapshot_step,
          "catch_up_secs": m.catch_up_secs, "fp": _toy.fingerprint(state) if m.committed else None,
          "t0": t0, "t1": time.time(), "process": jax.process_index(),
          "processes": jax.process_count(), "mesh_devices": mesh.devices.size}) + "\n")
      out.flush()
  if args.dump:
    import numpy as np  # pylint: disable=import-outside-toplevel
    flat = jax.tree_util.tree_flatten_with_path(_toy.host_values(state["params"]))[0]
    np.savez(args.dump, **{jax.tree_util.keystr(k): v for k, v in flat})
  return 0


def _target(args: argparse.Namespace) -> int:
  if args.steps_file and os.path.exists(args.steps_file):
    with open(args.steps_file, encoding="utf-8") as f:
      text = f.read().strip()
    if text:
      return int(text)
  return args.steps


if __name__ == "__main__":
  sys.exit(main())

"""A Flax NNX training loop that snapshots every step with jaxckpt.

A small transformer language model on synthetic tokens, FSDP-sharded over all
local devices (on CPU: ``--devices 8`` emulates an 8-device mesh). Batches are
a pure function of (seed, step), so a resumed or rolled-back run sees exactly
the batches the original run saw and its loss trajectory is bit-equal.

  python examples/train_flax.py --steps 20 --dump /tmp/run.json
  python examples/train_flax.py --steps 20 --rollback-at 12 --rollback-to 10
  python examples/train_flax.py --steps 50 --job-name demo --resume   # with the agent

As one replica group of a fault-tolerant job (export the same JAXCKPT_JOB_SECRET
to every process, start `jaxckpt lighthouse --bind 127.0.0.1:29510` first, then
one process per group):

  python examples/train_flax.py --lighthouse 127.0.0.1:29510 --group-id g0 --job-name demo

On two machines, give each group the address the other machine reaches it at (`--host`), and
every lighthouse replica's address (docs/replica_groups.md, "On two machines").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=30, help="train until this step")
  p.add_argument("--snapshot-interval", type=int, default=1, help="snapshot every N steps")
  p.add_argument("--max-snapshots", type=int, default=2, help="host snapshots kept")
  p.add_argument("--job-name", default=None,
                 help="use the per-host snapshot agent of this job (survives crashes); "
                      "without it snapshots live in this process")
  p.add_argument("--agent-run-root", default=None,
                 help="directory of the agents' shared memory (default /dev/shm/jaxckpt-UID)")
  p.add_argument("--directory", default=None,
                 help="also persist snapshots to this directory (local path or gs://, s3://) in the "
                      "universal format; without it snapshots live only in host memory")
  p.add_argument("--resume", action="store_true", help="restore the newest snapshot and go on")
  p.add_argument("--dump", default=None,
                 help="write final params (PATH.npz) and per-step losses (PATH) as JSON")
  p.add_argument("--rollback-at", type=int, default=None,
                 help="after this step, roll back to --rollback-to (a loss-spike drill)")
  p.add_argument("--rollback-to", type=int, default=None)
  p.add_argument("--devices", type=int, default=8, help="CPU devices to emulate")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--d-model", type=int, default=64)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--seq-len", type=int, default=32)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--vocab", type=int, default=256)
  p.add_argument("--lighthouse", default=None, metavar="HOST:PORT[,HOST:PORT...]",
                 help="run as one replica group of a fault-tolerant job (needs --group-id, --job-name); "
                      "every lighthouse replica's address when the control plane runs on etcd")
  p.add_argument("--group-id", default=None, help="this replica group's unique name")
  p.add_argument("--host", default=None, metavar="ADDRESS",
                 help="replica group: the address the other groups reach this machine at, which its "
                      "peer and ring ports bind and advertise (ReplicaGroupOptions.host); default: the "
                      "address this machine reaches the lighthouse from; 0.0.0.0: bind every interface")
  p.add_argument("--ft-timeout", type=float, default=10.0,
                 help="replica group: the longest any wait of a step may take, in seconds")
  p.add_argument("--max-groups", type=int, default=64,
                 help="replica group: batch slots per step, the same in every group of the job")
  p.add_argument("--ring-size", type=int, default=16,
                 help="replica group: averaged gradients of this many recent steps kept for peers")
  p.add_argument("--sleep-per-step", type=float, default=0.0, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.lighthouse and not (args.group_id and args.job_name):
    p.error("--lighthouse needs --group-id and --job-name (each group snapshots into the "
            "agent of job JOB_NAME-GROUP_ID)")
  if args.lighthouse and (args.resume or args.rollback_at is not None):
    p.error("--resume and --rollback-at do not apply to a replica group: a restarted group "
            "catches up from a healthy group's snapshot agent")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  import jax  # pylint: disable=import-outside-toplevel
  try:
    jax.config.update("jax_num_cpu_devices", args.devices)
  except RuntimeError:
    pass  # backend already started (e.g. under pytest): use what is there
  from examples import _model  # pylint: disable=import-outside-toplevel
  return _model.run(args)


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  # INFO from this example and jaxckpt only: JAX logs at INFO that it found no TPU on every CPU/GPU run
  logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
  for name in ("train_flax", "jaxckpt", "examples"):
    logging.getLogger(name).setLevel(logging.INFO)
  sys.exit(main())

"""jaxckpt's figures in TensorBoard: blocking time, snapshot and persist GB/s, lag, skips,
and the tier of each restore, as scalars of a run directory.

    pip install -e ".[tensorboard]"
    python examples/metrics_tensorboard.py --logdir /tmp/tb --steps 20
    tensorboard --logdir /tmp/tb

The manager hands every event to ``logger=`` (orbax's logger argument: anything
with ``log_entry(dict)``); this one writes each number of an entry as the scalar
``jaxckpt/<event>/<field>`` at the entry's step.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np
from tensorboardX import SummaryWriter

import jaxckpt as jc

TIERS = {"host": 0, "parity": 1, "storage": 2}


class TensorBoardLogger:
  """A ``logger=`` for a CheckpointManager: its entries as TensorBoard scalars."""

  def __init__(self, logdir: str) -> None:
    self.writer = SummaryWriter(logdir)
    self.lock = threading.Lock()          # snapshot and persist entries come from a thread

  def log_entry(self, entry: dict) -> None:
    event, step = entry["event_type"], entry["step"]
    with self.lock:
      for name, value in entry.items():
        if name == "tier":
          self.writer.add_scalar(f"jaxckpt/{event}/tier", TIERS[value], step)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and \
            name not in ("step", "start_time"):
          self.writer.add_scalar(f"jaxckpt/{event}/{name}", value, step)

  def close(self) -> None:
    self.writer.close()


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--logdir", required=True)
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--directory", default=None, help="checkpoint directory (default: a temp dir)")
  args = p.parse_args(argv)
  tb = TensorBoardLogger(args.logdir)
  directory = args.directory or tempfile.mkdtemp(prefix="jaxckpt-tb-")
  mesh = jax.make_mesh((len(jax.devices()),), ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  state = {"w": jax.device_put(np.zeros((1024, 256), np.float32), sharding), "step": 0}
  step_fn = jax.jit(lambda w: jnp.tanh(w + 0.1))
  try:
    with jc.CheckpointManager(os.path.abspath(directory), logger=tb) as mgr:
      for step in range(1, args.steps + 1):
        state = {"w": step_fn(state["w"]), "step": step}
        mgr.save(step, state, force=step == args.steps)
      mgr.wait_until_finished()
      mgr.restore(target=state)
  finally:
    tb.close()
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

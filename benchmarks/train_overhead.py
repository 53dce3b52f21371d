"""Step time of the example's training loop with a snapshot every step vs none (issue 2 (d)).

Builds the loop of ``examples/train_flax.py`` from ``examples._model``
(``init_state``, ``make_train_step``, ``make_batch``) with a bigger model than
the example's default (d_model 128, 4 layers, seq 64, batch 16; d_model 256
and seq 128 took 2-11 s per step on the shared 2-core machine, too slow to
repeat), and times each step (batch,
train step, loss fetched to host, ``save()``) three ways, side by side:
no manager at all, a manager on the in-process store, and a manager on the
snapshot agent. The modes run in interleaved rounds so they see the same
machine load. ``save()`` is called every step with the default
``on_busy="skip"``, so the achieved snapshot interval is steps / committed.

``--intervals 1,2,4,8`` sweeps the snapshot interval: each store mode runs once
per interval I, calling ``save()`` on every I-th step (as
``save_interval_steps=I`` does), all interleaved with the no-manager baseline.
``--plot PATH`` writes the overhead against the interval as a PNG.

  python benchmarks/train_overhead.py [--quick] [--rounds 8] [--steps-per-round 4]
      [--intervals 1,2,4,8] [--stores inproc,agent] [--plot PATH]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.dirname(_HERE))
import _common as c  # pylint: disable=wrong-import-position

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=wrong-import-position

from examples import _model  # pylint: disable=wrong-import-position

MODES = ("none", "inproc", "agent")
TARGET_OVERHEAD = 0.10


class Loop:
  """One training run of the example's model, stepped a few steps at a time."""

  def __init__(self, args: argparse.Namespace, mesh, mgr, interval: int = 1,
               train_step: Any = None) -> None:
    self.args, self.mesh, self.mgr, self.interval = args, mesh, mgr, interval
    graphdef, tx, self.state = _model.init_state(args, mesh)
    self.train_step = train_step or _model.make_train_step(graphdef, tx)
    self.step = 0
    self.times: list[float] = []
    self.round_medians: list[float] = []     # one per recorded run() call (round)
    self.saves = self.committed = 0

  def steps_recorded(self) -> int:
    return len(self.times)

  def run(self, n: int, *, record: bool) -> None:
    a = self.args
    committed0 = self.mgr.stats.committed if self.mgr else 0
    for _ in range(n):
      t0 = time.perf_counter()
      tokens = jnp.asarray(_model.make_batch(a.seed, self.step, a.batch, a.seq_len, a.vocab),
                           device=NamedSharding(self.mesh, P("fsdp")))
      s = self.state
      params, opt_state, loss, rng = self.train_step(s["params"], s["opt_state"], tokens,
                                                     s["rng"])
      losses = s["losses"].copy()
      losses[self.step] = float(loss)
      self.step += 1
      self.state = dict(s, params=params, opt_state=opt_state, rng=rng, losses=losses,
                        data=dict(s["data"], next_step=self.step))
      if self.mgr is not None and self.step % self.interval == 0:
        self.mgr.save(self.step, self.state)
      if record:
        self.times.append(time.perf_counter() - t0)
    if record:
      self.round_medians.append(statistics.median(self.times[-n:]))
    if self.mgr is not None:
      self.mgr.wait_until_finished()   # the round's last snapshot counts; keeps it out of the next mode
      if record:
        self.saves += n // self.interval
        self.committed += self.mgr.stats.committed - committed0


def parse_args() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="small model, 2 rounds of 4 steps")
  p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 8)")
  p.add_argument("--steps-per-round", type=int, default=None, help="default 4")
  p.add_argument("--warmup-steps", type=int, default=3)
  p.add_argument("--d-model", type=int, default=None, help="default 128")
  p.add_argument("--layers", type=int, default=None, help="default 4")
  p.add_argument("--seq-len", type=int, default=None, help="default 64")
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--vocab", type=int, default=256)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--intervals", default="1",
                 help="comma-separated snapshot intervals to sweep, e.g. 1,2,4,8")
  p.add_argument("--stores", default="inproc,agent", help="store modes to time: inproc, agent")
  p.add_argument("--directory", default=None,
                 help="persist to a new directory under this one per mode, with the default "
                      "options (no persist_interval_steps: the interval follows the measured "
                      "persist time)")
  p.add_argument("--plot", default=None, metavar="PATH",
                 help="write overhead vs snapshot interval as a PNG")
  a = p.parse_args()
  a.intervals = [int(i) for i in a.intervals.split(",")]
  a.stores = a.stores.split(",")
  if any(i < 1 for i in a.intervals) or not set(a.stores) <= set(MODES[1:]):
    p.error(f"--intervals must be >= 1 and --stores among {MODES[1:]}, got "
            f"{a.intervals} and {a.stores}")
  quick = a.quick
  a.rounds = a.rounds or (2 if quick else 8)
  a.steps_per_round = a.steps_per_round or max(4, max(a.intervals))
  if a.steps_per_round % max(a.intervals):
    p.error(f"--steps-per-round={a.steps_per_round} must be a multiple of every interval")
  a.d_model = a.d_model or 128
  a.layers = a.layers or (2 if quick else 4)
  a.seq_len = a.seq_len or 64
  a.steps = a.warmup_steps + a.rounds * a.steps_per_round + 1   # size of the losses array
  return a


def mode_report(loop: Loop, base: Loop | None) -> dict[str, Any]:
  med = statistics.median(loop.times)
  out: dict[str, Any] = {"step_s": c.summary(loop.times),
                         "mean_step_s": round(statistics.fmean(loop.times), 4)}
  if base is not None:
    out["overhead_median_pct"] = round(100 * (med / statistics.median(base.times) - 1), 2)
    # Each round against the baseline's round next to it in time: the machine's
    # load drifts over a run, and this cancels what the two rounds share.
    out["overhead_paired_pct"] = round(100 * statistics.median(
        m / b - 1 for m, b in zip(loop.round_medians, base.round_medians)), 2)
  if loop.mgr is not None:
    st = loop.mgr.stats
    out.update(saves=loop.saves, committed=loop.committed, skipped_busy=st.skipped_busy,
               interval_steps=loop.interval,
               achieved_interval_steps=round(loop.steps_recorded() / max(loop.committed, 1), 3),
               last_blocking_s=round(st.last_blocking_secs, 4),
               last_snapshot_s=round(st.last_snapshot_secs, 4),
               snapshot_bytes=st.last_nbytes)
    if loop.mgr.directory is not None:
      out["persisted_steps"] = len(c.jc.universal.all_steps(os.fspath(loop.mgr.directory)))
  return out


def mode_names(a: argparse.Namespace) -> list[tuple[str, str, int]]:
  """(mode name, store, interval): ``agent`` at interval 1, ``agent@4`` at 4."""
  return [(s if i == 1 else f"{s}@{i}", s, i) for i in a.intervals for s in a.stores]


def plot(a: argparse.Namespace, res: dict[str, Any], path: str) -> None:
  """Median step-time overhead against the snapshot interval, one line per store."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(6, 3.4), dpi=100)
  for store in a.stores:
    pts = [(i, res[n]["overhead_median_pct"]) for n, s, i in mode_names(a) if s == store]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=store)
  ax.axhline(100 * TARGET_OVERHEAD, color="gray", linestyle="--", linewidth=1, label="10% target")
  ax.axhline(0, color="black", linewidth=0.5)
  ax.set_xscale("log", base=2)
  ax.set_xticks(a.intervals, [str(i) for i in a.intervals])
  ax.set_xlabel("snapshot interval (steps)")
  ax.set_ylabel("median step-time overhead (%)")
  ax.set_title(f"Snapshot overhead, d_model={a.d_model}, {a.layers} layers, "
               f"{len(jax.devices())} CPU devices")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def main() -> None:
  a = parse_args()
  mesh = jax.make_mesh((len(jax.devices()),), ("fsdp",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  with contextlib.ExitStack() as stack:
    first = Loop(a, mesh, None)
    loops = {"none": first}
    for name, store, interval in mode_names(a):
      where = (None if a.directory is None
               else stack.enter_context(tempfile.TemporaryDirectory(dir=a.directory)))
      loops[name] = Loop(a, mesh, stack.enter_context(c.manager(store, directory=where)),
                         interval, first.train_step)
    for loop in loops.values():
      loop.run(a.warmup_steps, record=False)
    order = list(loops.values())
    for r in range(a.rounds):
      for loop in order[r % len(order):] + order[:r % len(order)]:   # rotate: no mode always first
        loop.run(a.steps_per_round, record=True)
    res = {m: mode_report(loop, None if m == "none" else loops["none"])
           for m, loop in loops.items()}
  state_bytes = c.tree_nbytes({k: loops["none"].state[k] for k in ("params", "opt_state")})
  met = {f"{m}_overhead_le_10pct": res[m]["overhead_median_pct"] <= 100 * TARGET_OVERHEAD
         for m in res if m != "none"}
  if a.plot:
    plot(a, res, a.plot)
  print(json.dumps({
      "model": {"d_model": a.d_model, "layers": a.layers, "seq_len": a.seq_len,
                "batch": a.batch, "vocab": a.vocab, "state_bytes": state_bytes},
      "devices": len(jax.devices()), "cpu_count": os.cpu_count(),
      "rounds": a.rounds, "steps_per_round": a.steps_per_round, "intervals": a.intervals,
      "load_avg_1m": round(os.getloadavg()[0], 2),
      "modes": res, "target_overhead_pct": 100 * TARGET_OVERHEAD, "targets_met": met,
      "notes": "step = batch + jitted train step (donating) + float(loss) + save(); modes "
               "interleaved per round, order rotated each round; overhead_median_pct compares "
               "medians over all recorded steps, overhead_paired_pct is the median over rounds "
               "of each round's median against the baseline round of the same cycle",
  }, indent=1))


if __name__ == "__main__":
  main()

"""``jaxckpt simulate``: the goodput simulator's command line.

Runs :func:`tools.goodput.simulator.sweep` (or its sensitivity report, or the closed-form
check of :mod:`jaxckpt.goodput.closed_form`) from parsed arguments and prints a table or
JSON; ``--plot`` writes a PNG (:mod:`tools.goodput.plots`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from tools.goodput import simulator
from jaxckpt.goodput.closed_form import SimulationInputError, simulate_synchronous
from jaxckpt.goodput.inputs import BENCHMARK_FILES, MEASURED_DIR, SOURCES, from_benchmarks
from tools.goodput.plots import plot, plot_tornado
from tools.goodput.simulator import (MODES, PAPER_ACCELERATORS, SENSITIVITY_ACCELERATORS, Mode,
                                       SimulationConfig, explain, paper_comparison, sensitivity,
                                       sweep)

_HOUR = 3600.0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
  """Adds ``jaxckpt simulate``; its handler is ``args.func(args) -> int``."""
  doc = simulator.__doc__
  parser = subparsers.add_parser(
      "simulate", help="goodput of synchronous restart vs replica groups (FT-HSDP)",
      description=doc.split("\n\n")[0] + "\n\n" + doc.split("\n\n", 1)[1].split(">>>")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--accelerators", type=_ints, default=[PAPER_ACCELERATORS], metavar="N[,N...]",
                      help=f"job sizes to simulate (default {PAPER_ACCELERATORS})")
  parser.add_argument("--seed", type=int, default=0, help="seed of the failure stream")
  days = SimulationConfig().simulated_days
  parser.add_argument("--days", type=float, default=days, dest="simulated_days",
                      help=f"simulated wall time per run (default {days})")
  parser.add_argument("--modes", type=lambda s: s.split(","), default=[m.value for m in MODES],
                      help="comma-separated modes (default all)")
  parser.add_argument("--plot", metavar="PATH",
                      help="write a PNG plot against N (with --sensitivity: a tornado chart)")
  parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
  parser.add_argument("--explain", action="store_true",
                      help="print the inputs, why, and each one's source, then exit")
  parser.add_argument("--from-benchmarks", metavar="DIR", default=None,
                      help="take jaxckpt's own recovery inputs from its benchmarks' JSON in DIR ("
                           + "; ".join(BENCHMARK_FILES.values()) + "); 'measured': the figures "
                           "shipped with jaxckpt (16-core H100 host)")
  parser.add_argument("--state-gib-per-host", type=float, default=8.0, metavar="GIB",
                      help="state each host snapshots, to scale the measured per-GiB figures "
                           "(default 8: a ~6 TB state over the 1,024 hosts of an 8K-GPU group, rounded up)")
  parser.add_argument("--sensitivity", action="store_true",
                      help="print, as JSON, each input's effect on effective training time when halved and "
                           "doubled, at 16K and 100K accelerators (or the sizes given with --accelerators)")
  closed = parser.add_argument_group(
      "closed-form check (Daly 2006)",
      "With --mtbf-hours: one synchronous job with the job's MTBF, a fixed checkpoint interval, and the "
      "Young/Daly model printed beside the simulated result.")
  closed.add_argument("--mode", choices=[Mode.SYNCHRONOUS.value], default=None,
                      help="the closed-form check simulates the synchronous mode only")
  closed.add_argument("--mtbf-hours", type=float, default=None, metavar="H",
                      help="the whole job's mean time between failures (selects the closed-form check)")
  closed.add_argument("--checkpoint-secs", type=float, default=None, metavar="C",
                      help="time to write one checkpoint (delta)")
  closed.add_argument("--restart-secs", type=float, default=0.0, metavar="R",
                      help="time to restart after a failure (R, default 0)")
  closed.add_argument("--interval-secs", type=float, default=None, metavar="TAU",
                      help="work between checkpoints (default Daly's optimum)")
  closed.add_argument("--optimal-interval", action="store_true",
                      help="search the interval that maximizes the simulated effective training time")
  closed.add_argument("--failures", type=int, default=1_000_000, metavar="N",
                      help="failures to simulate (default 1,000,000)")
  for f in dataclasses.fields(SimulationConfig):
    if f.name not in ("accelerators", "simulated_days"):
      parser.add_argument("--" + f.name.replace("_", "-"), type=int if f.type == "int" else float,
                          default=f.default, help=f"{f.metadata['why']} (default {f.default})")
  parser.set_defaults(func=run_cli)


def _ints(text: str) -> list[int]:
  try:
    return [int(x) for x in text.split(",") if x]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected N[,N...] integers, got {text!r}") from None


def run_cli(args: argparse.Namespace) -> int:
  """Runs ``jaxckpt simulate`` from parsed args; prints to stdout; returns the exit code."""
  if args.mtbf_hours is not None or args.mode is not None:
    return _run_closed_form(args)
  names = [f.name for f in dataclasses.fields(SimulationConfig) if f.name != "accelerators"]
  try:
    values = {n: getattr(args, n) for n in names}
    cites: dict[str, str] = {}
    if args.from_benchmarks:
      where = MEASURED_DIR if args.from_benchmarks == "measured" else args.from_benchmarks
      measured, cites = from_benchmarks(where, state_gib_per_host=args.state_gib_per_host)
      values.update(measured)
    config = SimulationConfig(accelerators=args.accelerators[0], **values)
    if args.explain:
      print(explain(config, cites))
      return 0
    if args.sensitivity:
      sizes = args.accelerators if args.accelerators != [PAPER_ACCELERATORS] else SENSITIVITY_ACCELERATORS
      report = sensitivity(config, sizes, args.modes)
      print(json.dumps(report, indent=1))
      if args.plot:
        plot_tornado(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
      return 0
    results = sweep(args.accelerators, config, args.seed, args.modes)
  except ValueError as e:
    print(f"jaxckpt simulate: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps({"config": dataclasses.asdict(config), "seed": args.seed,
                      "sources": {**SOURCES, **cites},
                      "results": [r.to_dict() for r in results],
                      "comparison": paper_comparison()}, indent=1))
  else:
    print(f"{'N':>8} {'mode':<30} {'eff. training':>13} {'stall/failure':>13} {'failures':>8}")
    for r in results:
      print(f"{r.accelerators:>8} {r.mode.value:<30} {100 * r.effective_training_time:>12.1f}% "
            f"{r.stall_per_failure_secs / 60:>9.2f} min {r.failures:>8}")
    print("comparison (not a target): " + simulator.paper_line())
  if args.plot:
    plot(results, args.plot)
    print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
  return 0


def _run_closed_form(args: argparse.Namespace) -> int:
  if args.mtbf_hours is None or args.checkpoint_secs is None:
    print("jaxckpt simulate: the closed-form check needs --mtbf-hours H and --checkpoint-secs C "
          "(e.g. --mode synchronous --mtbf-hours 24 --checkpoint-secs 300 --restart-secs 600 "
          "--optimal-interval)", file=sys.stderr)
    return 2
  try:
    r = simulate_synchronous(args.mtbf_hours * _HOUR, args.checkpoint_secs, args.restart_secs,
                             args.interval_secs, optimal_interval=args.optimal_interval, seed=args.seed,
                             failures=args.failures)
  except SimulationInputError as e:
    print(f"jaxckpt simulate: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps({"mode": Mode.SYNCHRONOUS.value, **r.to_dict()}, indent=1))
    return 0
  if r.optimal_interval_secs is not None:
    print(f"optimal interval (simulated): {r.optimal_interval_secs / 60:.2f} min")
  print(f"optimal interval (Daly 2006):  {r.daly_optimal_interval_secs / 60:.2f} min; "
        f"Young 1974: {r.young_optimal_interval_secs / 60:.2f} min")
  print(f"at interval {r.interval_secs / 60:.2f} min: effective training time "
        f"{100 * r.effective_training_time:.2f}% simulated ({r.failures} failures, seed {r.seed}), "
        f"{100 * r.daly_effective_training_time:.2f}% Daly exact, "
        f"{100 * r.first_order_effective_training_time:.2f}% first order")
  return 0

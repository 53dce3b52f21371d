"""Goodput vs job size: synchronous restart vs replica groups vs replica groups + host snapshots.

Sweeps N from 1K to 128K accelerators (log scale, plus the FT-HSDP paper's 96K), simulates
every mode on several seeds (the same failures for every mode of a seed), prints one JSON
object with the medians over seeds, and writes a PNG plot.

  python benchmarks/goodput.py [--quick] [--plot PATH]

The JSON holds, per N and mode, the median effective training time, stall per failure and
failures, the median seconds one simulated run took on this machine, and the check against
the paper's figures at 96K.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # Uninstalled repo.

from tools import goodput as sim


def _median_result(runs: list[sim.SimulationResult]) -> sim.SimulationResult:
  return dataclasses.replace(
      runs[0], seed=-1,
      effective_training_time=statistics.median(r.effective_training_time for r in runs),
      stall_per_failure_secs=statistics.median(r.stall_per_failure_secs for r in runs),
      failures=int(statistics.median(r.failures for r in runs)),
      breakdown={k: statistics.median(r.breakdown[k] for r in runs) for k in runs[0].breakdown})


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="3 seeds x 7 days (CI smoke)")
  parser.add_argument("--plot", default=os.path.join(os.path.dirname(__file__), "out", "goodput.png"))
  args = parser.parse_args()
  seeds, days = (range(3), 7.0) if args.quick else (range(7), 30.0)
  base = sim.SimulationConfig(simulated_days=days)
  ns = sorted({*sim.log_scale(1024, 131_072), sim.PAPER_ACCELERATORS})
  sim.simulate(dataclasses.replace(base, simulated_days=1.0), sim.Mode.SYNCHRONOUS, 0)  # Warm-up.
  medians, rows = [], []
  for n in ns:
    config = dataclasses.replace(base, accelerators=n)
    for mode in sim.MODES:
      runs, secs = [], []
      for seed in seeds:
        t0 = time.perf_counter()
        runs.append(sim.simulate(config, mode, seed))
        secs.append(time.perf_counter() - t0)
      m = _median_result(runs)
      medians.append(m)
      rows.append({"accelerators": n, "mode": mode.value,
                   "effective_training_time": round(m.effective_training_time, 4),
                   "stall_per_failure_min": round(m.stall_per_failure_secs / 60, 3),
                   "failures": m.failures,
                   "breakdown": {k: round(v, 4) for k, v in m.breakdown.items()},
                   "median_run_secs": round(statistics.median(secs), 4)})
  paper = {mode.value: {"paper": fig, "simulated": next(
      {"effective_training_time": r["effective_training_time"],
       "stall_per_failure_min": r["stall_per_failure_min"]}
      for r in rows if r["accelerators"] == sim.PAPER_ACCELERATORS and r["mode"] == mode.value)}
      for mode, fig in sim.PAPER_FIGURES.items()}
  os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
  sim.plot(medians, args.plot)
  print(json.dumps({"benchmark": "goodput", "seeds": len(seeds), "simulated_days": days,
                    "config": dataclasses.asdict(base), "paper_check_at_96k": paper,
                    "plot": args.plot, "results": rows}, indent=1))


if __name__ == "__main__":
  main()

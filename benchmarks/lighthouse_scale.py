"""The lighthouse's cost as groups grow: quorum time and reply bytes at G simulated groups.

Each G runs an in-process lighthouse with ``min_replicas=G`` and G simulated
groups (``tests.support.ft_simulate``: sealed quorum requests over a few sockets,
as a member sends them). A *round* is one quorum of all G groups, timed from
the last group's request to every group holding its reply; ``form_ms`` is the
lighthouse's own share (forming the quorum, sealing and queuing G replies), and
``lighthouse_cpu_ms`` the CPU time its serving thread spent on the whole round
(G requests, the quorum, G replies: what a busy machine does not inflate).
The *first* quorum of a job carries the whole membership to every member once;
later ones (*steady*) carry only what each member needs. Medians of
``--repeats`` (a fresh lighthouse for each first quorum; steady rounds of one).
With ``--etcd``, the lighthouse is the leader of a control plane on a 3-member
etcd cluster on loopback (:mod:`jaxckpt.ft._replicas`): each quorum is first
recorded by a fencing transaction, which the figures then include. Prints one
JSON object.

    python benchmarks/lighthouse_scale.py [--groups 8,32,128,1024] [--repeats 3] [--etcd]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from datetime import timedelta
from typing import Any

from jaxckpt.ft.lighthouse import Lighthouse, LighthouseOptions
import _repo  # noqa: F401  (the repository root on the path: tests.support)
from tests.support.ft_simulate import Round, SimulatedGroups


ETCD: list[str] = []        # the cluster's endpoints, with --etcd


def _options(groups: int) -> LighthouseOptions:
  return LighthouseOptions(min_replicas=groups, join_timeout=timedelta(milliseconds=10),
                           heartbeat_timeout=timedelta(seconds=300), straggler_timeout=timedelta(seconds=300),
                           etcd_endpoints=tuple(ETCD), job_name=f"scale{os.getpid()}-{time.monotonic_ns()}" if ETCD else "",
                           leader_lease=timedelta(seconds=2))


def _job(groups: int, steady: int) -> tuple[Round, list[Round]]:
  opts = _options(groups)
  with Lighthouse("127.0.0.1:0", opts) as lh, SimulatedGroups(lh, groups) as sim:
    deadline = time.monotonic() + 30
    while not lh.leading:                            # (with etcd: it leads once elected)
      if time.monotonic() > deadline:
        raise TimeoutError("the lighthouse was not elected within 30 s")
      time.sleep(0.01)
    time.sleep(opts.join_timeout.total_seconds())   # (a quorum never forms in a new lighthouse's grace period)
    return sim.round(), [sim.round() for _ in range(steady)]


def _summary(rounds: list[Round]) -> dict[str, float]:
  med = lambda f: statistics.median(getattr(r, f) for r in rounds)
  return {"quorum_ms": round(1e3 * med("quorum_secs"), 3), "form_ms": round(1e3 * med("form_secs"), 3),
          "lighthouse_cpu_ms": round(1e3 * med("lighthouse_cpu_secs"), 3),
          "reply_bytes_mean": round(med("reply_bytes_mean"), 1), "reply_bytes_max": int(med("reply_bytes_max")),
          "reply_bytes_total": int(med("reply_bytes_total"))}


def measure(groups: int, repeats: int) -> dict[str, Any]:
  jobs = [_job(groups, repeats if i == 0 else 0) for i in range(repeats)]
  first, steady = _summary([cold for cold, _ in jobs]), _summary(jobs[0][1])
  return {"groups": groups, "steady": steady, "first": first,
          "steady_us_per_group": round(1e3 * steady["quorum_ms"] / groups, 2),
          "steady_cpu_us_per_group": round(1e3 * steady["lighthouse_cpu_ms"] / groups, 2),
          "first_us_per_group": round(1e3 * first["quorum_ms"] / groups, 2),
          "first_cpu_us_per_group": round(1e3 * first["lighthouse_cpu_ms"] / groups, 2)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--groups", default="8,32,128,1024", help="comma-separated group counts")
  parser.add_argument("--repeats", type=int, default=3, help="medians of this many")
  parser.add_argument("--etcd", action="store_true", help="the leader of a control plane on etcd (fenced quorums)")
  args = parser.parse_args()
  t0 = time.monotonic()
  sizes = [int(g) for g in args.groups.split(",")]
  with contextlib.ExitStack() as stack:
    if args.etcd:
      from tests.support.etcd import EtcdCluster  # pylint: disable=import-outside-toplevel
      ETCD.extend(stack.enter_context(EtcdCluster(3)).endpoints)
    results = [measure(g, args.repeats) for g in sizes]
  small, large = results[0], results[-1]
  print(json.dumps({
      "benchmark": "lighthouse_scale", "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
      "control_plane": "etcd leader (fenced)" if args.etcd else "lighthouse",
      "repeats": args.repeats, "results": results,
      # per-group cost at the largest G over that at the smallest: ~1 when linear, ~G_large/G_small when quadratic
      "steady_per_group_ratio": round(large["steady_us_per_group"] / small["steady_us_per_group"], 3),
      "steady_cpu_per_group_ratio": round(large["steady_cpu_us_per_group"] / small["steady_cpu_us_per_group"], 3),
      "first_cpu_per_group_ratio": round(large["first_cpu_us_per_group"] / small["first_cpu_us_per_group"], 3),
      "seconds": round(time.monotonic() - t0, 1)}, indent=1))


if __name__ == "__main__":
  main()

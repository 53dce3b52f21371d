"""Where the goodput simulator's inputs come from: a citation for each, and jaxckpt's
own recovery figures read from its benchmarks' JSON (``jaxckpt simulate --from-benchmarks``).
Re-exported by :mod:`jaxckpt.goodput`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from jaxckpt import errors

_LLAMA3 = ("Llama 3 (Dubey et al. 2024, sec. 3.3.4): 419 unexpected interruptions in 54 days on 16,384 "
           "H100s, one per ~50.7K GPU-hours")
_KOKOLIS = ("Kokolis et al. 2024, 'Revisiting Reliability in Large-Scale ML Research Clusters' "
            "(arXiv 2410.21680): MTTF projected at 14 min for 131K GPUs, ~31K GPU-hours")
_FTHSDP = "FT-HSDP (arXiv 2602.00277): stall per failure 10 min synchronous, 3 min with replica groups"

#: Where each default comes from (``--explain`` prints it; ``--from-benchmarks`` replaces the
#: jaxckpt-measured ones with the figures of the benchmark files it read).
SOURCES: dict[str, str] = {
    "accelerators": "the job size FT-HSDP reports at (O(100K), here 96K); set with --accelerators",
    "accelerator_mtbf_hours": f"between {_LLAMA3} and {_KOKOLIS}; near the latter at this scale",
    "replica_groups": "FT-HSDP: groups of 8K accelerators (FSDP inside each) at O(100K)",
    "job_restart_secs": f"{_FTHSDP}; with checkpoint_load_secs, a failure during a restart restarts it",
    "checkpoint_load_secs": "reading a multi-TB checkpoint from a parallel filesystem: ~4 min (our "
                            "choice within the paper's 10 min synchronous stall)",
    "checkpoint_interval_secs": "an asynchronous persistent checkpoint every 5 min, bounded by the time "
                                "to persist a multi-TB state (our choice)",
    "checkpoint_save_stall_secs": "blocking part of an asynchronous save (orbax-style); jaxckpt's own: "
                                  "benchmarks/snapshot.py seconds.agent_blocking_s (--from-benchmarks)",
    "failure_detection_secs": f"{_FTHSDP}: a collective timeout, our split of the 3 min; jaxckpt's own: "
                              "benchmarks/ft_goodput.py (a kill or a stop until every survivor gave up)",
    "quorum_reform_secs": f"{_FTHSDP}: new quorum and communicators, our split of the 3 min; jaxckpt's "
                          "own: benchmarks/ft_goodput.py (from then to the next commit, less a step)",
    "rejoin_stall_secs": f"{_FTHSDP}: our split of the 3 min; jaxckpt's own: benchmarks/ft_goodput.py "
                         "(the healthy step at a rejoin minus the median), else benchmarks/catch_up.py "
                         "--stall (healthy worst step minus median while a peer catches up)",
    "group_restart_secs": "a group relaunches as slowly as the whole job (job_restart_secs)",
    "peer_state_fetch_secs": "FT-HSDP: fetch a healthy peer's state over the network (~4 min for a "
                             "multi-TB state); jaxckpt's own: benchmarks/catch_up.py catch_up_secs per GiB",
    "host_snapshot_load_secs": "jaxckpt host snapshots read at memory speed; jaxckpt's own: "
                               "benchmarks/snapshot.py seconds.agent_restore_same_s per GiB x state per host",
    "spare_fraction": "2% hot spares (our choice; repairs never bind at the defaults)",
    "repair_hours": "two days to repair or replace a failed accelerator (our choice)",
    "simulated_days": "long enough for thousands of failures at 96K (our choice)",
}

#: Benchmark files ``--from-benchmarks DIR`` reads, and the commands that write them.
BENCHMARK_FILES = {
    "snapshot.json": "python benchmarks/snapshot.py > DIR/snapshot.json",
    "catch_up.json": "python benchmarks/catch_up.py > DIR/catch_up.json",
    "catch_up_stall.json": "python benchmarks/catch_up.py --stall > DIR/catch_up_stall.json",
    "ft_goodput.json": "python benchmarks/ft_goodput.py --runs 3 > DIR/ft_goodput.json",
}
#: Files of BENCHMARK_FILES that may be missing (their inputs then keep what the others give).
OPTIONAL_FILES = ("ft_goodput.json",)


#: jaxckpt's own figures, shipped: three files measured on the 16-core host of one H100 (JAX on its
#: CPU; 1 GiB snapshot, 256 MiB catch-up, three processes for the stall), 2026-11-22, and
#: ft_goodput.json, measured on the 2-core development VM (three groups of 2 CPU devices and a
#: lighthouse as processes, each group with its own agent; its ``host`` field says so).
MEASURED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "measured",
                            "h100_host")


def from_benchmarks(directory: str | os.PathLike[str], *, state_gib_per_host: float
                    ) -> tuple[dict[str, float], dict[str, str]]:
  """The inputs jaxckpt measures, from its benchmarks' JSON in ``directory``:
  ({input: value}, {input: citation}). Host-side figures scale linearly with
  ``state_gib_per_host`` (every host of a group loads its own share at once).

  The replica groups' failure detection, quorum re-forming and rejoin stall come
  from ``ft_goodput.json`` when the directory has it (``goodput_inputs``: real
  groups under kills, stops and a lighthouse outage), in seconds as measured:
  heartbeats, aborts and a quorum cost the same whatever a group's size.

  Raises InvalidArgumentError naming a missing file (and the command that
  writes it) or a missing field.
  """
  def load(name: str) -> dict[str, Any]:
    path = os.path.join(os.fspath(directory), name)
    try:
      with open(path, encoding="utf-8") as f:
        return json.load(f)
    except FileNotFoundError:
      raise errors.InvalidArgumentError(
          f"--from-benchmarks: {path} is missing; write it with `{BENCHMARK_FILES[name]}`") from None
    except json.JSONDecodeError as e:
      raise errors.InvalidArgumentError(f"--from-benchmarks: {path} is not JSON ({e})") from None

  def field(doc: dict[str, Any], name: str, *keys: str) -> float:
    node: Any = doc
    for k in keys:
      if not isinstance(node, dict) or k not in node:
        raise errors.InvalidArgumentError(
            f"--from-benchmarks: {name} has no field {'.'.join(keys)}; rerun `{BENCHMARK_FILES[name]}` "
            "with this jaxckpt")
      node = node[k]
    return float(node)

  snap, catch, stall = load("snapshot.json"), load("catch_up.json"), load("catch_up_stall.json")
  gib = field(snap, "snapshot.json", "bytes") / 2**30
  restore = field(snap, "snapshot.json", "seconds", "agent_restore_same_s", "median")
  blocking = field(snap, "snapshot.json", "seconds", "agent_blocking_s", "median")
  fetch_gib = field(catch, "catch_up.json", "size_mib") / 1024
  fetch = field(catch, "catch_up.json", "catch_up_secs")
  worst = field(stall, "catch_up_stall.json", "healthy_worst_step_while_catching_up_s")
  median = field(stall, "catch_up_stall.json", "healthy_median_step_s")
  values = {"host_snapshot_load_secs": restore / gib * state_gib_per_host,
            "peer_state_fetch_secs": fetch / fetch_gib * state_gib_per_host,
            "checkpoint_save_stall_secs": blocking,
            "rejoin_stall_secs": max(0.0, worst - median)}
  where = os.fspath(directory)
  if os.path.exists(os.path.join(where, "ft_goodput.json")):
    ft = load("ft_goodput.json")
    detect = field(ft, "ft_goodput.json", "goodput_inputs", "failure_detection_secs")
    reform = field(ft, "ft_goodput.json", "goodput_inputs", "quorum_reform_secs")
    rejoin = field(ft, "ft_goodput.json", "goodput_inputs", "rejoin_stall_secs")
    values.update(failure_detection_secs=detect, quorum_reform_secs=reform, rejoin_stall_secs=rejoin)
    runs, host = len(ft.get("runs", [])), ft.get("host", "?")
    ft_cites = {
        "failure_detection_secs": f"{where}/ft_goodput.json: every survivor gave up {detect:.3f} s after "
                                  f"a kill or a stop (median of {runs} run(s), {host})",
        "quorum_reform_secs": f"{where}/ft_goodput.json: the next commit {reform:.3f} s after that, less "
                              "a step",
        "rejoin_stall_secs": f"{where}/ft_goodput.json: the healthy step at a rejoin {rejoin:.3f} s over "
                             "the median"}
  else:
    ft_cites = {}
  cites = {
      "host_snapshot_load_secs": f"{where}/snapshot.json: agent restore {restore:.3f} s for {gib:.2f} GiB, "
                                 f"x {state_gib_per_host:g} GiB per host",
      "peer_state_fetch_secs": f"{where}/catch_up.json: catch-up {fetch:.3f} s for {fetch_gib:.2f} GiB, "
                               f"x {state_gib_per_host:g} GiB per host",
      "checkpoint_save_stall_secs": f"{where}/snapshot.json: agent save() blocking {blocking:.4f} s",
      "rejoin_stall_secs": f"{where}/catch_up_stall.json: healthy worst step {worst:.3f} s - median "
                           f"{median:.3f} s while a peer catches up",
      **ft_cites}
  return values, cites

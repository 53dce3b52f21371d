"""Choosing options: the formulas behind ``docs/planning.md`` and ``jaxckpt plan``.

Given the state each host snapshots, a host's RAM, the number of hosts, the step time and the
storage bandwidth, :func:`plan` sizes four ways of running jaxckpt (host snapshots in an agent
with parity across hosts, in an agent, in the training process, or no host snapshots at all)
and recommends the one that fits the memory budget with the highest expected goodput. Every
number comes from a function of this module (the page quotes each), from jaxckpt's measured
figures (``jaxckpt/measured/h100_host``, read as ``jaxckpt simulate --from-benchmarks
measured`` reads them) and from the first-order checkpoint model of Young and Daly
(:func:`jaxckpt.goodput.closed_form.first_order_efficiency`), extended to two kinds of failure:

* failures arrive as a Poisson process at the job's MTBF (an accelerator's MTBF over the job's
  accelerators);
* a share ``host_loss_fraction`` of them take the memory of the host they hit with them (a
  reboot, a lost machine); the others (a GPU fault, a crashed trainer) leave it, so an agent's
  snapshots survive them;
* each failure costs a restart, the load of the newest state that survived it, and the work
  done since that state: on average half the interval between such states.

So the expected goodput is ``1 - blocking / save interval - sum over kinds of rate x (interval / 2
+ restart + load)`` (:func:`goodput`), each kind recovering from the fastest tier that survives
it. Each figure carries the model's error (:func:`model_error`: the terms the first-order model
drops, and the spread of the measured figures); options whose goodputs differ by less than their
errors are taken as equal, and the one that survives more failures from host memory is
recommended (:data:`PREFERENCE`).

>>> p = plan(PlanInputs(state_gib_per_host=8, host_ram_gib=512, hosts=64, step_secs=1,
...                     storage_gbps=1))
>>> p.recommended.name, p.recommended.options["parity"]
('agent + parity', {'group_size': 4, 'parity': 1})
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Any

from jaxckpt import errors
from jaxckpt.goodput.closed_form import daly_optimal_interval
from jaxckpt.goodput.inputs import MEASURED_DIR, from_benchmarks

GIB = 2**30
GB = 1e9

#: Device-to-host copy plus checksums of a committed snapshot, seconds per GiB: 6 GiB committed
#: in 1.44 s on one H100 host (4.5 GB/s; docs/benchmarks.md). The copy runs beside the next
#: steps; a save that finds the previous copy still running is skipped.
SNAPSHOT_SECS_PER_GIB = 1.44 / 6
#: Restore with one host rebuilt from parity, against nothing lost: 1.53x (docs/benchmarks.md).
PARITY_REBUILD_FACTOR = 1.53
#: Reed-Solomon encode on one core of the H100 host, GB/s; each host encodes m x its snapshot.
ENCODE_GBPS = 4.5
#: The storage-only mode's staging buffer when ``host_memory_limit_bytes`` is None.
STAGING_GIB = 1.0
#: Persists keep storage busy at most this share of the time (an interval of at least twice the
#: write), so a save due for storage rarely waits for the one before.
PERSIST_BUSY_SHARE = 0.5
#: Parity groups tried, smallest first (more memory, fewer hosts exposed per group).
GROUP_SIZES = (4, 8, 16, 32)
#: Order among options of equal goodput (within the model's error): the one that survives more
#: failures from host memory first.
PREFERENCE = ("agent + parity", "agent", "in-process", "storage-only")
#: An interval between persists (or saves) this long gets a note saying why.
LONG_INTERVAL_SECS = 3600.0

#: The range of each input the model computes with (a value outside it is refused by name: a
#: finite but absurd input, such as 1e308 GiB per host or 1e-320 s steps, overflows the model).
RANGES: dict[str, tuple[float, float, str]] = {
    "state_gib_per_host": (1e-6, 1e6, "GiB"), "host_ram_gib": (1e-3, 1e7, "GiB"),
    "hosts": (1, 10**6, "hosts"), "step_secs": (1e-6, 1e6, "s"),
    "storage_gbps": (1e-6, 1e5, "GB/s"), "memory_fraction": (1e-6, 1, ""),
    "network_gbps": (1e-6, 1e5, "GB/s"), "accelerators_per_host": (1, 1024, "accelerators"),
    "accelerator_mtbf_hours": (1e-3, 1e9, "h"), "host_loss_fraction": (0, 1, ""),
    "restart_secs": (0, 1e7, "s")}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanInputs:
  """What ``jaxckpt plan`` is told (units in the names; GB = 1e9 bytes, GiB = 2**30).

  Attributes:
    state_gib_per_host: bytes each host snapshots (its replica-0 shards), GiB.
    host_ram_gib: RAM of one host, GiB.
    hosts: hosts of the job (one trainer process and one agent each).
    step_secs: seconds per training step.
    storage_gbps: write (and read) bandwidth each host gets to storage, GB/s.
    memory_fraction: share of host RAM the snapshots may take (the manager's default
      budget is half of the free RAM and of free /dev/shm).
    network_gbps: bandwidth each host gets to its parity peers, GB/s (100 Gb/s: 12.5).
    accelerators_per_host: accelerators per host.
    accelerator_mtbf_hours: mean time between failures of one accelerator with its share of
      the host (``jaxckpt simulate``'s default: 33,000 h).
    host_loss_fraction: share of failures that take their host's memory with them.
    restart_secs: reschedule, relaunch and re-initialize the job after a failure
      (``jaxckpt simulate``'s default: 570 s).
  """
  state_gib_per_host: float
  host_ram_gib: float
  hosts: int
  step_secs: float
  storage_gbps: float
  memory_fraction: float = 0.5
  network_gbps: float = 12.5
  accelerators_per_host: int = 8
  accelerator_mtbf_hours: float = 33_000.0
  host_loss_fraction: float = 0.5
  restart_secs: float = 570.0

  def __post_init__(self) -> None:
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      zero_ok = f.name in ("restart_secs", "host_loss_fraction")
      if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
          or v < 0 or (v == 0 and not zero_ok)):
        raise _invalid(f.name, f"a {'non-negative' if zero_ok else 'positive'} number", v)
    for name in ("hosts", "accelerators_per_host"):
      if not isinstance(getattr(self, name), int):
        raise _invalid(name, "an int", getattr(self, name))
    for name in ("memory_fraction", "host_loss_fraction"):
      if getattr(self, name) > 1:
        raise _invalid(name, "<= 1", getattr(self, name))
    for name, (lo, hi, unit) in RANGES.items():
      v = getattr(self, name)
      if not lo <= v <= hi:
        raise _invalid(name, f"between {lo:g} and {hi:g}{' ' + unit if unit else ''} for the "
                       "model to hold", v)


def _invalid(name: str, rule: str, value: Any) -> errors.InvalidArgumentError:
  """A bad input, named as the API has it (``PlanInputs.name``); ``jaxckpt plan`` says it
  as its flag (``--name``) from the error's ``field``, ``rule`` and ``value``."""
  e = errors.InvalidArgumentError(f"PlanInputs.{name} must be {rule}, got {name}={value!r}")
  e.field, e.rule, e.value = name, rule, value
  return e


@dataclasses.dataclass(frozen=True)
class Measured:
  """jaxckpt's measured figures the plan uses (``jaxckpt/measured/h100_host``): medians, and
  their spread between runs ((max - min) / median), which :func:`model_error` counts."""
  save_blocking_secs: float      # save() blocks, per save
  host_load_secs_per_gib: float  # restore from the agent's host memory, per GiB
  blocking_spread: float = 0.0
  load_spread: float = 0.0


def measured() -> Measured:
  values, _ = from_benchmarks(MEASURED_DIR, state_gib_per_host=1.0)
  with open(f"{MEASURED_DIR}/snapshot.json", encoding="utf-8") as f:
    runs = json.load(f)["seconds"]

  def spread(name: str) -> float:
    r = runs[name]
    return (r["max"] - r["min"]) / r["median"]
  return Measured(values["checkpoint_save_stall_secs"], values["host_snapshot_load_secs"],
                  spread("agent_blocking_s"), spread("agent_restore_same_s"))


# -- the formulas (docs/planning.md quotes each) ----------------------------------------------

def job_mtbf_secs(i: PlanInputs) -> float:
  """The job's mean time between failures: ``accelerator MTBF / accelerators``."""
  return i.accelerator_mtbf_hours * 3600 / (i.hosts * i.accelerators_per_host)


def budget_gib(i: PlanInputs) -> float:
  return i.memory_fraction * i.host_ram_gib


def smallest_group(hosts: int, group_size: int) -> int:
  """The smallest parity group when ``hosts`` split evenly into groups of at most ``group_size``."""
  return hosts // -(-hosts // group_size)


def parity_fraction(hosts: int, group_size: int, parity: int) -> float:
  """Parity memory per snapshot as a share of the snapshot: ``m / (g - m)`` (smallest group)."""
  return parity / (smallest_group(hosts, group_size) - parity)


def host_memory_gib(state_gib: float, max_snapshots: int, parity_share: float = 0.0) -> float:
  """Host memory of the snapshot tier: ``(max_snapshots + 1) x state x (1 + parity share)``."""
  return (max_snapshots + 1) * state_gib * (1 + parity_share)


def staging_gib(i: PlanInputs) -> float:
  """The storage-only mode's one staging buffer: 1 GiB, or the budget if smaller."""
  return min(STAGING_GIB, budget_gib(i))


def snapshot_secs(state_gib: float) -> float:
  """The background copy of one snapshot (device to host, checksums, commit)."""
  return state_gib * SNAPSHOT_SECS_PER_GIB


def persist_secs(state_gib: float, storage_gbps: float) -> float:
  """Writing (or reading) one host's share of a step on storage."""
  return state_gib * GIB / (storage_gbps * GB)


def host_load_secs(state_gib: float, m: Measured) -> float:
  """Restoring one host's state from host memory (the agent's), measured."""
  return m.host_load_secs_per_gib * state_gib


def storage_load_secs(state_gib: float, storage_gbps: float, m: Measured) -> float:
  """Restoring one host's state from storage: the read, and everything a restore from host
  memory does (checksums, copies to the devices), overlapped at best; so never faster than
  loading from host memory."""
  return max(persist_secs(state_gib, storage_gbps), host_load_secs(state_gib, m))


def protect_secs(state_gib: float, parity: int, network_gbps: float) -> float:
  """From a save to its parity on the peers: the snapshot, then ``m x state`` sent each way and
  encoded (taken as not overlapped: an upper bound)."""
  return (snapshot_secs(state_gib)
          + parity * state_gib * GIB * (1 / (network_gbps * GB) + 1 / (ENCODE_GBPS * GB)))


def steps_at_least(secs: float, step_secs: float, multiple_of: int = 1) -> int:
  """The fewest steps, a multiple of ``multiple_of``, that last at least ``secs``."""
  steps = max(1, math.ceil(secs / step_secs - 1e-9))
  return -(-steps // multiple_of) * multiple_of


def loss_beyond_parity(group: int, parity: int, window_secs: float, host_mtbf_secs: float) -> float:
  """Chance that a host loss is followed, within ``window_secs``, by ``parity`` more in its group:
  ``C(g-1, m) (window / host MTBF)^m``; the step then comes from storage."""
  return math.comb(group - 1, parity) * (window_secs / host_mtbf_secs) ** parity


def goodput(i: PlanInputs, blocking: tuple[float, float],
            recoveries: list[tuple[float, float, float]]) -> float:
  """Expected effective training time, first order (Young/Daly), two kinds of failure:

  ``1 - delta / tau - sum over kinds of (share / M) ((tau_k + delta) / 2 + R + load_k)``

  With one kind this is :func:`~jaxckpt.goodput.closed_form.first_order_efficiency`.

  Args:
    blocking: ``(delta, tau)``: save() blocks ``delta`` seconds every ``tau``.
    recoveries: ``(share of failures, interval of the tier that survives them, load seconds)``.
  """
  delta, tau = blocking
  m = job_mtbf_secs(i)
  return 1 - delta / tau - sum(share / m * ((interval + delta) / 2 + i.restart_secs + load)
                               for share, interval, load in recoveries)


def model_error(i: PlanInputs, m: Measured, blocking: tuple[float, float, bool],
                recoveries: list[tuple[float, float, float, float]]) -> float:
  """How far :func:`goodput` may be off: the second-order terms the first-order model drops
  (:func:`~jaxckpt.goodput.closed_form.first_order_remainder`, per kind of failure), plus the
  spread of the measured figures it uses (blocking, and loads from host memory).

  Args:
    blocking: ``(delta, tau, measured)`` as for :func:`goodput`; ``measured``: ``delta`` is
      save()'s measured blocking (else a storage write, from your inputs).
    recoveries: ``(share, interval, load, measured load)``: the part of ``load`` that comes from
      the measured host-memory figures (the rest, storage reads, follows your inputs).
  """
  delta, tau, measured_delta = blocking
  mtbf = job_mtbf_secs(i)
  d = delta / tau
  out = d * d + (d * m.blocking_spread if measured_delta else 0.0)
  for share, interval, load, measured_load in recoveries:
    a, r = (interval + delta) / mtbf, (i.restart_secs + load) / mtbf
    out += share * (d * (a / 2 + r) + a * a / 12 + a * r / 2 + r * r / 2)
    out += share * measured_load * m.load_spread / mtbf
  return out


# -- the options ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Option:
  """One way of running jaxckpt, sized for the inputs (times in seconds, memory in GiB)."""
  name: str
  options: dict[str, Any]        # CheckpointOptions keywords (agent and parity as dicts)
  memory_gib: float              # host memory of the snapshot tier, per host
  fits: bool                     # within the budget
  blocked: float                 # share of the time save() blocks
  crash_recovery: tuple[float, float]   # a failure that leaves host memory: (interval, load)
  host_loss_recovery: tuple[float, float]  # a failure that takes it: (interval, load)
  goodput: float
  error: float = 0.0             # how far goodput may be off (model_error)
  notes: tuple[str, ...] = ()

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


# A recovery: (interval it goes back, load seconds, the part of the load that is measured).
Recovery = tuple[float, float, float]


def _max_snapshots(i: PlanInputs, parity_share: float) -> int:
  """2 (the newest and one to roll back to) if it fits, else 1, else 0 (nothing fits)."""
  for k in (2, 1):
    if host_memory_gib(i.state_gib_per_host, k, parity_share) <= budget_gib(i):
      return k
  return 0


def _option(i: PlanInputs, m: Measured, name: str, options: dict[str, Any], memory: float,
            blocking: tuple[float, float], crash: Recovery, loss: Recovery,
            notes: list[str]) -> Option:
  f = i.host_loss_fraction
  g = goodput(i, blocking, [(1 - f, *crash[:2]), (f, *loss[:2])])
  err = model_error(i, m, (*blocking, name != "storage-only"), [(1 - f, *crash), (f, *loss)])
  return Option(name, options, memory, memory <= budget_gib(i), blocking[0] / blocking[1],
                crash[:2], loss[:2], g, err, tuple(notes))


def storage_interval_secs(i: PlanInputs, m: Measured) -> float:
  """The storage tier's own interval: Daly's optimum for save()'s blocking against every
  failure, and at least twice the write (storage busy at most half the time)."""
  return max(daly_optimal_interval(job_mtbf_secs(i), m.save_blocking_secs),
             persist_secs(i.state_gib_per_host, i.storage_gbps) / PERSIST_BUSY_SHARE)


def save_interval_steps(i: PlanInputs, m: Measured, served_share: float) -> int:
  """Daly's optimum for save()'s blocking against the share of failures the host snapshots
  serve, never longer than the storage tier's own interval (persists are saves), never shorter
  than one snapshot's copy."""
  every = storage_interval_secs(i, m)
  if served_share > 0:
    every = min(every, daly_optimal_interval(job_mtbf_secs(i) / served_share,
                                             m.save_blocking_secs))
  return steps_at_least(max(every, snapshot_secs(i.state_gib_per_host)), i.step_secs)


def persist_interval_steps(i: PlanInputs, multiple_of: int) -> int:
  """Storage busy at most half the time; a multiple of the save interval (persists are
  snapshots)."""
  write = persist_secs(i.state_gib_per_host, i.storage_gbps)
  return steps_at_least(write / PERSIST_BUSY_SHARE, i.step_secs, multiple_of)


def _with_snapshots(i: PlanInputs, m: Measured, name: str, save: int, parity_group: int,
                    notes: list[str]) -> Option:
  s, t = i.state_gib_per_host, i.step_secs
  persist = persist_interval_steps(i, save)
  share = parity_fraction(i.hosts, parity_group, 1) if parity_group else 0.0
  k = _max_snapshots(i, share) or 1
  from_host = host_load_secs(s, m)
  from_storage = storage_load_secs(s, i.storage_gbps, m)
  storage = (persist * t, from_storage, from_host if from_host >= from_storage else 0.0)
  host = (max(save * t, snapshot_secs(s)), from_host, from_host)
  options: dict[str, Any] = {"max_snapshots": k, "save_interval_steps": save,
                             "persist_interval_steps": persist,
                             "agent": None if name == "in-process" else {"job_name": "JOB"}}
  crash, loss = (host, storage) if name == "agent" else (storage, storage)
  if parity_group:
    options["parity"] = {"group_size": parity_group, "parity": 1}
    crash = host
    rebuild = PARITY_REBUILD_FACTOR * from_host
    loss = (max(save * t, protect_secs(s, 1, i.network_gbps)), rebuild, rebuild)
    window = i.restart_secs + loss[1] + loss[0]
    host_mtbf = i.accelerator_mtbf_hours * 3600 / i.accelerators_per_host
    p = loss_beyond_parity(smallest_group(i.hosts, parity_group), 1, window, host_mtbf)
    notes = notes + [f"parity adds {share:.3f} x the state per snapshot; a host loss finds a "
                     f"second one in its group (the step then comes from storage) with "
                     f"probability {p:.1e}"]
  if persist * t >= LONG_INTERVAL_SECS:
    write = persist_secs(s, i.storage_gbps)
    who = {"agent + parity": "a loss of more than one host of a group",
           "agent": "a host loss", "in-process": "any failure"}[name]
    notes = notes + [f"persists every {_duration(persist * t)}: writing {s:g} GiB at "
                     f"{i.storage_gbps:g} GB/s takes {_duration(write)}, and storage is kept "
                     f"busy at most half the time; {who} goes back that far. Faster storage or "
                     "less state per host (shard it over more hosts) shortens it"]
  return _option(i, m, name, options, host_memory_gib(s, k, share),
                 (m.save_blocking_secs, save * t), crash, loss, notes)


def _storage_only(i: PlanInputs, m: Measured, host_tiers_fit: bool) -> Option:
  s, t = i.state_gib_per_host, i.step_secs
  write = persist_secs(s, i.storage_gbps)
  every = steps_at_least(max(daly_optimal_interval(job_mtbf_secs(i), write), write), t)
  from_host = host_load_secs(s, m)
  load = storage_load_secs(s, i.storage_gbps, m)
  storage = (every * t, load, from_host if from_host >= load else 0.0)
  notes = ["no host snapshots: each save due for storage blocks for its write"]
  if every * t >= LONG_INTERVAL_SECS:
    notes.append(
        f"persists every {_duration(every * t)} ({every:,} steps): each one blocks the loop for "
        f"its {_duration(write)} write, and Daly's optimum for that blocking against the job's "
        f"{job_mtbf_secs(i) / 3600:.1f} h MTBF is that far apart; a failure loses "
        f"{_duration(every * t / 2)} of work on average")
    if not host_tiers_fit:
      notes.append(_why_no_host_tier(i))
  return _option(i, m, "storage-only", {"host_snapshots": False, "persist_interval_steps": every},
                 staging_gib(i), (write, every * t), storage, storage, notes)


def _why_no_host_tier(i: PlanInputs) -> str:
  """Why no host tier fits, and what would make one fit."""
  s, need = i.state_gib_per_host, host_memory_gib(i.state_gib_per_host, 1)
  why = (f"host snapshots would make saves cheap, but even max_snapshots=1 needs 2 x {s:g} GiB "
         f"= {need:.1f} GiB per host against a budget of {budget_gib(i):.1f} GiB")
  fixes = []
  if i.hosts > 1 and host_memory_gib(s / i.hosts, 1) <= budget_gib(i):
    fixes.append(f"A state replicated on every host is snapshotted whole by one host: sharded "
                 f"over the {i.hosts} hosts (FSDP) it is {s / i.hosts:.2f} GiB per host, and "
                 "host snapshots fit")
  fixes.append(f"{'h' if fixes else 'H'}osts with {need / i.memory_fraction:.0f} GiB of RAM "
               f"(at --memory-fraction {i.memory_fraction:g}) fit max_snapshots=1")
  return why + ". " + "; or ".join(fixes)


def _duration(secs: float) -> str:
  if secs >= 3600:
    return f"{secs / 3600:.1f} h"
  if secs >= 600:
    return f"{secs / 60:.0f} min"
  return f"{secs:.0f} s" if secs >= 10 else f"{secs:.1f} s"


def options_for(i: PlanInputs, m: Measured | None = None) -> list[Option]:
  """Every option, sized, in :data:`PREFERENCE` order."""
  m = m or measured()
  f, out = i.host_loss_fraction, []
  if i.hosts >= 2:
    sizes = sorted({min(g, i.hosts) for g in GROUP_SIZES})
    fitting = [g for g in sizes if _max_snapshots(i, parity_fraction(i.hosts, g, 1))]
    out.append(_with_snapshots(i, m, "agent + parity", save_interval_steps(i, m, 1.0),
                               fitting[0] if fitting else sizes[-1], []))
  out.append(_with_snapshots(i, m, "agent", save_interval_steps(i, m, 1 - f), 0,
                             ["a host loss takes that host's snapshots: recovery reads storage"]))
  out.append(_with_snapshots(i, m, "in-process", save_interval_steps(i, m, 0.0), 0,
                             ["any failure takes the trainer's snapshots: recovery reads storage; "
                              "snapshots serve the persists and rollback"]))
  out.append(_storage_only(i, m, any(o.fits for o in out)))
  return out


@dataclasses.dataclass(frozen=True)
class Plan:
  inputs: PlanInputs
  options: tuple[Option, ...]
  recommended: Option

  def to_dict(self) -> dict[str, Any]:
    i = self.inputs
    return {"inputs": dataclasses.asdict(i),
            "job_mtbf_hours": job_mtbf_secs(i) / 3600, "budget_gib": budget_gib(i),
            "snapshot_secs": snapshot_secs(i.state_gib_per_host),
            "persist_secs": persist_secs(i.state_gib_per_host, i.storage_gbps),
            "options": [o.to_dict() for o in self.options],
            "recommended": self.recommended.name,
            "recommended_code": options_code(self.recommended, i)}


def recommend(options: list[Option]) -> Option:
  """The fitting option with the highest goodput, or, among the fitting options within the
  model's error of it (their goodputs differ by less than the sum of their errors), the one
  that survives more failures from host memory (the first in :data:`PREFERENCE`)."""
  fitting = [o for o in options if o.fits]
  best = max(fitting, key=lambda o: (o.goodput, -PREFERENCE.index(o.name)))
  close = [o for o in fitting if best.goodput - o.goodput <= best.error + o.error]
  chosen = min(close, key=lambda o: PREFERENCE.index(o.name))
  if chosen is best:
    return best
  why = (f"{best.name}'s goodput ({100 * best.goodput:.3f}%) is within the model's error "
         f"(±{100 * (best.error + chosen.error):.3f} points) of this one's; {chosen.name} "
         "survives more failures from host memory")
  return dataclasses.replace(chosen, notes=(why, *chosen.notes))


def plan(i: PlanInputs, m: Measured | None = None) -> Plan:
  """Sizes every option and recommends one (:func:`recommend`). Storage-only always fits (its
  buffer shrinks to the budget).

  Raises:
    InvalidArgumentError: the inputs drive a figure of the model out of range (it names them).
  """
  try:
    opts = options_for(i, m)
  except (OverflowError, ZeroDivisionError) as e:
    raise errors.InvalidArgumentError(
        f"the model cannot compute with these inputs ({e}): {_inputs_text(i)}") from None
  bad = [o.name for o in opts if not all(math.isfinite(x) for x in (
      o.goodput, o.error, o.memory_gib, *o.crash_recovery, *o.host_loss_recovery))]
  if bad:
    raise errors.InvalidArgumentError(
        f"the model gives non-finite figures for {bad} with these inputs: {_inputs_text(i)}")
  best = recommend(opts)
  return Plan(i, tuple(best if o.name == best.name else o for o in opts), best)


def _inputs_text(i: PlanInputs) -> str:
  return ", ".join(f"--{f.name.replace('_', '-')} {getattr(i, f.name):g}"
                   for f in dataclasses.fields(i))


# -- jaxckpt plan -----------------------------------------------------------------------------

def options_code(o: Option, i: PlanInputs) -> str:
  """The option as Python; ``host_memory_limit_bytes`` is the budget (the staging buffer for
  storage-only)."""
  parts = []
  for key, value in o.options.items():
    if key == "agent":
      value = "None" if value is None else f'jc.AgentOptions(job_name="{value["job_name"]}")'
    elif key == "parity":
      value = f"jc.ParityOptions(group_size={value['group_size']}, parity={value['parity']})"
    parts.append(f"{key}={value}")
  limit = o.memory_gib if o.name == "storage-only" else budget_gib(i)
  parts.append(f"host_memory_limit_bytes={int(limit * GIB)}")
  return "jc.CheckpointOptions(" + ", ".join(parts) + ")"


def render(p: Plan) -> str:
  """``jaxckpt plan``'s text."""
  i = p.inputs
  lines = [
      f"state {i.state_gib_per_host:g} GiB per host, {i.hosts} hosts x {i.accelerators_per_host} "
      f"accelerators, {i.step_secs:g} s steps, storage {i.storage_gbps:g} GB/s per host",
      f"job MTBF {job_mtbf_secs(i) / 3600:.1f} h, {100 * i.host_loss_fraction:g}% of failures "
      f"lose their host's memory; restart {i.restart_secs:g} s",
      f"snapshot copy {snapshot_secs(i.state_gib_per_host):.2f} s, persist "
      f"{persist_secs(i.state_gib_per_host, i.storage_gbps):.2f} s; memory budget "
      f"{budget_gib(i):.1f} GiB per host ({i.memory_fraction:g} x {i.host_ram_gib:g} GiB)",
      "",
      f"{'option':<15} {'memory/host':>11} {'fits':>4} {'blocked':>8} "
      f"{'crash: back/load':>17} {'host loss: back/load':>21} {'goodput':>15}"]
  for o in p.options:
    lines.append(
        f"{o.name:<15} {o.memory_gib:>7.1f} GiB {'yes' if o.fits else 'no':>4} "
        f"{100 * o.blocked:>7.3f}% {o.crash_recovery[0]:>8.0f} s/{o.crash_recovery[1]:>5.1f} s "
        f"{o.host_loss_recovery[0]:>12.0f} s/{o.host_loss_recovery[1]:>5.1f} s "
        f"{100 * o.goodput:>7.3f}% ±{100 * o.error:.3f}")
  r = p.recommended
  lines += ["", f"recommended: {r.name} (expected goodput {100 * r.goodput:.3f}% "
                f"±{100 * r.error:.3f})",
            "  " + options_code(r, i)]
  lines += [f"  note: {n}" for n in r.notes]
  return "\n".join(lines)


_HELP = """Recommend CheckpointOptions for a job, with their host memory, overhead and goodput.

Sizes four ways of running jaxckpt (agent + parity, agent, in-process, storage-only) from
the state each host snapshots, its RAM, the step time and the storage bandwidth, with
jaxckpt's measured figures and the Young/Daly checkpoint model. For each: host memory,
whether it fits the budget, the share of time save() blocks, how far back a failure that
leaves host memory (a crash) and one that takes it (a host loss) go and how long their
state takes to load, and the expected goodput with the model's error. Of options within
that error of each other, the one that survives more failures from host memory is
recommended. docs/planning.md explains each formula."""

_HELPS = {
    "state_gib_per_host": "GiB each host snapshots (its share of the state)",
    "host_ram_gib": "RAM of one host, GiB", "hosts": "hosts in the job",
    "step_secs": "seconds per training step",
    "storage_gbps": "storage bandwidth each host gets, GB/s (write and read)",
    "memory_fraction": "share of RAM the snapshots may take",
    "network_gbps": "bandwidth to the parity peers per host, GB/s",
    "accelerators_per_host": "accelerators per host",
    "accelerator_mtbf_hours": "mean time between failures of one accelerator, hours",
    "host_loss_fraction": "share of failures that take their host's memory",
    "restart_secs": "seconds to relaunch the job after a failure"}


def register_cli(subparsers: argparse._SubParsersAction) -> None:  # pylint: disable=protected-access
  """Adds ``jaxckpt plan``."""
  p = subparsers.add_parser("plan", help=_HELP.split("\n")[0], description=_HELP,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
  for f in dataclasses.fields(PlanInputs):
    required = f.default is dataclasses.MISSING
    p.add_argument("--" + f.name.replace("_", "-"), required=required,
                   type=int if f.name in ("hosts", "accelerators_per_host") else float,
                   default=None if required else f.default,
                   help=_HELPS[f.name] + ("" if required else f" (default {f.default:g})"))
  p.add_argument("--json", action="store_true", help="print the plan as JSON")
  p.set_defaults(func=run_cli)


def cli_message(e: errors.JaxckptError) -> str:
  """What ``jaxckpt plan`` says of ``e``: a bad input named as the flag that gave it."""
  field = getattr(e, "field", None)
  if field is None:
    return str(e)
  return f"--{field.replace('_', '-')} must be {e.rule}, got {e.value!r}"


def run_cli(args: argparse.Namespace) -> int:
  """Runs ``jaxckpt plan``; returns the exit code."""
  try:
    result = plan(PlanInputs(**{f.name: getattr(args, f.name)
                                for f in dataclasses.fields(PlanInputs)}))
    text = json.dumps(result.to_dict(), indent=1, allow_nan=False) if args.json else render(result)
  except errors.JaxckptError as e:
    print(f"jaxckpt plan: {cli_message(e)}", file=sys.stderr)
    return 2
  except (ArithmeticError, ValueError) as e:     # finite inputs too far out for the model
    print(f"jaxckpt plan: inputs out of range ({type(e).__name__}: {e}); give the sizes, "
          "times and rates of a real job", file=sys.stderr)
    return 2
  print(text)
  return 0

"""A run's identity: the options its processes agree on, and the name its tiers know it by.

A job is one unit: every process of it must decide alike which steps are saved,
persisted, kept and deleted, so every option that decides it must be the same on
every process. :func:`agree_options` checks that at start, through
jax.distributed's key-value store (one exchange, before anything else is
agreed), and refuses a job whose processes differ, naming the option, the values
and the processes. :func:`run_name` is the name the host tier keeps a run's
snapshots under: the job's directory (a new run in another directory never sees
the previous run's snapshots).
"""

from __future__ import annotations

import json
import os
from typing import Any

from jaxckpt import errors
from jaxckpt.net import _kv
from jaxckpt.options import CheckpointOptions

# The options that decide which steps a job saves, persists, keeps or deletes.
DECISIVE = ("max_snapshots", "save_interval_steps", "on_busy", "persist_interval_steps",
            "max_to_keep", "host_snapshots", "parity", "save_on_steps", "should_save_fn",
            "save_decision_policy", "keep_period", "keep_time_interval", "best_fn",
            "best_mode", "keep_checkpoints_without_metrics", "preservation_policy")


def run_name(directory: str | None) -> str:
  """The run a manager's host snapshots belong to: its directory, canonical ("" for
  none: host snapshots only, resumed by the job's name alone)."""
  if directory is None:
    return ""
  if "://" in directory:
    return directory.rstrip("/")
  return os.path.realpath(directory)


def digest(options: CheckpointOptions, directory: str | None) -> dict[str, str]:
  """What must be the same on every process: the decisive options, the directory and
  whether (and under which job) an agent holds the snapshots."""
  out = {name: _describe(getattr(options, name)) for name in DECISIVE}
  out["directory"] = repr(run_name(directory) if directory is not None else None)
  out["agent"] = repr(None if options.agent is None else options.agent.job_name)
  return out


def _describe(value: Any) -> str:
  """A value as every process would write it: functions and policies by their
  qualified name (their repr holds an address), sets sorted."""
  if value is None or isinstance(value, (bool, int, float, str)):
    return repr(value)
  if isinstance(value, (frozenset, set)):
    return repr(sorted(value))
  if callable(value) and hasattr(value, "__qualname__"):
    return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
  if hasattr(value, "__dataclass_fields__") and not callable(value):
    return f"{type(value).__qualname__}({', '.join(f'{k}={_describe(getattr(value, k))}' for k in value.__dataclass_fields__)})"
  return f"{type(value).__module__}.{type(value).__qualname__}"


def agree_options(options: CheckpointOptions, directory: str | None, *,
                  process: tuple[int, int]) -> None:
  """Refuses a job whose processes' decisive options differ (see the module).

  Raises:
    InvalidArgumentError (a ValueError): naming each option that differs, the value
      of every process that differs from process 0's, and process 0's.
  """
  if process[1] == 1:
    return
  mine = digest(options, directory)
  said = _kv.allgather("options", json.dumps(mine, sort_keys=True),
                       timeout_secs=options.timeout_secs,
                       what="their checkpoint options (each process's must match)")
  every = [json.loads(s) for s in said]
  diffs = []
  for name in sorted(set().union(*every)):
    values = [d.get(name) for d in every]
    if len(set(values)) > 1:
      others = {}
      for p, v in enumerate(values):
        if v != values[0]:
          others.setdefault(v, []).append(p)
      diffs.append(f"{name}: process 0 has {values[0]}, " + ", ".join(
          f"processes {ps} have {v}" for v, ps in others.items()))
  if diffs:
    raise errors.InvalidArgumentError(
        f"process {process[0]}: the {process[1]} processes of this job were given different "
        "checkpoint options, so they would save, keep or delete different steps: "
        + "; ".join(diffs) + ". Give every process the same CheckpointOptions and directory "
        "(a per-host configuration file that differs is the usual cause)")

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

import datetime
import functools
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
  none: host snapshots only, resumed by the job's name alone); a local directory is
  its real path however it is named (relative, ``file://``, a link, a trailing slash)."""
  if directory is None:
    return ""
  if directory.startswith("file://"):
    directory = directory[len("file://"):]
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


def _describe(value: Any, depth: int = 0) -> str:
  """A value as every process would write it, whatever differs in it described: numbers,
  strings, timedeltas and sets as they are; lists, tuples and dicts item by item; a
  function by its qualified name and the values it closes over (``every(2)`` is not
  ``every(3)``), a ``functools.partial`` by its function and arguments, an object (a
  dataclass, an orbax policy) by its type and fields; never a repr's address."""
  if depth > 8:
    return "..."
  d = lambda v: _describe(v, depth + 1)  # noqa: E731
  if value is None or isinstance(value, (bool, int, float, str, datetime.timedelta)):
    return repr(value)
  if isinstance(value, (frozenset, set)):
    return "{" + ", ".join(sorted(d(v) for v in value)) + "}"
  if isinstance(value, (list, tuple)):
    return "[" + ", ".join(d(v) for v in value) + "]"
  if isinstance(value, dict):
    return "{" + ", ".join(f"{d(k)}: {d(v)}" for k, v in sorted(value.items(), key=repr)) + "}"
  if isinstance(value, functools.partial):
    return f"partial({d(value.func)}, {d(value.args)}, {d(value.keywords)})"
  if callable(value) and hasattr(value, "__qualname__"):
    name = f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    cells = getattr(value, "__closure__", None) or ()
    code = getattr(value, "__code__", None)
    held = [d(c.cell_contents) if _plain(c.cell_contents) else
            type(c.cell_contents).__qualname__ for c in cells if _filled(c)]
    return name + (f"[{code.co_firstlineno}]" if code is not None else "") + (
        f"({', '.join(held)})" if held else "")
  fields = getattr(value, "__dataclass_fields__", None) or getattr(value, "__dict__", None)
  if fields is not None:
    return f"{type(value).__qualname__}({', '.join(f'{k}={d(getattr(value, k))}' for k in sorted(fields) if not k.startswith('__'))})"
  return f"{type(value).__module__}.{type(value).__qualname__}"


def _plain(value: Any) -> bool:
  """Whether a value a function closes over is plain data (numbers, strings, timedeltas,
  and containers of them): described as it is; anything else (a trainer object, whose
  fields may name this process) by its type only."""
  if value is None or isinstance(value, (bool, int, float, str, datetime.timedelta)):
    return True
  if isinstance(value, (list, tuple, set, frozenset)):
    return len(value) <= 1000 and all(_plain(v) for v in value)
  if isinstance(value, dict):
    return len(value) <= 1000 and all(_plain(k) and _plain(v) for k, v in value.items())
  return False


def _filled(cell: Any) -> bool:
  try:
    cell.cell_contents  # pylint: disable=pointless-statement
    return True
  except ValueError:                    # an empty cell
    return False


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

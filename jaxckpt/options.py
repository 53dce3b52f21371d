"""Frozen, keyword-only option dataclasses, validated on construction."""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import shutil
from typing import Any

import numpy as np
import psutil

from jaxckpt import errors

_ON_BUSY = ("skip", "wait")
_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_job_name(job: str) -> str:
  """``job`` if it names a job (its agents' directory), else InvalidArgumentError."""
  if not isinstance(job, str) or not _JOB_RE.match(job):
    raise errors.InvalidArgumentError(f"job_name={job!r} must be 1-64 characters of letters, digits, "
                     "'.', '_' or '-', starting with a letter or digit")
  return job


def check_step(step: Any, where: str) -> int:
  """``step`` as an int if it is a Python or numpy integer, or a 0-d integer array (as
  orbax takes ``optimizer.step.value``), in [0, 2**63); else raises.

  >>> check_step(np.int64(3), "save")
  3
  >>> check_step(np.asarray(4, np.uint32), "save")
  4
  """
  if _integer_scalar_array(step):
    step = int(step)
  if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)):
    raise errors.InvalidArgumentError(
        f"{where}(step={step!r}): a step is a non-negative int (Python or numpy integer, or a "
        f"0-d integer array), not a {type(step).__name__}")
  value = int(step)
  if not 0 <= value < 2**63:
    raise errors.InvalidArgumentError(
        f"{where}(step={step!r}): a step must be in [0, 2**63)")
  return value


def _integer_scalar_array(x: Any) -> bool:
  """Whether ``x`` is a 0-d array (numpy or jax) of an integer dtype."""
  if isinstance(x, (int, np.generic)) or getattr(x, "shape", None) != ():
    return False
  try:
    return np.issubdtype(x.dtype, np.integer)
  except TypeError:                 # a dtype numpy does not know (a PRNG key's)
    return False


def default_copy_threads() -> int:
  """A quarter of the CPU cores, at least 2 (where there are 2) and at most 8: on a
  host of few cores one thread left a snapshot at one core's copy speed (9.4 against
  11 GB/s with 2 threads on a 2-core host, 512 MiB)."""
  cores = os.cpu_count() or 1
  return max(min(2, cores), min(8, cores // 4))


def default_host_memory_limit_bytes() -> int:
  """Half of the free RAM and of the free space of /dev/shm, whichever is less."""
  free = psutil.virtual_memory().available
  if os.path.isdir("/dev/shm"):
    free = min(free, shutil.disk_usage("/dev/shm").free)
  return free // 2


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointOptions:
  """How a CheckpointManager snapshots and keeps state.

  Attributes:
    max_snapshots: committed host-memory snapshots kept (the newest is never
      dropped). Host memory holds ``max_snapshots + 1`` slots, and a slot more
      for each older step held for its persist while that persist runs (at
      most ``max_snapshots + 1`` more, as ``host_memory_limit_bytes`` and the
      run root allow; a WARNING says when they do not), so storage slower
      than the loop takes no snapshot from it.
    save_interval_steps: ``save(step)`` snapshots only steps divisible by this
      (``force=True`` overrides).
    on_busy: what ``save()`` does while the previous snapshot is still being
      copied: ``"skip"`` (return False and count the skip; never a run of saves: the
      two saves after a skipped one wait for the copy) or ``"wait"``.
    busy_timeout_secs: the longest ``on_busy="wait"`` waits.
    host_memory_limit_bytes: budget for all snapshot slots of this process;
      None means half of the free RAM and of free /dev/shm at start. With
      ``host_snapshots=False``, the staging buffer's size (None: 1 GiB).
    timeout_secs: the longest any internal wait (a background copy, a restore
      agreement) may take before a SnapshotTimeoutError names who was late.
    agent: keep snapshots in a per-host snapshot agent process (they survive a
      trainer crash); None keeps them in this process.
    persist_interval_steps: with a ``directory``, every snapshot whose step is
      a multiple of this is also written to storage in the universal format.
      None: the first snapshot, then as storage keeps up (a one-process job
      persists a snapshot whenever its previous persist has ended, its first
      too when its agent still persists an earlier trainer's steps, a job of
      several processes every m-th, m from the measured persist time:
      docs/planning.md), so snapshots between persists, the newest ones of a
      run included, stay in host memory only; ``save(step, force=True)``
      persists ``step``.
    max_to_keep: persisted steps kept on storage (None: all).
    parity: Reed-Solomon parity across the hosts' agents
      (``jaxckpt.ParityOptions``): after each committed snapshot the agents
      exchange parity among themselves, so a restore rebuilds up to
      ``parity.parity`` lost hosts per group; needs ``agent``. None: off.
    handle_sigterm: turn SIGTERM into a preemption notice that
      ``reached_preemption(step)`` reports, so the loop can take a last
      snapshot and exit cleanly. Installed only from the main thread, and only
      if no other handler owns SIGTERM: under ``jax.distributed`` JAX's
      preemption service does (installed in C), and reached_preemption is its
      agreed sync point, the same step on every process.
    sigterm_grace_secs: the longest the process lives after SIGTERM when its
      loop never asks ``reached_preemption``: it may ask until
      ``min(10 s, half of this)`` before the end; then the manager commits its
      newest snapshot and the process ends by SIGTERM's default action. The
      default, 25 s, fits inside the 30 s that Kubernetes, Slurm and GCE
      preemption give before SIGKILL; set it a few seconds under your
      scheduler's grace. A loop that asks in time owns the exit.
    host_snapshots: False is the storage-only mode, for states that do not
      fit in host memory twice: no snapshot is held in host memory; each
      ``save()`` due for storage stages the leaves a few at a time through one
      buffer of ``host_memory_limit_bytes`` (a larger leaf alone), writes them
      to ``directory`` and returns once the step is committed there (restores
      read storage). Needs a ``directory``; no ``agent`` or ``parity``.
    copy_threads: threads that copy and hash shards over 1 MiB into the
      snapshot slot in the background (numpy's copy and xxhash release the
      GIL); None: a quarter of the CPU cores, at least 2 (where there are 2) and
      at most 8, which leaves most cores to the training loop's input pipeline
      and dispatch.

  orbax's save-decision and retention fields, with orbax's names and meaning
  (``ocp.CheckpointManagerOptions``); a step is a *checkpoint* they rank once it
  is saved for storage (every ``persist_interval_steps``-th snapshot, or every
  saved step with ``persist_interval_steps=save_interval_steps``), and a step they
  drop is deleted from every tier (host, agent, parity, storage) once its persist
  has ended:

  Attributes:
    save_on_steps: steps saved (and persisted) besides those on the interval.
    should_save_fn: ``fn(step, latest_step) -> bool`` decides instead of the
      interval and ``save_on_steps``.
    save_decision_policy: an orbax ``SaveDecisionPolicy`` that decides instead.
    keep_period: steps divisible by it are kept whatever ``max_to_keep`` says.
    keep_time_interval: a ``datetime.timedelta``: one step per interval is kept.
    best_fn: ``fn(metrics) -> float``: ``max_to_keep`` keeps the best steps by
      the metrics given to ``save(metrics=...)``, and ``best_step()`` ranks by it.
    best_mode: ``"max"`` or ``"min"``: which of ``best_fn``'s values is best.
    keep_checkpoints_without_metrics: with ``best_fn``, steps saved without
      metrics are kept too.
    preservation_policy: an orbax ``PreservationPolicy`` that decides which
      steps are kept instead of ``max_to_keep``, ``keep_period``,
      ``keep_time_interval`` and ``best_fn``.

  >>> CheckpointOptions(max_snapshots=0)
  Traceback (most recent call last):
  ...
  jaxckpt.errors.InvalidArgumentError: CheckpointOptions.max_snapshots must be >= 1, got max_snapshots=0
  """

  max_snapshots: int = 2
  save_interval_steps: int = 1
  on_busy: str = "skip"
  busy_timeout_secs: float = 600.0
  host_memory_limit_bytes: int | None = None
  timeout_secs: float = 300.0
  agent: "AgentOptions | None" = None
  persist_interval_steps: int | None = None
  max_to_keep: int | None = None
  handle_sigterm: bool = True
  sigterm_grace_secs: float = 25.0
  parity: "ParityOptions | None" = None
  copy_threads: int | None = None
  host_snapshots: bool = True
  save_on_steps: Any = None
  should_save_fn: Any = None
  save_decision_policy: Any = None
  keep_period: int | None = None
  keep_time_interval: Any = None
  best_fn: Any = None
  best_mode: str = "max"
  keep_checkpoints_without_metrics: bool = True
  preservation_policy: Any = None

  def __post_init__(self) -> None:
    self._check_orbax_fields()
    _at_least(self, "max_snapshots", 1)
    if self.copy_threads is not None:
      _at_least(self, "copy_threads", 1)
    _at_least(self, "save_interval_steps", 1)
    if self.on_busy not in _ON_BUSY:
      raise errors.InvalidArgumentError(f"CheckpointOptions.on_busy must be one of {_ON_BUSY}, "
                       f"got on_busy={self.on_busy!r}")
    _positive(self, "busy_timeout_secs")
    _positive(self, "timeout_secs")
    _positive(self, "sigterm_grace_secs")
    if self.host_memory_limit_bytes is not None:
      _at_least(self, "host_memory_limit_bytes", 1)
    for name in ("persist_interval_steps", "max_to_keep"):
      if getattr(self, name) is not None:
        _at_least(self, name, 1)
    if not isinstance(self.host_snapshots, bool):
      raise errors.InvalidArgumentError(
          f"CheckpointOptions.host_snapshots must be True or False, got {self.host_snapshots!r}")
    if not self.host_snapshots and self.agent is not None:
      raise errors.InvalidArgumentError(
          "CheckpointOptions(host_snapshots=False) keeps no host snapshots, so it takes no "
          f"agent (got agent={self.agent!r}); set agent=None, or host_snapshots=True")
    if self.parity is not None:
      from jaxckpt.parity.placement import ParityOptions  # pylint: disable=import-outside-toplevel  (it loads numba, ~0.5 s: only with parity)
      if not isinstance(self.parity, ParityOptions):
        raise errors.InvalidArgumentError(f"CheckpointOptions.parity must be a jaxckpt.ParityOptions or None, "
                         f"got parity={self.parity!r}")
      if self.agent is None:
        raise errors.InvalidArgumentError(f"CheckpointOptions.parity={self.parity!r} needs agents (parity is "
                         "exchanged between the hosts' snapshot agents); set "
                         "agent=jaxckpt.AgentOptions(job_name=...) or parity=None")

  def _check_orbax_fields(self) -> None:
    if self.save_on_steps is not None:
      steps = list(self.save_on_steps)
      if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in steps):
        raise errors.InvalidArgumentError(
            f"CheckpointOptions.save_on_steps must be non-negative ints, got {self.save_on_steps!r}")
      object.__setattr__(self, "save_on_steps", frozenset(int(s) for s in steps))
    for name in ("should_save_fn", "best_fn"):
      if getattr(self, name) is not None and not callable(getattr(self, name)):
        raise errors.InvalidArgumentError(
            f"CheckpointOptions.{name} must be a function, got {name}={getattr(self, name)!r}")
    if self.keep_period is not None:
      _at_least(self, "keep_period", 1)
    if self.keep_time_interval is not None and not isinstance(self.keep_time_interval,
                                                              datetime.timedelta):
      raise errors.InvalidArgumentError(
          "CheckpointOptions.keep_time_interval must be a datetime.timedelta, got "
          f"keep_time_interval={self.keep_time_interval!r}")
    if self.best_mode not in ("max", "min"):
      raise errors.InvalidArgumentError(
          f"CheckpointOptions.best_mode must be 'max' or 'min', got best_mode={self.best_mode!r}")
    if self.preservation_policy is not None and any(
        x is not None for x in (self.max_to_keep, self.keep_period, self.keep_time_interval)):
      raise errors.InvalidArgumentError(
          "CheckpointOptions: preservation_policy decides which steps are kept, so "
          "max_to_keep, keep_period and keep_time_interval must be None beside it (as orbax's)")
    if self.save_decision_policy is not None and self.should_save_fn is not None:
      raise errors.InvalidArgumentError(
          "CheckpointOptions: save_decision_policy and should_save_fn both decide which steps "
          "are saved; pass one")

  def check_directory(self, directory: str | None) -> None:
    """Raises InvalidArgumentError if these options need a ``directory`` and there is none."""
    if directory is not None:
      return
    given = ", ".join(f"{n}={getattr(self, n)!r}" for n in (
        "persist_interval_steps", "max_to_keep", "keep_period", "keep_time_interval",
        "preservation_policy") if getattr(self, n) is not None)
    if given:
      raise errors.InvalidArgumentError(
          f"CheckpointOptions({given}) says how to keep steps on storage, but the manager has "
          "no directory, so nothing would ever be persisted: pass CheckpointManager("
          "'/path/or/s3://bucket/run', options), or leave them None for host snapshots only")
    if not self.host_snapshots:
      raise errors.InvalidArgumentError(
          "CheckpointOptions(host_snapshots=False) writes every save straight to storage, so "
          "the manager needs a directory: CheckpointManager('/path/or/s3://bucket/run', options)")


def _at_least(obj: object, name: str, lo: int) -> None:
  v = getattr(obj, name)
  if not isinstance(v, int) or isinstance(v, bool) or v < lo:
    raise errors.InvalidArgumentError(f"{type(obj).__name__}.{name} must be >= {lo}, got {name}={v!r}")


def _positive(obj: object, name: str) -> None:
  v = getattr(obj, name)
  if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
    raise errors.InvalidArgumentError(f"{type(obj).__name__}.{name} must be > 0, got {name}={v!r}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AgentOptions:
  """Keep host snapshots in a per-host snapshot agent process.

  The agent outlives the trainer, so a crashed or killed trainer restarts and
  restores from host memory. A restarted trainer finds its agent again by
  ``job_name`` and host.

  Attributes:
    job_name: names the job; agents and their shared memory are per job and host.
    host_id: this process's host index; None means ``jax.process_index()``.
    run_root: this host's directory for its agents' files: slot files, logs,
      the job's secret (default /dev/shm/jaxckpt-UID, created 0700). Each
      host's run root is private to it: hosts find each other's agents through
      the job (``jax.distributed``'s key-value store), never through a shared
      directory, so on a cluster leave it at each machine's own default (or a
      local tmpfs path), not a network filesystem.
    spawn: start the agent if none is running (False: a sidecar must be up).
    idle_timeout_secs: the agent exits this long after its last trainer died.
    request_timeout_secs: the longest wait for one agent reply.
    start_timeout_secs: the longest wait for a new agent to come up.
    tcp_host: the address the agent serves other hosts on (restores that read
      another host's pieces, parity exchange, replica-group catch-up). The
      loopback default suits one machine; on a cluster use this host's
      routable address.
    secret: the job's secret, which every request to its agents must prove
      (an HMAC). None: ``$JAXCKPT_JOB_SECRET``, else the 0600 file
      ``RUN_ROOT/JOB/secret`` made at the job's first start; under
      ``jax.distributed`` process 0's secret is handed to every process.
  """

  job_name: str
  host_id: int | None = None
  run_root: str | None = None
  spawn: bool = True
  idle_timeout_secs: float = 3600.0
  request_timeout_secs: float = 60.0
  start_timeout_secs: float = 60.0
  tcp_host: str = "127.0.0.1"
  secret: str | None = dataclasses.field(default=None, repr=False)

  def __post_init__(self) -> None:
    check_job_name(self.job_name)
    if self.host_id is not None:
      _at_least(self, "host_id", 0)
    for name in ("idle_timeout_secs", "request_timeout_secs", "start_timeout_secs"):
      _positive(self, name)
    if self.secret is not None and (not isinstance(self.secret, str) or len(self.secret) < 16):
      raise errors.InvalidArgumentError(
          "AgentOptions.secret must be a string of at least 16 characters (e.g. "
          "secrets.token_hex(32)), or None")

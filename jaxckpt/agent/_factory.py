"""The host store a manager's options ask for: in-process, or this host's snapshot agent."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid

import jax
import psutil

from jaxckpt import universal
from jaxckpt.agent import _parity_config, _paths
from jaxckpt.agent.client import AgentStore
from jaxckpt.host import _persist
from jaxckpt.host.store import HostStore, InProcessStore
from jaxckpt.net import _kv, _wire
from jaxckpt.options import CheckpointOptions, default_host_memory_limit_bytes

logger = logging.getLogger(__name__)


def open_store(options: CheckpointOptions, persist: _persist.PersistConfig | None, *,
               store: HostStore | None, run_id: str | None, run: str) -> HostStore:
  """The manager's store: ``store`` if given (told to persist as ``persist`` says), else
  the one ``options`` ask for, for the run ``run``; in a job of several processes with
  agents, the job's other agents found and the persists a lost agent held rebuilt."""
  if store is not None:
    if persist is not None:
      store.persist_to(persist)        # every store persists what it holds
    return store
  store = make_store(options, persist, run)
  if options.agent is not None and jax.process_count() > 1:
    store.discover(timeout_secs=options.timeout_secs)
    store.recover_persists(jax.process_index(), run_id=run_id)
  return store


def make_store(options: CheckpointOptions, persist: _persist.PersistConfig | None,
               run: str | None = None) -> HostStore:
  """The store ``options`` ask for, persisting as ``persist`` says (None: never), for
  the run ``run`` (its directory: an agent frees another run's snapshots).

  With agents under ``jax.distributed``, the job's secret is the one its hosts
  hold (it survives a lost host, process 0's too), else a new one of process 0
  (each host's run root is private), and parity's codec is loaded before anything else
  needs it (a rebuild after a restart must not wait for numba).
  """
  limit = options.host_memory_limit_bytes or default_host_memory_limit_bytes()
  a = options.agent
  _check_room(limit, None if a is None else a.run_root or _paths.default_run_root())
  if a is None:
    return InProcessStore(max_snapshots=options.max_snapshots,
                          host_memory_limit_bytes=limit, persist=persist, storage=universal)
  p = options.parity
  if p is not None:
    from jaxckpt.parity import codec, placement  # pylint: disable=import-outside-toplevel  (numba, ~0.5 s: only with parity)
    if a.host_id is None:                                     # hosts = this job's processes
      placement.check_hosts(jax.process_count(), p)
    codec.warm_up(p.group_size - p.parity, p.parity)
  host = jax.process_index() if a.host_id is None else a.host_id
  secret = None
  if jax.process_count() > 1 and a.secret is None and not os.environ.get(_paths.SECRET_ENV):
    root = a.run_root or _paths.default_run_root()
    secret = _kv.agree_kept("agent_secret", _paths.held_secret(root, a.job_name),
                            _wire.new_secret, timeout_secs=options.timeout_secs)
  parity = None if p is None else _parity_config.ParityConfig(p.group_size, p.parity,
                                                       options.timeout_secs).to_obj()
  return AgentStore(a, host=host, max_snapshots=options.max_snapshots, limit_bytes=limit,
                    persist=None if persist is None else persist.to_obj(), parity=parity,
                    secret=secret, owner=_owner_name(), run=run)


def _owner_name() -> str:
  """What names a manager to its agent (the lease holder a second manager is told of)."""
  return (f"the CheckpointManager {uuid.uuid4().hex[:8]} of pid {os.getpid()} (thread "
          f"{threading.current_thread().name!r}, made at {time.strftime('%H:%M:%S')})")


def _check_room(limit: int, run_root: str | None) -> None:
  """Says at start (once a first save would fail) when the host-memory budget is more
  than the memory the snapshots may take: free RAM, and the run root's free space
  for an agent's shared memory. The first save of a state that does not fit is
  refused, before the loop gets further."""
  free = psutil.virtual_memory().available
  where = "free RAM"
  if run_root is not None and os.path.isdir(run_root):
    shm = shutil.disk_usage(run_root).free
    if shm < free:
      free, where = shm, f"free space of the run root {run_root}"
  if limit > free:
    logger.warning(
        "host_memory_limit_bytes=%d (%.1f MiB) is more than the %s (%.1f MiB): snapshots "
        "larger than that fail at their first save; lower the limit, or give the run root "
        "more memory", limit, limit / 2**20, where, free / 2**20)


def persistence(directory: str | None, options: CheckpointOptions, *, writes: bool = True,
                create: bool = True) -> tuple[_persist.PersistConfig | None, str | None]:
  """Where and how this job persists, and its run id (the same on every process): None
  without a directory or when nothing may be written (``writes=False``: orbax's
  ``read_only``). A local directory is created and probed unless ``create`` is False
  and it does not exist (orbax's ``create``: a save then fails, naming it)."""
  options.check_directory(directory)
  if directory is None or not writes:
    return None, None
  if create or os.path.isdir(directory) or "://" in directory:
    universal.check_directory(directory, timeout_secs=options.timeout_secs)
  config = _persist.PersistConfig(   # (retention is the trainer's keep policy: no gc here)
      directory, options.persist_interval_steps or options.save_interval_steps,
      None, options.timeout_secs, hold_until_committed=options.parity is not None)
  return config, agree_run_id(options.timeout_secs)


def agree_run_id(timeout_secs: float) -> str:
  """A run id that every process of the job gets alike (process 0 picks it)."""
  if jax.process_count() == 1:
    return _persist.new_run_id()
  return _kv.broadcast_from_0("run_id", _persist.new_run_id, timeout_secs=timeout_secs)


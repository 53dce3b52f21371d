"""The host store a manager's options ask for: in-process, or this host's snapshot agent."""

from __future__ import annotations

import json
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
from jaxckpt.agent.trainer._remote import job_agents
from jaxckpt.agent.trainer.client import AgentStore
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
  root = a.run_root or _paths.default_run_root()
  host = a.host_id
  if jax.process_count() > 1:
    host = agent_hosts(root, a.job_name, a.host_id, timeout_secs=options.timeout_secs)
  elif host is None:
    host = jax.process_index()
  secret = None
  if jax.process_count() > 1 and a.secret is None and not os.environ.get(_paths.SECRET_ENV):
    secret = _kv.agree_kept("agent_secret", _paths.held_secret(root, a.job_name),
                            _wire.new_secret, timeout_secs=options.timeout_secs)
  parity = None if p is None else _parity_config.ParityConfig(p.group_size, p.parity,
                                                       options.timeout_secs).to_obj()
  return AgentStore(a, host=host, max_snapshots=options.max_snapshots, limit_bytes=limit,
                    persist=None if persist is None else persist.to_obj(), parity=parity,
                    secret=secret, owner=_owner_name(), process=jax.process_index(),
                    run=run)


def agent_hosts(run_root: str, job: str, host_id: int | None, *, timeout_secs: float) -> int:
  """The host id of the agent this process of a job uses (its directory under the run
  root), agreed by the job's processes through jax.distributed's key-value store.

  Each says which live agents of the job its run root holds. A process keeps the one
  named for its index (or ``host_id``, when set); one with none keeps its machine's
  agent of an earlier run of the job, whatever index it served, when that agent is
  the only one on its machine no other process sees (a relaunch on another number of
  processes, or in another order: the machine's snapshots serve the restore, and no
  second agent takes its memory); else its own index names a new agent.
  """
  here = [[h, info["tcp"]] for h, info in sorted(job_agents(run_root, job).items())]
  said = [json.loads(v) for v in _kv.allgather(
      f"agents_here/{job}", json.dumps({"fixed": host_id, "here": here}),
      timeout_secs=timeout_secs, what="the snapshot agents on their machines")]
  chosen = choose_agents(said)
  me = jax.process_index()
  if chosen[me] != (me if host_id is None else host_id):
    logger.warning("process %d of %d keeps this machine's snapshot agent of job %r (host %d, "
                   "from an earlier run of the job): the snapshots it holds serve this run",
                   me, len(said), job, chosen[me])
  return chosen[me]


def choose_agents(said: list[dict]) -> list[int]:
  """Each process's agent host id from what every process said of its machine
  (``{"fixed": host_id or None, "here": [[host, tcp], ...]}``, in process order): see
  :func:`agent_hosts`.

  >>> choose_agents([{"fixed": None, "here": [[2, "a"]]}, {"fixed": None, "here": []},
  ...                {"fixed": None, "here": [[0, "b"]]}])
  [2, 1, 0]
  """
  seen: dict[str, int] = {}                 # tcp -> how many processes' machines hold it
  for s in said:
    for _, tcp in s["here"]:
      seen[tcp] = seen.get(tcp, 0) + 1
  chosen: list[int | None] = [None] * len(said)
  taken: set[str] = set()
  for p, s in enumerate(said):              # the agent named for the process (as before)
    want = p if s["fixed"] is None else s["fixed"]
    tcp = next((t for h, t in s["here"] if h == want), None)
    if s["fixed"] is not None or tcp is not None:
      chosen[p] = want
      taken.add(tcp)
  for p, s in enumerate(said):              # the only agent of the job on its machine
    if chosen[p] is None:
      mine = [(h, t) for h, t in s["here"] if seen[t] == 1 and t not in taken]
      if len(mine) == 1 and len(s["here"]) == 1:
        chosen[p], _ = mine[0]
        taken.add(mine[0][1])
  return [p if h is None else h for p, h in enumerate(chosen)]


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


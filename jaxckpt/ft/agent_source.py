"""A :class:`~jaxckpt.ft.catch_up.SnapshotSource` backed by a replica group's snapshot agents.

A healthy group snapshots every step into its own agents (``CheckpointManager``
with ``AgentOptions(job_name=...)``). A recovering group reads the newest
complete step straight from those agent processes over their tcp endpoints, so
the healthy group's trainers never pause to serve it: they only answer the
small ``snap_where`` / ``digest`` / ``ring_get`` requests on their serving
thread. Each step being read is pinned in its agent (``open``/``close``) so the
agent cannot recycle its slot mid-read; a reader that dies leaves no pin (the
agent forgets the pins of dead processes).

>>> src = AgentSnapshotSource(run_root="/dev/shm/jaxckpt-1000", job_name="run7-g0")  # doctest: +SKIP
>>> step = src.latest_step()                                                            # doctest: +SKIP
>>> leaves = src.fetch(step)          # {keystr path: numpy array / scalar / key}        # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterator

from jaxckpt import errors
from jaxckpt.agent import _paths
from jaxckpt.agent.trainer._remote import complete_steps_of, job_clients, open_remote_piece
from jaxckpt.ft.catch_up import HostLeaves
from jaxckpt.restore import _read

logger = logging.getLogger(__name__)


class AgentSnapshotSource:
  """Snapshots of one job (one replica group) held by its agents under ``run_root``.

  Args:
    run_root: the agents' directory (None: the default, /dev/shm/jaxckpt-UID).
    job_name: the group's agent job name.
    timeout_secs: the longest wait for one agent reply.
  """

  def __init__(self, *, run_root: str | None, job_name: str, timeout_secs: float = 30.0):
    if timeout_secs <= 0:
      raise errors.InvalidArgumentError(f"AgentSnapshotSource timeout_secs must be > 0, got {timeout_secs!r}")
    self.run_root = run_root or _paths.default_run_root()
    self.job_name = _paths.check_job_name(job_name)
    self.timeout_secs = timeout_secs

  def locator(self) -> dict[str, str]:
    """What a peer needs to build this source: ``AgentSnapshotSource(**locator)``."""
    return {"run_root": self.run_root, "job_name": self.job_name}

  def latest_step(self) -> int | None:
    """The newest step every saving process of which some live agent holds."""
    with self._clients() as clients:
      return max(complete_steps_of(clients), default=None)

  def fetch(self, step: int) -> HostLeaves:
    """Every leaf of ``step`` read from the agents (checksum-verified), by tree path."""
    t0 = time.monotonic()
    with self._clients() as clients, contextlib.ExitStack() as pins:
      pieces: dict[int, Any] = {}
      count = None
      for c in clients.values():
        piece = open_remote_piece(c, step, pins)
        if piece is None or piece.manifest.process_index in pieces:
          continue
        pieces[piece.manifest.process_index] = piece
        count = piece.manifest.process_count
      missing = sorted(set(range(count or 1)) - set(pieces))
      if missing:
        raise KeyError(f"step {step} of job {self.job_name!r}: no live agent under {self.run_root} "
                       f"holds the snapshots of saving processes {missing}")
      source = _read.HostSource([pieces[i] for i in sorted(pieces)])
      leaves = _read.restore_tree(source, None)
      nbytes = source.bytes_read
    logger.info("fetched the snapshot of step %d from the snapshot agent(s) of job %r "
                "(%d bytes over tcp in %.3fs)", step, self.job_name, nbytes, time.monotonic() - t0,
                extra={"step": step})
    return leaves

  @contextlib.contextmanager
  def _clients(self) -> Iterator[dict[int, Any]]:
    with job_clients(self.run_root, self.job_name, timeout_secs=self.timeout_secs) as clients:
      if not clients:
        raise KeyError(f"no live snapshot agent of job {self.job_name!r} under {self.run_root}")
      yield clients

"""Where an agent's files live: one directory per (job, host) under a run root.

Everything an agent owns (its shared-memory slot files, its ipc socket, its
address file, its log) lives in that directory, on tmpfs when /dev/shm exists,
so ``jaxckpt agent stop`` frees all of it by removing one directory.
"""

from __future__ import annotations

import os
import re
import tempfile

from jaxckpt import errors

_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def default_run_root() -> str:
  base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
  return os.path.join(base, f"jaxckpt-{os.getuid()}")


def check_job_name(job: str) -> str:
  if not isinstance(job, str) or not _JOB_RE.match(job):
    raise errors.InvalidArgumentError(f"job_name={job!r} must be 1-64 characters of letters, digits, "
                     "'.', '_' or '-', starting with a letter or digit")
  return job


def agent_dir(run_root: str, job: str, host: int) -> str:
  return os.path.join(run_root, check_job_name(job), f"host{host}")


def address_file(d: str) -> str:
  return os.path.join(d, "agent.json")


def ipc_endpoint(d: str) -> str:
  return "ipc://" + os.path.join(d, "agent.sock")


def slot_file(d: str, index: int) -> str:
  return os.path.join(d, f"slot{index}.bin")

"""Where an agent's files live: one directory per (job, host) under a run root.

Everything an agent owns (its shared-memory slot files, its ipc socket, its
address file, its log) lives in that directory, on tmpfs when /dev/shm exists,
so ``jaxckpt agent stop`` frees all of it by removing one directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import stat
import tempfile
from typing import Any

import psutil

from jaxckpt import errors
from jaxckpt.net import _wire
from jaxckpt.util._text import shown
from jaxckpt.options import check_job_name  # noqa: F401  (also this module's name)


def default_run_root() -> str:
  base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
  return os.path.join(base, f"jaxckpt-{os.getuid()}")


def agent_dir(run_root: str, job: str, host: int) -> str:
  return os.path.join(run_root, check_job_name(job), f"host{host}")


def address_file(d: str) -> str:
  return os.path.join(d, "agent.json")


def read_address(d: str) -> dict[str, Any] | None:
  """The address record of the live agent whose directory is ``d`` (None: none runs)."""
  try:
    with open(address_file(d)) as f:
      info = json.load(f)
  except (OSError, ValueError):
    return None
  return info if pid_alive(info.get("pid", -1)) else None


def pid_alive(pid: int) -> bool:
  """True if ``pid`` runs (a zombie, killed but not yet reaped, is dead)."""
  try:
    return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
  except (psutil.NoSuchProcess, ValueError):
    return False


def ipc_endpoint(d: str) -> str:
  return "ipc://" + os.path.join(d, "agent.sock")


def log_file(d: str) -> str:
  """The agent's log: beside its directory in the job's private (0700) directory;
  a clean exit removes it, a failed start leaves it for the error message."""
  return d + ".log"


def slot_file(d: str, index: int, gen: int) -> str:
  """Slot ``index``'s file of generation ``gen`` (each reallocation is a new file)."""
  return os.path.join(d, f"slot{index}.{gen}.bin")


SECRET_ENV = _wire.SECRET_ENV


def secure_dir(path: str) -> str:
  """Creates ``path`` (and missing parents) 0700, or checks an existing one is safe:
  owned by this user and writable by no one else. Refuses anything else."""
  os.makedirs(path, mode=0o700, exist_ok=True)
  st = os.stat(path)
  if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
    raise errors.PermissionDeniedError(
        f"{path} is owned by uid {st.st_uid} with mode {oct(st.st_mode & 0o777)}; jaxckpt "
        f"keeps snapshots and the job's secret there, so it must be owned by you (uid "
        f"{os.getuid()}) and writable by no one else: `chmod 700 {path}` (if it is yours), "
        "or set AgentOptions(run_root=...) to a directory of your own")
  return path


def job_dir(run_root: str, job: str) -> str:
  return os.path.join(run_root, check_job_name(job))


def job_secret(run_root: str, job: str, given: str | bytes | None = None) -> bytes:
  """The job's secret: ``given`` (or $JAXCKPT_JOB_SECRET), else the 0600 file
  ``RUN_ROOT/JOB/secret``, created at the job's first start.

  A given secret is written to the file when there is none there yet, and must
  match it when there is (one secret per job: every agent and client of it).
  """
  secure_dir(run_root)
  d = secure_dir(job_dir(run_root, job))
  path = os.path.join(d, "secret")
  given = _wire.normalize_secret(given or os.environ.get(SECRET_ENV) or None)
  if not os.path.exists(path):            # first start: publish it whole, atomically
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
      f.write(given.decode() if given else secrets.token_hex(32))
    try:
      os.link(tmp, path)                    # fails if another process published first
    except FileExistsError:
      pass
    finally:
      os.unlink(tmp)
  try:     # never through a link, never blocked on a FIFO planted in its place
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
  except OSError as e:
    raise errors.PermissionDeniedError(
        f"the job secret {path} cannot be opened as a plain file ({e.strerror}): remove it "
        "(stop the job's agents first)") from None
  st = os.fstat(fd)
  if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
    os.close(fd)
    raise errors.PermissionDeniedError(
        f"the job secret {path} is {'a plain file' if stat.S_ISREG(st.st_mode) else 'not a plain file'} "
        f"of mode {oct(st.st_mode & 0o777)} and owner uid {st.st_uid}; it must be a plain "
        "file, yours and 0600: remove it (stop the job's agents first)")
  with os.fdopen(fd, "rb") as f:
    raw = f.read(1 << 20)
  try:
    have = _wire.normalize_secret(raw.decode())
  except (UnicodeDecodeError, ValueError, errors.JaxckptError) as e:
    raise errors.PermissionDeniedError(
        f"the job secret {path} is not one jaxckpt wrote ({shown(str(e))}): remove it (stop "
        "the job's agents first)") from None
  if have is None:
    raise errors.PermissionDeniedError(
        f"the job secret {path} is empty; remove it (stop the job's agents first)")
  if given is not None and given != have:
    raise errors.PermissionDeniedError(
        f"the secret given for job {job!r} differs from the one in {path}; the job's "
        "agents use that one: give the same secret to every process, or stop the agents "
        "and remove the file")
  return have


def release_job_dir(run_root: str, job: str) -> None:
  """Removes the job's directory (and its secret) once nothing else is left in it: the
  last of the job's processes on this run root to go calls it."""
  d = job_dir(run_root, job)
  with contextlib.suppress(OSError):
    if set(os.listdir(d)) <= {"secret"}:
      with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(d, "secret"))
      os.rmdir(d)


def held_secret(run_root: str, job: str) -> str | None:
  """The job's secret this run root holds (None: none yet), checked as
  :func:`job_secret` checks it."""
  if not os.path.exists(os.path.join(job_dir(run_root, job), "secret")):
    return None
  return job_secret(run_root, job).decode()


def file_size(path: str) -> int:
  try:
    return os.path.getsize(path)
  except OSError:
    return 0


def inode(path: str) -> int | None:
  """``path``'s inode (None if it is gone)."""
  try:
    return os.stat(path).st_ino
  except OSError:
    return None


def allocate(path: str, nbytes: int, *, host: int) -> None:
  """Sizes a slot file to ``nbytes`` with memory that exists now (not a sparse file:
  a full /dev/shm would kill the trainer writing through its map with SIGBUS)."""
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
  old = os.fstat(fd).st_size
  try:
    os.fchmod(fd, 0o600)
    os.posix_fallocate(fd, 0, nbytes)
  except OSError as e:
    os.ftruncate(fd, old)                     # give back what was taken
    where = os.path.dirname(path)
    free = shutil.disk_usage(where).free
    raise errors.HostMemoryBudgetError(
        f"host {host}: cannot reserve a {nbytes / 2**20:.1f} MiB snapshot slot in {where} "
        f"({e.strerror}; {free / 2**20:.1f} MiB free there); free shared memory, lower "
        "max_snapshots, or point AgentOptions.run_root at a larger filesystem") from None
  finally:
    os.close(fd)

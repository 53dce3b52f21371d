"""Shipped test helpers: run trainer processes and agents, and always clean up.

Only processes started here are ever killed, by pid. Each helper has a hard
timeout that names the process that was late.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
import uuid
from typing import Any, Iterator


from jaxckpt.agent import _paths
from jaxckpt.agent._paths import pid_alive
from jaxckpt.agent._protocol import Client
from jaxckpt.agent.trainer.client import wait_exited


def free_port() -> int:
  """A loopback TCP port that was free a moment ago."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def add_job_arguments(parser: Any) -> None:
  """A test job's worker process arguments: ``--port`` (jax.distributed's coordinator,
  on loopback unless ``--coordinator`` names process 0's address), ``--num-processes``
  and ``--process-id``."""
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--coordinator", default="127.0.0.1")
  parser.add_argument("--heartbeat-timeout-secs", type=int, default=100)
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--process-id", type=int, required=True)


def add_machine_arguments(parser: Any) -> None:
  """A test job's worker process's machine: ``--run-root`` (its agents' directory, of
  this machine alone), ``--tcp-host`` (its loopback address), ``--job`` and
  ``--directory`` (storage; empty: none)."""
  parser.add_argument("--run-root", required=True)
  parser.add_argument("--tcp-host", required=True)
  parser.add_argument("--job", required=True)
  parser.add_argument("--directory", default="")


def join_job(args: Any, *, devices: int = 2, timeout_secs: int = 120) -> None:
  """Gives this process ``devices`` CPU devices and joins the job of ``args``
  (:func:`add_job_arguments`) through jax.distributed."""
  import jax  # pylint: disable=import-outside-toplevel  (after the caller's own setup)
  jax.config.update("jax_num_cpu_devices", devices)
  jax.distributed.initialize(coordinator_address=f"{getattr(args, 'coordinator', '127.0.0.1')}:{args.port}",
                             num_processes=args.num_processes, process_id=args.process_id,
                             initialization_timeout=timeout_secs,
                             heartbeat_timeout_seconds=getattr(args, "heartbeat_timeout_secs", 100))


def barrier(name: str) -> None:
  """Waits until every process of the job has reached ``name``."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel  (after join_job)
  multihost_utils.sync_global_devices(name)


def differs(out: dict[str, Any], want: dict[str, Any], data: Any) -> str:
  """"ok" if every array leaf ``k`` of ``out`` holds ``want[k]`` bit for bit in each
  shard this process has, and ``out["data"] == data``; else what differs first."""
  import numpy as np  # pylint: disable=import-outside-toplevel  (a test helper's own)
  for k, v in want.items():
    for s in out[k].addressable_shards:
      if np.asarray(s.data).tobytes() != v[s.index].tobytes():
        return f"BAD:{k}{s.index}"
  return "ok" if out["data"] == data else f"BAD:data={out['data']}"


def run_job(args: Any, body: Any, *, devices: int = 2) -> None:
  """A test job's worker process: joins the job of ``args`` (:func:`join_job`), runs
  ``body()``, prints ``DONE`` and exits 0; on any error prints ``ERROR type: message``
  and its traceback and exits 3, at once (``os._exit``: nothing left of a failed job
  may hang the process)."""
  try:
    join_job(args, devices=devices)
    import jax  # pylint: disable=import-outside-toplevel  (after join_job)
    body()
    print("DONE", flush=True)
    jax.distributed.shutdown()
  except BaseException as e:  # pylint: disable=broad-except  (said, then a hard exit)
    print(f"ERROR {type(e).__name__}: {e}".replace("\n", " | "), flush=True)
    traceback.print_exc(file=sys.stdout)
    sys.stdout.flush()
    os._exit(3)
  sys.stdout.flush()
  os._exit(0)


@contextlib.contextmanager
def agent_sandbox(prefix: str = "jt") -> Iterator[tuple[str, str]]:
  """A fresh (run_root, job_name); on exit, every agent under it is killed by
  pid and its shared memory removed, even if the test failed."""
  base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
  root = os.path.join(base, f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
  job = "job" + uuid.uuid4().hex[:6]
  os.makedirs(root)
  try:
    yield root, job
  finally:
    for pid in agent_pids(root):
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(root, ignore_errors=True)


def agent_address(root: str, job: str, host: int = 0) -> dict[str, Any]:
  """The address record of job ``job``'s agent of ``host`` under run root ``root``."""
  with open(_paths.address_file(_paths.agent_dir(root, job, host))) as f:
    return json.load(f)


@contextlib.contextmanager
def agent_client(root: str, job: str, *, who: str, host: int = 0, tcp: bool = True,
                 timeout_secs: float = 20) -> Iterator[Client]:
  """A client of that agent with the job's secret, over tcp (as another machine reaches
  it) or its local socket; closed on exit."""
  info, secret = agent_address(root, job, host), _paths.job_secret(root, job)
  client = (Client.of(info, who=who, timeout_secs=timeout_secs, secret=secret) if tcp
            else Client(info["ipc"], who=who, timeout_secs=timeout_secs, secret=secret))
  try:
    yield client
  finally:
    client.close()


def agent_pids(root: str) -> list[int]:
  """Pids of the agents whose address files lie under ``root``."""
  pids = []
  for dirpath, _, files in os.walk(root):
    if "agent.json" in files:
      with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(dirpath, "agent.json")) as f:
          pids.append(int(json.load(f)["pid"]))
  return [p for p in pids if pid_alive(p)]


def wait_gone(pid: int, timeout_secs: float, what: str) -> None:
  if not wait_exited(pid, timeout_secs):
    raise TimeoutError(f"{what} (pid {pid}) still running after {timeout_secs} s")


class Proc:
  """A child process with its output captured line by line, killed on exit."""

  def __init__(self, args: list[str], *, env: dict[str, str] | None = None,
               cwd: str | None = None, stdin: bool = False,
               popen: Any = subprocess.Popen) -> None:
    """``python ARGS`` started by ``popen`` (``subprocess.Popen``'s signature; e.g. a
    network namespace's ``Host.popen``, so the process runs on that host)."""
    self.p = popen([sys.executable, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=cwd,
                              stdin=subprocess.PIPE if stdin else None,
                              env={**os.environ, **(env or {})})
    self.lines: list[str] = []

  def send(self, line: str) -> None:
    """Writes ``line`` to the child's stdin (made with ``stdin=True``)."""
    self.p.stdin.write(line + "\n")
    self.p.stdin.flush()

  def wait_for(self, needle: str, timeout_secs: float) -> str:
    """Reads output until a line contains ``needle``; returns that line."""
    deadline = time.monotonic() + timeout_secs
    while time.monotonic() < deadline:
      line = self.p.stdout.readline()
      if not line:
        break
      self.lines.append(line)
      if needle in line:
        return line
    raise TimeoutError(f"pid {self.p.pid} did not print {needle!r} within {timeout_secs} s "
                       f"(exit code {self.p.poll()}); last output:\n{''.join(self.lines[-30:])}")

  def finish(self, timeout_secs: float) -> str:
    try:
      out, _ = self.p.communicate(timeout=timeout_secs)
    except subprocess.TimeoutExpired:
      self.kill()
      raise TimeoutError(f"pid {self.p.pid} did not finish within {timeout_secs} s; output:\n"
                         f"{''.join(self.lines[-30:])}") from None
    self.lines.append(out)
    if self.p.returncode != 0:
      raise RuntimeError(f"pid {self.p.pid} exited with {self.p.returncode}:\n"
                         f"{''.join(self.lines)[-4000:]}")
    return "".join(self.lines)

  def kill(self) -> None:
    if self.p.poll() is None:
      self.p.kill()
      self.p.wait(timeout=30)

  def __enter__(self) -> "Proc":
    return self

  def __exit__(self, *exc) -> None:
    self.kill()
    for f in (self.p.stdout, self.p.stdin):
      if f:
        with contextlib.suppress(OSError):
          f.close()


@contextlib.contextmanager
def tmpfs(path: str, options: str) -> Iterator[str]:
  """A small tmpfs mounted at ``path`` (e.g. ``"size=8m,mode=0700"`` or ``"ro,size=1m"``),
  unmounted on exit; skips the test with the reason where mounting is not permitted."""
  import pytest  # pylint: disable=import-outside-toplevel  (a test helper; pytest is there)
  os.makedirs(path, exist_ok=True)
  r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                     capture_output=True, text=True, check=False)
  if r.returncode:
    pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); needs root")
  try:
    yield str(path)
  finally:
    subprocess.run(["umount", "-l", str(path)], check=False)

"""A pytest plugin: the snapshot agents a test session started are stopped when it ends,
however it ends (its tests passed or failed, Ctrl-C, SIGTERM from ``timeout`` or CI).

The session marks every process it starts: ``JAXCKPT_TEST_SESSION`` in its environment
(a fresh value per session), which subprocesses and the agents they spawn inherit. When
the session ends, each agent of this user whose environment carries the session's value
(and only those: never another session's or another user's) gets SIGTERM (it frees its
shared memory and exits), then SIGKILL if it is still there after ``STOP_SECS``, and its
files are removed. SIGTERM to the session (and SIGHUP) is turned into an interrupt, so
that fixtures' teardowns and this run as they do on Ctrl-C.

The repository's conftest.py loads it; another suite adds ``-p jaxckpt.testing.pytest_agents``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
import uuid
from typing import Any

import psutil

from jaxckpt.util._text import counted

ENV = "JAXCKPT_TEST_SESSION"
STOP_SECS = 15.0

_state: dict[str, Any] = {}


def _interrupted(signum: int, frame: Any) -> None:
  del frame
  raise KeyboardInterrupt(f"{signal.Signals(signum).name}: the test session ends")


def pytest_configure(config: Any) -> None:
  del config
  _state["previous"] = os.environ.get(ENV)
  worker = os.environ.get("PYTEST_XDIST_WORKER")
  token = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
  if worker and _state["previous"]:      # a pytest-xdist worker: within its controller's session,
    token = f"{_state['previous']}/{worker}-{token}"   # which stops its agents too
  _state["token"] = os.environ[ENV] = token
  if threading.current_thread() is threading.main_thread():
    for sig in (signal.SIGTERM, signal.SIGHUP):
      if signal.getsignal(sig) in (signal.SIG_DFL, None):
        _state.setdefault("handlers", {})[sig] = signal.signal(sig, _interrupted)


def pytest_unconfigure(config: Any) -> None:
  del config
  token = _state.pop("token", None)
  if token is None:
    return
  try:
    stopped, killed = stop_agents(token)
    if stopped or killed:
      n = counted(len(stopped) + len(killed), "snapshot agent")
      sys.stderr.write(f"\njaxckpt: stopped {n} this test session left running (pids "
                       f"{sorted(stopped + killed)}; {len(killed)} needed SIGKILL)\n")
  finally:
    for sig, old in _state.pop("handlers", {}).items():
      signal.signal(sig, old)
    if _state.get("previous") is None:
      os.environ.pop(ENV, None)
    else:
      os.environ[ENV] = _state["previous"]


def session_agents(token: str) -> list[tuple[psutil.Process, Any]]:
  """This user's agent processes (with what they serve) started under session ``token``
  (or one of its pytest-xdist workers' sessions)."""
  from jaxckpt.agent.commands import jobs  # pylint: disable=import-outside-toplevel  (when needed only)
  out = []
  for proc in psutil.process_iter(["uids"]):
    try:
      if proc.info["uids"] is None or proc.info["uids"].real != os.getuid():
        continue
      agent = jobs.agent_of(proc)
      mark = proc.environ().get(ENV) if agent is not None else None
      if mark is not None and (mark == token or mark.startswith(token + "/")):
        out.append((proc, agent))
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
      continue
  return out


def stop_agents(token: str) -> tuple[list[int], list[int]]:
  """Stops the agents of session ``token`` (SIGTERM, then SIGKILL after ``STOP_SECS``)
  and removes their files; returns (pids stopped, pids killed)."""
  found = session_agents(token)
  for proc, _ in found:
    with contextlib.suppress(psutil.NoSuchProcess):
      proc.send_signal(signal.SIGTERM)
  _, alive = psutil.wait_procs([p for p, _ in found], timeout=STOP_SECS)
  for proc in alive:
    with contextlib.suppress(psutil.NoSuchProcess):
      proc.kill()
  psutil.wait_procs(alive, timeout=STOP_SECS)
  for _, agent in found:                  # what a killed one (or a torn exit) left behind
    d = agent.directory
    shutil.rmtree(d, ignore_errors=True)
    for leftover in (d + ".log", d + ".lock"):
      with contextlib.suppress(OSError):
        os.unlink(leftover)
    job = os.path.dirname(d)
    with contextlib.suppress(OSError):
      if set(os.listdir(job)) <= {"secret"}:
        shutil.rmtree(job)
  killed = {p.pid for p in alive}
  return ([p.pid for p, _ in found if p.pid not in killed], sorted(killed))


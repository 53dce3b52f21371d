"""`jaxckpt agent start|status|stop|serve`: run the snapshot agent as a sidecar."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shlex
import signal
import sys

import msgspec

from jaxckpt import errors
from jaxckpt.agent import _paths, _requests
from jaxckpt.agent.commands import jobs
from jaxckpt.agent._protocol import Client
from jaxckpt.agent.server._server import Agent, serve
from jaxckpt.agent.trainer._remote import job_agents
from jaxckpt.agent.trainer.client import start_agent, wait_exited
from jaxckpt.options import default_host_memory_limit_bytes
from jaxckpt.util._progress import human_bytes


def _common(p: argparse.ArgumentParser, *, found: bool = False) -> None:
  p.add_argument("--job-name", required=True, help="the job the agent serves")
  if found:
    p.add_argument("--host-id", type=int, default=None,
                   help="only the agent of this host index (default: every agent of the job "
                        "on this machine, found under the run root)")
  else:
    p.add_argument("--host-id", type=int, default=0, help="this host's index (default 0)")
  p.add_argument("--run-root", default=None,
                 help=f"directory of agents' files (default {_paths.default_run_root()})")


def add_agent_commands(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("start", help="start the agent of a job on this host (detached)",
                     description="Start (or find) the snapshot agent of JOB on this host "
                     "and print its address as JSON. Trainers with "
                     "AgentOptions(job_name=JOB, spawn=False) then use it.")
  _common(p)
  p.add_argument("--max-snapshots", type=int, default=2)
  p.add_argument("--limit-bytes", type=int, default=None,
                 help="host-memory budget for snapshot slots (default: half the free RAM)")
  p.add_argument("--idle-timeout-secs", type=float, default=3600.0)
  p.add_argument("--tcp-host", default="127.0.0.1",
                 help="address to serve other hosts on (this host's routable address "
                      "on a multi-host cluster)")
  p.set_defaults(func=_start)
  p = sub.add_parser("status", help="print what this machine's agents of a job hold, as JSON",
                     description="Ask every agent of JOB on this machine (found under the run "
                     "root) what it holds: one JSON object per agent, one per line. "
                     "`jaxckpt status` shows the job's agents on every host.")
  _common(p, found=True)
  p.set_defaults(func=_status)
  p = sub.add_parser("stop", help="stop this machine's agents of a job (or all of yours) and "
                     "free their shared memory",
                     description="Stop every agent of JOB on this machine (found under the run "
                     "root; --host-id for one), or with --all every agent of yours on this "
                     "machine, whatever its job and run root (those `jaxckpt agent list` "
                     "shows); each deletes every shared-memory slot it owns before exiting. An "
                     "agent that does not answer the stop request gets SIGTERM (the same "
                     "cleanup). Exit 1 if one is still running after --timeout-secs.")
  p.add_argument("--job-name", default=None, help="the job whose agents stop")
  p.add_argument("--all", action="store_true",
                 help="every agent of yours on this machine (no --job-name)")
  p.add_argument("--host-id", type=int, default=None,
                 help="only the agent of this host index (with --job-name)")
  p.add_argument("--run-root", default=None,
                 help=f"directory of agents' files (default {_paths.default_run_root()}); "
                      "with --all: only the agents under it (default: under any)")
  p.add_argument("--timeout-secs", type=float, default=30.0)
  p.set_defaults(func=_stop)
  p = sub.add_parser("list", help="list every snapshot agent of yours on this machine",
                     description="Every snapshot agent process of yours on this machine, "
                     "whatever its job and run root: pid, job, host, the steps it holds, its "
                     "shared memory against its budget and its resident memory, its trainers, "
                     "and how long it has been idle (an idle agent exits once idle for its "
                     "idle timeout; `jaxckpt agent stop --all` stops them now). Exit 1 if one "
                     "did not answer (its row says why).")
  p.add_argument("--json", action="store_true", help="one JSON object per agent, per line")
  p.add_argument("--timeout-secs", type=float, default=5.0,
                 help="how long to wait for each agent's answer (default 5)")
  p.set_defaults(func=_list)
  p = sub.add_parser("serve", help="run the agent in the foreground (what `start` spawns)")
  _common(p)
  p.add_argument("--max-snapshots", type=int, default=2)
  p.add_argument("--limit-bytes", type=int, default=None)
  p.add_argument("--idle-timeout-secs", type=float, default=3600.0)
  p.add_argument("--tcp-host", default="127.0.0.1")
  p.set_defaults(func=_serve)


def register(subparsers: argparse._SubParsersAction) -> None:
  p = subparsers.add_parser("agent", help="run the per-host snapshot agent as a sidecar",
                            description="The snapshot agent holds a host's snapshots in "
                            "shared memory so that they survive a trainer crash.")
  add_agent_commands(p.add_subparsers(dest="agent_command", required=True))


def _root(args) -> str:
  return args.run_root or _paths.default_run_root()


def _limit(args) -> int:
  if args.limit_bytes:
    return args.limit_bytes
  return default_host_memory_limit_bytes()


def _start(args) -> int:
  info = start_agent(job=args.job_name, host=args.host_id, run_root=_root(args),
                     max_snapshots=args.max_snapshots, limit_bytes=_limit(args),
                     idle_timeout_secs=args.idle_timeout_secs, start_timeout_secs=60,
                     tcp_host=args.tcp_host)
  print(json.dumps(info))
  return 0


def _found(args) -> dict[int, dict]:
  """This machine's live agents of the job (one host's with --host-id), by host id."""
  agents = job_agents(_root(args), args.job_name)
  if args.host_id is not None:
    agents = {h: a for h, a in agents.items() if h == args.host_id}
  return agents


def _nobody(args) -> str:
  host = "" if args.host_id is None else f" host {args.host_id}"
  return f"no agent of job {args.job_name!r}{host} is running under {_root(args)}"


def _client(args, info: dict) -> Client:
  return Client(info["ipc"], who=f"agent pid {info['pid']}", timeout_secs=10,
                secret=_paths.job_secret(_root(args), args.job_name))


def _status(args) -> int:
  agents = _found(args)
  if not agents:
    print(json.dumps({"running": False, "job": args.job_name, "host": args.host_id,
                      "run_root": _root(args)}))
    return 1
  for _, info in sorted(agents.items()):
    c = _client(args, info)
    try:
      print(json.dumps({"running": True, **msgspec.to_builtins(c.call(_requests.Status())[0])}))
    finally:
      c.close()
  return 0


def _duration(secs: float) -> str:
  if secs >= 3600:
    return f"{secs / 3600:.1f} h"
  return f"{secs / 60:.0f} min" if secs >= 60 else f"{secs:.0f} s"


def _idle(a: jobs.LocalAgent) -> str:
  if not a.answered:
    return "?"
  if a.idle_timeout_secs is None:                 # an agent of an older jaxckpt
    return "?"
  if a.idle_secs is None:
    return "in use"
  left = "" if a.idle_timeout_secs is None else (
      f" (exits in {_duration(max(0.0, a.idle_timeout_secs - a.idle_secs))})")
  return f"{_duration(a.idle_secs)}{left}"


def _list(args) -> int:
  agents = jobs.local_agents(timeout_secs=args.timeout_secs)
  if args.json:
    for a in agents:
      print(json.dumps({**dataclasses.asdict(a), "directory": a.directory}))
    return 0 if all(a.answered for a in agents) else 1
  if not agents:
    print(f"no snapshot agent of uid {os.getuid()} runs on this machine")
    return 0
  cols = ("pid", "job", "host", "held", "memory", "rss", "trainers", "idle", "run root")
  rows = [dict(zip(cols, cols))]
  for a in agents:
    share = f" ({100 * a.bytes / a.limit_bytes:.0f}%)" if a.limit_bytes else ""
    rows.append({"pid": str(a.pid), "job": a.job, "host": str(a.host),
                 "held": ", ".join(map(str, a.steps[-4:])) or "-",
                 "memory": f"{human_bytes(a.bytes)} / {human_bytes(a.limit_bytes)}{share}"
                 if a.answered else "?",
                 "rss": human_bytes(a.rss_bytes),
                 "trainers": ", ".join(map(str, a.trainers)) or "-", "idle": _idle(a),
                 "run root": a.run_root})
  width = {c: max(len(r[c]) for r in rows) for c in cols}
  for r in rows:
    print("  ".join(r[c].ljust(width[c]) for c in cols).rstrip())
  for a in agents:
    if a.error:
      print(f"  ! pid {a.pid} (job {a.job} host {a.host}): {a.error}")
  total = sum(a.bytes for a in agents)
  print(f"{len(agents)} agent{'s' if len(agents) != 1 else ''}, {human_bytes(total)} of shared "
        "memory; to stop them:")
  for line in _stop_commands(agents):
    print(f"  {line}")
  return 0 if all(a.answered for a in agents) else 1


def _stop_commands(agents: list[jobs.LocalAgent]) -> list[str]:
  """What stops the listed agents: one command per job and run root (each stops that job's
  agents only: the others may serve trainers started elsewhere, whose rows say so), and
  ``stop --all``, which stops every one listed."""
  by_job: dict[tuple[str, str], list[jobs.LocalAgent]] = {}
  for a in agents:
    by_job.setdefault((a.job, a.run_root), []).append(a)
  cmds = []
  for (job, root), these in sorted(by_job.items()):
    trainers = sorted({t for a in these for t in a.trainers})
    serves = (f"serve{'s' if len(these) == 1 else ''} trainer pid{'s' if len(trainers) != 1 else ''} "
              + ", ".join(map(str, trainers))) if trainers else "no trainer attached"
    cmds.append((f"jaxckpt agent stop --job-name {shlex.quote(job)} --run-root {shlex.quote(root)}",
                 f"job {job}'s {len(these)} agent{'s' if len(these) != 1 else ''}: {serves}"))
  jobs_n = len({job for job, _ in by_job})
  cmds.append(("jaxckpt agent stop --all", f"all {len(agents)} listed, of {jobs_n} "
                                           f"job{'s' if jobs_n != 1 else ''}"))
  width = max(len(c) for c, _ in cmds)
  return [f"{c.ljust(width)}   # {what}" for c, what in cmds]


def _stop(args) -> int:
  if args.all == bool(args.job_name):
    print("jaxckpt agent stop: give --job-name JOB (that job's agents) or --all (every agent "
          "of yours on this machine)", file=sys.stderr)
    return 2
  if args.all:
    return _stop_all(args)
  agents = _found(args)
  if not agents:
    print(_nobody(args))
    return 0
  for host, info in sorted(agents.items()):
    c = _client(args, info)
    try:
      pid = c.call(_requests.Status())[0].pid
      c.call(_requests.Stop())
    finally:
      c.close()
    if not wait_exited(pid, args.timeout_secs):
      raise errors.SnapshotTimeoutError(
          f"agent pid {pid} of job {args.job_name!r} did not exit within {args.timeout_secs} s")
    print(f"stopped agent pid {pid} of job {args.job_name!r} host {host}")
  return 0


def _stop_all(args) -> int:
  """Stops every agent ``jaxckpt agent list`` shows: a stop request, or SIGTERM to one that
  does not answer it (its pid is an agent of this user: its command line says so)."""
  agents = jobs.local_agents(ask=False)
  if args.run_root is not None:
    root = os.path.realpath(args.run_root)
    agents = [a for a in agents if os.path.realpath(a.run_root) == root]
  if not agents:
    under = "" if args.run_root is None else f" under {args.run_root}"
    print(f"no snapshot agent of uid {os.getuid()} runs on this machine{under}")
    return 0
  for a in agents:
    how = "asked to stop"
    try:
      info = _paths.read_address(a.directory)
      if info is None or int(info["pid"]) != a.pid:
        raise errors.AgentUnavailableError(f"no address file of pid {a.pid} in {a.directory}")
      c = Client(info["ipc"], who=f"agent pid {a.pid}", timeout_secs=5,
                 secret=_paths.job_secret(a.run_root, a.job))
      try:
        c.call(_requests.Stop())
      finally:
        c.close()
    except errors.JaxckptError as e:
      how = f"sent SIGTERM ({e})"
      with contextlib.suppress(ProcessLookupError):
        os.kill(a.pid, signal.SIGTERM)
    a.error = how
  late = []
  for a in agents:
    if wait_exited(a.pid, args.timeout_secs):
      print(f"stopped agent pid {a.pid} of job {a.job!r} host {a.host} ({a.run_root}; {a.error})")
    else:
      late.append(a)
  for a in late:
    print(f"agent pid {a.pid} of job {a.job!r} host {a.host} ({a.run_root}) still runs "
          f"{args.timeout_secs:g} s after it was {a.error}; kill it with kill -9 {a.pid} and "
          f"remove {a.directory}", file=sys.stderr)
  return 1 if late else 0


def _serve(args) -> int:
  logging.basicConfig(level=logging.INFO,
                      format="%(asctime)s agent[%(process)d] %(levelname)s %(message)s")
  d = _paths.agent_dir(_root(args), args.job_name, args.host_id)
  secret = _paths.job_secret(_root(args), args.job_name)
  _paths.secure_dir(d)
  serve(Agent(job=args.job_name, host=args.host_id, directory=d,
              max_snapshots=args.max_snapshots, limit_bytes=_limit(args),
              idle_timeout_secs=args.idle_timeout_secs, tcp_host=args.tcp_host,
              secret=secret))
  return 0


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m jaxckpt.agent")
  add_agent_commands(p.add_subparsers(dest="agent_command", required=True))
  args = p.parse_args(argv)
  return args.func(args)


if __name__ == "__main__":
  sys.exit(main())

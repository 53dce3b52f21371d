"""`jaxckpt agent start|status|stop|serve`: run the snapshot agent as a sidecar."""

from __future__ import annotations

import argparse
import json
import logging
import sys


from jaxckpt import errors
from jaxckpt.agent import _paths
from jaxckpt.agent._protocol import Client
from jaxckpt.agent._server import Agent, serve
from jaxckpt.agent._remote import job_agents
from jaxckpt.agent.client import start_agent, wait_exited
from jaxckpt.options import default_host_memory_limit_bytes


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
  p = sub.add_parser("stop", help="stop this machine's agents of a job and free their shared memory",
                     description="Stop every agent of JOB on this machine (found under the run "
                     "root; --host-id for one); each deletes every shared-memory slot it owns "
                     "before exiting.")
  _common(p, found=True)
  p.add_argument("--timeout-secs", type=float, default=30.0)
  p.set_defaults(func=_stop)
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
      print(json.dumps({"running": True, **c.call("status")[0]}, default=str))
    finally:
      c.close()
  return 0


def _stop(args) -> int:
  agents = _found(args)
  if not agents:
    print(_nobody(args))
    return 0
  for host, info in sorted(agents.items()):
    c = _client(args, info)
    try:
      pid = c.call("status")[0].pid
      c.call("stop")
    finally:
      c.close()
    if not wait_exited(pid, args.timeout_secs):
      raise errors.SnapshotTimeoutError(
          f"agent pid {pid} of job {args.job_name!r} did not exit within {args.timeout_secs} s")
    print(f"stopped agent pid {pid} of job {args.job_name!r} host {host}")
  return 0


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

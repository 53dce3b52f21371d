"""``jaxckpt lighthouse``: run the lighthouse of a replica-group job in the foreground."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from datetime import timedelta

from jaxckpt import errors
from jaxckpt.ft.lighthouse import Lighthouse, LighthouseOptions
from jaxckpt.net import _wire


def _read_secret(path: str) -> str:
  st = os.stat(path)
  if st.st_uid != os.getuid() or st.st_mode & 0o077:
    raise errors.PermissionDeniedError(
        f"--secret-file {path} has mode {oct(st.st_mode & 0o777)} and owner uid {st.st_uid}; it "
        f"must be yours and unreadable by others: `chmod 600 {path}`")
  with open(path, encoding="utf-8") as f:
    return f.read().strip()


def register(subparsers: argparse._SubParsersAction) -> None:  # pylint: disable=protected-access
  """Adds the ``lighthouse`` command; it sets ``func`` (call ``args.func(args)``)."""
  p = subparsers.add_parser("lighthouse", help="run the lighthouse of a replica-group (FT-HSDP) job",
                            description=__doc__)
  p.add_argument("--bind", required=True, metavar="HOST:PORT",
                 help="address to serve on (port 0 picks a free port; the bound address is printed)")
  p.add_argument("--min-replicas", type=int, default=1, metavar="N",
                 help="fewest replica groups a quorum may have (default 1)")
  defaults = LighthouseOptions()
  p.add_argument("--heartbeat-timeout", type=float, default=defaults.heartbeat_timeout.total_seconds(),
                 metavar="SECS", help="drop a group whose last heartbeat is older, and end the attempt "
                 f"in flight for the others (default {defaults.heartbeat_timeout.total_seconds():g})")
  p.add_argument("--connection-timeout", type=float, default=defaults.connection_timeout.total_seconds(),
                 metavar="SECS", help="close a connection that does not answer the lighthouse's pings "
                 "this long; a group whose heartbeat connection closes is dropped and out of the attempt "
                 f"in flight (default {defaults.connection_timeout.total_seconds():g})")
  p.add_argument("--join-timeout", type=float, default=defaults.join_timeout.total_seconds(), metavar="SECS",
                 help="wait this long for live groups that have not asked yet "
                      f"(default {defaults.join_timeout.total_seconds():g})")
  p.add_argument("--straggler-timeout", type=float, default=defaults.straggler_timeout.total_seconds(),
                 metavar="SECS", help="wait this long for busy members of the previous quorum "
                 f"(default {defaults.straggler_timeout.total_seconds():g})")
  p.add_argument("--private-port", type=int, default=0, metavar="PORT",
                 help="port of the job's private door on the same interface (CURVE, keyed by the "
                      "secret; groups learn it from the lighthouse's replies); default 0: any free port")
  p.add_argument("--etcd", default="", metavar="URL[,URL...]",
                 help="serve as one replica of the job's control plane on this etcd cluster "
                      "(http://HOST:PORT of each member): the replicas elect a leader, which forms "
                      "the quorums; give every group every replica's address, comma-separated")
  p.add_argument("--job", default="", metavar="NAME", help="the job the replicas serve (with --etcd)")
  p.add_argument("--leader-lease", type=float, default=defaults.leader_lease.total_seconds(),
                 metavar="SECS", help="the leader's etcd lease: a dead leader leads until it expires "
                 f"(with --etcd; default {defaults.leader_lease.total_seconds():g})")
  p.add_argument("--secret-file", metavar="PATH",
                 help="file holding the job's secret (mode 0600); default: $JAXCKPT_JOB_SECRET")
  p.set_defaults(func=run_lighthouse)


def run_lighthouse(args: argparse.Namespace) -> int:
  """Serves until SIGINT or SIGTERM."""
  options = LighthouseOptions(min_replicas=args.min_replicas,
                              heartbeat_timeout=timedelta(seconds=args.heartbeat_timeout),
                              connection_timeout=timedelta(seconds=args.connection_timeout),
                              join_timeout=timedelta(seconds=args.join_timeout),
                              straggler_timeout=timedelta(seconds=args.straggler_timeout),
                              etcd_endpoints=tuple(e for e in args.etcd.split(",") if e),
                              job_name=args.job, leader_lease=timedelta(seconds=args.leader_lease))
  secret = _read_secret(args.secret_file) if args.secret_file else os.environ.get(_wire.SECRET_ENV)
  if not secret:
    raise errors.InvalidArgumentError(
        "the lighthouse needs the job's secret, which every group must also have: set "
        f"${_wire.SECRET_ENV} (e.g. `export {_wire.SECRET_ENV}=$(python -c 'import secrets; "
        "print(secrets.token_hex(32))')`) for the lighthouse and every group, or pass --secret-file")
  stop = threading.Event()
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda *_: stop.set())
  with Lighthouse(args.bind, options, secret=secret, private_port=args.private_port) as lighthouse:
    print(f"lighthouse serving on {lighthouse.address}", flush=True)
    stop.wait()
  return 0

"""``jaxckpt status``: one view of a job's snapshot agents, across hosts.

The job's agents are found the way the job finds them (:mod:`jaxckpt.agent.commands.jobs`):
this machine's under its run root, the others from the addresses the job gave
them. For each: pid, address, whether it answered, the steps it holds, the newest
protected by parity, those it persisted, its persist lag, and the host memory it
takes against its budget.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

from jaxckpt import errors
from jaxckpt.agent import _paths
from jaxckpt.agent.commands import jobs
from jaxckpt.util._progress import human_bytes
from jaxckpt.util._text import shown

_HELP = """Show a job's snapshot agents on every host: pid, address, alive, the steps each
holds in host memory, the newest step its parity group protects, the steps it
persisted and those still pending (the persist lag, in steps and seconds), and
the host memory it takes against its budget.

The agents are found as the job finds them: this machine's under the run root
(AgentOptions.run_root), the other hosts' from the addresses the job's
processes published (jax.distributed's key-value store) and gave to each agent.
Run it on any machine of the job; no host id is needed. Exit 0 if every agent
answered, 1 if one did not (its row says why), 2 if no agent of the job runs here."""

COLUMNS = ("host", "pid", "address", "alive", "held", "protected", "persisted", "pending",
           "lag", "memory")


def register(subparsers: argparse._SubParsersAction) -> None:  # pylint: disable=protected-access
  """Adds ``jaxckpt status``."""
  p = subparsers.add_parser("status", help=_HELP.split("\n")[0].rstrip(":") + ".",
                            description=_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--job-name", default=None,
                 help="the job (default: every job with an agent on this machine)")
  p.add_argument("--run-root", default=None,
                 help=f"this machine's run root (default {_paths.default_run_root()})")
  p.add_argument("--json", action="store_true",
                 help="print JSON (with --watch, one JSON document per line per refresh)")
  p.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECS",
                 help="refresh every SECS seconds (default 2) until Ctrl-C: a live table on a "
                      "terminal, a table per refresh otherwise")
  p.add_argument("--count", type=int, default=None,
                 help="with --watch: stop after this many refreshes")
  p.add_argument("--timeout-secs", type=float, default=5.0,
                 help="how long to wait for each agent's answer (default 5)")
  p.set_defaults(handler=status_command)


def gather(args: argparse.Namespace) -> list[jobs.JobStatus]:
  root = args.run_root or _paths.default_run_root()
  return [jobs.job_status(root, name, timeout_secs=args.timeout_secs)
          for name in jobs.jobs_here(root, args.job_name)]


def _steps(steps: list[int], most: int = 4) -> str:
  if not steps:
    return "-"
  shown = ", ".join(str(s) for s in steps[-most:])
  return ("... " if len(steps) > most else "") + shown


def row(a: jobs.AgentView) -> dict[str, str]:
  """One agent's cells, as the table shows them (escaped: an agent's and a peer's
  addresses and names are data, see :func:`jaxckpt.util._text.shown`)."""
  return {c: shown(v) for c, v in _cells(a).items()}


def _cells(a: jobs.AgentView) -> dict[str, str]:
  if not a.alive:
    return {"host": str(a.host), "pid": str(a.pid), "address": a.address, "alive": "NO",
            **{c: "" for c in COLUMNS[4:]}}
  lag = "-" if not a.pending else f"{a.lag_steps} steps"
  if a.pending and a.lag_secs is not None:
    lag += f", {a.lag_secs:.0f} s"
  share = f" ({100 * a.bytes / a.limit_bytes:.0f}%)" if a.limit_bytes else ""
  return {"host": str(a.host), "pid": str(a.pid), "address": a.address, "alive": "yes",
          "held": _steps(a.held), "protected": "-" if a.protected is None else str(a.protected),
          "persisted": _steps(a.persisted), "pending": _steps(a.pending), "lag": lag,
          "memory": f"{human_bytes(a.bytes)} / {human_bytes(a.limit_bytes)}{share}"}


def title(st: jobs.JobStatus) -> str:
  here = sum(a.local for a in st.agents)
  dirs = sorted({a.directory for a in st.agents if a.directory})
  where = f", persisting to {', '.join(dirs)}" if dirs else ", not persisting"
  return shown(f"job {st.job}: {len(st.agents)} agents ({here} on this machine, found from "
               f"{st.run_root}){where}")


def problems(st: jobs.JobStatus) -> list[str]:
  return [shown(f"host {a.host} (pid {a.pid}, {a.address}): {a.error}")
          for a in st.agents if a.error]


def plain(statuses: list[jobs.JobStatus]) -> str:
  """The view as plain text: a title, a table and what went wrong, per job."""
  out = []
  for st in statuses:
    rows = [dict(zip(COLUMNS, COLUMNS))] + [row(a) for a in st.agents]
    width = {c: max(len(r[c]) for r in rows) for c in COLUMNS}
    out.append(title(st))
    out += ["  ".join(r[c].ljust(width[c]) for c in COLUMNS).rstrip() for r in rows]
    out += [f"  ! {p}" for p in problems(st)]
    out.append("")
  return "\n".join(out).rstrip("\n")


def rich_view(statuses: list[jobs.JobStatus], stamp: str) -> Any:
  """The view as rich renderables (a table per job), for a terminal. Every text is a
  ``rich.text.Text``, never markup: a directory named ``sweep[lr=0.1]`` or ``exp[/b]``
  is shown as it is."""
  from rich.console import Group  # pylint: disable=import-outside-toplevel  (a terminal only)
  from rich.table import Table  # pylint: disable=import-outside-toplevel
  from rich.text import Text  # pylint: disable=import-outside-toplevel
  parts: list[Any] = []
  for st in statuses:
    t = Table(title=Text(title(st)), title_justify="left", caption=Text(stamp),
              caption_justify="left")
    for c in COLUMNS:
      t.add_column(c, justify="right" if c in ("host", "pid", "protected") else "left")
    for a in st.agents:
      r = row(a)
      t.add_row(*[Text(r[c]) for c in COLUMNS], style=None if a.alive else "bold red")
    parts.append(t)
    parts += [Text(f"! {p}", style="red") for p in problems(st)]
  return Group(*parts)


def _code(statuses: list[jobs.JobStatus]) -> int:
  return 1 if any(not a.alive for st in statuses for a in st.agents) else 0


def status_command(args: argparse.Namespace) -> int:
  """Runs ``jaxckpt status``; returns the exit code."""
  if args.watch is not None and not args.watch > 0:
    print(f"jaxckpt status: --watch takes a positive number of seconds, got {args.watch}",
          file=sys.stderr)
    return 2
  if args.count is not None and args.count < 1:
    print(f"jaxckpt status: --count must be at least 1, got {args.count}", file=sys.stderr)
    return 2
  try:
    if args.watch is None:
      statuses = gather(args)
      print(json.dumps({"jobs": [s.to_obj() for s in statuses]}, indent=1) if args.json
            else plain(statuses))
      return _code(statuses)
    return _watch(args)
  except errors.JaxckptError as e:
    print(f"jaxckpt status: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    return 0


def _watch(args: argparse.Namespace) -> int:
  """Refreshes every ``args.watch`` seconds: a live table on a terminal, else one table
  (or one JSON line) per refresh."""
  live = sys.stdout.isatty() and not args.json
  code, n = 0, 0

  def frames(show: Callable[[list[jobs.JobStatus], str], None]) -> int:
    nonlocal code, n
    while args.count is None or n < args.count:
      start = time.monotonic()
      statuses = gather(args)
      code = _code(statuses)
      n += 1
      show(statuses, time.strftime("%H:%M:%S") + f"  (every {args.watch:g} s; Ctrl-C ends)")
      if args.count is not None and n >= args.count:
        break
      time.sleep(max(0.0, args.watch - (time.monotonic() - start)))
    return code

  if live:
    from rich.live import Live  # pylint: disable=import-outside-toplevel  (a terminal only)
    with Live(auto_refresh=False) as screen:
      return frames(lambda s, stamp: screen.update(rich_view(s, stamp), refresh=True))
  if args.json:
    return frames(lambda s, stamp: print(json.dumps({"time": time.time(),
                                                     "jobs": [x.to_obj() for x in s]}),
                                         flush=True))
  return frames(lambda s, stamp: print(f"{stamp}\n{plain(s)}\n", flush=True))

"""``jaxckpt delete DIR --step N``: delete a step for good, as ``CheckpointManager.delete()``
does, fencing the persists of it that the job's agents run (found from this machine,
:mod:`jaxckpt.agent.commands.jobs`) before deleting it from storage.
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxckpt import errors
from jaxckpt.agent import _paths as agent_paths
from jaxckpt.agent.commands import jobs
from jaxckpt.universal import _commit
from jaxckpt.universal import _layout as lay
from jaxckpt.universal.cli import not_a_checkpoint_root, say

_DELETE_HELP = """Delete a step from a checkpoint directory, for good, as
CheckpointManager.delete() does: first every snapshot agent of this machine's
jobs that persists to DIR (and the job's agents on other hosts, which they
know) is told to discard the step, so that a persist of it that is queued never
runs and one that runs never commits (the command waits for it to stop); the
agents forget the step too. Then the step is deleted from storage: its commit
marker first (it is never listed half-deleted), then its data. A trainer that
persists without an agent (AgentOptions unset) is not reached: delete from it
with mgr.delete(step), or stop it first. Exits 0 once deleted, 2 if the step
is neither committed in DIR nor held or persisted by an agent found here, or an
agent that persists to DIR did not answer."""


def register(subparsers: argparse._SubParsersAction) -> None:  # pylint: disable=protected-access
  """Adds ``delete`` to the ``jaxckpt`` command."""
  p = subparsers.add_parser("delete", help="Delete a step from a checkpoint directory, for good.",
                            description=_DELETE_HELP,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("directory", metavar="DIR", help="the checkpoint's root directory or kvstore URL")
  p.add_argument("--step", type=int, required=True, help="the step to delete")
  p.add_argument("--run-root", default=None, help="this machine's agents' run root "
                 f"(default {agent_paths.default_run_root()})")
  p.add_argument("--job-name", default=None,
                 help="only this job's agents (default: every job with an agent here)")
  p.add_argument("--timeout-secs", type=float, default=60.0,
                 help="how long a running persist of the step may take to stop (default 60)")
  p.add_argument("--ignore-unreachable", action="store_true",
                 help="delete even if an agent that persists to DIR does not answer")
  p.set_defaults(handler=delete_command)


def delete_command(args: argparse.Namespace) -> int:
  """Deletes a step for good (see ``_DELETE_HELP``); returns the exit code."""
  local = lay.local_path(args.directory)
  missing = local is not None and not os.path.exists(local)     # no persist has written yet
  why = None if missing else not_a_checkpoint_root(args.directory, args.step, "delete")
  if why:
    say(f"jaxckpt delete: {why}", err=True)
    return 2
  if args.step < 0:
    print(f"jaxckpt delete: --step must be >= 0, got {args.step}", file=sys.stderr)
    return 2
  run_root = args.run_root or agent_paths.default_run_root()
  try:
    fenced = jobs.fence_step(run_root, args.directory, args.step, job=args.job_name,
                             timeout_secs=args.timeout_secs,
                             ignore_unreachable=args.ignore_unreachable)
    missing = local is not None and not os.path.exists(local)
    stored = [] if missing else _commit.all_steps(args.directory)
    touched = [f for f in fenced if f.dropped or f.persisting]
    if args.step not in stored and not touched:
      where = ("does not exist" if missing else
               f"holds no committed step {args.step} (committed steps: {stored})")
      print(f"jaxckpt delete: {args.directory!r} {where}, and no snapshot agent under "
            f"{run_root} holds or persists step {args.step}", file=sys.stderr)
      return 2
    if not missing:
      _commit.discard_step(args.directory, args.step)
  except errors.JaxckptError as e:
    say(f"jaxckpt delete: {e}", err=True)
    return 2
  where = ("storage" if args.step in stored else "nothing of it was on storage yet" if missing
           else "its uncommitted data on storage")
  print(f"deleted step {args.step} of {args.directory} ({where})")
  for f in fenced:
    say(f"  job {f.job}: {len(f.agents)} agents told; hosts {sorted(f.dropped)} dropped it "
          f"from host memory; the persist of hosts {sorted(f.persisting)} stopped uncommitted")
  return 0

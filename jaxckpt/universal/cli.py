"""``jaxckpt inspect`` and ``jaxckpt verify`` for universal-format directories.

``jaxckpt/cli.py`` calls :func:`register`; ``python -m jaxckpt.universal.cli``
runs the two commands on their own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import sys
from typing import Any, Callable, Iterator, Sequence

import tqdm

from jaxckpt import errors
from jaxckpt.universal import _commit
from jaxckpt.universal import _layout as lay
from jaxckpt.universal import _read

_INSPECT_HELP = """Show a committed step of a universal-format checkpoint directory: the tree
of leaves with shapes, dtypes and sizes, the step, the saving mesh and
PartitionSpec of each leaf, chunk layout and user metadata. DIR is a local
path or a tensorstore URL (gs://, s3://, file://). Reads only manifests."""

_VERIFY_HELP = """Read every chunk of every leaf of a committed step and check it against the
checksums in its manifest (xxh3-64 per chunk, crc32c per inner chunk).
Exits 0 if all is intact, 1 naming each damaged leaf and chunk, 2 if the
step cannot be opened at all."""


def human_bytes(n: float) -> str:
  """``1536`` -> ``'1.5 KiB'``."""
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  raise AssertionError("unreachable")


def register(subparsers: argparse._SubParsersAction) -> None:  # pylint: disable=protected-access
  """Adds ``inspect`` and ``verify`` to the ``jaxckpt`` command."""
  for name, helptext, handler in (("inspect", _INSPECT_HELP, inspect_command),
                                  ("verify", _VERIFY_HELP, verify_command)):
    p = subparsers.add_parser(name, help=helptext.split(".")[0] + ".", description=helptext,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", metavar="DIR", help="checkpoint directory or kvstore URL")
    p.add_argument("--step", type=int, default=None,
                   help="step to look at (default: the latest committed one)")
    if name == "inspect":
      p.add_argument("--json", action="store_true", help="print the manifest as JSON instead")
    else:
      p.add_argument("--all-steps", action="store_true", help="verify every committed step")
      p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=handler)


def _open(args: argparse.Namespace, step: int | None) -> _read.StepReader:
  return _read.open_step(args.directory, step)


def _tree_lines(reader: _read.StepReader) -> list[str]:
  lines = []
  width = max((len(p) for p in reader.leaves), default=0)
  for path in sorted(reader.leaves):
    info = reader.leaves[path]
    if not info.is_array:
      lines.append(f"  {path:<{width}}  {info.kind:<8} = {info.scalar!r}")
      continue
    mesh = (info.sharding or {}).get("mesh_shape") if isinstance(info.sharding, dict) else None
    spec = (info.sharding or {}).get("spec") if isinstance(info.sharding, dict) else None
    where = f"  mesh={mesh} spec={spec}" if mesh else ""
    key = f" key_impl={info.key_impl}" if info.key_impl else ""
    lines.append(f"  {path:<{width}}  {info.dtype:<9} {str(list(info.shape)):<18} "
                 f"{human_bytes(info.nbytes):>10}  chunks={list(info.chunk_shape or ())}"
                 f"{where}{key}")
  return lines


def _not_a_checkpoint_directory(directory: str, step: int | None = None,
                                verb: str = "inspect") -> str | None:
  """Why a local ``directory`` holds no jaxckpt checkpoint (it is a file, it does not exist, it
  is an orbax checkpoint), or None (then opening it says what is wrong, if anything)."""
  local = directory.removeprefix("file://").rstrip("/")
  if "://" in local or not local:
    return None                    # an object store: opening it tells
  if os.path.isfile(local):
    return (f"{directory!r} is a file, not a checkpoint directory; pass the directory the "
            f"manager or `jaxckpt convert` wrote (it holds commits/ and steps/)")
  if not os.path.exists(local):
    return f"{directory!r} does not exist; pass the directory the manager or `jaxckpt convert` wrote"
  if not os.path.isdir(os.path.join(local, lay.COMMITS_PREFIX)):
    return _orbax_hint(directory, local, step, verb)
  return None


def _orbax_hint(directory: str, local: str, step: int | None, verb: str) -> str | None:
  """If ``local`` is an orbax checkpoint: says so, with the ``jaxckpt import-orbax`` command."""
  def has(*parts: str) -> bool:
    return os.path.exists(os.path.join(local, *parts))
  extra = []
  if has("_METADATA"):                                     # one StandardCheckpointer save
    what, src = "an orbax checkpoint (one saved item)", local
  elif (steps := _orbax_steps(local)):                     # a CheckpointManager directory
    what, src = f"an orbax CheckpointManager directory (steps {sorted(steps)})", local
    extra = [] if step is None else ["--step", str(step)]     # every item is imported
  elif has("_CHECKPOINT_METADATA") and (n := re.search(r"(\d+)$", os.path.basename(local))):
    what, src = "one step of an orbax CheckpointManager directory", os.path.dirname(local)
    extra = ["--step", str(int(n.group(1)))]
  else:
    return None
  dst = src + "-jaxckpt"
  command = shlex.join(["jaxckpt", "import-orbax", src, dst, *extra])
  return (f"{directory!r} is {what}, not a jaxckpt checkpoint; import it into the universal "
          f"format first: {command}  (then: jaxckpt {verb} {shlex.quote(dst)})")


def _orbax_steps(local: str) -> dict[int, str]:
  """Orbax's finalized step directories (``<step>`` or ``<prefix>_<step>``) by step."""
  steps = {}
  for name in os.listdir(local):
    m = re.fullmatch(r"(?:.*_)?(\d+)", name)
    if m and os.path.exists(os.path.join(local, name, "_CHECKPOINT_METADATA")):
      steps[int(m.group(1))] = name
  return steps


def inspect_command(args: argparse.Namespace) -> int:
  """Prints the tree of one step; returns the exit code."""
  if (why := _not_a_checkpoint_directory(args.directory, args.step)):
    print(f"jaxckpt inspect: {why}", file=sys.stderr)
    return 2
  try:
    reader = _open(args, args.step)
  except errors.JaxckptError as e:
    print(f"jaxckpt inspect: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps({"step": reader.step, "metadata": reader.metadata,
                      "leaves": [i.to_obj() for i in reader.leaves.values()]}, indent=1))
    return 0
  total = sum(i.nbytes for i in reader.leaves.values())
  steps = _commit.all_steps(args.directory)
  print(f"{args.directory}: step {reader.step} (committed steps: {steps})")
  print(f"written by {reader.process_count} process(es); {len(reader.leaves)} leaves, "
        f"{human_bytes(total)}")
  if reader.metadata:
    print(f"metadata: {json.dumps(reader.metadata, sort_keys=True)}")
  print("\n".join(_tree_lines(reader)))
  return 0


def verify_command(args: argparse.Namespace) -> int:
  """Checks every chunk of one step (or all); returns the exit code."""
  if (why := _not_a_checkpoint_directory(args.directory, args.step, "verify")):
    print(f"jaxckpt verify: {why}", file=sys.stderr)
    return 2
  try:
    steps = _commit.all_steps(args.directory) if args.all_steps else [args.step]
    readers = [_open(args, s) for s in steps]
  except errors.JaxckptError as e:
    print(f"jaxckpt verify: {e}", file=sys.stderr)
    return 2
  bad = 0
  for reader in readers:
    total = sum(i.nbytes for i in reader.leaves.values())
    with byte_bar(args, total, f"step {reader.step}") as bar:
      problems = _read.verify_step(reader, progress=bar)
    for line in problems:
      print(f"DAMAGED step {reader.step}: {line}")
    if not problems:
      print(f"step {reader.step}: OK ({len(reader.leaves)} leaves, {human_bytes(total)} verified)")
    bad += len(problems)
  return 1 if bad else 0


@contextlib.contextmanager
def byte_bar(args: argparse.Namespace, total: int, desc: str) -> Iterator[Any]:
  """A progress bar in bytes on stderr (off with ``--no-progress``)."""
  with tqdm.tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                 disable=args.no_progress or None, file=sys.stderr) as bar:
    yield bar


def run(prog: str, description: str, register_fn: Callable[[Any], None],
        argv: Sequence[str] | None) -> int:
  """Runs the subcommands that ``register_fn`` adds, as a standalone ``python -m`` tool."""
  parser = argparse.ArgumentParser(prog=prog, description=description)
  register_fn(parser.add_subparsers(dest="command", required=True))
  args: Any = parser.parse_args(argv)
  return args.handler(args)


def main(argv: Sequence[str] | None = None) -> int:
  return run("python -m jaxckpt.universal.cli",
             "Inspect and verify universal-format checkpoints.", register, argv)


if __name__ == "__main__":
  sys.exit(main())

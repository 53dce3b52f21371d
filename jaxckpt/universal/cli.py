"""``jaxckpt inspect`` and ``jaxckpt verify`` for universal-format directories.

``jaxckpt/cli.py`` calls :func:`register`; ``python -m jaxckpt.universal.cli``
runs the two commands on their own.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import sys
from typing import Any, Callable, Sequence

from jaxckpt import errors
from jaxckpt.universal import _commit
from jaxckpt.universal import _layout as lay
from jaxckpt.universal import _read
from jaxckpt.universal import _saved_items as items
from jaxckpt.util._progress import Progress, human_bytes  # noqa: F401  (re-exported)

_INSPECT_HELP = """Show a committed step of a universal-format checkpoint directory: the tree
of leaves with shapes, dtypes and sizes, the step, the saving mesh and
PartitionSpec of each leaf, chunk layout and user metadata, and the items of a
step saved with orbax's Composite as the user saved them (a JsonSave item as
its JSON, a Grain iterator's state as its fields). DIR is the checkpoint's root
(it holds commits/ and step_NNNNNNNNNN/ directories): a local path or a
tensorstore URL (gs://, s3://, file://). Reads manifests and item rows only."""

_VERIFY_HELP = """Read every chunk of every leaf of a committed step and check it against the
checksums in its manifest (xxh3-64 per chunk, crc32c per inner chunk).
Exits 0 if all is intact, 1 naming each damaged leaf and chunk, 2 if the
step cannot be opened at all or storage refused or did not answer a read (not
damage: nothing is said of the bytes). Shows a progress bar on a terminal (plain lines
otherwise) and the time and rate at the end."""


def register(subparsers: argparse._SubParsersAction) -> None:  # pylint: disable=protected-access
  """Adds ``inspect`` and ``verify`` to the ``jaxckpt`` command."""
  for name, helptext, handler in (("inspect", _INSPECT_HELP, inspect_command),
                                  ("verify", _VERIFY_HELP, verify_command)):
    p = subparsers.add_parser(name, help=helptext.split(".")[0].replace("\n", " ") + ".",
                              description=helptext,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", metavar="DIR",
                   help="the checkpoint's root directory or kvstore URL")
    p.add_argument("--step", type=int, default=None,
                   help="step to look at (default: the latest committed one)")
    if name == "inspect":
      p.add_argument("--json", action="store_true", help="print the manifest as JSON instead")
    elif name == "verify":
      p.add_argument("--all-steps", action="store_true", help="verify every committed step")
      p.add_argument("--no-progress", action="store_true", help="no progress bar or lines")
    p.set_defaults(handler=handler)


def _open(args: argparse.Namespace, step: int | None) -> _read.StepReader:
  return _read.open_step(args.directory, step)


def _tree_lines(reader: _read.StepReader, row_items: dict[str, str]) -> list[str]:
  lines = []
  width = max((len(p) for p in reader.leaves), default=0)
  for path in sorted(reader.leaves):
    info = reader.leaves[path]
    if path in row_items and not info.is_array:      # a JSON item: one for the whole job
      lines.append(f"  {path:<{width}}  {row_items[path]} item, one for the job: see items")
      continue
    if not info.is_array:
      lines.append(f"  {path:<{width}}  {info.kind:<8} = {info.scalar!r}")
      continue
    if path in row_items:
      lines.append(f"  {path:<{width}}  {row_items[path]} item, saved by {info.shape[0]} "
                   "process(es): see items")
      continue
    mesh = (info.sharding or {}).get("mesh_shape") if isinstance(info.sharding, dict) else None
    spec = (info.sharding or {}).get("spec") if isinstance(info.sharding, dict) else None
    where = f"  mesh={mesh} spec={spec}" if mesh else ""
    key = f" key_impl={info.key_impl}" if info.key_impl else ""
    lines.append(f"  {path:<{width}}  {info.dtype:<9} {str(list(info.shape)):<18} "
                 f"{human_bytes(info.nbytes):>10}  chunks={list(info.chunk_shape or ())}"
                 f"{where}{key}")
  return lines


_STEP_DIR = re.compile(r"step_(\d{10})")
LAYOUT = "it holds commits/ and step_NNNNNNNNNN/ directories"


def _enclosing_root(local: str) -> tuple[str, int | None] | None:
  """The checkpoint root ``local`` lies inside (a step directory or deeper, or a file
  there), with the step whose directory it is in; None if it is in none."""
  path, step = os.path.abspath(local), None
  for _ in range(6):
    parent = os.path.dirname(path)
    if (m := _STEP_DIR.fullmatch(os.path.basename(path))):
      step = int(m.group(1))
    if os.path.isdir(os.path.join(parent, lay.COMMITS_PREFIX)):
      return parent, step
    if parent == path:
      break
    path = parent
  return None


def _pass_root(directory: str, root: str, step: int | None, what: str, verb: str) -> str:
  extra = [] if step is None else ["--step", str(step)]
  command = shlex.join(["jaxckpt", verb, root, *extra])
  how = (f": {command}" if verb in ("inspect", "verify", "delete") else
         f" ({root}{' with --step ' + str(step) if step is not None else ''})")
  return (f"{directory!r} is {what} the checkpoint {root!r}, not its root ({LAYOUT}); pass "
          f"the root{how}")


def not_a_checkpoint_root(directory: str, step: int | None = None,
                                verb: str = "inspect") -> str | None:
  """Why ``directory`` is not a checkpoint's root (a file, a step directory inside one,
  nothing, an orbax checkpoint), or None (then opening it says what is wrong, if anything)."""
  local = directory.removeprefix("file://").rstrip("/")
  if "://" in local or not local:    # an object store: a step directory is told by its name
    if "://" in local and (m := _STEP_DIR.fullmatch(local.rsplit("/", 1)[-1])):
      return _pass_root(directory, local.rsplit("/", 1)[0], int(m.group(1)),
                        f"step {int(m.group(1))}'s directory in", verb)
    return None
  if os.path.isfile(local):
    found = _enclosing_root(local)
    if found is not None:
      return _pass_root(directory, found[0], found[1], "a file inside", verb)
    return (f"{directory!r} is a file, not a checkpoint directory; pass the directory the "
            f"manager or `jaxckpt convert` wrote ({LAYOUT})")
  if not os.path.exists(local):
    return f"{directory!r} does not exist; pass the directory the manager or `jaxckpt convert` wrote"
  if not os.path.isdir(os.path.join(local, lay.COMMITS_PREFIX)):
    found = _enclosing_root(local)
    if found is not None:
      root, at = found
      what = (f"step {at}'s directory in" if at is not None and
              _STEP_DIR.fullmatch(os.path.basename(local)) else "a directory inside")
      return _pass_root(directory, root, at if step is None else step, what, verb)
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


def _items(reader: _read.StepReader) -> tuple[dict[str, Any], list[str]]:
  """The step's items as saved (name -> {"kind", and "values" per saving process or
  "leaves"}), and what is damaged."""
  out, damaged = {}, []
  for name, kind in items.kinds(reader.metadata).items():
    path = items.path_of(name)
    if kind == items.PYTREE:
      under = [i for p, i in reader.leaves.items() if p.startswith(path)]
      out[name] = {"kind": kind, "leaves": len(under), "nbytes": sum(i.nbytes for i in under)}
      continue
    info = reader.leaves.get(path)
    if kind == items.JSON and info is not None and items.is_json_leaf(info):
      try:
        out[name] = {"kind": kind, "values": [items.decode_json(info.scalar, name)]}
      except errors.JaxckptError as e:
        damaged.append(f"item {name!r} ({kind}): {e}")
      continue
    if info is None or not items.is_row_leaf(info):
      damaged.append(f"item {name!r} ({kind}): the step has no leaf {path} of uint8 rows")
      continue
    try:
      values = items.decode_rows(reader.read(path), name)
    except errors.JaxckptError as e:
      damaged.append(f"item {name!r} ({kind}): {e}")
      continue
    if kind == items.GRAIN:
      values = [items.grain_fields(v) for v in values]
    out[name] = {"kind": kind, "values": values}
  return out, damaged


def _item_lines(saved: dict[str, Any]) -> list[str]:
  lines = ["items:"]
  for name, item in saved.items():
    if item["kind"] == items.PYTREE:
      lines.append(f"  {name} (pytree): {item['leaves']} leaves, {human_bytes(item['nbytes'])}"
                   f" under {items.path_of(name)}")
      continue
    for i, value in enumerate(item["values"]):
      who = f", process {i}" if len(item["values"]) > 1 else ""
      if item["kind"] == items.JSON:
        lines.append(f"  {name} (json{who}): {json.dumps(value, sort_keys=True)}")
      else:
        lines.append(f"  {name} (grain iterator state{who}):")
        lines += [f"    {k} = {json.dumps(v, sort_keys=True)}" for k, v in value.items()]
  return lines


def inspect_command(args: argparse.Namespace) -> int:
  """Prints the tree of one step, and its items as saved; returns the exit code."""
  if (why := not_a_checkpoint_root(args.directory, args.step)):
    print(f"jaxckpt inspect: {why}", file=sys.stderr)
    return 2
  try:
    reader = _open(args, args.step)
    saved, damaged = _items(reader)
  except errors.JaxckptError as e:
    print(f"jaxckpt inspect: {e}", file=sys.stderr)
    return 2
  for line in damaged:
    print(f"jaxckpt inspect: DAMAGED {line}", file=sys.stderr)
  if args.json:
    print(json.dumps({"step": reader.step, "metadata": reader.metadata, "items": saved,
                      "leaves": [i.to_obj() for i in reader.leaves.values()]}, indent=1))
    return 1 if damaged else 0
  total = sum(i.nbytes for i in reader.leaves.values())
  steps = _commit.all_steps(args.directory)
  print(f"{args.directory}: step {reader.step} (committed steps: {steps})")
  print(f"written by {reader.process_count} process(es); {len(reader.leaves)} leaves, "
        f"{human_bytes(total)}")
  own = reader.metadata
  if isinstance(own.get(items.TIME_KEY), (int, float)):
    when = datetime.datetime.fromtimestamp(own[items.TIME_KEY], tz=datetime.timezone.utc)
    print(f"saved at {when:%Y-%m-%d %H:%M:%S} UTC")
  if own.get(items.METRICS_KEY) is not None:
    print(f"metrics: {json.dumps(own[items.METRICS_KEY], sort_keys=True)}")
  meta = {k: v for k, v in own.items() if not k.startswith(items.OWN_PREFIX)}
  if meta:
    print(f"metadata: {json.dumps(meta, sort_keys=True)}")
  row_items = {items.path_of(n): k for n, k in items.kinds(reader.metadata).items()
               if k != items.PYTREE and n in saved}
  print("\n".join(_tree_lines(reader, row_items)))
  if saved:
    print("\n".join(_item_lines(saved)))
  return 1 if damaged else 0


def verify_command(args: argparse.Namespace) -> int:
  """Checks every chunk of one step (or all); returns the exit code."""
  if (why := not_a_checkpoint_root(args.directory, args.step, "verify")):
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
    try:
      with progress(args, total, f"verify step {reader.step}") as bar:
        problems = _read.verify_step(reader, progress=bar)
    except errors.StorageError as e:        # refused or unanswered: not damage, not verified
      print(f"jaxckpt verify: step {reader.step} was not verified: {e}", file=sys.stderr)
      return 2
    for line in problems:
      print(f"DAMAGED step {reader.step}: {line}")
    if not problems:
      print(f"step {reader.step}: OK ({len(reader.leaves)} leaves, {bar.summary('verified')})")
    bad += len(problems)
  return 1 if bad else 0


def progress(args: argparse.Namespace, total: int, desc: str) -> Progress:
  """The command's progress on stderr: a bar on a terminal, plain lines otherwise, none
  with ``--no-progress``."""
  return Progress(total, desc, enabled=not getattr(args, "no_progress", False))


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

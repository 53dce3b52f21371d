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
from jaxckpt.util._text import shown

_INSPECT_HELP = """Show a committed step of a universal-format checkpoint directory: the tree
of leaves with shapes, dtypes and sizes, the step, the saving mesh and
PartitionSpec of each leaf, chunk layout and user metadata, and the items of a
step saved with orbax's Composite as the user saved them (a JsonSave item as
its JSON, a Grain iterator's state as its fields). DIR is the checkpoint's root
(it holds commits/ and step_NNNNNNNNNN/ directories): a local path or a
tensorstore URL (gs://, s3://, file://). Reads manifests and item rows only.
Without --step, a newest step that cannot be opened is named (with the command
that deletes it) and the newest intact step is shown, exit 1."""

_VERIFY_HELP = """Read every chunk of every leaf of a committed step and check it against the
checksums in its manifest (xxh3-64 per chunk, crc32c per inner chunk).
Exits 0 if all is intact, 1 naming each damaged leaf and chunk, or a step whose
commit marker or manifest is damaged (it cannot be opened; with --all-steps every
other step is still checked), 2 if there is no such step, or storage refused or did
not answer a read (not damage: nothing is said of the bytes); the command that
deletes a damaged step is named. Shows a progress bar on a terminal (plain lines
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


def _newest_intact(args: argparse.Namespace) -> tuple[_read.StepReader, list[tuple[int, str]]]:
  """The step to show without ``--step``: the newest one that opens, and the newer ones
  that do not (each with why); the newest step's error if none opens."""
  damaged: list[tuple[int, str]] = []
  steps = _commit.all_steps(args.directory)
  for step in reversed(steps):
    try:
      return _open(args, step), damaged
    except (errors.CorruptSnapshotError, errors.ManifestError) as e:
      damaged.append((step, str(e)))
  if damaged:
    raise errors.CorruptSnapshotError(
        f"no committed step of {args.directory!r} can be opened (steps {steps}); the newest: "
        f"{damaged[0][1]}")
  return _open(args, None), damaged      # (none committed: says so)


def _advice(directory: str, steps: list[int]) -> str:
  return ("to remove a damaged step for good: "
          + "; ".join(_commit.delete_command(directory, s) for s in sorted(steps)))


def inspect_command(args: argparse.Namespace) -> int:
  """Prints the tree of one step, and its items as saved; returns the exit code. Without
  ``--step`` a damaged newest step is named and the newest intact one shown (exit 1)."""
  if (why := not_a_checkpoint_root(args.directory, args.step)):
    say(f"jaxckpt inspect: {why}", err=True)
    return 2
  try:
    if args.step is None:
      reader, skipped = _newest_intact(args)
    else:
      reader, skipped = _open(args, args.step), []
    saved, damaged = _items(reader)
  except errors.JaxckptError as e:
    damage = isinstance(e, (errors.CorruptSnapshotError, errors.ManifestError))
    advice = f"; {_advice(args.directory, [args.step])}" if damage and args.step is not None else ""
    say(f"jaxckpt inspect: {e}{advice}", err=True)
    return 2
  for step, why in skipped:
    say(f"jaxckpt inspect: DAMAGED step {step}: {why}", err=True)
  if skipped:
    say(f"jaxckpt inspect: showing step {reader.step}, the newest that is intact; "
        + _advice(args.directory, [s for s, _ in skipped]), err=True)
  for line in damaged:
    say(f"jaxckpt inspect: DAMAGED {line}", err=True)
  bad = 1 if damaged or skipped else 0
  if args.json:
    print(json.dumps({"step": reader.step, "metadata": reader.metadata, "items": saved,
                      "leaves": [i.to_obj() for i in reader.leaves.values()]}, indent=1))
    return bad
  total = sum(i.nbytes for i in reader.leaves.values())
  steps = _commit.all_steps(args.directory)
  say(f"{args.directory}: step {reader.step} (committed steps: {steps})")
  say(f"written by {reader.process_count} process(es); {len(reader.leaves)} leaves, "
      f"{human_bytes(total)}")
  own = reader.metadata
  if isinstance(own.get(items.TIME_KEY), (int, float)):
    when = datetime.datetime.fromtimestamp(own[items.TIME_KEY], tz=datetime.timezone.utc)
    say(f"saved at {when:%Y-%m-%d %H:%M:%S} UTC")
  if own.get(items.METRICS_KEY) is not None:
    say(f"metrics: {json.dumps(own[items.METRICS_KEY], sort_keys=True)}")
  meta = {k: v for k, v in own.items() if not k.startswith(items.OWN_PREFIX)}
  if meta:
    say(f"metadata: {json.dumps(meta, sort_keys=True)}")
  row_items = {items.path_of(n): k for n, k in items.kinds(reader.metadata).items()
               if k != items.PYTREE and n in saved}
  say(*_tree_lines(reader, row_items))
  if saved:
    say(*_item_lines(saved))
  return bad


def verify_command(args: argparse.Namespace) -> int:
  """Checks every chunk of one step (or of every step: a step that cannot be opened is
  reported damaged and the others are checked); returns the exit code."""
  if (why := not_a_checkpoint_root(args.directory, args.step, "verify")):
    say(f"jaxckpt verify: {why}", err=True)
    return 2
  step = args.step
  try:
    if args.all_steps:
      steps: list[Any] = _commit.all_steps(args.directory)
    else:
      step = _commit.latest_step(args.directory) if step is None else step
      steps = [_open(args, step)]
  except errors.JaxckptError as e:
    damage = isinstance(e, (errors.CorruptSnapshotError, errors.ManifestError))
    advice = f"; {_advice(args.directory, [step])}" if damage and step is not None else ""
    say(f"jaxckpt verify: {e}{advice}", err=True)
    return 1 if damage else 2         # (damage found, as in a chunk; else nothing was verified)
  damaged = []
  for step in steps:
    try:
      reader = step if isinstance(step, _read.StepReader) else _open(args, step)
    except (errors.CorruptSnapshotError, errors.ManifestError) as e:
      say(f"DAMAGED step {step}: {e}")
      damaged.append(step)
      continue
    except errors.StorageError as e:        # refused or unanswered: not damage, not verified
      say(f"jaxckpt verify: step {step} was not verified: {e}", err=True)
      return 2
    total = sum(i.nbytes for i in reader.leaves.values())
    try:
      with progress(args, total, f"verify step {reader.step}") as bar:
        problems = _read.verify_step(reader, progress=bar)
    except errors.StorageError as e:        # refused or unanswered: not damage, not verified
      say(f"jaxckpt verify: step {reader.step} was not verified: {e}", err=True)
      return 2
    for line in problems:
      say(f"DAMAGED step {reader.step}: {line}")
    if problems:
      damaged.append(reader.step)
    else:
      say(f"step {reader.step}: OK ({len(reader.leaves)} leaves, {bar.summary('verified')})")
  if damaged:
    say(f"jaxckpt verify: {_advice(args.directory, damaged)}", err=True)
  return 1 if damaged else 0


def say(*lines: Any, err: bool = False) -> None:
  """Prints each line, every character a terminal would act on escaped: names and
  values in a checkpoint are data (:func:`jaxckpt.util._text.shown`)."""
  print("\n".join(shown(str(line)) for line in lines), file=sys.stderr if err else sys.stdout)


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
  return until_stdout_closes(lambda: args.handler(args))


# The exit code of a command whose reader went away (as a command killed by SIGPIPE).
STDOUT_CLOSED = 141


def until_stdout_closes(command: Callable[[], int]) -> int:
  """Runs ``command``; if its reader closes stdout (``jaxckpt inspect DIR | head -1``),
  it ends quietly with :data:`STDOUT_CLOSED`, never a BrokenPipeError traceback."""
  try:
    code = command()
    sys.stdout.flush()
    return code
  except BrokenPipeError:
    # Python flushes stdout again at exit: point it at /dev/null first, so that the
    # flush of what is left is silent too.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return STDOUT_CLOSED


def main(argv: Sequence[str] | None = None) -> int:
  return run("python -m jaxckpt.universal.cli",
             "Inspect and verify universal-format checkpoints.", register, argv)


if __name__ == "__main__":
  sys.exit(main())

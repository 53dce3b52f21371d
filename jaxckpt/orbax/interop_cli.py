"""``jaxckpt import-orbax`` and ``jaxckpt export-orbax``: orbax checkpoints in and out of
the universal format (:mod:`jaxckpt.orbax.interop`, loaded when a command runs).

``jaxckpt/cli.py`` calls :func:`register`; ``python -m jaxckpt.orbax.interop_cli`` runs the
two commands on their own.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from jaxckpt import errors
from jaxckpt.universal import _read
from jaxckpt.universal import convert as cv
from jaxckpt.universal.cli import progress, run
from jaxckpt.universal.convert_cli import EXPECTED, command_parser, fail, src_problem

_IMPORT_HELP = """Copy an orbax checkpoint into a universal-format directory.

ORBAX_DIR is a directory of ocp.CheckpointManager (steps inside; default: the
whole run, every finalized step, each into the step of the same number; --steps
100,200 picks some, --step N one) or one ocp.StandardCheckpointer save. Steps
that DST holds already are refused before anything is copied. (A jaxckpt
manager opened on ORBAX_DIR itself reads orbax's steps where they lie, without
an import.) Every item of a step is
imported (pytree, JSON, array and Grain iterator items), as one Composite
step that the manager restores with args=ocp.args.Composite(...); an item
saved by any other handler is refused, naming it (--item imports one item
alone). Tree, shapes and dtypes come from orbax's metadata; arrays are read
from orbax's tensorstore files chunk by chunk. The result restores onto any
mesh and is readable by any zarr v3 reader."""

_EXPORT_HELP = """Write a committed universal-format step as an orbax checkpoint.

ocp.StandardCheckpointer().restore(ORBAX_DIR) reads the result. The tree is
nested from the leaf paths: ['a'][0].b becomes {'a': [{'b': ...}]}. Arrays
are saved as numpy arrays, scalars as numbers; string leaves and zero-size
arrays, which orbax cannot save, must be dropped with --spec. Orbax holds
the whole tree in host memory while it saves."""


def register(subparsers: argparse._SubParsersAction) -> None:  # pylint: disable=protected-access
  """Adds ``import-orbax`` and ``export-orbax`` to the ``jaxckpt`` command."""
  p = command_parser(subparsers, "import-orbax", _IMPORT_HELP)
  p.add_argument("orbax_dir", metavar="ORBAX_DIR", help="orbax checkpoint directory")
  p.add_argument("dst", metavar="DST", help="universal-format directory to write")
  which = p.add_mutually_exclusive_group()
  which.add_argument("--step", type=int, default=None,
                     help="one orbax step (default: every step, see --steps)")
  which.add_argument("--steps", type=_step_list, default=None, metavar="N,M,...",
                     help="these orbax steps, each into the step of the same number "
                     "(default: every finalized step)")
  p.add_argument("--item", default=None,
                 help="one CheckpointManager item, imported alone (default: every item of the "
                 "step, as one Composite step)")
  p.add_argument("--dst-step", type=int, default=None,
                 help="step to write, for one step (--step, or a bare save; default: the "
                 "orbax step, 0 for a bare save)")
  p.add_argument("--layout", choices=["auto", "nnx", "plain"], default="auto",
                 help="nnx: Flax NNX paths and typed RNG keys, restorable into "
                 "nnx.state(nnx.eval_shape(...)); plain: orbax's paths; auto (default): NNX "
                 "paths for each NNX state in the tree (the whole tree, or e.g. the 'train' "
                 "entry of a dict around it), orbax's paths elsewhere")
  p.set_defaults(handler=import_orbax_command)

  p = command_parser(subparsers, "export-orbax", _EXPORT_HELP)
  p.add_argument("src", metavar="SRC", help="universal-format directory to read")
  p.add_argument("orbax_dir", metavar="ORBAX_DIR", help="orbax checkpoint directory to create")
  p.add_argument("--step", type=int, default=None, help="universal step (default: latest)")
  p.add_argument("--spec", default=None, help="rules file applied on the way")
  p.add_argument("--force", action="store_true", help="overwrite ORBAX_DIR if it exists")
  p.set_defaults(handler=export_orbax_command)


def _step_list(text: str) -> list[int]:
  """``--steps 100,200`` as steps (argparse's type: a clear error names the bad one)."""
  try:
    steps = [int(s) for s in text.split(",") if s.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"--steps {text!r}: expected step numbers separated by commas, e.g. 100,200") from None
  if not steps or min(steps) < 0:
    raise argparse.ArgumentTypeError(f"--steps {text!r}: expected steps >= 0, e.g. 100,200")
  return steps


def import_orbax_command(args: argparse.Namespace) -> int:
  """Runs ``jaxckpt import-orbax``; returns the exit code."""
  from jaxckpt.orbax import interop as ox  # pylint: disable=import-outside-toplevel  (orbax: when run)
  one = args.step is not None or args.dst_step is not None or ox.is_one_save(args.orbax_dir)
  if args.dst_step is not None and args.steps is not None and len(args.steps) != 1:
    return fail("import-orbax", errors.InvalidArgumentError(
        f"--dst-step {args.dst_step} names one step but --steps gives {len(args.steps)}; "
        "import them each into its own number (no --dst-step), or one at a time"))
  try:
    if one:
      step = args.step if args.steps is None else args.steps[0]
      total = ox.orbax_nbytes(args.orbax_dir, step=step, item=args.item)
      with progress(args, total, "import-orbax") as bar:
        done = [ox.import_orbax(args.orbax_dir, args.dst, step=step, item=args.item,
                                dst_step=args.dst_step, progress=bar, layout=args.layout)]
    else:
      steps = ox.run_steps(args.orbax_dir, args.dst, args.steps)   # all checked first
      total = sum(ox.orbax_nbytes(args.orbax_dir, step=s, item=args.item) for s in steps)
      with progress(args, total, "import-orbax") as bar:
        done = ox.import_orbax_steps(args.orbax_dir, args.dst, steps=steps, item=args.item,
                                     progress=bar, layout=args.layout)
  except EXPECTED as e:
    return fail("import-orbax", e)
  what = f"step {done[0]}" if len(done) == 1 else f"steps {done}"
  print(f"imported {args.orbax_dir} into {what} of {args.dst}: {bar.summary('copied')}")
  return 0


def export_orbax_command(args: argparse.Namespace) -> int:
  """Runs ``jaxckpt export-orbax``; returns the exit code."""
  from jaxckpt.orbax import interop as ox  # pylint: disable=import-outside-toplevel  (orbax: when run)
  if (code := src_problem("export-orbax", args.src, args.step)) is not None:
    return code
  try:
    spec = None if args.spec is None else cv.ConversionSpec.load(args.spec)
    reader = _read.open_step(args.src, args.step)
    total = sum(i.nbytes for i in (reader.leaves if spec is None
                                   else cv.apply(spec, reader).leaves).values())
    with progress(args, total, f"export-orbax step {reader.step}") as bar:
      out = ox.export_orbax(args.src, args.orbax_dir, step=reader.step, spec=spec,
                            force=args.force, progress=bar)
  except EXPECTED as e:
    return fail("export-orbax", e)
  except ValueError as e:  # orbax refuses an existing directory without --force, etc.
    return fail("export-orbax", e)
  print(f"wrote orbax checkpoint {out} from step {reader.step} of {args.src}: "
        f"{bar.summary('read')}")
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  return run("python -m jaxckpt.orbax.interop_cli",
             "orbax checkpoints in and out of the universal format.", register, argv)


if __name__ == "__main__":
  sys.exit(main())

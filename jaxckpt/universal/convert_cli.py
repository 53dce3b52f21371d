"""``jaxckpt convert`` (orbax's ``import-orbax`` and ``export-orbax`` are
:mod:`jaxckpt.orbax.interop_cli`'s).

``jaxckpt/cli.py`` calls :func:`register`; ``python -m jaxckpt.universal.convert_cli``
runs the command on its own.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from jaxckpt import errors
from jaxckpt.universal import _read
from jaxckpt.universal import convert as cv
from jaxckpt.universal.cli import human_bytes, not_a_checkpoint_root, progress, run, say

_CONVERT_HELP = """Write a converted copy of a committed step of a universal-format checkpoint.

The conversion is a YAML or JSON file of rules applied in order, each to the
tree the previous ones produced; leaves no rule touches are copied as they
are. Rules: rename, drop, stack/unstack (per-layer leaves <-> a scanned layer
axis), split/concat (fused QKV <-> q, k, v), pad/unpad (a vocabulary padded to
a multiple of the mesh), transpose, reshape, cast and average (copies). Rules
match tree paths like ['params']['layers_0']['w'] with {name} captures, * and
** globs, or re: regular expressions. Example rules.yaml:

  rules:
    - unstack: {src: "['params']['layers']['{p}']", dst: "['params']['layers_{i}']['{p}']"}
    - split: {src: "['params']['layers_{i}']['qkv']", axis: 1,
              dsts: ["['params']['layers_{i}']['q']", "['params']['layers_{i}']['k']",
                     "['params']['layers_{i}']['v']"]}
    - unpad: {src: "['params']['embed']", axis: 0, size: 50257}

Data is read lazily and written chunk by chunk: no tensor is held whole.
A rule that matches nothing, or two rules producing one path, is an error
naming the paths (exit 2). See docs/conversion.md."""

def command_parser(subparsers: argparse._SubParsersAction,  # pylint: disable=protected-access
                   name: str, helptext: str) -> argparse.ArgumentParser:
  """A subcommand that copies data: its help from ``helptext`` and ``--no-progress``."""
  p = subparsers.add_parser(name, help=helptext.split("\n")[0], description=helptext,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--no-progress", action="store_true",
                 help="no progress (a bar on a terminal, plain lines otherwise)")
  return p


def register(subparsers: argparse._SubParsersAction) -> None:  # pylint: disable=protected-access
  """Adds ``convert`` to the ``jaxckpt`` command."""
  p = command_parser(subparsers, "convert", _CONVERT_HELP)
  p.add_argument("src", metavar="SRC", help="universal-format directory to read")
  p.add_argument("dst", metavar="DST", help="universal-format directory to write")
  p.add_argument("--spec", required=True, help="rules file (.yaml, .yml or .json)")
  p.add_argument("--step", type=int, default=None, help="source step (default: latest)")
  p.add_argument("--dst-step", type=int, default=None, help="step to write (default: same)")
  p.add_argument("--dry-run", action="store_true",
                 help="print the converted tree and write nothing")
  p.set_defaults(handler=convert_command)


#: The errors a command reports as a message and exit 2 (never a traceback).
EXPECTED = (errors.JaxckptError, FileNotFoundError, FileExistsError)


def fail(command: str, e: BaseException) -> int:
  """Reports ``e`` as ``jaxckpt COMMAND: ...`` on stderr; returns the exit code, 2."""
  say(f"jaxckpt {command}: {e}", err=True)
  return 2


def src_problem(command: str, src: str, step: int | None) -> int | None:
  """Exit 2 with the reason if ``src`` is not a checkpoint's root (a step directory, a file)."""
  if (why := not_a_checkpoint_root(src, step, command)):
    say(f"jaxckpt {command}: {why}", err=True)
    return 2
  return None


def convert_command(args: argparse.Namespace) -> int:
  """Runs ``jaxckpt convert``; returns the exit code."""
  if (code := src_problem("convert", args.src, args.step)) is not None:
    return code
  try:
    spec = cv.ConversionSpec.load(args.spec)
    view = cv.apply(spec, _read.open_step(args.src, args.step))
    if args.dry_run:
      for path, info in view.leaves.items():
        what = f"{info.dtype} {list(info.shape)}" if info.is_array else f"= {info.scalar!r}"
        say(f"  {path}  {what}")
      print(f"{len(view.leaves)} leaves, {human_bytes(cv.total_nbytes(view))}")
      return 0
    with progress(args, cv.total_nbytes(view), f"convert step {view.step}") as bar:
      step = cv.convert(args.src, args.dst, spec, step=view.step, dst_step=args.dst_step,
                        progress=bar)
  except (*EXPECTED, OSError) as e:
    return fail("convert", e)
  print(f"wrote step {step} of {args.dst}: {len(view.leaves)} leaves "
        f"({len(spec.rules)} rules applied to step {view.step} of {args.src}); "
        f"{bar.summary('written')}")
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  return run("python -m jaxckpt.universal.convert_cli",
             "Convert universal checkpoints.", register, argv)


if __name__ == "__main__":
  sys.exit(main())

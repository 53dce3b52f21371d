"""``jaxckpt simulate``: the door to the goodput simulator, which is not in the wheel.

The simulator (a discrete-event model of a job under failures, the paper's figures it
reproduces, its plots: ``tools/goodput/`` in the repository) is research code; what users
choose options with, ``jaxckpt plan``, needs only the closed forms, which ship. Run from
a checkout (``python -m jaxckpt``, an editable install), ``jaxckpt simulate`` finds the
simulator beside the package and runs it; from a wheel it says where it lives.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import sys
from types import ModuleType

#: The checkout this jaxckpt runs from, if it runs from one (its ``tools/goodput/``).
ROOT = pathlib.Path(__file__).resolve().parents[2]
SIMULATOR = ROOT / "tools" / "goodput" / "simulate_cli.py"
REPOSITORY = "https://github.com/jaxckpt/jaxckpt"


def simulator_cli() -> ModuleType | None:
  """``tools.goodput.simulate_cli`` of the checkout this jaxckpt runs from; None when it
  runs from a wheel (no checkout around it)."""
  if not SIMULATOR.is_file():
    return None
  if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))          # (after site-packages: an installed jaxckpt stays first)
  return importlib.import_module("tools.goodput.simulate_cli")


def register_cli(subparsers: argparse._SubParsersAction) -> None:
  """Adds ``jaxckpt simulate``: the simulator's own, or one that says where it is."""
  cli = simulator_cli()
  if cli is not None:
    cli.register_cli(subparsers)
    return
  parser = subparsers.add_parser(      # (every argument, --help too, gets the same answer)
      "simulate", help="goodput simulator (research code: run it from a jaxckpt checkout)",
      description=_not_here_text(), prefix_chars="\0", add_help=False)
  parser.add_argument("given", nargs="*", help=argparse.SUPPRESS)
  parser.set_defaults(func=_not_here)


def _not_here_text() -> str:
  return (f"jaxckpt simulate: the goodput simulator is research code kept in the repository "
          f"(tools/goodput/), not in the installed package ({ROOT / 'jaxckpt'}); run it from a "
          f"checkout: git clone {REPOSITORY} && cd jaxckpt && python -m jaxckpt simulate ... "
          "(`jaxckpt plan` chooses options without it)")


def _not_here(args: argparse.Namespace) -> int:
  del args
  print(_not_here_text(), file=sys.stderr)
  return 2

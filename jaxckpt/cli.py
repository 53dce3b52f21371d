"""The `jaxckpt` command: one subcommand per task, each with its own --help."""

from __future__ import annotations

import argparse
import re
import sys

from jaxckpt import goodput
from jaxckpt.agent.commands import cli as agent_cli
from jaxckpt.agent.commands import delete_cli, status_cli
from jaxckpt.ft import cli as ft_cli
from jaxckpt.goodput import plan as goodput_plan
from jaxckpt.orbax import interop_cli
from jaxckpt.universal import cli as universal_cli
from jaxckpt.universal import convert_cli


_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain_text(text: str) -> str:
  """Docstring reStructuredText as terminal text: Sphinx roles and double backticks dropped."""
  return _LITERAL.sub(r"\1", _ROLE.sub(r"\1", text))


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="jaxckpt",
      description="Multi-level, fault-tolerant checkpoints for JAX: snapshot agents, "
                  "universal checkpoints on storage, replica-group tooling.")
  sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
  status_cli.register(sub)
  agent_cli.register(sub)
  universal_cli.register(sub)
  delete_cli.register(sub)
  convert_cli.register(sub)
  interop_cli.register(sub)
  ft_cli.register(sub)
  goodput.register_cli(sub)
  goodput_plan.register_cli(sub)
  for parser in sub.choices.values():  # subcommand help is plain text, whatever markup its docstring has
    if parser.description:
      parser.description = plain_text(parser.description)
    if parser.epilog:
      parser.epilog = plain_text(parser.epilog)
  return p


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  fn = getattr(args, "func", None) or getattr(args, "handler")
  return universal_cli.until_stdout_closes(lambda: int(fn(args) or 0))


if __name__ == "__main__":
  sys.exit(main())

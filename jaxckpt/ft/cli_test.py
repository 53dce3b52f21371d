"""The ``lighthouse`` subcommand as the lead's argparse CLI will see it."""

import argparse

from jaxckpt.ft import cli


def test_register_adds_lighthouse_with_its_options():
  parser = argparse.ArgumentParser(prog="jaxckpt")
  cli.register(parser.add_subparsers(dest="command"))
  args = parser.parse_args(["lighthouse", "--bind", "127.0.0.1:29510", "--min-replicas", "2",
                            "--heartbeat-timeout", "3"])
  assert (args.command, args.bind, args.min_replicas, args.heartbeat_timeout) == (
      "lighthouse", "127.0.0.1:29510", 2, 3.0)
  assert args.func is cli.run_lighthouse

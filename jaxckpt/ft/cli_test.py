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


def test_the_lighthouse_command_refuses_to_run_without_the_jobs_secret(monkeypatch, tmp_path):
  import pytest  # pylint: disable=import-outside-toplevel
  from jaxckpt import errors  # pylint: disable=import-outside-toplevel
  monkeypatch.delenv("JAXCKPT_JOB_SECRET", raising=False)
  parser = argparse.ArgumentParser(prog="jaxckpt")
  cli.register(parser.add_subparsers(dest="command"))
  with pytest.raises(errors.InvalidArgumentError, match="JAXCKPT_JOB_SECRET"):
    cli.run_lighthouse(parser.parse_args(["lighthouse", "--bind", "127.0.0.1:0"]))
  loose = tmp_path / "secret"
  loose.write_text("s3cret")
  loose.chmod(0o644)
  with pytest.raises(errors.PermissionDeniedError, match="chmod 600"):
    cli.run_lighthouse(parser.parse_args(["lighthouse", "--bind", "127.0.0.1:0",
                                          "--secret-file", str(loose)]))

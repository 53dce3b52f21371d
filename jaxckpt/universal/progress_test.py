"""The long commands (`convert`, `import-orbax`, `export-orbax`, `verify`) show a bar on a
terminal and plain lines otherwise, and end with the bytes, seconds and GB/s."""

from __future__ import annotations

import argparse
import fcntl
import io
import logging
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import threading
import time

import numpy as np
import pytest

import jaxckpt.universal as u
from tests.support import fixtures as _fixtures
from jaxckpt.orbax import interop_cli
from jaxckpt.universal import cli, convert_cli
from jaxckpt.util import _progress

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
W = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)      # 64 KiB
SUMMARY = r"(\d+\.\d) KiB {verb} in (\d+\.\d\d) s, ([0-9.e+-]+) GB/s"


@pytest.fixture(scope="module")
def src(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("progress") / "src")
  leaves = {"['a']": W, "['b']": W[::-1].copy(), "['c']": W[:128].copy(), "['step']": 5}
  for manifest, buf in _fixtures.host_snapshots(5, leaves):
    u.write_process_shards(d, manifest, buf, attempt="t", merged_chunk_bytes=0)
  u.commit_step(d, 5, process_count=1, timeout_secs=10, attempt="t")
  return d


def run(module, *argv):
  parser = argparse.ArgumentParser()
  module.register(parser.add_subparsers(dest="cmd", required=True))
  args = parser.parse_args(list(argv))
  return args.handler(args)


def _plain_lines(err: str, desc: str) -> list[int]:
  """The percentages of the plain progress lines of ``desc``, in order."""
  pcts = [int(m.group(1)) for m in re.finditer(rf"^{re.escape(desc)}: .* of .* \((\d+)%\)$", err,
                                                re.M)]
  assert pcts and pcts == sorted(pcts) and pcts[-1] == 100, err
  return pcts


def test_verify_without_a_terminal_prints_plain_lines_and_the_rate(src, capsys):
  assert run(cli, "verify", src) == 0
  out, err = capsys.readouterr()
  _plain_lines(err, "verify step 5")
  assert "\r" not in err and "\x1b[" not in err
  m = re.search(r"step 5: OK \(4 leaves, " + SUMMARY.format(verb="verified") + r"\)", out)
  assert m and float(m.group(1)) == 160.0
  secs, gbps = float(m.group(2)), float(m.group(3))     # seconds shown to 0.01 s
  assert gbps > 0 and abs(gbps * 1e9 * secs - 160 * 1024) <= gbps * 1e9 * 0.005 + 0.01 * 160 * 1024


def test_convert_import_and_export_print_lines_and_rates(src, tmp_path, capsys):
  spec = tmp_path / "r.json"
  spec.write_text('{"rules": [{"op": "rename", "src": "[\'a\']", "dst": "[\'z\']"}]}')
  assert run(convert_cli, "convert", src, str(tmp_path / "dst"), "--spec", str(spec)) == 0
  out, err = capsys.readouterr()
  _plain_lines(err, "convert step 5")
  assert re.search(r"; " + SUMMARY.format(verb="written") + "$", out.strip())
  assert run(interop_cli, "export-orbax", src, str(tmp_path / "ob"), "--spec", str(spec)) == 0
  out, err = capsys.readouterr()
  _plain_lines(err, "export-orbax step 5")
  assert re.search(r": " + SUMMARY.format(verb="read") + "$", out.strip())
  assert run(interop_cli, "import-orbax", str(tmp_path / "ob"), str(tmp_path / "back")) == 0
  out, err = capsys.readouterr()
  _plain_lines(err, "import-orbax")
  assert re.search(r": " + SUMMARY.format(verb="copied") + "$", out.strip())
  np.testing.assert_array_equal(u.open_step(str(tmp_path / "back"), 0).read("['z']"), W)


def test_no_progress_prints_only_the_result(src, capsys):
  assert run(cli, "verify", src, "--no-progress") == 0
  out, err = capsys.readouterr()
  assert err == "" and "step 5: OK" in out


def test_on_a_terminal_it_is_a_bar(src):
  leader, follower = pty.openpty()
  fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))   # 120 x 24
  proc = subprocess.Popen([sys.executable, "-m", "jaxckpt", "verify", src],
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=follower,
                          env=dict(os.environ, PYTHONPATH=REPO, COLUMNS="120"))
  os.close(follower)
  err = b""
  try:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
      if select.select([leader], [], [], 0.5)[0]:
        try:
          chunk = os.read(leader, 65536)
        except OSError:
          break
        if not chunk:
          break
        err += chunk
      elif proc.poll() is not None:
        break
    out, _ = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    os.close(leader)
  text = err.decode(errors="replace")
  assert proc.returncode == 0, text
  assert "\r" in text and "verify step 5: 100%|" in text and "160k/160k" in text
  assert not re.search(r"^verify step 5: .* of .* \(\d+%\)", text, re.M)   # no plain lines
  assert b"step 5: OK (4 leaves, 160.0 KiB verified in " in out


def test_without_a_terminal_a_slow_job_still_reports_every_so_often(monkeypatch):
  out = io.StringIO()
  monkeypatch.setattr(_progress, "LINE_EVERY_SECS", 0.0)
  with _progress.Progress(10**6, "slow", stream=out) as p:
    for _ in range(3):
      p.update(1000)                     # 0.1% each: no new tenth, but the interval passed
  assert out.getvalue().splitlines() == ["slow: 1000 B of 976.6 KiB (0%)",
                                         "slow: 2.0 KiB of 976.6 KiB (0%)",
                                         "slow: 2.9 KiB of 976.6 KiB (0%)"]


class _Lines(logging.Handler):
  """The messages a logger says, and a condition to wait for them."""

  def __init__(self):
    super().__init__(logging.INFO)
    self.said: list[str] = []
    self.cv = threading.Condition()

  def emit(self, record):
    with self.cv:
      self.said.append(record.getMessage())
      self.cv.notify_all()

  def wait_for(self, n: int, timeout_secs: float) -> list[str]:
    with self.cv:
      assert self.cv.wait_for(lambda: len(self.said) >= n, timeout_secs), (
          f"{len(self.said)} progress lines within {timeout_secs} s, not {n}: {self.said}")
      return list(self.said)


def test_log_progress_says_a_line_every_interval_while_nothing_is_done():
  # Work that completes nothing for a while (a persist draining its writes) still says
  # where it stands each interval, with the bytes still in flight; nothing after close.
  log = logging.getLogger("jaxckpt.test_progress")
  lines = _Lines()
  log.addHandler(lines)
  log.setLevel(logging.INFO)
  try:
    p = _progress.LogProgress(log, "persisting step 3", 4 << 20, every_secs=0.2,
                              verb="written", in_flight=lambda: 3 << 20)
    p.update(1 << 20)                   # then nothing more completes
    said = lines.wait_for(2, 30)
    p.close()
    n = len(lines.said)
    pattern = (r"persisting step 3: 1\.0 MiB of 4\.0 MiB written \(25%\) in ([\d.]+) s, "
               r"[\d.e+-]+ GB/s; 3\.0 MiB handed to storage, not yet on it")
    secs = [float(re.fullmatch(pattern, m).group(1)) for m in said[:2]]
    assert secs[0] >= 0.2 and secs[1] - secs[0] >= 0.19, said   # never before it is due
    with lines.cv:
      assert not lines.cv.wait_for(lambda: len(lines.said) > n, 0.5), lines.said
  finally:
    log.removeHandler(lines)

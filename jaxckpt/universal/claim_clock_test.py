"""A writer waiting for another writer's commit claim while its host's clock jumps
(libfaketime; every clock of that process, monotonic too): a jump two minutes forward
takes no live writer's claim, a jump an hour back keeps no dead writer's claim for that hour.

Before each look counted at most ``CLAIM_LOOK_CAP_SECS`` towards a claim's lapse, the
waiter compared its clock now with the clock of its first sight of the claim: two
minutes forward and a live claim lapsed at the next look (two writers held the step),
an hour back and a dead one stayed for an hour.

Needs libfaketime (``apt-get install -y faketime``); the tests fail, never skip, without it.
"""

from __future__ import annotations

import glob
import json
import os
import queue
import subprocess
import sys
import threading
import time

import pytest

from jaxckpt.universal import _commit
from jaxckpt.universal import _layout as lay

INSTALL = "apt-get install -y faketime"
LIBS = ("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1")
STEP = 7

WAITER = r'''
import sys
from jaxckpt.universal import _commit, _layout as lay
directory, step = sys.argv[1], int(sys.argv[2])
kv = lay.open_kvstore(directory)
print("WAITING", flush=True)
with _commit._claimed(kv, directory, step, "w-waiter", 300.0):
  print("ACQUIRED", flush=True)
'''


def _libfaketime() -> str:
  for lib in LIBS:
    if os.path.exists(lib):
      return lib
  pytest.fail(f"libfaketime is not installed ({INSTALL})")


class Waiter:
  """The waiting writer, in a process whose clocks follow ``control`` (a faketime offset)."""

  def __init__(self, tmp_path, directory: str) -> None:
    self.control = str(tmp_path / "faketime")
    with open(self.control, "w") as f:
      f.write("+0\n")
    prog = tmp_path / "waiter.py"
    prog.write_text(WAITER)
    env = {**os.environ, "LD_PRELOAD": _libfaketime(), "FAKETIME_TIMESTAMP_FILE": self.control,
           "FAKETIME_NO_CACHE": "1", "JAX_PLATFORMS": "cpu"}
    self.p = subprocess.Popen([sys.executable, str(prog), directory, str(STEP)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    self.lines: queue.Queue[str] = queue.Queue()
    self.said: list[str] = []
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self) -> None:
    for line in self.p.stdout:
      self.lines.put(line.strip())

  def wait_for(self, word: str, timeout: float) -> float:
    """Real seconds until the waiter says ``word``; fails naming what it said."""
    t0 = time.monotonic()
    while True:
      left = timeout - (time.monotonic() - t0)
      try:
        line = self.lines.get(timeout=max(0.01, left))
      except queue.Empty:
        line = None
      if line is not None:
        self.said.append(line)
        if line == word:
          return time.monotonic() - t0
      if time.monotonic() - t0 > timeout:
        raise AssertionError(f"the waiter did not say {word} within {timeout} s; it said "
                             f"{self.said[-10:]}")

  def said_now(self) -> list[str]:
    while not self.lines.empty():
      self.said.append(self.lines.get())
    return self.said

  def jump(self, offset: str) -> None:
    with open(self.control + ".new", "w") as f:
      f.write(offset + "\n")
    os.replace(self.control + ".new", self.control)

  def close(self) -> None:
    if self.p.poll() is None:
      self.p.kill()
    self.p.wait(timeout=30)


def _looked(directory: str, timeout: float = 120) -> None:
  """Until the waiter has looked at the other claims once: its claim put, withdrawn (it saw
  another claim) and put again."""
  t0 = time.monotonic()
  where = os.path.join(directory, lay.claims_prefix(STEP), "w-waiter")
  for present in (True, False, True):
    while os.path.exists(where) != present:
      assert time.monotonic() - t0 < timeout, f"the waiter did not look at the claims in {timeout} s"
      time.sleep(0.002)


@pytest.mark.timeout(300)
def test_a_clock_jumped_forward_takes_no_live_writers_claim(tmp_path):
  d = str(tmp_path / "ckpt")
  kv = lay.open_kvstore(d)
  holder = _commit._Claim(kv, lay.claims_prefix(STEP) + "w-holder", "w-holder", STEP)
  holder.put()
  waiter = Waiter(tmp_path, d)
  try:
    waiter.wait_for("WAITING", 120)
    _looked(d)
    # two minutes forward, right after its first look (a jump past the wait's own timeout
    # ends the wait early: SnapshotTimeoutError, nothing committed)
    waiter.jump("+120")
    # the holder lives: it renews every 2 s (within the 6 s lapse) for 15 s
    end = time.monotonic() + 15
    while time.monotonic() < end:
      time.sleep(2)
      holder.put()
      assert "ACQUIRED" not in waiter.said_now(), "the waiter took a live writer's claim"
    assert "ACQUIRED" not in waiter.said_now(), "the waiter took a live writer's claim"
    os.unlink(os.path.join(d, lay.claims_prefix(STEP), "w-holder"))    # the holder is done
    waiter.wait_for("ACQUIRED", 60)
  finally:
    waiter.close()


@pytest.mark.timeout(300)
def test_a_clock_jumped_back_keeps_no_dead_writers_claim_for_long(tmp_path):
  d = str(tmp_path / "ckpt")
  kv = lay.open_kvstore(d)
  kv.write(lay.claims_prefix(STEP) + "w-dead", json.dumps(
      {"attempt": "w-dead", "at": time.time(), "renewal": 1}).encode()).result(timeout=60)
  waiter = Waiter(tmp_path, d)
  try:
    waiter.wait_for("WAITING", 120)
    _looked(d)
    waiter.jump("-3600")                  # an hour back, right after its first look
    secs = waiter.wait_for("ACQUIRED", 90)   # the 6 s lapse, on a loaded machine
    assert secs < 90
  finally:
    waiter.close()

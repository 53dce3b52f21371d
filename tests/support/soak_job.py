"""The chaos soak's job: its trainer processes (each one's stdout parsed into events by a
thread) and one incarnation of the 4-process job that waits on them. Used by
:mod:`tests.support.soak`, which runs the schedule."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable

from jaxckpt.testing import processes

if TYPE_CHECKING:
  from tests.support.soak import Soak

HOSTS = 4
PERSIST_INTERVAL = 5
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# tensorstore's S3 client logs these at every persist: kept in the logs, not in the tails
_NOISE = re.compile(r"\.aws/|AuthCredentialsProvider|Gloo\]")


@contextlib.contextmanager
def _endpoint(url: str):
  """``AWS_ENDPOINT_URL`` is ``url`` for the body (the trainers and agents inherit it)."""
  old = os.environ.get("AWS_ENDPOINT_URL")
  os.environ["AWS_ENDPOINT_URL"] = url
  try:
    yield
  finally:
    if old is None:
      os.environ.pop("AWS_ENDPOINT_URL", None)
    else:
      os.environ["AWS_ENDPOINT_URL"] = old


class SoakError(RuntimeError):
  """The soak could not go on (a wait timed out); names what it waited for."""


class TrainerDied(SoakError):
  """A trainer exited when none was expected to (an unplanned failure)."""


class Trainer:
  """One trainer process; its stdout lines are parsed by a thread into events."""

  def __init__(self, job: "Job", index: int, argv: list[str], log_path: str) -> None:
    self.job, self.index = job, index
    self.log = open(log_path, "a", buffering=1)  # pylint: disable=consider-using-with
    self.p = subprocess.Popen([sys.executable, "-m", "tests.support.soak_worker", *argv],
                              # native libraries' logs (tensorstore's S3 client, gloo) go to
                              # the log file: a line of theirs written through one of the
                              # trainer's own lines made the soak miss it (RESTORED lost)
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=self.log, text=True, bufsize=1, cwd=REPO,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"})
    self.tail: collections.deque[str] = collections.deque(maxlen=60)
    self.restored: tuple[int, str, str, float] | None = None
    self.fresh = False
    self.available: set[int] | None = None
    self.last_step: int | None = None
    self.saved: dict[int, bool] = {}
    self.agent_restarts = 0
    self.skipped = 0
    self.save_errors: list[str] = []
    self.reported: set[tuple[int, int]] = set()   # (incarnation, step) an error said was lost
    self.deleted: int | None = None
    self.after_delete: set[int] = set()           # what it could restore after its delete
    self.damaged_skipped: list[int] = []
    self.second: tuple[str, str] | None = None
    self.stopped: int | None = None
    self.done = False
    self.error: str | None = None
    self.expect_exit = False
    self.reader = threading.Thread(target=self._read, daemon=True,
                                   name=f"soak-trainer{index}")
    self.reader.start()

  def _read(self) -> None:
    for line in self.p.stdout:
      self.log.write(line)
      line = line.rstrip("\n")
      if not _NOISE.search(line):
        self.tail.append(line)
      w = line.split()
      with self.job.cond:
        if not w:
          pass
        elif w[0] == "STEP" and len(w) == 5:
          s = int(w[1])
          self.saved[s] = w[2] == "1"
          self.last_step, self.agent_restarts, self.skipped = s, int(w[3]), int(w[4])
        elif w[0] == "RESTORED" and len(w) == 5:
          self.restored = (int(w[1]), w[2], w[3], float(w[4]))
          self.last_step = int(w[1])
        elif w[0] == "AVAILABLE" and len(w) == 2:
          self.available = set() if w[1] == "-" else {int(x) for x in w[1].split(",")}
        elif w[0] == "FRESH":
          self.fresh, self.last_step = True, 0
        elif w[0] == "SAVE_ERROR":
          self.save_errors.append(line)
        elif w[0] == "DELETED" and len(w) == 3:
          self.deleted = int(w[1])
          self.after_delete = set() if w[2] == "-" else {int(x) for x in w[2].split(",")}
        elif w[0] == "DAMAGED_SKIPPED" and len(w) == 2:
          self.damaged_skipped = [int(x) for x in w[1].split(",")]
        elif w[0] == "SECOND" and len(w) == 3:
          self.second = (w[1], w[2])
        elif w[0] == "STOPPED":
          self.stopped = int(w[1])
        elif w[0] == "DONE":
          self.done = True
        elif w[0] == "ERROR" and self.error is None:
          self.error = line
        self.job.cond.notify_all()
    self.p.wait()
    with self.job.cond:
      self.job.cond.notify_all()

  def send(self, line: str) -> None:
    with contextlib.suppress(OSError):
      self.p.stdin.write(line + "\n")
      self.p.stdin.flush()

  def kill(self) -> None:
    """SIGKILL (by pid: our own child) and reap."""
    self.expect_exit = True
    if self.p.poll() is None:
      with contextlib.suppress(ProcessLookupError):
        os.kill(self.p.pid, signal.SIGKILL)
    self.p.wait(timeout=60)

  def close(self) -> None:
    self.kill()
    self.reader.join(timeout=30)
    for f in (self.p.stdin, self.p.stdout, self.log):
      with contextlib.suppress(OSError):
        f.close()


class Job:
  """One incarnation of the 4-process job."""

  def __init__(self, soak: "Soak", incarnation: int, *, fresh: bool) -> None:
    self.soak, self.incarnation = soak, incarnation
    self.cond = threading.Condition()
    port = processes.free_port()
    self.trainers: list[Trainer] = []
    self.t0 = time.monotonic()
    for i in range(HOSTS):
      root, address = soak.machine(i)
      argv = ["--port", str(port), "--num-processes", str(HOSTS), "--process-id", str(i),
              "--run-root", root, "--tcp-host", address, "--job", soak.job_name,
              "--directory", soak.directory, "--seed", str(soak.seed),
              "--steps", str(soak.steps), "--rows", str(soak.rows), "--cols", str(soak.cols),
              "--persist-interval", str(PERSIST_INTERVAL), "--run-ahead", "0",
              "--history", soak.history_dir, "--incarnation", str(incarnation)]
      argv += ["--fresh"] if fresh else []       # (each holds before its first step: GO)
      self.trainers.append(Trainer(self, i, argv, os.path.join(
          soak.log_dir, f"inc{incarnation:02d}-p{i}.log")))

  def wait(self, pred: Callable[[], bool], timeout: float, what: str) -> None:
    """Waits for ``pred`` (checked on every event); TrainerDied if a trainer
    exited unexpectedly, SoakError naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    with self.cond:
      while not pred():
        dead = [t for t in self.trainers if t.p.poll() is not None and not t.expect_exit
                and not t.done and t.stopped is None]
        if dead:
          t = dead[0]
          raise TrainerDied(f"incarnation {self.incarnation}: trainer {t.index} exited with "
                            f"{t.p.returncode} while waiting for {what}: "
                            f"{t.error or 'no ERROR line'}")
        left = deadline - time.monotonic()
        if left <= 0:
          raise SoakError(f"incarnation {self.incarnation}: timed out after {timeout} s "
                          f"waiting for {what}; trainers at steps "
                          f"{[t.last_step for t in self.trainers]}\n" + self.tails())
        self.cond.wait(min(left, 0.5))

  def tails(self, n: int = 15) -> str:
    return "\n".join(f"--- trainer {t.index} (pid {t.p.pid}, exit {t.p.poll()}):\n" +
                     "\n".join(list(t.tail)[-n:]) for t in self.trainers)

  def progress(self) -> int:
    """The newest step every trainer has gone past (saved or skipped)."""
    steps = [t.last_step for t in self.trainers]
    return -1 if None in steps else min(steps)

  def furthest(self) -> int:
    return max((t.last_step or 0) for t in self.trainers)

  def complete_steps(self) -> list[int]:
    """Steps whose snapshot committed on every host in this incarnation."""
    common = set.intersection(*({s for s, ok in t.saved.items() if ok} for t in self.trainers))
    return sorted(common)

  def send(self, line: str) -> None:
    for t in self.trainers:
      t.send(line)

  def kill(self) -> None:
    for t in self.trainers:
      t.kill()

  def close(self) -> None:
    for t in self.trainers:
      t.close()

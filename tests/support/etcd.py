"""A real etcd cluster for tests: N members (3 by default) on loopback ports picked at run time.

The ``etcd`` binary is Debian's ``etcd-server`` package (3.4; ``apt-get install
-y etcd-server``, which ``.ci/run`` does before the README's commands). A test
that needs it fails, never skips, when it is missing: the message says how to
install it.

>>> with EtcdCluster(3) as cluster:               # doctest: +SKIP
...   client = Etcd(cluster.endpoints)
...   cluster.kill(0)                              # SIGKILL of member 0, by pid
...   cluster.restart(0)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

from jaxckpt import errors

INSTALL = "apt-get install -y etcd-server"


def etcd_binary() -> str:
  """The ``etcd`` executable; StorageError naming how to install it when there is none."""
  path = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
  if path is None:
    raise errors.StorageError(f"the `etcd` binary is missing: install Debian's etcd-server ({INSTALL}; "
                              ".ci/run does) to run the control plane's tests")
  return path


def _free_port(host: str) -> int:
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


class EtcdCluster:
  """``n`` etcd members on ``host``; a context manager. Entering starts them and waits
  until the cluster answers a write (a condition, not a time); exiting kills every
  member it started (by pid) and removes their data, also when the body failed.

  Fast elections for tests: 50 ms heartbeats, a 500 ms election timeout (the
  shortest lease is then 1 s). Data under ``/dev/shm`` when there is one (its
  fsyncs cost nothing: etcd 3.4 has no flag to skip them).

  Attributes:
    endpoints: each member's client URL (``http://HOST:PORT``), in member order.
  """

  def __init__(self, n: int = 3, *, host: str = "127.0.0.1", start_timeout_secs: float = 60.0,
               heartbeat_ms: int = 50, election_ms: int = 500) -> None:
    self.n, self.host, self.start_timeout_secs = n, host, start_timeout_secs
    self._heartbeat, self._election = heartbeat_ms, election_ms
    self._dir: str | None = None
    self._procs: list[subprocess.Popen | None] = [None] * n
    self._client = [_free_port(host) for _ in range(n)]
    self._peer = [_free_port(host) for _ in range(n)]
    self.endpoints = [f"http://{host}:{p}" for p in self._client]

  def __enter__(self) -> EtcdCluster:
    etcd_binary()
    self._dir = tempfile.mkdtemp(prefix="jaxckpt-etcd-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
      for i in range(self.n):
        self._start(i, "new")
      self.wait_healthy()
    except BaseException:
      self._stop_all()
      raise
    return self

  def __exit__(self, *exc) -> None:
    self._stop_all()

  def pid(self, i: int) -> int:
    return self._procs[i].pid

  def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
    """Sends ``sig`` to member ``i`` (its pid); SIGKILL also waits for it to end."""
    proc = self._procs[i]
    with contextlib.suppress(ProcessLookupError):
      os.kill(proc.pid, sig)
    if sig == signal.SIGKILL:
      proc.wait(timeout=30)

  def restart(self, i: int) -> None:
    """Starts member ``i`` again on its data (after :meth:`kill`)."""
    if self._procs[i] is not None and self._procs[i].poll() is None:
      self.kill(i)
    self._start(i, "existing")

  def wait_healthy(self, timeout_secs: float | None = None) -> None:
    """Waits until every running member serves a read through the cluster's leader."""
    deadline = time.monotonic() + (timeout_secs or self.start_timeout_secs)
    for i, proc in enumerate(self._procs):
      if proc is None or proc.poll() is not None:
        continue
      last = None
      while True:
        if proc.poll() is not None:
          raise errors.StorageError(f"etcd member {i} exited with {proc.returncode} while starting; "
                                    f"its log: {self._log(i)}")
        try:
          req = urllib.request.Request(f"{self.endpoints[i]}/v3/kv/range", data=b'{"key": "AA=="}',
                                       method="POST")
          with urllib.request.urlopen(req, timeout=2) as r:
            if r.status == 200:
              break
        except OSError as e:
          last = e
        if time.monotonic() > deadline:
          raise errors.SnapshotTimeoutError(f"etcd member {i} ({self.endpoints[i]}) did not serve within "
                                            f"{self.start_timeout_secs} s (last: {last}); log: {self._log(i)}")
        time.sleep(0.05)

  def _start(self, i: int, state: str) -> None:
    names = [f"m{j}" for j in range(self.n)]
    cluster = ",".join(f"{names[j]}=http://{self.host}:{self._peer[j]}" for j in range(self.n))
    cmd = [etcd_binary(), "--name", names[i], "--data-dir", os.path.join(self._dir, names[i]),
           "--listen-client-urls", self.endpoints[i], "--advertise-client-urls", self.endpoints[i],
           "--listen-peer-urls", f"http://{self.host}:{self._peer[i]}",
           "--initial-advertise-peer-urls", f"http://{self.host}:{self._peer[i]}",
           "--initial-cluster", cluster, "--initial-cluster-state", state,
           "--initial-cluster-token", os.path.basename(self._dir),
           "--heartbeat-interval", str(self._heartbeat), "--election-timeout", str(self._election),
           "--logger", "zap", "--log-outputs", os.path.join(self._dir, f"{names[i]}.log")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
    self._procs[i] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)

  def _log(self, i: int) -> str:
    try:
      with open(os.path.join(self._dir, f"m{i}.log"), encoding="utf-8", errors="replace") as f:
        return f.read()[-1500:]
    except OSError:
      return "(none)"

  def _stop_all(self) -> None:
    for proc in self._procs:
      if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
          os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    if self._dir is not None:
      shutil.rmtree(self._dir, ignore_errors=True)

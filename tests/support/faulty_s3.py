"""Storage that fails chosen requests: an HTTP proxy on loopback in front of a real S3
server (``SeaweedS3``) that answers some requests itself, as a failing S3 does:
``503 SlowDown``, ``500 InternalError``, or a connection reset (closed with RST, no
answer); every other request is the real server's.

A :class:`Fault` names which requests fail (an HTTP method, a substring of the path)
and how, for its first ``count`` matches or every ``every``-th. Each request goes to
the server on a connection of its own (the answer says ``Connection: close``).

>>> with SeaweedS3() as s3, FaultyS3Proxy(s3.endpoint) as proxy:   # doctest: +SKIP
...   proxy.fail(Fault("503", method="PUT", path="/arrays/", every=2))
...   os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import struct
import threading
import time
import urllib.parse

from jaxckpt import errors

_BODIES = {
    "503": (b"503 Slow Down", b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown"
            b"</Code><Message>Please reduce your request rate.</Message></Error>"),
    "500": (b"500 Internal Server Error", b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error>"
            b"<Code>InternalError</Code><Message>We encountered an internal error. Please try "
            b"again.</Message></Error>"),
}
HOW = ("503", "500", "reset")


@dataclasses.dataclass
class Fault:
  """Requests matching ``method`` (None: any) whose path contains ``path`` fail ``how``
  (one of :data:`HOW`): the first ``count`` of them (None: all), or every ``every``-th."""

  how: str
  method: str | None = None
  path: str = ""
  count: int | None = None
  every: int = 1
  matched: int = 0
  served: int = 0

  def __post_init__(self) -> None:
    if self.how not in HOW:
      raise errors.InvalidArgumentError(f"Fault(how={self.how!r}): one of {HOW}")

  def applies(self, method: str, path: str) -> bool:
    if (self.method is not None and method != self.method) or self.path not in path:
      return False
    self.matched += 1
    if self.count is not None and self.served >= self.count:
      return False
    if self.matched % self.every:
      return False
    self.served += 1
    return True


class FaultyS3Proxy:
  """A context manager: ``endpoint`` forwards to ``target`` (``http://host:port``) but
  for the requests :meth:`fail` names. Exiting closes every connection."""

  def __init__(self, target: str, *, host: str = "127.0.0.1") -> None:
    url = urllib.parse.urlsplit(target)
    if not url.hostname or not url.port:
      raise errors.InvalidArgumentError(
          f"FaultyS3Proxy(target={target!r}): give the server as http://HOST:PORT")
    self._target = (url.hostname, url.port)
    self._faults: list[Fault] = []
    self._lock = threading.Lock()
    self._listener = socket.create_server((host, 0))
    self.endpoint = f"http://{host}:{self._listener.getsockname()[1]}"
    self._threads: list[threading.Thread] = []
    self._socks: set[socket.socket] = set()
    self._closed = False
    self.requests = 0

  def fail(self, *faults: Fault) -> None:
    """From now on, these faults (replacing any before)."""
    with self._lock:
      self._faults = list(faults)

  def heal(self) -> None:
    self.fail()

  def __enter__(self) -> "FaultyS3Proxy":
    self._start(self._accept)
    return self

  def __exit__(self, *exc: object) -> None:
    self._closed = True
    with contextlib.suppress(OSError):
      self._listener.shutdown(socket.SHUT_RDWR)     # wakes the accept
    self._listener.close()
    with self._lock:
      socks = list(self._socks)
    for s in socks:                 # a shutdown wakes a recv blocked on it (a close does not)
      with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    deadline = time.monotonic() + 30
    for t in self._threads:
      t.join(timeout=max(0.0, deadline - time.monotonic()))
    late = [t for t in self._threads if t.is_alive()]
    if late:
      raise errors.JaxckptError(f"FaultyS3Proxy: {len(late)} connection threads did not end "
                                "within 30 s of closing")

  def _start(self, fn, *args) -> None:
    t = threading.Thread(target=fn, args=args, daemon=True, name="faulty-s3")
    t.start()
    with self._lock:                 # (those that ended are dropped: one per connection)
      self._threads = [x for x in self._threads if x.is_alive()] + [t]

  def _accept(self) -> None:
    while not self._closed:
      try:
        client, _ = self._listener.accept()
      except OSError:
        return
      with self._lock:
        self._socks.add(client)
      self._start(self._serve, client)

  def _fault_for(self, method: str, path: str) -> Fault | None:
    with self._lock:
      self.requests += 1
      return next((f for f in self._faults if f.applies(method, path)), None)

  def _serve(self, client: socket.socket) -> None:
    buf = b""
    try:
      while not self._closed:
        head, buf = _read_head(client, buf)
        if head is None:
          return
        length = _content_length(head)
        if b"\r\nexpect: 100-continue" in head.lower():
          client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
          head = b"\r\n".join(ln for ln in head.split(b"\r\n")
                              if not ln.lower().startswith(b"expect:"))
        while len(buf) < length:
          more = client.recv(1 << 16)
          if not more:
            return
          buf += more
        body, buf = buf[:length], buf[length:]
        method, path = head.split(b" ", 2)[:2]
        fault = self._fault_for(method.decode(), urllib.parse.unquote(path.decode()))
        if fault is not None and fault.how == "reset":
          client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
          return                                  # closed with RST, no answer
        if fault is not None:
          status, text = _BODIES[fault.how]
          client.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/xml\r\n"
                         b"Content-Length: " + str(len(text)).encode() + b"\r\n\r\n" + text)
          continue
        client.sendall(self._forward(head, body))
    except OSError:
      return
    finally:
      with self._lock:
        self._socks.discard(client)
      with contextlib.suppress(OSError):
        client.close()

  def _forward(self, head: bytes, body: bytes) -> bytes:
    """The server's answer to one request (on a connection of its own), whole."""
    lines = [ln for ln in head.split(b"\r\n") if not ln.lower().startswith(b"connection:")]
    request = b"\r\n".join(lines + [b"Connection: close"]) + b"\r\n\r\n" + body
    with socket.create_connection(self._target, timeout=120) as up:
      up.sendall(request)
      chunks = []
      while True:
        got = up.recv(1 << 16)
        if not got:
          break
        chunks.append(got)
    answer = b"".join(chunks)
    # keep the client's connection open: the answer is delimited by its Content-Length
    # (or chunked encoding) as the server sent it; a server's close-delimited answer
    # would need closing, which SeaweedFS never sends with Connection: close asked
    return answer.replace(b"\r\nConnection: close", b"", 1)


def _read_head(sock: socket.socket, buf: bytes) -> tuple[bytes | None, bytes]:
  while b"\r\n\r\n" not in buf:
    more = sock.recv(1 << 16)
    if not more:
      return None, buf
    buf += more
  head, rest = buf.split(b"\r\n\r\n", 1)
  return head, rest


def _content_length(head: bytes) -> int:
  for line in head.split(b"\r\n")[1:]:
    name, _, value = line.partition(b":")
    if name.strip().lower() == b"content-length":
      return int(value.strip())
  if b"transfer-encoding: chunked" in head.lower():
    raise errors.StorageError("FaultyS3Proxy: a chunked request body is not supported")
  return 0

"""The speed-capped proxy forwards every byte, both ways, no faster than its cap."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from jaxckpt import errors
from tests.support.throttle import ThrottledProxy


def _echo_server():
  """A loopback server that sends back what it receives; (its URL, its stop)."""
  srv = socket.create_server(("127.0.0.1", 0))
  threads = []

  def serve(conn):
    with conn:
      while data := conn.recv(1 << 16):
        conn.sendall(data)

  def accept():
    while True:
      try:
        conn, _ = srv.accept()
      except OSError:
        return
      t = threading.Thread(target=serve, args=(conn,), daemon=True)
      threads.append(t)
      t.start()

  acceptor = threading.Thread(target=accept, daemon=True)
  acceptor.start()

  def stop():
    srv.close()
    acceptor.join(10)
    for t in threads:
      t.join(10)
  return f"http://127.0.0.1:{srv.getsockname()[1]}", stop


def test_bytes_go_through_both_ways_at_the_capped_speed():
  url, stop = _echo_server()
  payload = os.urandom(1 << 20)
  rate = 8e6                                   # 1 MiB each way: >= 0.12 s
  try:
    with ThrottledProxy(url, rate) as proxy:
      port = int(proxy.endpoint.rsplit(":", 1)[1])
      t0 = time.monotonic()
      with socket.create_connection(("127.0.0.1", port)) as c:
        sender = threading.Thread(target=c.sendall, args=(payload,))
        sender.start()
        got = bytearray()
        while len(got) < len(payload):
          chunk = c.recv(1 << 16)
          assert chunk, f"the proxy closed after {len(got)} bytes"
          got += chunk
        sender.join(30)
      secs = time.monotonic() - t0
      assert bytes(got) == payload
      assert secs >= (len(payload) - (64 << 10)) / rate, secs   # never faster than the cap
      assert proxy.forwarded == 2 * len(payload)
  finally:
    stop()


def test_a_bad_cap_or_target_is_refused_naming_it():
  with pytest.raises(errors.InvalidArgumentError, match=r"bytes_per_sec=0\b"):
    ThrottledProxy("http://127.0.0.1:9000", 0)
  with pytest.raises(errors.InvalidArgumentError, match=r"target='s3.example'"):
    ThrottledProxy("s3.example", 1e6)

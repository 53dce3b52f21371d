"""Small network probes run inside a host's namespace (``python -m tests.support.netns_probe ...``).

Used by the harness's own tests and by tests that want to see the network as a
host sees it. Each command prints one JSON line.

  serve PORT              TCP on PORT: answers each connection with "ok", or with
                          "got N" after reading N bytes when the client sends a
                          size line; UDP on PORT: logs each datagram to stdout.
                          Prints {"ready": PORT} once both are bound.
  connect ADDR PORT SECS  {"result": "ok" | "timeout" | "refused" | "unreachable"}
  udp ADDR PORT TEXT      sends one datagram
  send ADDR PORT NBYTES   sends NBYTES to a ``serve``; {"bytes": N, "secs": S} once
                          the server confirms it read them all
  fetch ADDR PORT NBYTES  asks a ``serve`` for NBYTES; {"bytes": N, "secs": S}
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

_CHUNK = 64 * 1024


def _say(**kw) -> None:
  print(json.dumps(kw), flush=True)


def _recv_line(conn: socket.socket) -> bytes:
  line = b""
  while not line.endswith(b"\n"):
    b = conn.recv(1)
    if not b:
      break
    line += b
  return line


def _handle(conn: socket.socket) -> None:
  with conn:
    conn.settimeout(120)
    line = _recv_line(conn).decode().split()
    if not line:
      conn.sendall(b"ok\n")
    elif line[0] == "put":
      left = int(line[1])
      while left > 0:
        b = conn.recv(min(_CHUNK, left))
        if not b:
          break
        left -= len(b)
      conn.sendall(f"got {int(line[1]) - left}\n".encode())
    elif line[0] == "get":
      left, block = int(line[1]), b"\0" * _CHUNK
      while left > 0:
        conn.sendall(block[:min(_CHUNK, left)])
        left -= min(_CHUNK, left)


def serve(port: int) -> None:
  tcp = socket.socket()
  tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  tcp.bind(("0.0.0.0", port))
  tcp.listen(64)
  udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
  udp.bind(("0.0.0.0", port))

  def udp_loop():
    while True:
      data, peer = udp.recvfrom(65536)
      _say(udp=data.decode(), peer=peer[0])

  threading.Thread(target=udp_loop, daemon=True).start()
  _say(ready=port)
  while True:
    conn, _ = tcp.accept()
    threading.Thread(target=_handle, args=(conn,), daemon=True).start()


def connect(addr: str, port: int, secs: float) -> None:
  try:
    with socket.create_connection((addr, port), timeout=secs) as s:
      s.sendall(b"\n")
      result = "ok" if s.recv(3) == b"ok\n" else "bad answer"
  except (TimeoutError, socket.timeout):
    result = "timeout"
  except ConnectionRefusedError:
    result = "refused"
  except OSError as e:
    result = f"unreachable: {e}"
  _say(result=result)


def send(addr: str, port: int, nbytes: int) -> None:
  with socket.create_connection((addr, port), timeout=120) as s:
    start = time.monotonic()
    s.sendall(f"put {nbytes}\n".encode())
    left, block = nbytes, b"\0" * _CHUNK
    while left > 0:
      s.sendall(block[:min(_CHUNK, left)])
      left -= min(_CHUNK, left)
    got = int(_recv_line(s).split()[1])
    _say(bytes=got, secs=time.monotonic() - start)


def fetch(addr: str, port: int, nbytes: int) -> None:
  with socket.create_connection((addr, port), timeout=120) as s:
    start = time.monotonic()
    s.sendall(f"get {nbytes}\n".encode())
    got = 0
    while got < nbytes:
      b = s.recv(_CHUNK)
      if not b:
        break
      got += len(b)
    _say(bytes=got, secs=time.monotonic() - start)


def main(argv: list[str]) -> None:
  cmd, args = argv[0], argv[1:]
  if cmd == "serve":
    serve(int(args[0]))
  elif cmd == "connect":
    connect(args[0], int(args[1]), float(args[2]))
  elif cmd == "udp":
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
      s.sendto(args[2].encode(), (args[0], int(args[1])))
    _say(sent=args[2])
  elif cmd == "send":
    send(args[0], int(args[1]), int(args[2]))
  elif cmd == "fetch":
    fetch(args[0], int(args[1]), int(args[2]))
  else:
    raise SystemExit(f"netns_probe: unknown command {cmd!r}; see the module docstring")


if __name__ == "__main__":
  main(sys.argv[1:])

"""The network harness itself: a cut cuts, a heal heals, a one-way cut is one-way, tbf caps, nothing is left."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from jaxckpt import errors
from tests.support import netns
from tests.support.netns import Cluster

PORT = 7000
_PROBE = [sys.executable, "-m", "tests.support.netns_probe"]


class Server:
  """A netns_probe server on one host; its JSON lines (UDP datagrams) in a queue."""

  def __init__(self, net: Cluster, name: str, timeout_secs: float = 60.0) -> None:
    self.name, self.lines = name, queue.Queue()
    self.proc = net.host(name).popen([*_PROBE, "serve", str(PORT)], stdout=subprocess.PIPE, text=True)
    threading.Thread(target=self._read, daemon=True).start()
    first = self.next(timeout_secs)
    assert first == {"ready": PORT}, first

  def _read(self) -> None:
    for line in self.proc.stdout:
      self.lines.put(json.loads(line))

  def next(self, timeout_secs: float = 60.0) -> dict:
    try:
      return self.lines.get(timeout=timeout_secs)
    except queue.Empty:
      raise AssertionError(f"the probe server on {self.name} said nothing within {timeout_secs} s "
                           f"(exit code {self.proc.poll()})") from None


def probe(net: Cluster, src: str, *args: str, timeout: float = 90.0) -> dict:
  return json.loads(net.host(src).run([*_PROBE, *args], timeout=timeout).stdout)


def connect(net: Cluster, src: str, dst: str, secs: float = 1.5) -> str:
  return probe(net, src, "connect", net.host(dst).address, str(PORT), str(secs))["result"]


def test_hosts_reach_each_other_by_address_and_nothing_else():
  with Cluster(["h0", "h1"]) as net:
    Server(net, "h1")
    assert net.host("h0").address == "10.231.1.2" and net.host("h1").address == "10.231.2.2"
    assert connect(net, "h0", "h1") == "ok"
    # the test's own namespace has no route into the cluster: hosts are reached through them only
    assert all(not line.startswith(netns.SUBNET + ".")
               for line in subprocess.run(["ip", "route"], capture_output=True, text=True).stdout.splitlines())


def test_call_runs_in_the_hosts_namespace_and_sees_its_cuts():
  with Cluster(["h0", "h1"]) as net:
    Server(net, "h1")

    def hello() -> bytes:
      with socket.create_connection((net.host("h1").address, PORT), timeout=2) as s:
        s.sendall(b"\n")
        return s.recv(3)
    assert net.host("h0").call(hello) == b"ok\n"
    net.cut("h0")
    with pytest.raises(TimeoutError):
      net.host("h0").call(hello)
    net.heal()
    assert net.host("h0").call(hello) == b"ok\n"


def test_cut_host_from_everyone_times_out_and_heal_restores():
  with Cluster(["h0", "h1", "storage"]) as net:
    Server(net, "h0")
    Server(net, "h1")
    assert connect(net, "storage", "h0") == "ok" and connect(net, "h0", "h1") == "ok"
    net.cut("h0")
    assert net.faults == {"cuts": [("*", "h0"), ("h0", "*")], "limited": []}
    # packets vanish: the connect hangs until its timeout, it is not refused
    assert connect(net, "h0", "h1") == "timeout"
    assert connect(net, "storage", "h0") == "timeout"
    assert connect(net, "storage", "h1") == "ok"          # the others still talk
    net.heal()
    assert net.faults == {"cuts": [], "limited": []}
    assert connect(net, "h0", "h1") == "ok" and connect(net, "storage", "h0") == "ok"


def test_cut_between_two_hosts_leaves_the_rest():
  with Cluster(["h0", "h1", "storage"]) as net:
    for name in ("h0", "h1", "storage"):
      Server(net, name)
    net.cut("h0", "h1")
    assert connect(net, "h0", "h1") == "timeout" and connect(net, "h1", "h0") == "timeout"
    assert connect(net, "h0", "storage") == "ok" and connect(net, "h1", "storage") == "ok"
    assert connect(net, "storage", "h0") == "ok"
    net.heal()
    assert connect(net, "h0", "h1") == "ok"


def test_cut_drops_an_open_connection_too():
  with Cluster(["h0", "h1"]) as net:
    Server(net, "h1")
    script = textwrap.dedent(f"""
        import socket, sys
        s = socket.create_connection(("{net.host('h1').address}", {PORT}), timeout=60)
        s.sendall(b"get 1000000000\\n")
        assert s.recv(65536)
        print("flowing", flush=True)
        sys.stdin.readline()
        s.settimeout(2)
        try:
          while s.recv(1 << 20):
            pass
          print("closed")
        except TimeoutError:
          print("stalled")
        """)
    proc = net.host("h0").popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
    assert proc.stdout.readline().strip() == "flowing"
    net.cut("h0", "h1")
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "stalled"    # the stream stops, no reset, no close
    proc.wait(timeout=30)


def test_one_way_cut_is_one_way():
  with Cluster(["h0", "h1", "storage"]) as net:
    s0, s1 = Server(net, "h0"), Server(net, "h1")
    net.cut_oneway("h0", "h1")
    assert net.faults["cuts"] == [("h0", "h1")]
    probe(net, "h1", "udp", net.host("h0").address, str(PORT), "h1-to-h0")
    assert s0.next() == {"udp": "h1-to-h0", "peer": net.host("h1").address}      # h1 -> h0 passes
    probe(net, "h0", "udp", net.host("h1").address, str(PORT), "h0-to-h1")
    probe(net, "storage", "udp", net.host("h1").address, str(PORT), "marker")
    # the marker went out after h0's datagram: once it is in, h0's would have been too
    assert s1.next() == {"udp": "marker", "peer": net.host("storage").address}
    assert s1.lines.empty()
    net.heal()
    probe(net, "h0", "udp", net.host("h1").address, str(PORT), "healed")
    assert s1.next() == {"udp": "healed", "peer": net.host("h0").address}


def _mbit_per_sec(result: dict, nbytes: int) -> float:
  assert result["bytes"] == nbytes, result
  return nbytes * 8 / result["secs"] / 1e6


@pytest.mark.slow
def test_limit_caps_bandwidth_both_ways_measured():
  nbytes, cap_mbit = 1_500_000, 8
  with Cluster(["h0", "storage"]) as net:
    Server(net, "storage")
    addr = net.host("storage").address
    free = _mbit_per_sec(probe(net, "h0", "fetch", addr, str(PORT), str(nbytes)), nbytes)
    assert free > 4 * cap_mbit, f"an unlimited link moved only {free:.1f} Mbit/s"
    net.limit("h0", rate=f"{cap_mbit}mbit")
    assert net.faults["limited"] == ["h0"]
    down = _mbit_per_sec(probe(net, "h0", "fetch", addr, str(PORT), str(nbytes)), nbytes)
    up = _mbit_per_sec(probe(net, "h0", "send", addr, str(PORT), str(nbytes)), nbytes)
    # the bucket's burst (0.1 s at the rate) lets a transfer run a little above the cap, never far
    assert down < 1.25 * cap_mbit and up < 1.25 * cap_mbit, (down, up)
    assert down > 0.3 * cap_mbit and up > 0.3 * cap_mbit, (down, up)     # capped, not cut
    net.heal()
    healed = _mbit_per_sec(probe(net, "h0", "fetch", addr, str(PORT), str(nbytes)), nbytes)
    assert healed > 4 * cap_mbit, healed


def _root_links() -> set[str]:
  out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
  return {line.split(":")[1].strip() for line in out.splitlines()}


def _ours() -> list[str]:
  return [n for n in os.listdir("/run/netns") if n.startswith(f"jxn{os.getpid()}x")] \
      if os.path.isdir("/run/netns") else []


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  with open(f"/proc/{pid}/stat", encoding="ascii") as f:
    return f.read().rsplit(")", 1)[1].split()[0] != "Z"


_DAEMON = textwrap.dedent("""
    import os, sys, time
    if os.fork() == 0:
      os.setsid()
      if os.fork() == 0:
        print(os.getpid(), flush=True)
        while True:
          time.sleep(60)
      os._exit(0)
    os.wait()
    """)


def test_cleanup_leaves_no_namespace_link_or_process_even_when_the_body_fails():
  links = _root_links()
  pids = []
  with pytest.raises(RuntimeError, match="the body failed"):
    with Cluster(["h0", "h1"]) as net:
      Server(net, "h0")
      net.cut("h0", "h1")
      net.limit("h1", rate="1mbit")
      # a daemon that left its parent's session: only the namespace still knows it
      daemon = net.host("h1").popen([sys.executable, "-c", _DAEMON], stdout=subprocess.PIPE, text=True)
      pids.append(int(daemon.stdout.readline()))
      pids.append(net.host("h0").popen(["sleep", "600"]).pid)
      assert len(_ours()) == 3 and all(_alive(p) for p in pids)
      raise RuntimeError("the body failed")
  assert _ours() == []
  assert not [p for p in pids if _alive(p)]
  assert _root_links() == links


def test_namespaces_of_a_killed_test_process_are_removed_by_the_next_cluster():
  script = textwrap.dedent("""
      import os, signal, subprocess, sys
      from tests.support.netns import Cluster
      net = Cluster(["h0"]).__enter__()
      net.host("h0").popen(["sleep", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
      print(net.prefix, flush=True)
      os.kill(os.getpid(), signal.SIGKILL)     # no atexit, no finalizer
      """)
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
  assert done.returncode == -signal.SIGKILL, done.stderr
  prefix = done.stdout.strip()
  left = [n for n in os.listdir("/run/netns") if n.startswith(prefix + "-")]
  assert sorted(left) == [f"{prefix}-h0", f"{prefix}-router"]
  orphans = subprocess.run(["ip", "netns", "pids", f"{prefix}-h0"], capture_output=True, text=True).stdout.split()
  assert orphans
  with Cluster(["h0"]):
    assert not [n for n in os.listdir("/run/netns") if n.startswith(prefix + "-")]
  assert not [p for p in orphans if _alive(int(p))]


def test_bad_names_and_unknown_hosts_are_refused_naming_them():
  with pytest.raises(errors.InvalidArgumentError, match="router"):
    Cluster(["h0", "router"])
  with pytest.raises(ValueError, match="unique"):
    Cluster(["h0", "h0"])
  with Cluster(["h0", "h1"]) as net:
    with pytest.raises(errors.InvalidArgumentError, match=r"no host 'h9'.*\['h0', 'h1'\]"):
      net.host("h9")
    with pytest.raises(errors.InvalidArgumentError, match="from itself"):
      net.cut("h0", "h0")
    with pytest.raises(errors.InvalidArgumentError, match="10mbit"):
      net.limit("h0", rate="fast")


def test_missing_tools_fail_naming_the_install_command(tmp_path):
  """With ip and tc on PATH but no iptables the harness fails, never skips, naming the command."""
  for tool in ("ip", "tc"):
    os.symlink(shutil.which(tool), tmp_path / tool)
  script = textwrap.dedent("""
      from tests.support import netns
      try:
        netns.Cluster(["h0"]).__enter__()
      except netns.NetnsUnavailableError as e:
        print(e)
      """)
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True,
                        env={**os.environ, "PATH": str(tmp_path)})
  assert "missing iptables" in done.stdout and netns.INSTALL in done.stdout, done.stdout


def test_proxy_delays_blackholes_and_resets_the_traffic_through_it():
  with Cluster(["h0", "h1"]) as net:
    Server(net, "h1")
    proxy = net.proxy("h1", PORT)
    via = ["connect", proxy.address, str(proxy.port)]
    assert probe(net, "h0", *via, "5")["result"] == "ok"
    proxy.delay(1.5)
    started = time.monotonic()
    assert probe(net, "h0", *via, "20")["result"] == "ok"
    assert time.monotonic() - started > 3.0          # the request and the answer each held 1.5 s
    proxy.clear()
    proxy.blackhole()
    assert probe(net, "h0", *via, "2")["result"] == "timeout"   # accepted, then nothing comes back
    proxy.clear()
    assert probe(net, "h0", *via, "5")["result"] == "ok"
    script = textwrap.dedent(f"""
        import socket, sys
        s = socket.create_connection(("{proxy.address}", {proxy.port}), timeout=60)
        s.sendall(b"get 1000000000\\n")
        assert s.recv(65536)
        print("flowing", flush=True)
        while s.recv(1 << 20):
          pass
        print("closed", flush=True)
        """)
    proc = net.host("h0").popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "flowing"
    proxy.reset()
    assert proc.stdout.readline().strip() == "closed"
    proc.wait(timeout=30)

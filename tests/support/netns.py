"""Hosts that share nothing but a network: one Linux network namespace per host, joined by a router.

Every host of a test (its trainer processes and its agent, a storage server, an
etcd member) runs in a network namespace of its own, with one link (a veth pair)
to a router namespace that forwards between them. The router is where the faults
are made, so they are faults of the network and not of a host: a cut is an
iptables ``DROP`` in the router's ``FORWARD`` chain (packets vanish, so a
``connect`` hangs until its timeout and an open connection stops hearing back, as
on a partitioned network, never a quick ``ECONNREFUSED``); a slow link is a
``tc`` token bucket (``tbf``) on both ends of the host's link (``netem`` is not in
every kernel, this one's included).

Address plan (the same inside every cluster: each cluster is a network of its
own, so concurrent tests never see each other's addresses): host ``i`` (from 1,
in the order given) is ``10.231.i.2`` on the link ``10.231.i.0/24`` whose router
end is ``10.231.i.1``, its default route. Nothing routes to or from the test's own
namespace: a test only ever reaches addresses inside the namespaces it made (or
loopback inside one of them), through :meth:`Host.popen` and :meth:`Host.run`.

Needs root, ``ip`` (iproute2), ``tc`` and ``iptables`` (nft or legacy backend,
both work inside a namespace): ``apt-get install -y iproute2 iptables``, which
``.ci/run`` does before the suite. A test that needs them fails, never skips,
naming that command.

Everything a cluster made is removed by name and pid however the test ends:
leaving the ``with`` block (also on an exception) kills every process living in
its namespaces (``ip netns pids``, so also the daemons its processes started in
sessions of their own), then deletes the namespaces, which takes their links,
rules and qdiscs with them; an ``atexit`` hook does the same for a cluster the
test never closed; and a new cluster first removes the namespaces of clusters
whose owning process is gone (a pytest killed by SIGKILL), recognised by the
owner's pid in their names.

>>> with Cluster(["h0", "h1", "storage"]) as net:          # doctest: +SKIP
...   server = net.host("storage").popen(["python3", "-m", "http.server", "8000"])
...   net.host("h0").run(["curl", f"http://{net.host('storage').address}:8000/"])
...   net.cut("storage")                    # storage from everyone, both ways
...   net.cut("h0", "h1")                   # between two hosts only
...   net.cut_oneway("h0", "storage")       # h0's packets to storage are dropped, not the replies
...   net.heal()                            # every cut and limit removed
...   net.limit("storage", rate="10mbit")   # storage's link capped, both directions
...   proxy = net.proxy("storage", 8000)    # a path to storage:8000 that can be faulted
...   proxy.delay(0.5); proxy.blackhole(); proxy.reset(); proxy.clear()
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Iterable, Mapping, Sequence, TypeVar

from jaxckpt import errors

log = logging.getLogger(__name__)

INSTALL = "apt-get install -y iproute2 iptables"
"""The command that installs what this harness needs (``.ci/run`` runs it)."""

SUBNET = "10.231"
"""Every address a cluster hands out is inside ``10.231.0.0/16``, inside its own namespaces only."""

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,19}$")
_ROUTER = "router"
_PREFIX = "jxn"               # namespace names: jxn<owner pid>x<n>-<host>
_CHAIN = "JXFAULT"            # the router's chain of cuts, jumped to from FORWARD
_RUN_DIR = "/run/netns"
_CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def _libc() -> ctypes.CDLL:
  return ctypes.CDLL(None, use_errno=True)


class NetnsUnavailableError(errors.JaxckptError, RuntimeError):
  """The harness cannot make namespaces here: not root, or a tool is missing (the message names the fix)."""


class NetnsCommandError(errors.JaxckptError, RuntimeError):
  """A command the harness ran to build or fault the network failed (the message has its argv and stderr)."""


def require_tools() -> None:
  """Fails (NetnsUnavailableError, naming the fix) unless this process can make namespaces and faults."""
  if os.geteuid() != 0:
    raise NetnsUnavailableError(f"network namespaces need root (euid is {os.geteuid()}): run the "
                                "multi-namespace tests as root, as .ci/run does")
  missing = [tool for tool in ("ip", "tc", "iptables") if _which(tool) is None]
  if missing:
    raise NetnsUnavailableError(f"missing {', '.join(missing)} (looked on PATH={os.environ.get('PATH', '')}): "
                                f"install them ({INSTALL}; .ci/run does) to run the tests whose hosts share "
                                "only a network")


def _which(tool: str) -> str | None:
  return shutil.which(tool)


def _run(argv: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
  argv = [_which(argv[0]) or argv[0], *argv[1:]]
  done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
  if check and done.returncode != 0:
    raise NetnsCommandError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
  return done


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _namespaces() -> list[str]:
  try:
    return sorted(os.listdir(_RUN_DIR))
  except FileNotFoundError:
    return []


def _kill_namespace(ns: str) -> None:
  """SIGKILL every process living in namespace ``ns`` (by pid), then delete the namespace."""
  for _ in range(50):   # a process may fork while we kill; stop when none is left
    done = _run(["ip", "netns", "pids", ns], check=False)
    pids = [int(p) for p in done.stdout.split()] if done.returncode == 0 else []
    pids = [p for p in pids if p != os.getpid()]
    if not pids:
      break
    for pid in pids:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    _reap(pids)
  _run(["ip", "netns", "delete", ns], check=False)


def _reap(pids: Iterable[int], timeout_secs: float = 10.0) -> None:
  """Waits (a condition: each pid gone) for killed pids; reaps our own children among them."""
  deadline = time.monotonic() + timeout_secs
  for pid in pids:
    while time.monotonic() < deadline:
      try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
          break
      except ChildProcessError:   # not our child: wait for it to vanish
        if not _pid_alive(pid) or _zombie(pid):
          break
      time.sleep(0.01)


def _zombie(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      return f.read().rsplit(")", 1)[1].split()[0] == "Z"
  except (FileNotFoundError, IndexError):
    return True


def sweep_stale() -> list[str]:
  """Deletes the namespaces of clusters whose owning process has died; returns their names."""
  stale = []
  for ns in _namespaces():
    m = re.match(rf"^{_PREFIX}(\d+)x\d+-", ns)
    if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
      _kill_namespace(ns)
      stale.append(ns)
  if stale:
    log.warning("removed %d namespaces left by dead test processes: %s", len(stale), stale)
  return stale


@dataclasses.dataclass
class Host:
  """One host of a cluster: a namespace with one address. Made by :class:`Cluster`, not by hand.

  Attributes:
    name: the host's name in the cluster (``"h0"``, ``"storage"``).
    namespace: its network namespace's name (``ip netns exec NAMESPACE ...``).
    address: its IPv4 address, reachable from every other host of the cluster (unless cut).
    index: its link number ``i`` (its address is ``10.231.i.2``).
  """
  name: str
  namespace: str
  address: str
  index: int
  _cluster: Cluster = dataclasses.field(repr=False)

  @property
  def gateway(self) -> str:
    """The router's end of this host's link."""
    return f"{SUBNET}.{self.index}.1"

  @property
  def router_link(self) -> str:
    """The name of this host's link inside the router namespace."""
    return f"h{self.index}"

  def argv(self, argv: Sequence[str]) -> list[str]:
    """``argv`` run inside this host's namespace (``ip netns exec``, which then execs it: same pid)."""
    return [_which("ip") or "ip", "netns", "exec", self.namespace, *map(str, argv)]

  def popen(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs) -> subprocess.Popen:
    """Starts ``argv`` in this host's namespace; ``subprocess.Popen``'s keywords pass through.

    The process is the cluster's: killed (by pid, with its process group and every
    other process in the namespace) when the cluster closes, if it has not exited by
    then. It gets a session of its own unless ``start_new_session`` says otherwise.
    """
    kwargs.setdefault("start_new_session", True)
    proc = subprocess.Popen(self.argv(argv), env=None if env is None else dict(env), **kwargs)
    self._cluster._track(proc)
    return proc

  def call(self, fn: Callable[..., T], *args, timeout: float = 120.0) -> T:
    """``fn(*args)`` in a thread of this process that joined this host's namespace; its result.

    Sockets ``fn`` opens are this host's (``setns`` moves only the calling thread), so
    the test itself can reach the cluster's addresses, e.g. to wait until a server in
    it answers. Threads that already exist (a library's pool) are not moved: keep
    ``fn`` to plain sockets. Raises what ``fn`` raised; TimeoutError naming the host
    when it outlives ``timeout`` seconds.
    """
    box: dict[str, object] = {}

    def body() -> None:
      try:
        fd = os.open(os.path.join(_RUN_DIR, self.namespace), os.O_RDONLY)
        try:
          if _libc().setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise NetnsCommandError(f"setns into {self.namespace} failed: {os.strerror(err)}")
        finally:
          os.close(fd)
        box["result"] = fn(*args)
      except BaseException as e:  # pylint: disable=broad-except  (raised in the caller)
        box["error"] = e

    thread = threading.Thread(target=body, name=f"netns-{self.name}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
      raise TimeoutError(f"{getattr(fn, '__name__', fn)} on host {self.name} ({self.address}) did not return "
                         f"within {timeout} s")
    if "error" in box:
      raise box["error"]
    return box["result"]

  def run(self, argv: Sequence[str], *, timeout: float = 60.0, check: bool = True,
          env: Mapping[str, str] | None = None, input: str | None = None) -> subprocess.CompletedProcess:
    """Runs ``argv`` in this host's namespace to completion; stdout and stderr captured as text.

    Raises NetnsCommandError (with argv and stderr) when ``check`` and it exits non-zero;
    ``subprocess.TimeoutExpired`` (naming the argv) when it outlives ``timeout`` seconds.
    """
    proc = self.popen(argv, env=env, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
      out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
      _killpg(proc)
      proc.communicate()
      raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check and proc.returncode != 0:
      raise NetnsCommandError(f"on host {self.name} ({self.address}): {' '.join(map(str, argv))} exited "
                              f"{proc.returncode}: {err.strip()[-2000:]}")
    return done


def _killpg(proc: subprocess.Popen) -> None:
  if proc.poll() is not None:
    return
  try:
    os.killpg(proc.pid, signal.SIGKILL)   # its own session: the group id is its pid
  except (ProcessLookupError, PermissionError):
    try:
      proc.kill()
    except ProcessLookupError:
      pass
  try:
    proc.wait(timeout=10)
  except subprocess.TimeoutExpired:
    log.warning("pid %d did not die within 10 s of SIGKILL", proc.pid)


_counter = itertools.count()
_live: dict[str, Cluster] = {}
_live_lock = threading.Lock()


@atexit.register
def _close_live() -> None:
  for cluster in list(_live.values()):
    if cluster.owner == os.getpid():     # (not in a forked child that exits normally)
      cluster.close()


class Cluster:
  """Hosts in namespaces of their own, joined by a router namespace; a context manager.

  Entering builds the network (and fails with NetnsUnavailableError, naming the
  install command, without root or the tools); leaving removes every namespace,
  link, rule and process it made, also when the body raised.

  Args:
    names: the hosts' names (lower case letters, digits, ``_``; unique; not ``router``).

  Attributes:
    owner: the pid of the process that made it (its namespaces' names carry it).
    prefix: the unique prefix of this cluster's namespace names.
    hosts: the hosts, in the order given.
    router: the router's namespace name.
  """

  def __init__(self, names: Sequence[str]) -> None:
    names = list(names)
    bad = [n for n in names if not isinstance(n, str) or not _NAME.match(n) or n == _ROUTER]
    if bad or not names or len(set(names)) != len(names) or len(names) > 250:
      raise errors.InvalidArgumentError(
          f"Cluster(names={names!r}): give 1 to 250 unique host names of lower case letters, digits and _ "
          f"(starting with a letter, at most 20 characters, not {_ROUTER!r}); bad: {bad!r}")
    self.owner = os.getpid()
    self.prefix = f"{_PREFIX}{self.owner}x{next(_counter)}"
    self.router = f"{self.prefix}-{_ROUTER}"
    self.hosts = [Host(n, f"{self.prefix}-{n}", f"{SUBNET}.{i}.2", i, self) for i, n in enumerate(names, 1)]
    self._by_name = {h.name: h for h in self.hosts}
    self._procs: list[subprocess.Popen] = []
    self._cuts: set[tuple[str, str]] = set()        # (src address or "", dst address or "")
    self._limited: set[str] = set()
    self._open = False
    self._lock = threading.Lock()
    self._dir: str | None = None

  # -- lifecycle --

  def __enter__(self) -> Cluster:
    require_tools()
    sweep_stale()
    with _live_lock:
      _live[self.prefix] = self
    self._open = True
    try:
      self._build()
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _build(self) -> None:
    r = self.router
    _run(["ip", "netns", "add", r])
    self._in(r, ["ip", "link", "set", "lo", "up"])
    self._in(r, ["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
    self._in(r, ["iptables", "-w", "-N", _CHAIN])
    self._in(r, ["iptables", "-w", "-A", "FORWARD", "-j", _CHAIN])
    for h in self.hosts:
      _run(["ip", "netns", "add", h.namespace])
      # made inside the namespaces, so no name is ever taken in the test's own namespace
      self._in(r, ["ip", "link", "add", h.router_link, "type", "veth", "peer", "name", "eth0", "netns",
                   h.namespace])
      self._in(r, ["ip", "addr", "add", f"{h.gateway}/24", "dev", h.router_link])
      self._in(r, ["ip", "link", "set", h.router_link, "up"])
      self._in(h.namespace, ["ip", "link", "set", "lo", "up"])
      self._in(h.namespace, ["ip", "addr", "add", f"{h.address}/24", "dev", "eth0"])
      self._in(h.namespace, ["ip", "link", "set", "eth0", "up"])
      self._in(h.namespace, ["ip", "route", "add", "default", "via", h.gateway])

  def close(self) -> None:
    """Kills every process in the cluster's namespaces (by pid) and deletes the namespaces. Idempotent."""
    with self._lock:
      if not self._open:
        return
      self._open = False
    for proc in self._procs:
      _killpg(proc)
    for ns in [h.namespace for h in self.hosts] + [self.router]:
      if ns in _namespaces():
        _kill_namespace(ns)
    if self._dir is not None:
      shutil.rmtree(self._dir, ignore_errors=True)
    with _live_lock:
      _live.pop(self.prefix, None)

  def _track(self, proc: subprocess.Popen) -> None:
    if not self._open:
      _killpg(proc)
      raise NetnsCommandError(f"cluster {self.prefix} is closed: no process may start in it")
    self._procs.append(proc)

  def _in(self, ns: str, argv: Sequence[str]) -> subprocess.CompletedProcess:
    return _run(["ip", "netns", "exec", ns, *[_which(argv[0]) or argv[0], *argv[1:]]])

  # -- hosts --

  def host(self, name: str) -> Host:
    """The host called ``name``; InvalidArgumentError naming the hosts there are otherwise."""
    try:
      return self._by_name[name]
    except KeyError:
      raise errors.InvalidArgumentError(
          f"no host {name!r} in this cluster: its hosts are {list(self._by_name)}") from None

  def namespaces(self) -> list[str]:
    """Every namespace this cluster made (its hosts' and its router's)."""
    return [h.namespace for h in self.hosts] + [self.router]

  # -- faults --

  def cut(self, a: str, b: str | None = None) -> None:
    """Cuts host ``a`` off from every other host, or (with ``b``) ``a`` and ``b`` from each other only.

    Both directions; packets are dropped silently (a connect hangs until its own
    timeout). Open connections stop too. Lasts until :meth:`heal`.
    """
    ha = self.host(a)
    if b is None:
      self._drop(ha.address, "")
      self._drop("", ha.address)
    else:
      hb = self._other(ha, b)
      self._drop(ha.address, hb.address)
      self._drop(hb.address, ha.address)

  def cut_oneway(self, src: str, dst: str) -> None:
    """Drops the packets from ``src`` to ``dst`` only; ``dst``'s packets still reach ``src``.

    For TCP both ends then stall (a handshake needs both ways); UDP shows the direction.
    """
    hs = self.host(src)
    self._drop(hs.address, self._other(hs, dst).address)

  def _other(self, h: Host, name: str) -> Host:
    other = self.host(name)
    if other is h:
      raise errors.InvalidArgumentError(f"cannot cut host {name!r} from itself: name two different hosts")
    return other

  def _drop(self, src: str, dst: str) -> None:
    if (src, dst) in self._cuts:
      return
    rule = (["-s", src] if src else []) + (["-d", dst] if dst else [])
    self._in(self.router, ["iptables", "-w", "-A", _CHAIN, *rule, "-j", "DROP"])
    self._cuts.add((src, dst))
    log.info("cluster %s: dropping %s -> %s", self.prefix, src or "*", dst or "*")

  def limit(self, name: str, *, rate: str = "10mbit", burst: str | None = None) -> None:
    """Caps host ``name``'s link to ``rate`` (tc's units: ``10mbit``, ``500kbit``) in each direction.

    A token bucket (``tbf``) on both ends of the link: the router's end shapes what
    the host receives, the host's end what it sends. ``burst`` defaults to a tenth
    of a second at ``rate`` (at least 16 KiB). Replaces an earlier limit; lasts until
    :meth:`heal` or :meth:`unlimit`.
    """
    h = self.host(name)
    bits = _rate_bits(rate)
    burst = burst or str(max(16 * 1024, bits // 8 // 10))
    shape = ["tbf", "rate", rate, "burst", burst, "latency", "1s"]
    self._in(self.router, ["tc", "qdisc", "replace", "dev", h.router_link, "root", *shape])
    self._in(h.namespace, ["tc", "qdisc", "replace", "dev", "eth0", "root", *shape])
    self._limited.add(name)
    log.info("cluster %s: host %s limited to %s", self.prefix, name, rate)

  def unlimit(self, name: str) -> None:
    """Removes host ``name``'s bandwidth cap (no-op without one)."""
    h = self.host(name)
    if name in self._limited:
      self._in(self.router, ["tc", "qdisc", "del", "dev", h.router_link, "root"])
      self._in(h.namespace, ["tc", "qdisc", "del", "dev", "eth0", "root"])
      self._limited.discard(name)

  def heal(self) -> None:
    """Removes every cut and every bandwidth cap: the network is whole again."""
    self._in(self.router, ["iptables", "-w", "-F", _CHAIN])
    self._cuts.clear()
    for name in list(self._limited):
      self.unlimit(name)
    log.info("cluster %s: healed", self.prefix)

  def proxy(self, to: str, port: int, *, timeout_secs: float = 60.0) -> Proxy:
    """A TCP proxy in the router to host ``to``'s ``port``, whose traffic can be delayed,
    blackholed or reset (:class:`Proxy`); hosts connect to ``proxy.address:proxy.port``.

    It is a path of its own: a :meth:`cut` of ``to`` does not stop it (the router itself
    talks to ``to``), so a test points the client it wants to fault at the proxy.
    """
    target = self.host(to)
    control = os.path.join(self._tmp(), f"proxy-{to}-{port}-{next(_counter)}.json")
    with open(control, "w", encoding="utf-8") as f:
      json.dump({}, f)
    router = Host(_ROUTER, self.router, target.gateway, 0, self)
    proc = router.popen([sys.executable, "-m", "tests.support.netns_proxy", "0.0.0.0", "0", target.address,
                         str(port), control], stdout=subprocess.PIPE, text=True)
    line = _readline(proc, timeout_secs, f"the proxy to {to}:{port}")
    return Proxy(target.gateway, json.loads(line)["ready"], control, proc)

  def _tmp(self) -> str:
    if self._dir is None:
      self._dir = tempfile.mkdtemp(prefix=f"{self.prefix}-")
    return self._dir

  @property
  def faults(self) -> dict[str, list]:
    """What is faulted now: ``{"cuts": [(src, dst), ...], "limited": [host, ...]}`` ("*" for everyone)."""
    by_addr = {h.address: h.name for h in self.hosts}
    cuts = sorted((by_addr.get(s, "*"), by_addr.get(d, "*")) for s, d in self._cuts)
    return {"cuts": cuts, "limited": sorted(self._limited)}


@dataclasses.dataclass
class Proxy:
  """A TCP proxy made by :meth:`Cluster.proxy`: connect to ``address:port``. Its faults
  last until changed; :meth:`clear` forwards everything at once again.

  Attributes:
    address: the router's address on the target's link. port: the proxy's port.
  """
  address: str
  port: int
  _control: str = dataclasses.field(repr=False)
  _proc: subprocess.Popen = dataclasses.field(repr=False)
  _settings: dict = dataclasses.field(default_factory=dict, repr=False)

  def _set(self, **changes) -> None:
    self._settings.update(changes)
    tmp = self._control + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(self._settings, f)
    os.replace(tmp, self._control)        # (the proxy re-reads it when its mtime changes)

  def delay(self, secs: float) -> None:
    """Holds every chunk ``secs`` seconds before forwarding it, both ways."""
    self._set(delay_secs=float(secs))

  def blackhole(self) -> None:
    """Forwards nothing: connections stay open and bytes vanish."""
    self._set(blackhole=True)

  def reset(self) -> None:
    """Closes every connection open now (new ones go through)."""
    self._set(reset=self._settings.get("reset", 0) + 1)

  def clear(self) -> None:
    """No delay, no blackhole."""
    self._set(delay_secs=0, blackhole=False)


def _readline(proc: subprocess.Popen, timeout_secs: float, what: str) -> str:
  box: list[str] = []
  reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
  reader.start()
  reader.join(timeout_secs)
  if not box or not box[0]:
    raise NetnsCommandError(f"{what} did not start within {timeout_secs} s (exit code {proc.poll()})")
  return box[0]


_UNITS = {"bit": 1, "kbit": 1000, "mbit": 1000**2, "gbit": 1000**3, "bps": 8, "kbps": 8000, "mbps": 8 * 1000**2}


def _rate_bits(rate: str) -> int:
  m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]+)", rate.strip().lower())
  if not m or m.group(2) not in _UNITS:
    raise errors.InvalidArgumentError(f"rate={rate!r}: give a number and one of {sorted(_UNITS)} (e.g. '10mbit')")
  return int(float(m.group(1)) * _UNITS[m.group(2)])

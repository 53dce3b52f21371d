"""Which address a replica group binds and advertises to its peers.

A group publishes two addresses in its quorum record, its peer server's (catch-up
requests) and its ring port's (the all-reduce streams), and every peer connects to
them: each must be one its peers can reach. The loopback address, which suited one
machine, is exactly the one a peer on another machine cannot: its connect goes to its
own machine. So, unless ``ReplicaGroupOptions.host`` names one, a group advertises the
address its machine reaches the lighthouse from (the kernel's route to it: the
interface the job's network is on; loopback only when the lighthouse is on loopback),
and binds that. ``host="0.0.0.0"`` binds every interface and advertises that same
address. A loopback ``host`` beside a lighthouse on another machine is refused: peers
there would be told an address that leads back to themselves.

>>> toward("127.0.0.1:29510")
'127.0.0.1'
>>> choose(None, "127.0.0.1:29510")
('127.0.0.1', '127.0.0.1')
"""

from __future__ import annotations

import ipaddress
import socket

from jaxckpt import errors
from jaxckpt.ft import _route

ANY = ("0.0.0.0", "")


def _host_of(address: str) -> str:
  host = address.rsplit(":", 1)[0]
  return host[1:-1] if host.startswith("[") else host


def _is_loopback(host: str) -> bool:
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def _is_ipv6(host: str) -> bool:
  try:
    return ipaddress.ip_address(host.strip("[]")).version == 6
  except ValueError:
    return False


def toward(address: str) -> str:
  """This machine's address on the route to ``address`` (``HOST:PORT``): the source address
  the kernel would use (a UDP socket is "connected", which sends nothing)."""
  host, _, port = address.rpartition(":")
  if host and _is_ipv6(host):
    raise errors.InvalidArgumentError(
        f"the lighthouse at {address} has an IPv6 address: replica groups speak IPv4 only; "
        "start the lighthouse on an IPv4 address")
  try:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
      s.connect((_host_of(address) if host else address, int(port) if port.isdigit() else 9))
      return s.getsockname()[0]
  except OSError as e:
    raise errors.InvalidArgumentError(
        f"no route from this machine to the lighthouse at {address} ({e}): give ReplicaGroupOptions.host "
        "the address this machine's peers reach it at") from None


def choose(host: str | None, lighthouse: str) -> tuple[str, str]:
  """``(bind, advertise)`` for a group whose ``ReplicaGroupOptions.host`` is ``host``, of the
  lighthouse (or replicas, comma-separated) at ``lighthouse``."""
  lighthouses = _route.addresses(lighthouse)
  if host is not None and _is_ipv6(host):
    raise errors.InvalidArgumentError(
        f"ReplicaGroupOptions.host={host!r} is an IPv6 address: a replica group's ring and peer "
        "server speak IPv4 only; give this machine's IPv4 address, 0.0.0.0 to bind every "
        "interface, or leave it unset")
  if host not in (None, *ANY):
    if _is_loopback(host):
      remote = [a for a in lighthouses if not _is_loopback(_host_of(a)) and toward(a) != _host_of(a)]
      if remote:
        raise errors.InvalidArgumentError(
            f"ReplicaGroupOptions.host={host!r} is a loopback address, but the lighthouse at {remote[0]} is "
            f"on another machine: its other groups would be told {host}:PORT, which leads each of them back "
            f"to itself. Give host the address they reach this machine at (this machine reaches the "
            f"lighthouse from {toward(remote[0])}), or leave it unset to advertise that one")
    return host, host
  advertise = toward(lighthouses[0])
  return (advertise if host is None else "0.0.0.0"), advertise


def on_this_machine(address: str) -> bool:
  """Whether ``address`` (``HOST:PORT``, as a peer advertises it) is one of this machine's:
  loopback, or the source of the route to it is that address itself."""
  host = _host_of(address)
  if _is_loopback(host):
    return True
  try:
    return toward(address) == host
  except errors.InvalidArgumentError:
    return False

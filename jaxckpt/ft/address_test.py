"""What a replica group binds and advertises (ft/_address.py): never an address its peers
cannot reach, and an IPv6 address it cannot serve is refused naming the fix (the ring and
the peer server speak IPv4 only), never advertised as '::'."""

import pytest

from jaxckpt import errors
from jaxckpt.ft import _address


def test_a_group_beside_a_loopback_lighthouse_binds_and_advertises_loopback():
  assert _address.choose(None, "127.0.0.1:29510") == ("127.0.0.1", "127.0.0.1")
  assert _address.choose("0.0.0.0", "127.0.0.1:29510") == ("0.0.0.0", "127.0.0.1")


@pytest.mark.parametrize("host", ["::", "::1", "[fe80::1]"])
def test_an_ipv6_host_is_refused_naming_the_fix(host):
  with pytest.raises(errors.InvalidArgumentError, match=r"IPv6 address.*IPv4 only.*0\.0\.0\.0"):
    _address.choose(host, "10.1.2.3:29510")


def test_an_ipv6_lighthouse_is_refused_naming_the_fix():
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"lighthouse at \[::1\]:29510 has an IPv6 address.*IPv4"):
    _address.choose(None, "[::1]:29510")

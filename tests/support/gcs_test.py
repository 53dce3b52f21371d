"""The gs:// harness: fake-gcs-server's launcher refuses a process whose tensorstore it
cannot reach (and leaves nothing running), and the flaky proxy fails exactly what it is
told to, each kind in turn, and forwards the rest."""

import http.client
import os
import socket
import urllib.error
import urllib.request

import pytest

from jaxckpt import errors
from jaxckpt.universal import _layout
from tests.support.flaky_http import FlakyProxy
from tests.support.gcs import URL_ENV, FakeGcs


def test_a_second_server_is_refused_while_jaxckpt_holds_a_store_of_the_first(gcs_server):
  held = _layout.open_kvstore(gcs_server.url())    # tensorstore reuses it: the first URL
  other = FakeGcs()
  with pytest.raises(errors.StorageError, match=rf"does not reach fake-gcs-server at "
                     rf"http://{other.host}:\d+; tensorstore reads {URL_ENV} when it opens"):
    with other:        # (were it entered, it would be stopped at the end of the body)
      pass
  del held
  with pytest.raises(ConnectionRefusedError):      # the second server was killed
    host, port = other.endpoint.removeprefix("http://").split(":")
    socket.create_connection((host, int(port)), timeout=5).close()
  assert os.environ[URL_ENV] == gcs_server.endpoint


def _get(url: str) -> object:
  try:
    with urllib.request.urlopen(url, timeout=30) as r:
      return r.status
  except urllib.error.HTTPError as e:
    return e.code
  except (ConnectionError, http.client.RemoteDisconnected) as e:
    return type(e).__name__


def test_the_flaky_proxy_fails_what_it_is_told_each_kind_in_turn(gcs_server):
  with FlakyProxy(gcs_server.endpoint) as flaky:
    listing = f"{flaky.endpoint}/storage/v1/b/{gcs_server.bucket}/o"
    flaky.fail(1, where="prefix=only-this")
    flaky.fail(3)
    assert _get(f"{listing}?prefix=only-this") == 503            # the first arm's
    said = [_get(listing) for _ in range(4)]
    assert said[0] in ("ConnectionResetError", "RemoteDisconnected"), said
    assert said[1] in ("ConnectionResetError", "RemoteDisconnected"), said
    assert said[2:] == [503, 200], said                          # the kinds go on in turn
    flaky.wait_failed(5)
    assert flaky.failed == {"503": 2, "reset": 1, "reset-after": 1} and flaky.forwarded == 1
    assert _get(f"{listing}?prefix=only-this") == 200

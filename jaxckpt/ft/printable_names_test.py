"""A replica group's names reach the lighthouse's log and every member's messages, so
they are printable text: a group id, an address or a quorum id with
an escape sequence or a newline is refused, and a failure's free-text reason is relayed
escaped."""

from __future__ import annotations

import pytest

from jaxckpt import errors
from jaxckpt.ft import _requests

TITLE = "\x1b]0;pwned\x07"


@pytest.mark.parametrize("header", [
    {"op": "heartbeat", "group": f"g0{TITLE}"},
    {"op": "ready", "group": "g0\nINFO lighthouse: forged line"},
    {"op": "leave", "group": "g0\u202e"},
    {"op": "quorum", "request_id": 1, "view": "v", "member": [f"g{TITLE}", "tcp://a", 0, 0]},
    {"op": "quorum", "request_id": 1, "view": "v", "member": ["g0", f"tcp://a{TITLE}", 0, 0]},
    {"op": "failed", "group": "g0", "q": f"q{TITLE}", "why": "x", "blame": []},
    {"op": "failed", "group": "g0", "q": "q1", "why": "x", "blame": [f"g1{TITLE}"]},
])
def test_a_name_with_a_control_character_is_refused(header):
  with pytest.raises(errors.InvalidArgumentError, match="printable characters"):
    _requests.parse(header)


def test_a_failure_s_reason_is_relayed_escaped():
  got = _requests.parse({"op": "failed", "group": "g0", "q": "q1",
                         "why": f"the ring broke{TITLE}\nforged", "blame": ["g1"]})
  assert got.why == "the ring broke\\x1b]0;pwned\\x07\\nforged"
  assert got.why.isprintable()

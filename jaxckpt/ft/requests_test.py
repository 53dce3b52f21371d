"""The lighthouse's requests are one declarative schema (jaxckpt.net._schema): every
value bounded, checked when a header is decoded, the same Structs members send."""

from __future__ import annotations

import pytest

from jaxckpt import errors
from jaxckpt.ft import _requests
from jaxckpt.ft._quorum import Member
from jaxckpt.ft._terms import Terms
from jaxckpt.net import _schema, _wire

MEMBER = Member(group_id="g0", address="127.0.0.1:5", step=3, digest=2**64 - 1,
                ring_address="127.0.0.1:6", batches=12)
TERMS = Terms(max_groups=4, data_order="c4-seed1", averaging="mean",
              layout=(1, 2, 3, 2**64 - 1, "4 leaves"))


def test_every_value_a_request_carries_is_bounded_by_the_schema():
  # digests run to 2**64 - 1, past what msgspec's bounds hold (int64): their Structs check
  # them (_schema.check_u64), as msgpack could not carry more anyway
  assert [w for cls in _requests.REQUESTS.values() for w in _schema.unbounded(cls)] == [
      "quorum.wire_member.digest", *(f"quorum.wire_terms.layout.{x}" for x in "abcd")]


@pytest.mark.parametrize("request_", [
    _requests.Heartbeat(group="g0", step=7, lineage="5b12a215-4"),
    _requests.Heartbeat(group="g0"),
    _requests.Ready(group="g0"),
    _requests.Leave(group="g0"),
    _requests.QuorumRequest(request_id=9, wire_member=_requests.MemberWire.of(MEMBER), view="v1",
                            ask=8, held=2, wire_terms=_requests.TermsWire.of(TERMS)),
    _requests.Failed(group="g0", q="5b12a215-4", why="the ring broke", blame=("g1",)),
    _requests.Status(request_id=3),
])
def test_what_a_member_sends_is_what_the_lighthouse_decodes(request_):
  header = _wire.unpack(_wire.pack(dict(_schema.encode(request_), inc=b"i" * 16, seq=4)))
  assert _requests.parse(header) == request_       # (the replay stamp is left out)


def test_a_quorum_request_gives_the_lighthouse_its_member_and_terms():
  got = _requests.parse(_schema.encode(_requests.QuorumRequest(
      request_id=1, wire_member=_requests.MemberWire.of(MEMBER),
      wire_terms=_requests.TermsWire.of(TERMS))))
  assert (got.member, got.terms, got.view) == (MEMBER, TERMS, "")
  older = _requests.parse({"op": "quorum", "request_id": 1, "member": ["g0", "h:1", 3, 7]})
  assert older.member == Member(group_id="g0", address="h:1", step=3, digest=7)
  assert older.terms is None


@pytest.mark.parametrize("header, why", [
    ({"op": "quorum", "request_id": 1, "member": ["g0", "h:1", 3, 7, "", 0, "extra"]},
     r"^'quorum' needs member \(Expected `array` of at most length 6, got 7\)"),
    ({"op": "quorum", "request_id": 1, "member": ["g0", "h:1", 3, 2**64]},
     r"^'quorum' needs member \(digest=18446744073709551616 is above 2\*\*64 - 1\)"),
    ({"op": "quorum", "request_id": 1, "member": ["g0", "h:1", 3, 7], "terms": [4, "o", "avg", None]},
     r"^'quorum' needs terms.averaging \(Invalid enum value 'avg'\), got 'avg'$"),
    ({"op": "quorum", "request_id": 1, "member": ["g0", "h:1", 3, 7],
      "terms": [4, "o", "sum", [1, 2, 3, -4, "x"]]},
     r"^'quorum' needs terms.layout.d \(Expected `int` >= 0\), got -4$"),
    ({"op": "quorum", "request_id": -1, "member": ["g0", "h:1", 3, 7]},
     r"^'quorum' needs request_id \(Expected `int` >= 0\), got -1$"),
    ({"op": "heartbeat", "group": "g0", "q": "x" * 65},
     r"^'heartbeat' needs q \(Expected `str` of length <= 64\), got 'xxx"),
    ({"op": "failed", "group": "g0", "q": "q1", "why": "x", "blame": ["g"] * 9},
     r"^'failed' needs blame \(Expected `array` of length <= 8\)"),
    ({"op": "ready"}, r"^'ready' needs group \(it is missing\)$"),
    ({"op": "status", "request_id": True}, r"^'status' needs request_id \(Expected `int \| null`, got `bool`\), got True$"),
])
def test_a_malformed_request_is_refused_naming_the_field_and_what_came(header, why):
  with pytest.raises(errors.InvalidArgumentError, match=why):
    _requests.parse(header)

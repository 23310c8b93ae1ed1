import pytest

from stages.traces.pii import KINDS, Scrubber, luhn, maybe_pii


def scrub(text, kinds=KINDS):
    s = Scrubber(set(kinds))
    return s.text(text), s.counts


@pytest.mark.parametrize("text, kind", [
    ("mail Ann.Lee+x@mail.example.org now", "email"),
    ("card 4111 1111 1111 1111 exp", "card"),
    ("card 5500-0000-0000-0004", "card"),
    ("from 192.168.10.254 today", "ip"),
    ("from 2001:db8::8a2e:370:7334 today", "ip"),
    ("call +44 20 7946 0958 now", "phone"),
    ("call (555) 123-4567 now", "phone"),
    ("key sk-proj-abcdefghijklmnopqrstuvwx1234", "secret"),
    ("key sk-ant-api03-abcdefghijklmnopqrstuvwxyz", "secret"),
    ("aws AKIAIOSFODNN7EXAMPLE", "secret"),
    ("gh ghp_abcdefghijklmnopqrstuvwxyz0123456789", "secret"),
    ("Authorization: Bearer abcdef0123456789abcdef", "secret"),
    ("tok eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N", "secret"),
])
def test_each_kind_is_found(text, kind):
    assert maybe_pii(text), "the cheap pre-check must see every candidate"
    out, counts = scrub(text)
    assert f"<{kind.upper()}_1>" in out and counts[kind] == 1
    assert sum(counts.values()) == 1, out


@pytest.mark.parametrize("text", [
    "What is 47*38?", "123-456", "answer:24815", "card 4111 1111 1111 1112",  # fails Luhn
    "version 1.2.3", "at 12:30:45", "999.1.1.1", "order 12345678",
])
def test_ordinary_text_is_left_alone(text):
    out, counts = scrub(text)
    assert out == text and sum(counts.values()) == 0


def test_placeholders_are_consistent_within_a_trace():
    s = Scrubber(set(KINDS))
    out = s.walk([{"content": "a@x.io and b@y.io"}, {"args": '{"to": "A@X.io"}'}])
    assert out[0]["content"] == "<EMAIL_1> and <EMAIL_2>"
    assert out[1]["args"] == '{"to": "<EMAIL_1>"}'
    assert s.counts["email"] == 3


def test_kinds_can_be_switched_off():
    out, counts = scrub("a@x.io from 10.0.0.1", kinds={"ip"})
    assert out == "a@x.io from <IP_1>" and counts["email"] == 0


def test_luhn():
    assert luhn("4111111111111111") and not luhn("4111111111111112")

"""PII and secret scrubbing, applied to every string of a trace before anything is written downstream.

Kinds, each switched on or off by `ingest.scrub_<kind>s` in params.yaml:

| kind   | what                                                              | placeholder  |
|--------|-------------------------------------------------------------------|--------------|
| secret | API keys and tokens (OpenAI, Anthropic, AWS, GitHub, Slack, Google, Stripe, Hugging Face), JWTs, `Bearer` tokens | `<SECRET_n>` |
| email  | e-mail addresses                                                  | `<EMAIL_n>`  |
| card   | payment card numbers, 13 to 19 digits, only if the Luhn check passes | `<CARD_n>` |
| ip     | IPv4 and IPv6 addresses (IPv6 checked by `ipaddress`, never inside code: `std::move`) | `<IP_n>` |
| phone  | `+` and 8 to 15 digits, three digit groups (`(415)555-0132`), `09-7625400`, mobile `13812345678` | `<PHONE_n>` |

Placeholders are consistent inside a trace: the same address becomes the same placeholder, so a
conversation still reads sensibly ("mail <EMAIL_1>... sent to <EMAIL_1>"). Secrets go first: a key
can contain digit runs that look like phone or card numbers.
"""

from __future__ import annotations

import ipaddress
import re

KINDS = ("secret", "email", "card", "ip", "phone")

SECRET = re.compile(
    r"\b(?:sk-ant-[A-Za-z0-9_\-]{20,}"           # Anthropic
    r"|sk-(?:proj-|svcacct-)?[A-Za-z0-9_\-]{20,}"  # OpenAI
    r"|(?:AKIA|ASIA)[0-9A-Z]{16}"                 # AWS access key id
    r"|gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{40,}"  # GitHub
    r"|xox[abposr]-[A-Za-z0-9\-]{10,}"            # Slack
    r"|AIza[0-9A-Za-z_\-]{35}"                    # Google API key
    r"|(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{16,}"  # Stripe
    r"|hf_[A-Za-z0-9]{30,}"                       # Hugging Face
    r"|eyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"  # JWT
    r")"
    r"|(?<=Bearer )[A-Za-z0-9._~+/\-]{16,}=*"
)
EMAIL = re.compile(r"[A-Za-z0-9._%+\-]+@[A-Za-z0-9.\-]+\.[A-Za-z]{2,}")
CARD = re.compile(r"(?<![\d.])\d(?:[ \-]?\d){12,18}(?![\d.])")
# an IPv4 address may end a sentence ("My IP is 10.0.0.1."), not a longer dotted number
IPV4 = re.compile(r"(?<![\w.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}"
                  r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?!\w|\.\d)")
# IPv6: hex groups standing on their own, never inside identifiers: `std::move`, `Foo::bar`,
# `a[1::2]`, `Usage::` and CSS `::before` are code (`_is_ipv6` also wants the shape of an address)
IPV6 = re.compile(r"(?<![\w:.])[0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4}){2,7}(?![\w:]|\.\d)")
# not part of a longer run of digit groups (a card number that failed Luhn is not a phone)
PHONE = re.compile(r"(?<![\w+])(?<!\d[ .\-])(?:\+[1-9][\d ().\-]{7,17}\d"  # no code starts 0
                   r"|(?:\(\d{2,4}\)[ .\-]?|\d{2,4}[ .\-])\d{3,4}[ .\-]\d{3,5}"  # (415)555-0132
                   r"|0\d{1,3}-\d{6,8}"                       # 09-7625400: area code, subscriber
                   r"|1[3-9]\d{9})"                            # 13812345678: a mobile number
                   r"(?!\w)(?![ .\-]\d)")


DIGIT = re.compile(r"\d")


def luhn(digits: str) -> bool:
    """True if the digits pass the Luhn check (card numbers do)."""
    total = 0
    for i, char in enumerate(reversed(digits)):
        n = int(char)
        if i % 2:
            n = n * 2 - 9 if n > 4 else n * 2
        total += n
    return total % 10 == 0


def _is_card(text: str) -> bool:
    """13 to 19 digits passing Luhn, starting as card numbers do (1 to 9; `0000-0000-...` of a
    nil UUID passes Luhn too).
    """
    digits = re.sub(r"\D", "", text)
    return 13 <= len(digits) <= 19 and digits[0] != "0" and luhn(digits)


_HEX_GROUP = re.compile(r"[0-9A-Fa-f]{3,4}")


def _is_ipv6(text: str) -> bool:
    """An address, not code: valid, with a digit and a group of three or four hex digits
    (`fe80::1`, `2001:db8::8a2e:370:7334`); `a::b`, `dead::beef`, `1::2` and `::1` are left alone
    (the loopback address is nobody's).
    """
    if not any(c.isdigit() for c in text) or not _HEX_GROUP.search(text):
        return False
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


_DECIMAL = re.compile(r"[+\-]?\d+\.\d+")


def _is_phone(text: str) -> bool:
    """8 to 15 digits, and not a decimal number (`+35236450.6`)."""
    return 8 <= len(re.sub(r"\D", "", text)) <= 15 and not _DECIMAL.fullmatch(text)


# Cheap tests over a whole serialized trace: only text that might hold PII is scrubbed piece by
# piece. Looser than the patterns above (they only have to see every candidate); three simple
# searches are several times faster than one alternation of everything.
_MAYBE_SECRET = re.compile(r"sk[-_]|rk_|AKIA|ASIA|gh[pousr]_|github_pat_|xox|AIza|hf_|eyJ|Bearer")
_MAYBE_NUMBER = re.compile(r"\d[\d .\-()]{5,}\d")  # phones, cards, IPv4 (8.8.8.8: 7 characters)
_MAYBE_IPV6 = re.compile(r"::|[0-9A-Fa-f]:[0-9A-Fa-f]{1,4}:")


def maybe_pii(text: str) -> bool:
    """True if the text may hold PII: a cheap test before the patterns run."""
    return ("@" in text or _MAYBE_SECRET.search(text) is not None
            or _MAYBE_NUMBER.search(text) is not None or _MAYBE_IPV6.search(text) is not None)


PATTERNS = [("secret", SECRET, None), ("email", EMAIL, None), ("card", CARD, _is_card),
            ("ip", IPV4, None), ("ip", IPV6, _is_ipv6), ("phone", PHONE, _is_phone)]


class Scrubber:
    """Scrubs one trace; `counts` holds the redactions per kind."""

    def __init__(self, kinds: set[str]):
        """A scrubber of the PII `kinds`, its counts at zero."""
        self.kinds = kinds
        self.counts = {kind: 0 for kind in KINDS}
        self.placeholders: dict[tuple[str, str], str] = {}
        self.numbers = {kind: 0 for kind in KINDS}

    def _placeholder(self, kind: str, value: str) -> str:
        key = (kind, value.lower() if kind == "email" else value)
        if key not in self.placeholders:
            self.numbers[kind] += 1
            self.placeholders[key] = f"<{kind.upper()}_{self.numbers[kind]}>"
        self.counts[kind] += 1
        return self.placeholders[key]

    def text(self, value: str) -> str:
        """The text with PII replaced by placeholders, counted."""
        has_digit = DIGIT.search(value) is not None
        for kind, pattern, check in PATTERNS:
            # cheap pre-checks first: most strings hold no PII at all
            if kind not in self.kinds or (kind == "email" and "@" not in value) or (
                    kind in ("card", "phone") and not has_digit) or (
                    kind == "ip" and ":" not in value and not has_digit):
                continue

            def replace(match: re.Match, kind=kind, check=check) -> str:
                if check is not None and not check(match[0]):
                    return match[0]
                return self._placeholder(kind, match[0])

            value = pattern.sub(replace, value)
        return value

    def walk(self, value):
        """Every string inside lists and dicts (tool arguments, nested content parts) too."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.walk(v) for v in value]
        if isinstance(value, dict):
            return {k: self.walk(v) for k, v in value.items()}
        return value

"""PII and secret scrubbing, applied to every string of a trace before anything is written downstream
(its messages, tools, feedback and usage, keys and whole numbers too, its ids and model name).

Kinds, each switched on or off by `ingest.scrub_<kind>s` in params.yaml: `secret` (provider keys,
JWTs, auth headers, URL passwords, PEM keys, secret assignments), `email`, `card` (Luhn-checked),
`ip` and `phone`, each replaced by a numbered placeholder (`<SECRET_n>`, `<EMAIL_n>`, ...) that
stays the same for the same value inside a trace. Secrets go first. Plain placeholders
(`ghp_xxxx...`, `${VAR}`, `changeme`) and code that names a secret without holding one are left
alone. Reads and writes no file: ingest calls it.

Details: docs/traces.md, "How PII and secrets are scrubbed (stages/traces/pii.py)".
"""

from __future__ import annotations

import functools
import ipaddress
import json
import math
import re
import threading
from collections import _count_elements  # what Counter counts with (C in CPython)

KINDS = ("secret", "email", "card", "ip", "phone")

# Provider tokens: a prefix the provider puts on every key, then the key's alphabet. The formats
# are those gitleaks' rules describe (cmd/generate/config/rules/*.go), written here with loose
# lengths: a key one character shorter than documented is still a key.
_TOKENS = (
    r"sk-ant-(?:api|admin|sid)\d\d-[\w\-]{20,}"                     # Anthropic
    r"|sk-(?:proj-|svcacct-|admin-)?[\w\-]{20,}"                     # OpenAI
    r"|(?:A3T[A-Z0-9]|AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}"              # AWS access key id
    r"|ABSK[A-Za-z0-9+/]{100,}=*|bedrock-api-key-YmVkcm9jay5hbWF6b25hd3MuY29t[\w+/=]*"        # AWS Bedrock
    r"|gh[pousr]_\w{30,}|github_pat_\w{40,}"                         # GitHub
    r"|gl(?:pat|dt|ffct|ft|imt|agent|oas|ptt|rt|soat|cbt|ddt)-[\w\-.]{20,}"  # GitLab
    r"|GR1348941[\w\-]{20,}|_gitlab_session=[0-9a-z]{32}"
    r"|xox[bpose]-(?:\d+-){2,}[\w\-]{4,}|xoxb-\d{8,}-[\w\-]{10,}|xox[ar]-(?:\d-)?[A-Za-z0-9\-]{15,}"  # Slack
    r"|xapp-\d-[\w\-]{10,}|xoxe\.xox[bp]-\d-\w{100,}|xoxe-\d-\w{100,}"
    r"|AIza[\w\-]{35}(?![\w\-])"                                               # Google
    r"|(?:sk|rk)_(?:live|test|prod)_\w{10,}"                          # Stripe
    r"|hf_[A-Za-z0-9]{34}\b|api_org_[A-Za-z]{34}\b"                    # Hugging Face
    r"|npm_[A-Za-z0-9]{36}"                                          # npm
    r"|pypi-AgE[\w\-]{50,}"                                           # PyPI
    r"|SG\.[\w\-=.]{60,70}"                                            # SendGrid
    r"|xkeysib-[a-f0-9]{64}-\w{16}"                                   # Brevo (Sendinblue)
    r"|dckr_pat_[\w\-]{20,}"                                          # Docker Hub
    r"|AKCp[A-Za-z0-9]{60,}|cmVmd[A-Za-z0-9]{59}"                    # Artifactory
    r"|A3-[A-Z0-9]{6}-[A-Z0-9\-]{11,12}-[A-Z0-9]{5}-[A-Z0-9]{5}-[A-Z0-9]{5}"  # 1Password
    r"|ops_eyJ[A-Za-z0-9+/]{100,}=*"
    r"|p8e-[A-Za-z0-9]{32}|AGE-SECRET-KEY-1[0-9A-Z]{58}"              # Adobe, age
    r"|pat[A-Za-z0-9]{14}\.[a-f0-9]{64}|LTAI[A-Za-z0-9]{20}"          # Airtable, Alibaba
    r"|(?:sc|ext|scauth|authress)_\w{5,30}\.\w{4,6}\.acc[_\-][\w\-]{10,32}\.[\w+/=\-]{30,}"  # Authress
    r"|4b1d[A-Za-z0-9]{38}|CLOJARS_[A-Za-z0-9]{60}"                  # ClickHouse, Clojars
    r"|v1\.0-[a-f0-9]{24}-[a-f0-9]{146}"                              # Cloudflare origin CA
    r"|dapi[a-f0-9]{32}(?:-\d)?\b|do[opr]_v1_[a-f0-9]{64}|dp\.pt\.\w{40,}"  # Databricks, DO, Doppler
    r"|duffel_(?:test|live)_[\w\-=]{43}|dt0c01\.\w{24}\.\w{64}"         # Duffel, Dynatrace
    r"|EZ[AT]K[A-Za-z0-9]{54}\b|EAA[MC][A-Za-z0-9]{100,}|FLW(?:SEC|PUB)K_TEST-\w{12,32}(?:-X)?"
    r"|fo1_[\w\-]{43}|fm[12][ar]?_[A-Za-z0-9+/]{100,}=*|fio-u-[\w\-=]{64}"  # Fly.io, Frame.io
    r"|sk_[A-Za-z0-9]{29}|pat\.\w{22}\.\w{24}\.\w{20}|sat\.[\w\-]{22}\.\w{24}\.\w{20}"  # Freemius, Harness
    r"|HRKU-AA[\w\-]{58}"                                              # Heroku
    r"|(?<!\.)ico-[A-Za-z0-9]{32}\b|s-s4t2(?:ud|af)-[a-f0-9]{64}"               # Infracost, 42
    r"|eyJrIjoi[A-Za-z0-9]{70,}=*|glc_[A-Za-z0-9+/]{32,}=*|glsa_[A-Za-z0-9]{32}_[A-Fa-f0-9]{8}"  # Grafana
    r"|lin_api_[A-Za-z0-9]{40}"                                       # Linear
    r"|ntn_\d{11}[A-Za-z0-9]{35}\b|API-[A-Z0-9]{26}\b|sha256~[\w\-]{43}"  # Notion, Octopus, OpenShift
    r"|pplx-[A-Za-z0-9]{48}|pscale_(?:tkn|oauth|pw)_[\w=.\-]{32,64}"   # Perplexity, PlanetScale
    r"|PMAK-[a-f0-9]{24}-[a-f0-9]{34}|pnu_[A-Za-z0-9]{36}|pul-[a-f0-9]{40}"  # Postman, Prefect, Pulumi
    r"|rdme_[a-z0-9]{70}|rubygems_[a-f0-9]{48}|tk-us-[\w\-]{48}"       # ReadMe, RubyGems, Scalingo
    r"|sntryu_[a-f0-9]{64}\b|sntrys_eyJ[\w+/=]{40,}|sm_[aps]at_[A-Za-z0-9]{16}"              # Sentry, SettleMint
    r"|shippo_(?:live|test)_[a-fA-F0-9]{40}|shp(?:at|ca|pa|ss)_[a-fA-F0-9]{32}"  # Shippo, Shopify
    r"|sgp_(?:[a-fA-F0-9]{16}_|local_)?[a-fA-F0-9]{40}"              # Sourcegraph
    r"|(?:EAAA|sq0atp-|sq0csp-)[\w\-]{22,60}|SK[0-9a-fA-F]{32}"        # Square, Twilio
    r"|hv[sb]\.[\w\-]{90,300}|t1\.[\w\-]+=*\.[\w\-]{86}=*|YC[\w\-]{38}|AQVN[\w\-]{35,38}"  # Vault, Yandex
    r"|eyJ[A-Za-z0-9_\-]{10,}\.ey[A-Za-z0-9_/\\\-]{10,}(?:\.[A-Za-z0-9_/\\\-]+=*)?"  # JWT, signed or not
)
# The prefixes SECRET's alternatives begin with, as one regex written as a trie: Python's `re`
# tries each branch of an alternation at each position, a trie only the branches of one first
# character (twice as fast).
_SECRET_PREFIXES = (
    "sk-", "sk_", "rk_", "A3T", "AKIA", "ASIA", "ABIA", "ACCA", "ABSK", "bedrock-api-key-", "ghp_",
    "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "glpat-", "gldt-", "glffct-", "glft-", "glimt-",
    "glagent-", "gloas-", "glptt-", "glrt-", "glsoat-", "glcbt-", "glddt-", "GR1348941",
    "_gitlab_session=", "xox", "xapp-", "AIza", "hf_", "api_org_", "npm_", "pypi-AgE", "SG.",
    "xkeysib-", "AKCp", "cmVmd", "A3-", "ops_eyJ", "p8e-", "AGE-SECRET-KEY-1", "pat", "LTAI",
    "sc_", "ext_", "scauth_", "authress_", "4b1d", "CLOJARS_", "v1.0-", "dapi", "doo_v1_", "dop_v1_",
    "dor_v1_", "dp.pt.", "duffel_", "dt0c01.", "EZAK", "EZTK", "EAAM", "EAAC", "EAAA", "FLWSECK_TEST-",
    "FLWPUBK_TEST-", "fo1_", "fm1", "fm2_", "fio-u-", "sat.", "HRKU-AA", "ico-",
    "s-s4t2", "eyJ", "glc_", "glsa_", "lin_api_", "ntn_", "API-", "sha256~", "pplx-",
    "pscale_", "PMAK-", "pnu_", "pul-", "rdme_", "rubygems_", "tk-us-", "sntry", "sm_aat_", "sm_pat_",
    "sm_sat_", "shippo_", "shpat_", "shpca_", "shppa_", "shpss_", "sgp_", "sq0atp-", "sq0csp-", "SK", "dckr_pat_",
    "hvs.", "hvb.", "t1.", "YC", "AQVN")


def _trie(words, shortest: int = 0) -> str:
    r"""A regex matching any of the words, as a trie: `A(?:KIA|SIA)`; with `shortest`, each word
    followed by enough non-space characters for a key of that length: `AKIA(?=\S{9})`. The
    first characters lead as a class, `(?=[AB...])`: one lookup turns down a place where no word
    begins, where the trie's first branches are tried one by one (a sixth less time on code).
    """
    tree: dict = {}
    for word in words:
        node = tree
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}

    def emit(node: dict, depth: int) -> str:
        if "" in node:  # a word ends here, a longer one goes on: the shorter is enough
            return rf"(?=\S{{{shortest - depth}}})" if shortest > depth else ""
        branches = [re.escape(char) + emit(child, depth + 1) for char, child in sorted(node.items())]
        return branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    return "(?=[" + "".join(map(re.escape, sorted(tree))) + "])" + emit(tree, 0)


# Keys found by their prefix, tried only where one of the prefixes is (the lookahead: a trie of
# `_SECRET_PREFIXES`, cheap at each position, where the alternation of all formats is not)
SECRET = re.compile(r"\b(?=" + _trie(_SECRET_PREFIXES) + r")(?:" + _TOKENS + r")")
# Bots' tokens, which no prefix announces: Discord's, three base64url parts (a numeric id in
# base64, which therefore begins `M`, `N` or `O`, a timestamp and an HMAC; no boundary before it:
# a key pasted after other characters, `=MTAy...`, is still one), and Telegram's outside its URL
# (the bot's id, `:`, 35 characters). A search of their own, run only where `maybe_pii`'s scan
# found one of the shapes.
SIGNED = re.compile(r"[MNO][\w\-]{23,25}\.[\w\-]{6}\.[\w\-]{27,38}|(?<![\w:])\d{8,10}:[\w\-]{35}(?![\w\-])")
# its test (as a Hyperscan expression too: no look behind), looser by the boundaries
_MAYBE_SIGNED = r"[MNO][\w\-]{23,25}\.[\w\-]{6}\.[\w\-]{27}|\d{8,10}:[\w\-]{35}"
_MAYBE_SIGNED_RE = re.compile(_MAYBE_SIGNED)
# a key glued to an identifier by an `_`, a word's character, so no `\b`: `lookup_sk-proj-...` as a
# tool's name, `call_sk-...` as a call's id (a pattern of its own, led by the `_` it keeps: a
# boundary or an `_` before SECRET's trie made every search of code a sixth slower)
GLUED_SECRET = re.compile(r"_(?P<key>(?=" + _trie(_SECRET_PREFIXES) + r")(?:" + _TOKENS + r"))")
# What no prefix announces: webhooks (Slack, Teams, Discord, Zapier), a header's value, a password
# in a URL or after `curl -u`, the formats whose mark is inside (Azure's `Q~`, Terraform's
# `.atlasv1.`, MaxMind's `_mmk`). Looked for only in text holding one of `_SECRET_MARKS`.
MARKED = re.compile(
    r"(?:https?://hooks|hooks)\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9+/]{20,}"
    r"|https://[a-z0-9]+\.webhook\.office\.com/webhookb2/[\w\-@]+/IncomingWebhook/\w+/[\w\-]+"
    r"|https?://(?:discord(?:app)?\.com|[\w.]+\.zapier\.com)/api/webhooks/\d+/[\w\-]+"
    # these begin after a character that is no word's (each says so in its own way): one test
    # turns down a place inside a word, where each of them was tried (half the search's time)
    r"|(?<!\w)(?:(?:(?<=Bearer )|(?<=bearer )|(?<=: Token )|(?<=Api-Token ))[A-Za-z0-9._~+/\-]{16,}=*"
    r"|(?<=Basic )(?=[A-Za-z]*[0-9+/=])[A-Za-z0-9+/]{8,}={0,2}"  # base64 of `user:pw`, not a word
    r"|(?<![\w~.])[\w~.]{3}\dQ~[\w~.\-]{31,34}(?![\w~.\-])"     # Azure AD client secret
    r"|\b[A-Za-z0-9]{14}\.atlasv1\.[\w\-=]{60,70}"                # Terraform Cloud
    r"|\b[A-Za-z0-9]{6}_[A-Za-z0-9]{29}_mmk\b"                      # MaxMind
    # user:password@host: the user may be empty (`redis://:pw@host`), the password may hold `@`
    # (up to the last one before the host); a Go DSN's `user:password@tcp(host:port)/db`
    r"|(?P<url>(?<=://)[^\s:/@\"'<>]{0,64}:[^\s:/\"'<>]{1,128}(?=@[\w.\-]+))"
    r"|(?P<dsn>[\w.\-]{1,64}:[^\s\"'<>]{1,128}(?=@(?:tcp|unix|udp)\()))"
    # a password or token given to a command: `--password pw`, `--token tok` (the `=` form is an
    # assignment), `sshpass -p 'pw'`, and the MySQL client's `-ppw` (glued: `-p pw` asks for it,
    # and `pw` is the database)
    # (each led by a one-character look behind: one test turns down most places)
    r"|(?<=[ p])(?P<flag>(?:(?<=-password )|(?<=-passwd )|(?<=-token )|(?<=-api-key )|(?<=-secret )"
    r"|(?<=sshpass -p )|(?<=\s-p)(?=[^\s\"']))[\"']?[^\s\"']{4,128}[\"']?)"
    r"|(?<=t)(?<=telegram\.org/bot)\d{8,10}:[\w\-]{30,40}"            # a Telegram bot's token
    r"|(?P<curl>(?<=[ur])(?:(?<=\s-u)|(?<=\s--user))[ =]{1,3}[\"']?[^\s\"':]{0,64}:[^\s\"']{0,128}[\"']?)")
# a command's flags, and Telegram's URL: a digit is wanted in the value (`maybe_pii` looks for
# these only in text with one, where `"-p" in text` stands for them and `mysql -ppw`)
_FLAG_MARKS = ("-password ", "-passwd ", "-token ", "-api-key ", "-secret ", "sshpass -p ", "mysql",
               "mariadb", "telegram.org/bot")
_SECRET_MARKS = ("hooks.slack.com", "webhook", "Bearer ", "bearer ", "Basic ", ": Token ", "Api-Token ",
                 "Q~", ".atlasv1.", "_mmk", "://", "@tcp(", "@unix(", "@udp(", " -u", "--user",
                 *_FLAG_MARKS)
# A PEM private key, body and all; an unterminated one up to the end of its base64 lines
PRIVATE_KEY = re.compile(r"-----BEGIN[ A-Z0-9_\-]{0,100}PRIVATE KEY(?: BLOCK)?-----"
                         r"(?:\s*[^\-\s][\s\S]*?-----END[ A-Z0-9_\-]{0,100}PRIVATE KEY(?: BLOCK)?-----"
                         r"|(?=\s*[^\-\s])[\s\S]*?(?=\n\s*\n|$))")
# A PuTTY key file's private part: its base64 lines after `Private-Lines: n` (newlines real or
# escaped in JSON), up to its `Private-MAC`
PUTTY_KEY = re.compile(r"Private-Lines: \d+[ \t]*(?:\r?\n|(?:\\r)?\\n)(?:[A-Za-z0-9+/=]+(?:\r?\n|(?:\\r)?\\n))*"
                       r"[A-Za-z0-9+/=]*")
# A secret assigned to a name that says it is one, in code or configuration: `password = "..."`,
# `DB_PASS: ...`, `"api_key": "..."`, `<authToken>...</authToken>`, `apiKey := `...``, a session's
# cookie (`Cookie: session=...`, `JSESSIONID=...`). Only the value
# is replaced, and only a value that looks random (`_is_secret_value`): `token = get_token()`,
# `password = settings.DB_PASSWORD` and `token = request.headers["X"]` are code, and stay.
_ASSIGNMENT_NAMES = "pass|pwd|secret|token|key|cred|auth|session|contribsys__com"
ASSIGNMENT = re.compile(
    # (not the `SECRET` of a placeholder already written: `<SECRET_1>` then `>` read as XML's)
    r"(?P<k>(?i:" + _ASSIGNMENT_NAMES + r"))(?<!<SECRET)(?P<n>[\w.\-]{0,30}+)"
    r"(?:[ \t]+[A-Za-z]\w{0,11}+)?"  # a type between name and value: `var apiToken string = "..."`
    # `=`, `:=`, `=>`, `?=`, `.=`, `==`, `:`, `>` (XML); a comma only between quoted strings:
    # `setProperty("API_TOKEN", "...")`, not `f(token, x)`
    # (name, operator and value on one line, but for XML's: a value on the next line after `=`
    # was that line's name)
    r"(?:[\"'`]?[ \t]{0,4}(?:(?:=>|:{0,3}=|[=!]==?|\?=|\.=|\|\||[=:])[ \t]{0,8}|>\s{0,8})"
    r"|(?P<c>[\"'`][ \t]{0,4},)[ \t]{0,8})"
    r"(?P<q>\\?[\"'`])?"
    r"(?P<v>[^\s\"'`;,<>(){}\[\]\\]{6,300}+)(?=[\"'`\s;,<)\]}]|\\[nrt\"]|$)")
# A secret found by its context, whatever its shape (issue 54: what detect-secrets' keyword
# plugin finds, not one provider's format): a quoted value given to a name that says password,
# secret or key (`password = "..."`, `api_key: '...'`, `secret("...")`, `password "..."`), or
# compared with one (`if ("..." == passwd)`): any characters, spaces too, judged by
# `_is_keyword_value`. (Two more context rules were tried and left out for speed, issue 54: three
# dot-separated runs of base64url, Discord's bot tokens, which took as many of detect-secrets'
# near-miss negatives as positives; and a quoted run of base64 with 4.5 bits a character. With
# them the scrubber was 7 % slower on the peers' cases, below 100 times Presidio.)
# (the names where a word begins: `my_password`, `dbPassword`, not `surrogatepass`, `bypass`)
_KEYWORD_WORDS = ("password", "passwd", "pwd", "secret", "apikey", "api_key", "privatekey",
                  "private_key", "accesskey", "access_key", "authtoken", "auth_token", "accesstoken",
                  "access_token")
_KEYWORD_PASS = ("dbpass", "db_pass", "databasepass", "database_pass", "keypass", "key_pass")  # + \b


def _names(any_case: bool) -> str:  # (`_any_case` below: called once it is defined)
    """The names as one alternation: `(?i:` around them, or (`any_case`) each word spelled in
    both cases, every branch led by a literal (`re` skips in C to where one can begin).
    """
    if not any_case:
        return "(?i:" + "|".join([*_KEYWORD_WORDS, *(w + r"\b" for w in _KEYWORD_PASS)]) + ")"
    return "(?:" + "|".join([*(b for w in _KEYWORD_WORDS for b in _any_case(w)),
                             *(b for w in _KEYWORD_PASS for b in _any_case(w, r"\b"))]) + ")"


def _keyword(names: str) -> str:
    return (r"(?P<name>" + names + r")(?P<rest>[\w.\-]{0,30})(?:\[\d*\])?[\"'`]?[ \t]{0,4}"
            r"(?:(?P<op>=>|:{0,3}=|[=!]==?|\?=|:|\(|\.assign\()[ \t]{0,8}|(?<=[ \t]))@?"
            r"(?:\"(?P<v1>[^\"\n]{1,200}+)\"|'(?P<v2>[^'\n]{1,200}+)'|`(?P<v3>[^`\n]{1,200}+)`)"
            r"|(?P<q>[\"'`])(?P<v4>[^\"'`\n]{1,200}+)(?P=q)[ \t]{0,4}[!=]==?[ \t]{0,4}(?:[\w.]{0,30}[^a-z])?"
            + names)


KEYWORD = None  # compiled below, after `_any_case`
# maybe_pii's tests for them (Hyperscan expressions, and `re` where there is none): what leads
# each branch
_MAYBE_KEYWORD = re.compile(
    _names(False) + r"[\w.\-]{0,30}(?:\[\d*\])?[\"'`]?[ \t]{0,4}[=!:?(>.@ \t\"'`]"
    r"|[\"'`][ \t]{0,4}[!=]==?[^\n]{0,35}" + _names(False))
# a top-level domain is letters that end the name: `sd_IN@devanagari.UTF-8` and
# `ks_in@devanagari.utf8` are locales (language_territory@modifier.codeset), not addresses
# (the local part in any script: `josé.garcía@correo.es` lost only its ASCII tail); or an
# internationalized one as DNS writes it, `xn--p1ai` (.рф)
EMAIL = re.compile(r"[\w.%+\-]+@[A-Za-z0-9.\-]+\.(?:xn--[A-Za-z0-9]{2,59}|[A-Za-z]{2,})(?!-?[A-Za-z0-9])")
# a mailing list's address is a group's, not a person's: `email-sig@python.org`, `python-dev@...`,
# `optik-users@lists.sourceforge.net`, Mailman's `-request` and `-owner`; never on a free-mail
# domain, where `jane-dev@gmail.com` is a person (24 of CPython's 305 changed lines were lists')
_LIST_ADDRESS = re.compile(
    r"[A-Za-z0-9._%+\-]*-(?i:sig|dev|devel|users|announce|bugs|discuss|request|owner|bounces"
    r"|commits|checkins|list|digest)@(?!(?i:gmail|googlemail|outlook|hotmail|live|msn|yahoo|ymail"
    r"|icloud|me|mac|aol|proton|protonmail|gmx|web|mail|qq|163|126|yandex|naver)\.)")
# never glued to letters: digit runs inside hex hashes and identifiers pass Luhn one time in ten
# (the lookbehind after the first digit, not before it: a pattern that starts with a digit class
# lets `re` skip to the next digit in C; `(?<![\w.]\d)` there is `(?<![\w.])` before it)
CARD = re.compile(r"\d(?<![\w.]\d)(?:[ \-]?\d){12,18}(?!\w|\.\d)")  # may end a sentence
# an IPv4 address may end a sentence ("My IP is 10.0.0.1."), not a longer dotted number
_QUAD = r"(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
# (nor a version with a pre-release's name: `10.0.0.1-SNAPSHOT`, `3.4.5.6-beta`, `1.2.0.4-rc1`)
IPV4 = re.compile(r"(?<![\w.])" + _QUAD + r"(?!\w|\.\d|-(?i:alpha|beta|rc|snapshot|dev|pre|preview"
                  r"|nightly|final|release)(?![a-z]))")
_DOTTED_QUAD = re.compile(_QUAD)  # the shape of an IPv4 address, however it is judged
# a dotted number named as a section or a version is not an address: "section 17.4.1.2",
# "subclause 7.3.5.1", `#section-7.1.1.1`, `__version__ = "0.5.1.2"` (19 of the 260 lines of the
# C++ headers it changed before; clauses cited bare, `// 27.4.5.1` or `[23.2.4.1]`, still change:
# nothing in them tells them from an address in a comment or an SMTP `[10.0.0.1]`)
_NUMBERED = re.compile(r"(?<![A-Za-z])(?i:(?:sub)?(?:section|clause)s?|version_*|\u00a7)[\s:=\"'#\-]{0,4}"
                       r"(?:[\d.]+(?:,\s*|,?\s+(?:and|or|to)\s+))?$")  # "clauses 21.1.3.1 and 21.1.3.2"
# IPv6: hex groups standing on their own, never inside identifiers: `std::move`, `Foo::bar`,
# `a[1::2]`, `Usage::` and CSS `::before` are code (`_is_ipv6` also wants the shape of an address)
# An address may end in an IPv4 address (`::ffff:192.0.2.1`, `2001:db8::8a2e:192.168.0.1`), and
# carry a zone (`fe80::1%eth0`) and a prefix's length (`::1/128`): all of it goes, or its first
# groups would say what the address was (run before IPV4, which would take the tail alone)
_HEX4 = r"[0-9A-Fa-f]{0,4}"
IPV6 = re.compile(r"(?<![\w:.])(?:" + _HEX4 + r"(?::" + _HEX4 + r"){1,6}:" + _QUAD
                  + r"(?!\.?\d)|" + _HEX4 + r"(?::" + _HEX4 + r"){2,7})"
                  r"(?:%[A-Za-z0-9_.\-]{1,16})?(?:/\d{1,3}(?!\d))?(?![\w:]|\.\d)")
# not part of a longer run of digit groups (a card number that failed Luhn is not a phone)
PHONE = re.compile(r"(?<![\w+])(?<!\d[ .\-])(?:(?P<intl>\+[1-9][\d ().\-]{7,17}\d)"  # no code starts 0
                   r"|(?:\d{1,3}[ .\-])?(?:\(\d{2,4}\)[ .\-]?|\d{2,4}[ .\-])\d{3,4}[ .\-]\d{3,5}"  # (415)555-0132, 91-415-555-0132
                   r"|0\d{1,3}-\d{6,8}"                       # 09-7625400: area code, subscriber
                   # a national number: the trunk prefix 0 most plans dial before the area code,
                   # then 8 to 10 digits, written whole or in groups of 2 to 4 (`05321234567`,
                   # `020 7946 0958`, `01 23 45 67 89`)
                   r"|(?P<national>0[1-9]\d{8,10}|0[1-9]\d{0,3}(?:[ \-]\d{2,4}){2,4})"
                   r"|1[3-9]\d{9}"                            # 13812345678: a mobile number
                   # any other grouping of digits a plan writes (`07400 123456`, `(0212) 345 67 89`,
                   # `8 (912) 345-67-89`, `612 34 56 78`, `030/123456`, `06.12.34.56.78`): a number
                   # only if some country's plan holds it (`_in_a_plan`)
                   r"|(?<![\-./])(?P<plan>(?:\+|(?=\(?\d))(?:\(\d{1,5}\)|\d{1,14}+)"
                   r"(?:(?:[ .\-/]|(?<=\))|(?=\())(?:\(\d{1,5}\)|\d{1,14}+)){1,7}+)"
                   # digits alone, as code writes its numbers: a phone's only after a word that
                   # says so (`phone: 4155550132`, `Tel. 5321234567`) and in some plan
                   r"|(?P<bare>\d{8,12}+))"
                   r"(?!\w)(?![ .\-/]\d)")
# what says that the digits after it are a phone number (`_is_phone`: `bare`), up to 16
# characters before them, no digit between
_PHONE_WORD = re.compile(r"\b(?i:phone|telephone|tel|mobile|cell|cellphone|call|fax|whatsapp|sms|contact"
                         r"|telefon|tel[eé]fono|telefone|t[eé]l[eé]phone|handy|celular|m[oó]vil"
                         r"|(?:my|your|his|her|our|their) number)s?\b[^\n\d]{0,16}$")


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


def _is_card(match: re.Match) -> bool:
    """13 to 19 digits passing Luhn, starting as card numbers do (1 to 9; `0000-0000-...` of a
    nil UUID passes Luhn too).
    """
    digits = re.sub(r"\D", "", match[0])
    return 13 <= len(digits) <= 19 and digits[0] != "0" and luhn(digits)


def _is_mask(address: str, bits: int) -> bool:
    """True for a netmask or a hostmask, which names a prefix's length and no host (one of 33 or
    129 values): ones then zeros from a first group of ones (`255.255.255.0`, `ffff:ffff::`), or
    zeros then ones from a first group of zeros (`0.0.0.255`, Cisco's wildcard masks). All ones
    (`255.255.255.255`, the broadcast address) and all zeros (`0.0.0.0`) are addresses.
    """
    if bits == 32:
        number = int.from_bytes(bytes(map(int, address.split("."))), "big")
    else:
        number = int(ipaddress.IPv6Address(address))
    full = (1 << bits) - 1
    if number in (0, full):
        return False
    first = number >> (bits - 8) if bits == 32 else number >> (bits - 16)
    inverse = full ^ number
    if first == (255 if bits == 32 else 0xFFFF):
        return inverse & (inverse + 1) == 0  # ones, then zeros
    return bits == 32 and first == 0 and number & (number + 1) == 0  # zeros, then ones


_HEX_GROUP = re.compile(r"[0-9A-Fa-f]{3,4}")


def _is_ipv6(match: re.Match) -> bool:
    """An address, not code: valid, with a digit and a group of three or four hex digits
    (`fe80::1`, `2001:db8::8a2e:370:7334`), or the loopback `::1` on its own; `a::b`, `dead::beef`,
    `1::2` and the unspecified `::` are left alone.
    """
    text = match[0].split("/")[0].split("%")[0]  # the address, without its prefix length or zone
    if text == "::1":  # the loopback address, written out ("connecting from ::1"), not a slice `a[::1]`
        return match.string[match.start() - 1:match.start()] != "["
    if not any(c.isdigit() for c in text) or not _HEX_GROUP.search(text):
        return False
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return not _is_mask(text, 128)


_C_LOG2_C = [0.0] + [c * math.log2(c) for c in range(1, 513)]  # c log2 c, looked up


def entropy(text: str) -> float:
    """Shannon entropy of the text's characters (its first 512), in bits per character."""
    text = text[:512]
    n = len(text)  # log2(n) - sum(c log2 c) / n, the products from a table
    counts: dict = {}
    _count_elements(counts, text)  # Counter's own counting, without its Python-level set-up
    return math.log2(n) - sum(map(_C_LOG2_C.__getitem__, counts.values())) / n


def _entropy_at_least(text: str, bits: float) -> bool:
    """`entropy(text) >= bits`, mostly without counting: n characters of which k differ have at
    least the entropy of one of them n - k + 1 times and the others once (entropy is Schur-concave),
    which a random key's already exceeds (4 in 5 of the peers' keys); only the rest are counted.
    """
    text = text[:512]
    n = len(text)
    # (the margin keeps rounding from ever deciding what the count would not)
    if math.log2(n) - _C_LOG2_C[n - len(set(text)) + 1] / n >= bits + 1e-9:
        return True
    return entropy(text) >= bits


# what stands in for a secret in examples and templates: `${DB_PASSWORD}`, `%(token)s`, `{{ .Token }}`,
# `<your-key>`, `xxxxxxxx`, `********`, `####`, `changeme`, `somefakekey`, AWS's `...EXAMPLE...`
# (written so that every branch begins with a literal: `re` then skips in C to where one can
# begin; `^\$` and `(?i:` in the alternation made it try every branch at every character, the
# costliest step of judging a key. `_not_a_secret` adds what they said.)
_NOT_A_SECRET = re.compile(r"%[\d.]*[sdfrx(]|\{\{|xxxxxx|XXXXXX|EXAMPLE|####|\*\*\*\*|\.\.\."
                           r"|fake|FAKE|dummy|DUMMY|changeme|CHANGEME|placeholder|PLACEHOLDER")
_NOT_A_SECRET_ANY_CASE = re.compile(r"(?i:your[_\-]|redacted)")


def _any_case(word: str, then: str = "") -> list[str]:
    r"""Branches matching the ASCII word in any case, each beginning with a literal: `y[oO][uU]`
    and `Y[oO][uU]` for `(?i:you)`, which makes `re` try its branches at every character (a
    literal first lets it skip to where one can begin). The same as `(?i:` in ASCII text only:
    to `(?i:`, other scripts' `ſ` and `K` are an `s` and a `k`.
    """
    rest = "".join(f"[{char}{char.upper()}]" if char.isalpha() else re.escape(char) for char in word[1:])
    return [first + rest + then for first in (word[0], word[0].upper())]


# `_NOT_A_SECRET` and `_NOT_A_SECRET_ANY_CASE` in one search, for ASCII text
_NOT_A_SECRET_A = re.compile("|".join([_NOT_A_SECRET.pattern, *_any_case("your", r"[_\-]"),
                                       *_any_case("redacted")]))


def _not_a_secret(text: str) -> bool:
    """True if the text stands in for a secret (`_NOT_A_SECRET`, `${...}`, `your-key`, `REDACTED`)."""
    if text.startswith("$"):
        return True
    if text.isascii():
        return _NOT_A_SECRET_A.search(text) is not None
    return _NOT_A_SECRET.search(text) is not None or _NOT_A_SECRET_ANY_CASE.search(text) is not None


# `$USER:$PASSWORD`, `<user:password>`, `neo4j:[PASSWORD]`, `test:test`, `xxx:yyy`, `username:token`
_CREDENTIALS_PLACEHOLDER = re.compile(
    r"(?:^|:)[\"']?[$<\[{%]|^(\w+):\1$|^(\w)\2*:(\w)\3*$|^.?:.?$"
    r"|^(?i:user(?:name)?|admin|api)?:(?i:pass(?:word)?|token|secret)?$")
# values that begin as a provider's keys do are judged by SECRET alone: `xoxp-1234567890` is no
# Slack token, and no other key either
_PROVIDER_PREFIX = re.compile(r"xox|xapp-|sk[-_]|rk_|gh[pousr]_|github_pat_|AKIA|AIza|gl[a-z]{1,5}-|hf_|npm_"
                              r"|pypi-|dapi|SG\.|eyJ|sm_[aps]at_|pscale_|shp[a-z]{2}_|sntry|rdme_|pnu_|pul-"
                              r"|PMAK-|pplx-|ntn_|lin_api_|glsa_|glc_|ico-|HRKU-|fio-|dop_|doo_|dor_|dp\.pt\.")
_ATTRIBUTE = re.compile(r"[A-Za-z_$][\w$]*(?:\.[A-Za-z_$][\w$]*)+|[A-Za-z_][\w\-]*")


_ALPHABET, _DIGITS = "abcdefghijklmnopqrstuvwxyz", "0123456789"
_SEQUENCE = re.compile("|".join(run[i:i + 10] for run in (_ALPHABET, _DIGITS)
                                for i in range(len(run) - 9)))


def _is_sequence(text: str) -> bool:
    """True if it runs through ten letters or digits in order (`abcdefghij`, `0123456789`): typed
    by hand, as in examples (`AIzaSyabcdefghijklmnopqrstuvwxyz1234567`), never drawn at random.
    """
    low = text.lower()
    # every ten letters in order hold `ij` (`abcdefghij` to `ijklmnopqr`) or `rs` (`jklmnopqrs` to
    # `qrstuvwxyz`), the digits `01`: three plain searches turn down nearly every key before the
    # alternation of 18 runs, which is tried at nearly every letter
    return ("ij" in low or "rs" in low or "01" in low) and _SEQUENCE.search(low) is not None


# prefixes no placeholder carries: what follows them is a key whatever it looks like
_PROOF = ("AGE-SECRET-KEY-1", "pypi-AgE", "-----BEGIN")


def _is_token(match: re.Match) -> bool:
    """MARKED's match is a secret, not a placeholder: a password in a URL or given to a command
    by their own rules, anything else as a key (`_is_key`: 2.5 bits of entropy a character or more,
    no run of one character or of the alphabet).
    """
    text = match[0]
    if match.lastgroup in ("url", "dsn", "curl"):  # a password in a URL or curl's -u: any entropy
        return _CREDENTIALS_PLACEHOLDER.search(text.strip(" =\"'")) is None
    if match.lastgroup == "flag":  # a command's password: not a word, a path or a `$VARIABLE`
        value = text.strip("\"'")
        return (len(value) >= 4 and not value.isalpha() and value[0] not in "-/~.$<"
                and not _not_a_secret(value) and _entropy_at_least(value, 2.0))
    return _is_key(text)


def _is_key(text: str) -> bool:
    """A key found by its prefix, not a placeholder: one whose prefix no placeholder carries, or
    2.5 bits a character and no sequence.
    """
    return text.startswith(_PROOF) or (not _not_a_secret(text) and _entropy_at_least(text, 2.5)
                                       and not _is_sequence(text))



def _is_secret_value(match: re.Match) -> bool:
    """A value that looks random enough to be a key, not code: with a digit, and either a quoted
    password of six characters or more, or ten or more with 3 bits of entropy a character (random
    16 characters have about 4), or a long number; never a name (`get_password`, `settings.TOKEN`,
    `request.headers`), a placeholder (`${TOKEN}`, `xxxxxx`) or a format (`"%0.f"`).
    """
    value, name, quote, comma = match.group("v", "k", "q", "c")
    # a password is judged more leniently: people choose them (`Welcome1!`, `hunter2hunter2`),
    # quoted or not; unquoted, eight characters or more and not a path (the shell's `PWD=/home/ann`).
    # (Of the names, only `pass` and `pwd` begin with a p.)
    password = name[0] in "pP" and (quote is not None or (len(value) >= 8 and value[0] not in "/~."))
    if len(value) < 10 and not password:
        return False  # short, and no password (below): the costlier tests need not run
    if value[0] in "/~" and name[:2] in ("pw", "pW", "Pw", "PW"):
        return False  # the shell's working folder, `PWD=/home/ann/proj1`, `OLDPWD=~/src`
    # the digits counted once (in ASCII `\d` is 0-9: deleted in C, not listed)
    is_ascii = value.isascii()
    digits = (len(value) - len(value.encode().translate(None, b"0123456789")) if is_ascii
              else len(DIGIT.findall(value)))
    # letters alone are words and names (`getuser`, `HTTPPasswordMgrWithDefaultRealm`), not keys
    # (a digit of any script: `²` too)
    if ((not digits and (is_ascii or not any(map(str.isdigit, value)))) or (comma and not quote)
            or _not_a_secret(value) or _is_sequence(value) or _PROVIDER_PREFIX.match(value)
            or value.startswith(("ssh-", "ecdsa-sha2-"))):  # an SSH key's type: `ssh-ed25519`
        return False
    if password and _entropy_at_least(value, 2.3) and (quote or any(map(str.isalpha, value))):
        return not _names_no_secret(match)  # `password = "hunter2!x"`, `DB_PASSWORD=Welcome1!`
    if len(value) < 10 or (comma and digits < 2):
        return False  # short; or a list of names, `"tokens", "symbol2label"`
    if "." in value and digits < 3 and _ATTRIBUTE.fullmatch(value):
        return False  # `settings.TOKEN`, `self.api_key`; a key's parts have digits (`s.ZC9Ecf4M5g9o`)
    if digits == len(value):  # a number: long, and not `100000000000`
        return len(value) >= 12 and _entropy_at_least(value, 2.5) and not _names_no_secret(match)
    return _entropy_at_least(value, 3.0) and not _names_no_secret(match)


# names whose value is a key's name, id, path or kind, not a secret: `key_name`, `secret_arn`,
# `kms_key_id`, `signingKeyPath`, `password_file`. (What the name holds before the word for a
# secret, `public_key`, `cache_key`, is not looked at: that look cost 3 % of the scrubber's time
# on the peers' cases, and such a value scrubbed by mistake is no leak.)
_NOT_SECRET_TAIL = re.compile(r"(?:^|[_\-.])(?i:name|id|ids|arn|path|file|filename|url|uri|type|alias|label)$"
                              r"|(?:Name|Id|Ids|Arn|Path|File|Filename|Url|Uri|Type|Alias|Label)$")
_TAIL_ENDS = frozenset(("me", "id", "ds", "rn", "th", "le", "rl", "ri", "pe", "as", "el"))


def _names_no_secret(match: re.Match) -> bool:
    """True if the part of the name after the word for a secret (ASSIGNMENT's `n`) says that the
    value is no secret (above). Its last two letters first: most names end otherwise (`_KEY`).
    """
    tail = match["n"]
    end = tail[-2:].lower()
    if end not in _TAIL_ENDS or _NOT_SECRET_TAIL.search(tail) is None:
        return False
    return end not in ("id", "ds") or match["k"][:3].lower() != "ses"  # a session's id is its secret


_PLACEHOLDER_WRITTEN = re.compile(r"<[A-Z]+_\d+>")
_WORDS = re.compile(r"[A-Za-z_]+(?: [A-Za-z_]+)*")  # `real_key`, `Enter the password`
_TEMPLATE = re.compile(r"\{\{?\s*[\w.]*\s*\}\}?|\$\{?\w+\}?|%\(\w+\)s")  # `{{ pw }}`, `${PW}`, `{}`


def _is_keyword_value(value: str, name: str, op: str | None) -> bool:
    """A quoted value given to a password's, secret's or key's name (`name`, the whole identifier)
    is one, unless it is plainly something else: short (under 6 characters), no letter or digit in
    it, a placeholder (`_not_a_secret`, `{{ pw }}`, `${PW}`, once its template fields are taken
    out), a path or URL, one word or name (`real_key`, `password = "secret"`), words after no
    operator or in a call (`secret("Enter the password")`), or too plain to be random (under 2.5
    bits of entropy a character); nor a name whose end says it holds none (`secret_name`,
    `password_file`: `_NOT_SECRET_TAIL`). A name then the value with no operator between
    (`password "..."`) counts only for a bare `password`, `passwd`, `pwd`, `secret(e)`.
    """
    if len(value) < 6 or len(value) > 200 or not any(c.isalnum() for c in value):
        return False
    if op is None and name.lower() not in ("password", "passwd", "pwd", "secret", "secrete"):
        return False
    if _NOT_SECRET_TAIL.search(name):  # `secret_name`, `password_file`: no secret's value
        return False
    rest = _TEMPLATE.sub("", value)  # `{{ pw }}`, `${PW}`, `%(pw)s`: fields, not a secret
    if (len(rest) < 6 or not any(c.isalnum() for c in rest) or _PLACEHOLDER_WRITTEN.search(value)
            or _not_a_secret(rest) or rest[0] in "/~." or "://" in rest or _is_sequence(rest)):
        return False
    if _WORDS.fullmatch(value.strip()):  # words: a passphrase after an operator, 3 words or more
        if op in (None, "(", ".assign(") or len(value.split()) < 3:
            return False
    return _entropy_at_least(value, 2.5)


_DECIMAL = re.compile(r"[+\-]?\d+\.\d+")
# a date, not a number: `2024-01-31`, `31.01.2024`, `01/31/2024 12`, `2024/01/31`
_DATE = re.compile(r"\d{4}[\-./]\d\d?[\-./]\d\d?|\d\d?[\-./]\d\d?[\-./]\d{4}")
_DIGIT_GROUPS = re.compile(r"\d+")


def _is_phone(match: re.Match) -> bool:
    """8 to 15 digits, and neither a decimal number (`+35236450.6`) nor in the shape of an IPv4
    address, which the IP rule judges (a netmask `255.255.255.0` it leaves is no phone). A number
    with its country's code is held to that country's plan (`phonenumbers`: a length it can
    have); a national one must not run through ten digits in order (`0123456789`, a table); one
    in any other grouping (PHONE's `plan`, or a national one too short for its shape) must be
    valid in some country's plan (`_in_a_plan`), and digits alone (`bare`) also follow a word
    that says phone (`_PHONE_WORD`). Never one digit or two repeated (`0000 0000 0000`).
    """
    text = match[0]
    digits = re.sub(r"\D", "", text)
    if (not (8 <= len(digits) <= 15) or _DECIMAL.fullmatch(text) or _DOTTED_QUAD.fullmatch(text)
            or len(set(digits)) < 3):  # (`0000 0000 0000`, `1111-2222`: no number)
        return False
    if match["intl"] is not None:
        return _possible_number(text)
    if match["national"] is not None and len(digits) >= 10 and not _is_sequence(digits):
        return True
    if match["bare"] is not None:  # digits alone: after a word that says phone, and in a plan
        return (_PHONE_WORD.search(match.string, max(0, match.start() - 40), match.start()) is not None
                and not _is_sequence(digits) and _in_a_national_plan(text, digits))
    if match["national"] is None and match["plan"] is None:
        return True
    return _in_a_plan(text, digits)  # (a national number too short for its shape: `08-12 34 56`)


@functools.lru_cache(maxsize=4096)
def _possible_number(text: str) -> bool:
    """True if `phonenumbers` reads the text (`+` and the country's code) as a number its
    country's plan can have.
    """
    import phonenumbers  # (imported on the first number with a country's code: 0.1 s)

    try:
        return phonenumbers.is_possible_number(phonenumbers.parse(text, None))
    except phonenumbers.NumberParseException:
        return False


def _in_a_plan(text: str, digits: str) -> bool:
    """A grouping of digits PHONE's other shapes do not take is a phone number when some
    country's plan holds it as a valid number (`phonenumbers`, as a parser validates one): with
    `+` (or the international prefix `00`) the plan of its country's code, else the plan of a
    country whose national format it can be (its trunk prefix, a length and leading digits the
    plan has). Code's numbers are left: a date (`2024-01-31`), groups of one digit (`1 2 3 4 5 6
    7 8`), one group repeated (`0246 0246`), counting (`0123 4567`, `8-11 16-19 24-27 ...`).
    Two groups only after a trunk prefix or an area code in parentheses (`07400 123456`,
    `(11) 96123-4567`): `2001-2022` and `2045-2047` are ranges.
    """
    groups = _DIGIT_GROUPS.findall(text)
    if (any(len(group) < 2 for group in groups[1:]) or (len(groups) < 3 and text[0] not in "+(0")
            or (len(groups[0]) == 1 and len(groups) < 4 and "(" not in text)
            or len(set(groups)) == 1 or _ascending(groups) or digits.startswith("01234567")
            or _DATE.search(text)):
        return False
    if text[0] == "+" or digits[:2] == "00":
        return _valid_number("+" + (digits[2:] if text[0] != "+" else digits), None)
    return _in_a_national_plan(text, digits)


def _in_a_national_plan(text: str, digits: str) -> bool:
    """True if the text is a valid number in the national format of some country's plan."""
    return any(_valid_number(text, region) for region in _plans_for(digits))


def _ascending(groups: list[str]) -> bool:
    """Five groups or more, each a larger number than the one before: a list or ranges (`8-11
    16-19 24-27`), not a phone number's groups.
    """
    return len(groups) >= 5 and all(int(a) < int(b) for a, b in zip(groups, groups[1:]))


@functools.lru_cache(maxsize=4096)
def _valid_number(text: str, region: str | None) -> bool:
    """True if `phonenumbers` parses the text in that region's plan as a valid number."""
    import phonenumbers

    try:
        return phonenumbers.is_valid_number(phonenumbers.parse(text, region))
    except phonenumbers.NumberParseException:
        return False


@functools.cache
def _plans() -> tuple:
    """((region, its trunk prefix, its national numbers' lengths, their pattern), ...) of every
    plan `phonenumbers` knows (245; read on the first number that needs them).
    """
    import phonenumbers

    out = []
    for region in sorted(phonenumbers.SUPPORTED_REGIONS):
        plan = phonenumbers.PhoneMetadata.metadata_for_region(region)
        general = plan.general_desc
        if general is not None and general.national_number_pattern is not None:
            out.append((region, plan.national_prefix or "", frozenset(general.possible_length),
                        re.compile(general.national_number_pattern)))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _plans_for(digits: str) -> tuple[str, ...]:
    """The regions whose national format the digits can be: with the region's trunk prefix
    (`0`, `8`, `1`) or without it, a length its numbers have and the leading digits its numbers
    begin with (the plan's general pattern: one regex each, before `phonenumbers` parses, 40 us).
    """
    out = []
    for region, trunk, lengths, pattern in _plans():
        national = digits[len(trunk):] if trunk and digits.startswith(trunk) else digits
        if len(national) in lengths and pattern.fullmatch(national):
            out.append(region)
    return tuple(out)


# Cheap tests over a whole serialized trace: only text that might hold PII is scrubbed piece by
# piece. Looser than the patterns above (they only have to see every candidate that their check
# can accept); simple searches are several times faster than one alternation of everything. Each
# pattern also has its own test in `Scrubber.text`, so a text is searched only by the patterns
# that may match in it. A test that starts with a literal or a character class lets `re` skip, in
# C, to the next place where it can begin; one that starts with a lookbehind, `^` or `(?i:` enters
# its branches at every character (`\b` is cheap: `_MAYBE_KEY` enters them only at a word's start).
_MAYBE_NAME = re.compile(_ASSIGNMENT_NAMES)  # ASSIGNMENT's names, in the lowercased text
_MAYBE_MARKED = re.compile("|".join(re.escape(mark) for mark in _SECRET_MARKS))
# maybe_pii's search for what needs no digit: the marks (`-u` stands for ` -u` and `--user`),
# the PEM header, an `@` before a domain. Every branch begins with a literal other than a space:
# `re` skips, in C, to the next character that can begin one. (ASSIGNMENT's names need a digit:
# `_is_secret_value` wants one in the value; so do a lowercase `bearer ` and a command's flags,
# left to text with a digit: a `b` or an `m` first would stop the skip at every such letter.)
_MAYBE_MARK = re.compile("|".join(sorted(
    {re.escape(mark) for mark in (*_SECRET_MARKS, "-----BEGIN", "-u")}
    - {re.escape(mark) for mark in (" -u", "--user", "bearer ", *_FLAG_MARKS)}))
    + r"|@[A-Za-z0-9.\-]+\.[A-Za-z]{2}")


# where SECRET can begin: a prefix at the start of a word, and a key's length of non-space (13, the
# shortest of `_TOKENS`: `xoxb-1-2-Abcd`; none holds a space). maybe_pii's test for provider keys:
# one search, the prefix and the run together
_MAYBE_KEY = re.compile(r"\b(?=" + _trie(_SECRET_PREFIXES, shortest=13) + ")")
_MAYBE_GLUED_KEY_A = re.compile(r"_(?=" + _trie(_SECRET_PREFIXES, shortest=13) + ")", re.ASCII)


def _maybe_named(text: str) -> bool:
    # a value `_is_secret_value` takes has a digit (of any script: `not text.isascii()`). In
    # ASCII text the names are left to the search itself (`_ASSIGNMENT_A`): not looked for twice
    if text.isascii():
        return _DIGIT_OUTSIDE_A.search(text) is not None
    return _MAYBE_NAME.search(text.lower()) is not None


# a digit outside the placeholders already written (`<SECRET_1>`): a digit that only digits and a
# `>` follow is in no value ASSIGNMENT takes (a value is never followed by `>`), so a text whose
# only digits are its placeholders' (half of the peers' cases once their key is out) is not searched
_DIGIT_OUTSIDE_A = re.compile(r"\d(?!\d*>)", re.ASCII)


# phones, cards, IPv4 (8.8.8.8: 7 characters): each of them is such a run, so a text without one
# holds none of them, whatever else its digits are (84 % of the peers' cases have a digit, 16 % a run)
_MAYBE_NUMBER = re.compile(r"\d[\d .\-()]{5,}\d")
# an IPv6 address `_is_ipv6` accepts is a run of hex digits and colons with two colons or more
# and a digit among them: the digit after the first two colons or between them (a search led by
# the colon), or before them (led by the digit). A `::` between names (`std::vector<int> v(10)`)
# has no digit in its run. Two searches, not one alternation: each begins with a literal or a
# class, so `re` skips in C to where it can begin (JSON's colons made the alternation slow).
# (each run up to the next colon or the first digit, possessive: nothing to backtrack into)
_MAYBE_IPV6_COLON = re.compile(r":[0-9A-Fa-f]*+:[A-Fa-f:]*+\d|:[A-Fa-f]*+\d[0-9A-Fa-f]*+:")
_MAYBE_IPV6_DIGIT = re.compile(r"\d[0-9A-Fa-f]*+:[0-9A-Fa-f]*+:")


# In ASCII text (nearly all there is) the tests run compiled with re.ASCII (`_A`): `\d`, `\b`
# and `\S` are then a table lookup, not a call into the Unicode database for each character (a
# third of the time of a search on a serialized trace). On ASCII text they find what the Unicode
# ones find (`\S` also takes the separators \x1c-\x1f: looser, which a cheap test may be).
_DIGIT_A, _MAYBE_NUMBER_A, _MAYBE_IPV6_COLON_A, _MAYBE_IPV6_DIGIT_A, _MAYBE_KEY_A = (
    re.compile(pattern.pattern, re.ASCII)
    for pattern in (DIGIT, _MAYBE_NUMBER, _MAYBE_IPV6_COLON, _MAYBE_IPV6_DIGIT, _MAYBE_KEY))
# Twins of two patterns for ASCII text, finding there exactly what the patterns find. SECRET's
# has no `\s` or `(?i:` (which re.ASCII would change). ASSIGNMENT's spells its names in both
# cases (`_any_case`) for `(?i:`, which made `re` try every branch at every character.
_SECRET_A = re.compile(SECRET.pattern, re.ASCII)
KEYWORD = re.compile(_keyword(_names(False)))
_KEYWORD_A = re.compile(_keyword(_names(True)))  # KEYWORD's twin for ASCII text
_ASSIGNMENT_A = re.compile(ASSIGNMENT.pattern.replace(f"(?i:{_ASSIGNMENT_NAMES})", "(?:" + "|".join(
    branch for name in _ASSIGNMENT_NAMES.split("|") for branch in _any_case(name)) + ")"))


def _maybe_context(text: str) -> bool:  # KEYWORD's test
    return _MAYBE_KEYWORD.search(text) is not None


def _maybe_number(text: str) -> bool:
    return (_MAYBE_NUMBER_A if text.isascii() else _MAYBE_NUMBER).search(text) is not None


def _maybe_ipv6(text: str) -> bool:
    if ":" not in text:
        return False
    colon, digit = ((_MAYBE_IPV6_COLON_A, _MAYBE_IPV6_DIGIT_A) if text.isascii()
                    else (_MAYBE_IPV6_COLON, _MAYBE_IPV6_DIGIT))
    return colon.search(text) is not None or digit.search(text) is not None


# What one Hyperscan scan of ASCII text finds (below): a bit for each of `maybe_pii`'s tests, and
# for `_MAYBE_MARKED`, `Scrubber._scrub`'s test for MARKED
(_MARK, _KEY, _NUMBER, _IPV6_COLON, _IPV6_DIGIT, _DIGIT, _NAME, _DASH_P, _PUTTY, _GLUED_KEY,
 _JSON_ESCAPE, _URL_AT, _MARKED, _KEYWORD, _SIGNED) = (1 << bit for bit in range(15))
_GATE_ALONE = _MARK | _KEY | _NUMBER | _IPV6_COLON | _IPV6_DIGIT | _KEYWORD | _SIGNED  # each is reason enough
_GATE_WITH_DIGIT = _NAME | _DASH_P | _PUTTY | _GLUED_KEY | _JSON_ESCAPE | _URL_AT  # with a digit


def _gate_patterns() -> list[str]:
    r"""The tests as Hyperscan expressions, in the order of their bits. Each finds a place where
    its `re` test finds one: no lookahead in Hyperscan, so a key's prefix is followed by its run of
    non-space characters (`_MAYBE_KEY`'s `(?=\S{9})` becomes `\S{9}`); a possessive `*+` is a plain
    `*` (each is followed by what its class cannot hold: the same places); the names case-blind,
    as the `re` gate searches the lowercased text. In ASCII, Hyperscan's `\d`, `\s`, `\S` and `\b`
    are `re.ASCII`'s.
    """
    def keys(lead: str) -> str:  # the prefixes grouped by the run they want: compiled in 0.13 s, not 0.22
        runs: dict[int, list[str]] = {}
        for prefix in sorted(set(_SECRET_PREFIXES)):
            runs.setdefault(max(0, 13 - len(prefix)), []).append(re.escape(prefix))
        return "|".join(lead + "(?:" + "|".join(prefixes) + ")" + (rf"\S{{{run}}}" if run else "")
                        for run, prefixes in sorted(runs.items()))
    return [_MAYBE_MARK.pattern, keys(r"\b"), _MAYBE_NUMBER.pattern,
            _MAYBE_IPV6_COLON.pattern.replace("*+", "*"), _MAYBE_IPV6_DIGIT.pattern.replace("*+", "*"),
            r"\d", _ASSIGNMENT_NAMES, "-p", "Private-Lines:", keys("_"), r"\\u00", "%40",
            _MAYBE_MARKED.pattern, _MAYBE_KEYWORD.pattern, _MAYBE_SIGNED]


# The tests on ASCII text (nearly all there is) in one Hyperscan scan: they run in C as one
# automaton over the text, a few tenths of a microsecond a line of code where the `re` searches
# take 1.5 to 2, and a whole serialized trace in one pass (BENCHMARKS.md, "The PII scrubber beside
# its peers"). Compiled on first use (0.15 s); a scratch space a thread (Hyperscan's rule: it
# scans without the GIL). Where Hyperscan cannot be had (no wheel for the platform, a CPU without
# SSSE3) the `re` searches answer alike: tests/stages/traces/test_pii.py holds the two to the same answers.
_SCAN: list = [None]  # the compiled scan, or False where there is none
# the last text scanned and what was found in it, for `Scrubber._scrub` (as one tuple: threads)
_LAST_SCAN: list = [("", 0)]


def _compile_gate():
    try:
        import hyperscan

        patterns = _gate_patterns()
        flags = [hyperscan.HS_FLAG_SINGLEMATCH] * len(patterns)  # (each found once: a call each)
        flags[_NAME.bit_length() - 1] |= hyperscan.HS_FLAG_CASELESS
        database = hyperscan.Database()
        database.compile(expressions=[p.encode() for p in patterns], ids=[1 << bit for bit in range(len(patterns))],
                         elements=len(patterns), flags=flags)
    except Exception:  # noqa: BLE001 (ImportError, or Hyperscan's own error on this CPU)
        _SCAN[0] = False
        return False
    local = threading.local()

    def scan(text: str) -> int:
        try:
            scratch = local.scratch
        except AttributeError:
            scratch = local.scratch = hyperscan.Scratch(database)
        found: list = []
        database.scan(text.encode(), _found, 0, found, scratch)  # (positional: keywords cost 0.3 us)
        bits = sum(found)  # (each id is its bit, found once)
        _LAST_SCAN[0] = (text, bits)
        return bits
    _SCAN[0] = scan
    return scan


def _found(id_, start, end, flags, found: list) -> None:
    found.append(id_)


def maybe_pii(text: str) -> bool:
    """True if the text may hold PII: a cheap test before the patterns run."""
    is_ascii = text.isascii()
    if is_ascii:
        scan = _SCAN[0]
        if scan is None:
            scan = _compile_gate()
        if scan:
            bits = scan(text)
            return bool(bits & _GATE_ALONE or (bits & _DIGIT and bits & _GATE_WITH_DIGIT))
    return _maybe_pii_re(text, is_ascii)


def _maybe_pii_re(text: str, is_ascii: bool) -> bool:
    # on most lines of code three searches: a digit, the marks, a key's prefix. Without a digit
    # (83 % of lines of code) there is no phone, card or address, and no assignment of a secret;
    # a digit of another script (`²`) may be one for `_is_secret_value`, so non-ASCII text counts
    if is_ascii and _DIGIT_A.search(text) is None:
        return (_MAYBE_MARK.search(text) is not None or _MAYBE_KEY_A.search(text) is not None
                or _maybe_context(text) or _MAYBE_SIGNED_RE.search(text) is not None)
    # with a digit, a secret's name first: it settles most text that holds secrets in one search
    # (the marks need none). An IPv6 address has a digit (`_is_ipv6`): C++'s `std::` alone is no
    # reason to look
    return (_MAYBE_NAME.search(text.lower()) is not None or _MAYBE_MARK.search(text) is not None
            or _maybe_number(text) or _maybe_ipv6(text) or "-p" in text  # (`mysql -ppw`)
            or "Private-Lines:" in text or _MAYBE_GLUED_KEY_A.search(text) is not None
            or "\\u00" in text or "%40" in text  # escapes may hide an `@` or a key's `-` (`Scrubber.text`)
            or (_MAYBE_KEY_A if is_ascii else _MAYBE_KEY).search(text) is not None
            or _maybe_context(text) or _MAYBE_SIGNED_RE.search(text) is not None)


# Strings `maybe_pii` turned down, remembered: agents' traces repeat their system prompt, tool
# schemas, roles and keys trace after trace (a lookup costs the string's hash; the test ~40 ns a
# character). Emptied when it holds 2**16 strings or 2**24 characters (16 MB of ASCII): each
# trace's own strings churn through it.
_NO_PII: dict[str, None] = {}
_NO_PII_HELD = [0]  # characters held


def holds_pii(text: str) -> bool:
    """`maybe_pii`, remembering the strings it turned down."""
    if text in _NO_PII:
        return False
    if maybe_pii(text):
        return True
    _clear(text)
    return False


def _clear(text: str) -> None:
    """Remember `text` as holding nothing to scrub (emptying the memory when full)."""
    if len(_NO_PII) >= 1 << 16 or _NO_PII_HELD[0] + len(text) > 1 << 24:
        _NO_PII.clear()
        _NO_PII_HELD[0] = 0
    _NO_PII[text] = None
    _NO_PII_HELD[0] += len(text)


_NAMES_SECRET: dict[str, bool] = {}  # a dict key -> whether it names a secret (`_MAYBE_NAME`)


def _names_secret(key: str) -> bool:
    found = _NAMES_SECRET.get(key)
    if found is None:
        if len(_NAMES_SECRET) >= 1 << 16:
            _NAMES_SECRET.clear()
        found = _NAMES_SECRET[key] = _MAYBE_NAME.search(key.lower()) is not None
    return found


_BREAKS = (" ", "\n", "\t", '"', "'", ",", ";", "\\", "(", "[", "{", "<")


def excerpt(text: str, limit: int = 2000) -> str:
    """At most `limit` characters of the text, to show beside a refusal, cut where no secret can
    be cut in half: before its last space, quote, comma, bracket or backslash that is not inside a
    number written in groups (a key or a phone number cut short no longer matches its format, and
    the scrubber would let its first half through). Scrub after.
    """
    if len(text) <= limit:
        return text
    end = limit
    while (cut := max(text.rfind(mark, 0, end) for mark in _BREAKS)) > 0:
        # nor inside a number written in groups: `+44 20 | 7946 0958`, `4111 1111 | 1111 1111`
        if text[cut - 1] in _NUMBERISH and text[cut + 1:cut + 2] in _NUMBERISH_AFTER:
            end = cut
            continue
        return text[:cut]
    return text[:limit]


_NUMBERISH, _NUMBERISH_AFTER = frozenset("0123456789)"), frozenset("0123456789(")


# JSON's escape of a printable ASCII character other than `"` and `\`, or of `/` (not after a `\`);
# a URL's `%40` (`?email=ann%40corp.com`)
_ESCAPE = re.compile(r"(?<!\\)\\(?:u00([2-7][0-9a-fA-F])|/)|%40")


def _unescape(match: re.Match) -> str:
    if match[1] is None:
        return "@" if match[0] == "%40" else "/"
    char = chr(int(match[1], 16))
    return match[0] if char in '"\\\x7f' else char


_ZERO = dict.fromkeys(KINDS, 0)
_MASKS = ("####", "****", "xxxx", "XXXX", "....")


class Scrubber:
    """Scrubs one trace; `counts` holds the redactions per kind."""

    def __init__(self, kinds: set[str]):
        """A scrubber of the PII `kinds`, its counts at zero."""
        self.kinds = kinds
        self.counts = _ZERO.copy()  # (a copy is made 4 times as fast as `dict.fromkeys`)
        # {(kind, value): its placeholder}, and {kind: placeholders of that kind so far} (one dict)
        self.placeholders: dict = {}

    def _placeholder(self, kind: str, value: str) -> str:
        key = (kind, value.lower() if kind == "email" else value)
        placeholder = self.placeholders.get(key)
        if placeholder is None:
            number = self.placeholders[kind] = self.placeholders.get(kind, 0) + 1
            placeholder = self.placeholders[key] = f"<{kind.upper()}_{number}>"
        self.counts[kind] += 1
        return placeholder

    def text(self, value: str) -> str:
        r"""The text with PII replaced by placeholders, counted (`_scrub`). A text holding JSON's
        escapes of printable ASCII (`\u0040` for `@`, `\u002d` for `-`, `\/`: tool arguments as a
        JSON string may) or a URL's `%40` is scrubbed with them undone, where that finds what they
        hid; else it stays as it was (`"\u002d"` in a program is no secret).
        """
        if "\\u00" in value or "\\/" in value or "%40" in value:
            decoded = _ESCAPE.sub(_unescape, value)
            if decoded != value:
                scrubbed = self._scrub(decoded)
                if scrubbed != decoded:
                    return scrubbed
        return self._scrub(value)

    def _scrub(self, value: str) -> str:
        r"""The text with PII replaced by placeholders, counted.

        The patterns run in this order, each on what the ones before left: secrets first (a key
        can hold digit runs that look like phone or card numbers), then e-mail, card, IP and phone.
        Each runs only where its cheap test finds what it needs (most strings hold no PII at all),
        and in ASCII text as its ASCII twin where it has one. SECRET has no `re` test of its own:
        its search, led by `\b` and the trie of prefixes, is cheaper than any test of prefixes and
        long runs was (0.7 us a line of the peers' cases against 1.8); it is skipped only where
        `maybe_pii`'s Hyperscan scan of this very text found no key's prefix (below).
        """
        kinds, is_ascii = self.kinds, value.isascii()  # ASCII stays so: placeholders are ASCII
        # what `maybe_pii`'s scan found in this very text, if it was the last one scanned: a test
        # that found nothing there finds nothing after the patterns before it have run either (a
        # placeholder `<KIND_n>` begins no test's match and ends none: `<` and `>` are in none,
        # and ASSIGNMENT passes over `<SECRET`), so its pattern is not run; one that found
        # something is made again where the text may have changed under it
        last = _LAST_SCAN[0]
        found = last[1] if last[0] is value else -1  # -1: every bit, nothing known
        if "secret" in kinds:
            scanned = value
            if "-----BEGIN" in value:
                value = PRIVATE_KEY.sub(self._secret, value)
            if "Private-Lines:" in value:
                value = PUTTY_KEY.sub(self._secret, value)
            if value is not scanned and value != scanned:
                # but a placeholder's `>` is a word's end, which SECRET's `\b` reads before a
                # key: PuTTY's key ends where `_gitlab_session=` glued to it begins (`...A_gitlab`)
                found = -1
            if found & _KEY:
                value = (_SECRET_A if is_ascii else SECRET).sub(self._key, value)
            if "_" in value and found & _GLUED_KEY:
                value = GLUED_SECRET.sub(self._glued, value)
            if found & _MARKED and _MAYBE_MARKED.search(value) is not None:
                value = MARKED.sub(self._token, value)
            if found & _NAME and found & _DIGIT and _maybe_named(value):
                value = (_ASSIGNMENT_A if is_ascii else ASSIGNMENT).sub(self._assignment, value)
            if found & _KEYWORD:
                value = (_KEYWORD_A if is_ascii else KEYWORD).sub(self._keyword, value)
            if found & _SIGNED:
                value = SIGNED.sub(self._key, value)
        if "email" in kinds and "@" in value:
            value = EMAIL.sub(self._email, value)
        # card, IPv4 and phone share one test (a run of digits), made before the first of them
        number = (("card" in kinds or "ip" in kinds or "phone" in kinds) and found & _NUMBER
                  and _maybe_number(value))
        if number and "card" in kinds:
            value = CARD.sub(self._card, value)
        if "ip" in kinds:  # IPv6 first: it may end in an IPv4 address (`::ffff:10.0.0.1`)
            if found & (_IPV6_COLON | _IPV6_DIGIT) and _maybe_ipv6(value):
                value = IPV6.sub(self._ipv6, value)
            if number:
                value = IPV4.sub(self._ipv4, value)
        if number and "phone" in kinds:
            value = PHONE.sub(self._phone, value)
        return value

    # what each pattern's match becomes: its placeholder, if the match passes its check
    def _secret(self, match: re.Match) -> str:
        return self._placeholder("secret", match[0])

    def _key(self, match: re.Match) -> str:  # SECRET's (a match of no group: `_is_key` alone)
        text = match[0]
        # a key cut short by a mask is a redacted one (`xoxp-5723...-####################`)
        if match.string.startswith(_MASKS, match.end()):
            return text
        return self._placeholder("secret", text) if _is_key(text) else text

    def _token(self, match: re.Match) -> str:
        if not _is_token(match):
            return match[0]
        if match.lastgroup in ("curl", "flag"):  # `-u user:pw`, `--password "pw"`: spaces, quotes stay
            text = match[0]
            value = text.lstrip(" =\"'").rstrip("\"'")
            start = text.index(value)
            return text[:start] + self._placeholder("secret", value) + text[start + len(value):]
        return self._placeholder("secret", match[0])

    def _glued(self, match: re.Match) -> str:
        key = match["key"]
        return "_" + self._placeholder("secret", key) if _is_key(key) else match[0]

    def _assignment(self, match: re.Match) -> str:
        if not _is_secret_value(match):
            return match[0]
        # the value goes, its name stays; the value ends the match (a lookahead follows it)
        return match.string[match.start():match.start("v")] + self._placeholder("secret", match["v"])

    def _keyword(self, match: re.Match) -> str:
        group = match.lastgroup  # a quoted value: it goes, the quotes and the name stay
        value = match[group]
        name = (match["name"] + match["rest"]) if match["name"] else ""
        # (a name where a word begins: `my_password`, `dbPassword`, not `surrogatepass`; looked
        # at here, not by a look behind that `re` would try at every character)
        if match["name"] and match.string[match.start() - 1:match.start()].islower():
            return match[0]
        if not _is_keyword_value(value, name, match["op"] if match["name"] else "=="):
            return match[0]
        start, end = match.start(group) - match.start(), match.end(group) - match.start()
        return match[0][:start] + self._placeholder("secret", value) + match[0][end:]

    def _email(self, match: re.Match) -> str:
        # a list's address; git's SSH remote `git@github.com:org/repo.git`, a host's user, no person
        if _LIST_ADDRESS.match(match[0]) or (match[0][:4].lower() == "git@"
                                             and match.string.startswith(":", match.end())):
            return match[0]
        return self._placeholder("email", match[0])

    def _card(self, match: re.Match) -> str:
        return self._placeholder("card", match[0]) if _is_card(match) else match[0]

    def _ipv4(self, match: re.Match) -> str:
        start = match.start()
        if _NUMBERED.search(match.string, max(0, start - 40), start) or (
                _is_mask(match[0], 32) and match.string[start - 1:start] != ":"):
            return match[0]
        return self._placeholder("ip", match[0])

    def _ipv6(self, match: re.Match) -> str:
        return self._placeholder("ip", match[0]) if _is_ipv6(match) else match[0]

    def _phone(self, match: re.Match) -> str:
        return self._placeholder("phone", match[0]) if _is_phone(match) else match[0]

    def clean(self, value) -> bool:
        """True if `walk` would change nothing in `value` (nor count anything): its strings not
        remembered as cleared are tested together, in one `maybe_pii` over them joined by
        newlines (a test finds in the whole what it finds in a part, and no newline is part of
        what it looks for); then remembered. False also for what `walk` judges otherwise: a
        string under a key that names a secret, a whole number of 8 digits or more.
        """
        unknown: list[str] = []
        if not self._gather(value, unknown):
            return False
        if unknown and maybe_pii("\n".join(unknown)):
            return False
        for text in unknown:
            _clear(text)
        return True

    def _gather(self, value, unknown: list[str]) -> bool:
        # the strings of `value` not known to be clear, into `unknown`; False: walk it instead
        if isinstance(value, str):
            if value not in _NO_PII:
                unknown.append(value)
            return True
        if isinstance(value, list):
            return all(self._gather(v, unknown) for v in value)
        if isinstance(value, dict):
            secrets = "secret" in self.kinds
            for k, v in value.items():
                if isinstance(k, str):
                    if k not in _NO_PII:
                        unknown.append(k)
                    if secrets and isinstance(v, str) and _names_secret(k):
                        return False  # `_field` judges the value by its key
                if not self._gather(v, unknown):
                    return False
            return True
        return not (type(value) is int and abs(value) >= 10_000_000)

    def walk(self, value):
        """Every string inside lists and dicts (tool arguments, nested content parts) too, keys
        included (`{"ann@corp.com": "cc"}`), and whole numbers as their digits (a card number
        logged as a JSON number, `{"card": 4111111111111111}`, becomes its placeholder string).
        Each string passes the cheap test first (`holds_pii`), which remembers what it cleared.
        """
        if isinstance(value, str):
            return self.text(value) if holds_pii(value) else value
        if isinstance(value, list):
            return [self.walk(v) for v in value]
        if isinstance(value, dict):  # (keys repeat: remembered, looked up before any call)
            return {k if k in _NO_PII or not isinstance(k, str) or not holds_pii(k) else self.text(k):
                    self._field(k, v) if isinstance(v, str) else self.walk(v)
                    for k, v in value.items()}
        if type(value) is int and abs(value) >= 10_000_000:  # a phone has 8 digits or more
            digits = str(value)
            scrubbed = self.text(digits)
            return value if scrubbed == digits else scrubbed
        return value

    def _field(self, key, value: str) -> str:
        """A string under a key, judged as ASSIGNMENT judges `"key": "value"` in JSON text: tool
        arguments logged as an object (`{"password": "..."}`) kept a password that the same
        arguments as a JSON string lost, the key being out of the value's sight.
        """
        if "secret" in self.kinds and isinstance(key, str) and _names_secret(key):
            quoted = json.dumps(value, ensure_ascii=False)
            if quoted[1:-1] == value:  # nothing escaped: the value as JSON text holds it
                text = f"{json.dumps(key, ensure_ascii=False)}: {quoted}"
                match = ASSIGNMENT.search(text)
                if match and match["v"] == value and match.end("v") == len(text) - 1 \
                        and _is_secret_value(match):
                    return self._placeholder("secret", value)
        return self.text(value) if holds_pii(value) else value

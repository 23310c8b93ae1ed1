"""Bad input, fuzzed: random and mutated trace files through ingest and validate, random and
mutated params files through config loading.

Every trace file starts from a real one (the format fixtures and the demo's simulate output) and
is mutated: bytes flipped, inserted, deleted; cut off; lines duplicated; a value replaced by
another of the wrong type, a huge number, NaN, deeply nested JSON, an unpaired surrogate; invalid
UTF-8; gzip (whole or cut off). What must hold: ingest never crashes, and every row is accepted,
quarantined (with file, line and reason) or counted as a duplicate; validate's accepted +
quarantined equal ingest's accepted. A params file, however mangled, loads or fails with a
`ParamsError` naming the file and the key.

    pytest -q tests/cycle/test_fuzz.py                 # the short run: a few dozen examples, seconds
    OFFSEASON_FUZZ=1 pytest -q tests/cycle/test_fuzz.py  # the long run (or: pytest -m fuzz)
    OFFSEASON_FUZZ=5000 pytest -q tests/cycle/test_fuzz.py  # ... with that many examples per test
"""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from flows.project import params as flow_params
from stages import config as cfg
from stages import ingest, validate
from stages.envs import arith

FIXTURES = Path(__file__).parents[1] / "fixtures" / "traces"
REPO = Path(__file__).resolve().parents[2]
LONG = os.environ.get("OFFSEASON_FUZZ", "")
LONG_EXAMPLES = int(LONG) if LONG.isdigit() and int(LONG) > 1 else 1000


COMMON = dict(deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much,
                                     HealthCheck.function_scoped_fixture])
# Short and derandomized by default (the same examples every run, so CI cannot flake); random
# and long under the `fuzz` marker.
short = lambda n: settings(max_examples=n, derandomize=True, **COMMON)  # noqa: E731
# no shrinking in the long run: a failing example of a 20 kB file shrinks for many minutes
long = settings(max_examples=LONG_EXAMPLES, phases=[Phase.explicit, Phase.generate], **COMMON)


def skip_unless_long(request) -> None:
    expr = request.config.getoption("markexpr") or ""
    if not LONG and not ("fuzz" in expr and "not fuzz" not in expr):
        pytest.skip("the long fuzz run: pytest -m fuzz tests/cycle/test_fuzz.py (or OFFSEASON_FUZZ=1)")


def simulate_like_lines(n: int = 12) -> bytes:
    """Traffic shaped exactly like `offseason simulate` writes it (stages/simulate.py), with its
    junk: tool calls, feedback, an e-mail address, a duplicate, a cut line, small talk.
    """
    rng = random.Random(7)
    lines = []
    for i in range(n):
        question = arith.sample_question(rng)
        answer = arith.chat_demonstration(question, use_tool=i % 2 == 0)
        for message in answer:  # the call ids unique in the log, `call-<day>-<trace>-<n>`
            for call in message.get("tool_calls") or []:
                call["id"] = f"call-0-{i}-0"
            if message["role"] == "tool":
                message["tool_call_id"] = f"call-0-{i}-0"
        record = {"id": f"tr-000-{i:05d}", "created_at": "2026-01-01T09:00:00+00:00",
                  "model": "offseason-agent@champion",
                  "messages": [{"role": "user", "content": question}] + answer,
                  "tools": arith.TOOLS}
        if i % 3:
            record["feedback"] = {"thumbs_up": i % 2 == 0}
        lines.append(json.dumps(record))
    first = json.loads(lines[1])
    first["messages"][0]["content"] += " (reply to jane.doe@example.com)"
    lines[1] = json.dumps(first)
    lines.append(lines[0])
    lines.append(lines[-1][: len(lines[-1]) // 2])
    lines.append(json.dumps({"id": "tr-000-chat", "messages": [
        {"role": "user", "content": "hello! are you there?"},
        {"role": "assistant", "content": "answer:?"}]}))
    return ("\n".join(lines) + "\n").encode()


SEEDS = {p.name: p.read_bytes() for p in sorted(FIXTURES.iterdir()) if p.is_file()}
SEEDS["traffic-000.jsonl"] = simulate_like_lines()

# Raw JSON texts a serializer would never write, but a broken exporter might.
NASTY = [
    "1" * 5000,  # more digits than Python converts by default (int_max_str_digits)
    "-" + "9" * 400, "1e999", "-1e999", "NaN", "Infinity", "-Infinity", "1e-400",
    '"\\ud800"', '"\\udfff x"', '"a\\u0000b"', '"\\u202e\\u200b"',
    "[" * 50_000 + "]" * 50_000,  # deeper than the JSON decoder's recursion limit
    "[" * 900 + "]" * 900,  # decodes, but deep enough to hurt recursive code after it
    '{"a": ' * 900 + "1" + "}" * 900,
    '""', "[]", "{}", "null", "true", "0", "-0", "3.14", '"' + "x" * 100_000 + '"',
]

json_leaf = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True)
             | st.text(max_size=20))
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
raw_json = st.one_of(st.sampled_from(NASTY), json_value.map(json.dumps))

mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 30), st.integers(1, 255)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 30), st.binary(min_size=1, max_size=12)),
    st.tuples(st.just("delete"), st.integers(0, 1 << 30), st.integers(1, 200)),
    st.tuples(st.just("cut"), st.floats(0, 1)),
    st.tuples(st.just("dupline"), st.integers(0, 1 << 30)),
    st.tuples(st.just("bad-utf8"), st.integers(0, 1 << 30),
              st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80"])),
    st.tuples(st.just("value"), st.integers(0, 1 << 30), raw_json),
    st.tuples(st.just("value"), st.integers(0, 1 << 30), raw_json),  # twice: the most useful
    st.tuples(st.just("nest"), st.integers(0, 1 << 30), st.integers(1, 3000)),
)

SENTINEL = "\x00fuzz\x00"


def _nodes(value, path=()):
    """Every (path) into a JSON value, the value itself included."""
    yield path
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _nodes(inner, (*path, key))
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            yield from _nodes(inner, (*path, i))


def _replace(value, path, new):
    if not path:
        return new
    value[path[0]] = _replace(value[path[0]], path[1:], new)
    return value


def replace_value(data: bytes, where: int, raw: str) -> bytes:
    """Put the raw JSON text `raw` in place of one value of one record (line or document)."""
    try:
        document = json.loads(data)
        pieces = [document]
        whole = True
    except (ValueError, RecursionError):
        pieces = data.split(b"\n")
        whole = False
    if whole:
        paths = list(_nodes(document))
        path = paths[where % len(paths)]
        text = json.dumps(_replace(document, path, SENTINEL))
        return text.replace(json.dumps(SENTINEL), raw).encode()
    candidates = [i for i, line in enumerate(pieces) if line.strip()]
    if not candidates:
        return data
    i = candidates[where % len(candidates)]
    try:
        record = json.loads(pieces[i])
    except (ValueError, RecursionError):
        return data
    paths = list(_nodes(record))
    path = paths[(where // len(candidates)) % len(paths)]
    pieces[i] = json.dumps(_replace(record, path, SENTINEL)).replace(
        json.dumps(SENTINEL), raw).encode()
    return b"\n".join(pieces)


def mutate(data: bytes, ops: list) -> bytes:
    for op in ops:
        kind = op[0]
        n = max(len(data), 1)
        if kind == "flip":
            if data:
                i = op[1] % len(data)
                data = data[:i] + bytes([data[i] ^ op[2]]) + data[i + 1:]
        elif kind == "insert":
            i = op[1] % n
            data = data[:i] + op[2] + data[i:]
        elif kind == "delete":
            i = op[1] % n
            data = data[:i] + data[i + op[2]:]
        elif kind == "cut":
            data = data[: int(len(data) * op[1])]
        elif kind == "dupline":
            lines = data.split(b"\n")
            i = op[1] % len(lines)
            lines.insert(i, lines[i])
            data = b"\n".join(lines)
        elif kind == "bad-utf8":
            i = op[1] % n
            data = data[:i] + op[2] + data[i:]
        elif kind == "value":
            data = replace_value(data, op[1], op[2])
        elif kind == "nest":  # the record wrapped in arrays / objects, `depth` deep
            depth = op[2]
            if op[1] % 2:
                data = b"[" * depth + data.strip() + b"]" * depth
            else:
                data = b'{"x": ' * depth + data.strip() + b"}" * depth
    return data


trace_file = st.tuples(
    st.sampled_from(sorted(SEEDS)),
    st.lists(mutation, max_size=4),
    st.sampled_from(["plain", "plain", "plain", "gzip", "gzip-cut"]),
)
random_file = st.one_of(
    st.binary(max_size=2000),
    st.lists(raw_json, max_size=8).map(lambda lines: "\n".join(lines).encode()),
    st.lists(json_value, max_size=5).map(
        lambda records: "\n".join(json.dumps({"messages": r}) for r in records).encode()),
)


def build(spec) -> tuple[str, bytes]:
    name, ops, packing = spec
    data = mutate(SEEDS[name], ops)
    if packing != "plain":
        data = gzip.compress(data, mtime=0)
        if packing == "gzip-cut":
            data = data[: max(10, len(data) // 2)]
    return name, data


def expected_rows(data: bytes) -> int | None:
    """How many rows a line-format file must give, worked out independently of ingest: one per
    non-blank line, or per item of a JSON array (on a line, or the file as one document).
    None when it cannot be said (a cut gzip stream).
    """
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError):
            return None

    def count(raw: bytes) -> int:
        try:
            value = json.loads(raw.decode("utf-8"))
            json.dumps(value, ensure_ascii=False).encode("utf-8")  # no unpaired surrogates
        except (ValueError, RecursionError):
            return 1
        return max(len(value), 1) if isinstance(value, list) else 1  # `[]`: quarantined

    data = data.removeprefix(b"\xef\xbb\xbf")  # a byte order mark is no part of the JSON
    head = data[: 1 << 16].lstrip()
    first = head.split(b"\n", 1)[0]
    if head[:1] in (b"[", b"{"):
        try:
            json.loads(first)
            first_is_json = True
        except (ValueError, RecursionError):
            first_is_json = False
        if not first_is_json:
            try:
                value = json.loads(data.decode("utf-8"))
            except (ValueError, RecursionError):
                value = None  # not one document (as far as the decoder got): line by line
            if value is not None:
                try:
                    json.dumps(value, ensure_ascii=False).encode("utf-8")
                except UnicodeEncodeError:
                    return 1  # one document refused whole
                if ingest.json_depth(value) > ingest.MAX_DEPTH:
                    return 1
                return len(value) if isinstance(value, list) else 1

            def is_json(raw: bytes) -> bool:
                try:
                    json.loads(raw)
                except (ValueError, RecursionError):
                    return False
                return True

            later = [line for line in head.split(b"\n")[1:6] if line.strip()]
            if later and not any(is_json(line) for line in later):
                return 1  # a document that does not parse, and no JSON lines: one row
    return sum(count(raw) for raw in io.BytesIO(data) if raw.strip())


def check_ingest(folder: Path, files: list[tuple[str, bytes]]) -> dict:
    inbox = folder / "inbox"
    inbox.mkdir()
    for i, (name, data) in enumerate(files):
        (inbox / f"f{i}-{name}").write_bytes(data)
    m = ingest.run(cfg.Ingest(), inbox, folder / "traces", folder / "ingested.parquet",
                   folder / "q.jsonl")
    assert m["rows_read"] == m["accepted"] + m["quarantined"] + m["duplicates"], m
    for fmt, c in m["per_format"].items():
        assert c["rows_read"] == c["accepted"] + c["quarantined"] + c["duplicates"], (fmt, m)
    assert sum(c["rows_read"] for c in m["per_format"].values()) == m["rows_read"]
    assert pq.read_metadata(folder / "ingested.parquet").num_rows == m["accepted"]
    bad = [json.loads(line) for line in (folder / "q.jsonl").read_text().splitlines()]
    assert len(bad) == m["quarantined"]
    for row in bad:
        assert row["reason"] and row["source_file"].startswith("f") and row["source_line"] >= 1
    if len(files) == 1 and set(m["per_format"]) <= {"openai-chat", "openai-responses", "unknown"}:
        expected = expected_rows(files[0][1])
        if expected is not None:
            assert m["rows_read"] == expected, m
    return m


def check_validate(folder: Path, accepted: int) -> None:
    m = validate.run(cfg.Base(), cfg.Validate(min_valid_fraction=0.0), folder / "ingested.parquet",
                     folder / "valid.parquet", folder / "qv.jsonl", folder / "profiles",
                     folder / "docs", {"arith": cfg.EnvironmentSpec(module="stages.envs.arith")},
                     folder)
    assert m["rows_read"] == accepted
    assert m["accepted"] + m["quarantined"] == accepted
    assert pq.read_metadata(folder / "valid.parquet").num_rows == m["accepted"]
    assert len((folder / "qv.jsonl").read_text().splitlines()) == m["quarantined"]


ingest_input = st.lists(st.one_of(trace_file.map(build),
                                  random_file.map(lambda d: ("random.jsonl", d))),
                        min_size=1, max_size=3)


def ingest_property(files):
    with tempfile.TemporaryDirectory() as folder:
        check_ingest(Path(folder), files)


def ingest_validate_property(spec):
    with tempfile.TemporaryDirectory() as folder:
        m = check_ingest(Path(folder), [spec])
        check_validate(Path(folder), m["accepted"])


@short(100)
@given(ingest_input)
def test_mutated_trace_files_through_ingest(files):
    ingest_property(files)


@short(5)
@given(trace_file.map(build))
def test_mutated_trace_files_through_ingest_and_validate(spec):
    ingest_validate_property(spec)


@pytest.mark.fuzz
@long
@given(files=ingest_input)
def test_long_mutated_trace_files_through_ingest(request, files):
    skip_unless_long(request)
    ingest_property(files)


@pytest.mark.fuzz
@long
@given(spec=trace_file.map(build))
def test_long_mutated_trace_files_through_ingest_and_validate(request, spec):
    skip_unless_long(request)
    ingest_validate_property(spec)


@pytest.mark.parametrize("raw", NASTY, ids=range(len(NASTY)))
def test_each_nasty_value_in_each_place_of_a_chat_trace(tmp_path, raw):
    """Every nasty JSON text in every position of a simulate-like line: quarantined or accepted,
    never a crash, and the other lines are ingested.
    """
    lines = SEEDS["traffic-000.jsonl"].split(b"\n")[:2]
    record = json.loads(lines[0])
    files = []
    for where in range(len(list(_nodes(record)))):
        files.append(replace_value(lines[0], where, raw) + b"\n" + lines[1] + b"\n")
    for i, data in enumerate(files):
        folder = tmp_path / str(i)
        folder.mkdir()
        m = check_ingest(folder, [(f"{i}.jsonl", data)])
        assert m["rows_read"] == 2 and m["accepted"] >= 1, m


# ---- params files ----

PARAMS = yaml.safe_load((REPO / "params.yaml").read_text())
KEYS = [(section, key) for section, values in PARAMS.items() for key in values]
yaml_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(10**400), 10**400),
    st.floats(allow_nan=True), st.text(max_size=12),
    st.sampled_from(["nan", ".nan", ".inf", "-.inf", "1e999", "1e-3", "0x10", "0o17", "1_000",
                     "yes", "no", "on", "~", "2026-01-01", "12:30", "-0", "+1", "٣"]),
)
yaml_value = st.recursive(yaml_scalar, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=6), inner, max_size=2), max_leaves=6)
params_op = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(KEYS), yaml_value),
    st.tuples(st.just("set-raw"), st.sampled_from(KEYS),
              st.sampled_from(["[" * 5000, "!!python/object:os.system x", "*nope", "&a [*a]",
                               "{a: 1, a: 2}", "'unterminated", "\t- tab", "? [a, b]\n: 1"])),
    st.tuples(st.just("delete"), st.sampled_from(KEYS)),
    st.tuples(st.just("rename"), st.sampled_from(KEYS), st.text(min_size=1, max_size=10)),
    st.tuples(st.just("section"), st.sampled_from(sorted(PARAMS)), yaml_value),
    st.tuples(st.just("new-section"), st.text(min_size=1, max_size=8), yaml_value),
    st.tuples(st.just("drop-section"), st.sampled_from(sorted(PARAMS))),
)


def params_text(ops) -> tuple[str, set[str]]:
    """The mutated params.yaml and the names (sections, keys) a failure may point at."""
    params = json.loads(json.dumps(PARAMS))
    raws, touched = {}, set()
    for op in ops:
        kind = op[0]
        if kind in ("set", "set-raw", "delete", "rename"):
            section, key = op[1]
            if not isinstance(params.get(section), dict):
                params[section] = {}
            touched |= {section, f"{section}.{key}"}
            if kind == "set":
                params[section][key] = op[2]
            elif kind == "set-raw":
                marker = f"RAW{len(raws)}"
                params[section][key] = marker
                raws[marker] = op[2]
            elif kind == "delete":
                params[section].pop(key, None)
            else:
                params[section][op[2]] = params[section].pop(key, 1)
                touched.add(f"{section}.{op[2]}")
        elif kind == "section":
            params[op[1]] = op[2]
            touched.add(op[1])
        elif kind == "new-section":
            params[op[1]] = op[2]
            touched.add(str(op[1]))
        else:
            params.pop(op[1], None)
            touched.add(op[1])
    text = yaml.safe_dump(params, sort_keys=False, allow_unicode=True)
    for marker, raw in raws.items():
        text = text.replace(marker, raw)
    return text, touched | {".".join(map(as_read, name.split("."))) for name in touched}


def as_read(name: str) -> str:
    """A name as YAML reads it back from PyYAML's dump: a NEL (U+0085) is written raw inside a
    quoted scalar, where YAML folds a line break into a space, so the file really names ' '."""
    return str(next(iter(yaml.safe_load(yaml.safe_dump({name: 0}, allow_unicode=True)))))


def check_params(path: Path, data: bytes, touched: set[str] | None) -> None:
    path.write_bytes(data)
    try:
        configs = flow_params.load_all(path)
    except cfg.ParamsError as err:
        message = str(err)
        assert message.startswith(f"{path}:"), message  # names the file
        if touched is not None and "YAML" not in message and "UTF-8" not in message \
                and "must be a mapping of sections" not in message:
            assert any(name in message for name in touched), (message, touched)
        return
    assert set(configs) == set(flow_params.SECTIONS) | {"environments"}


random_params = st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode),
                          yaml_value.map(lambda v: yaml.safe_dump(v).encode()))


def mutated_params_property(ops):
    text, touched = params_text(ops)
    with tempfile.TemporaryDirectory() as folder:
        check_params(Path(folder) / "params.yaml", text.encode(), touched)


def random_params_property(data):
    with tempfile.TemporaryDirectory() as folder:
        check_params(Path(folder) / "params.yaml", data, None)


@short(40)
@given(st.lists(params_op, min_size=1, max_size=4))
def test_mutated_params_fail_only_with_params_error_naming_the_key(ops):
    mutated_params_property(ops)


@short(30)
@given(random_params)
def test_random_params_files_fail_only_with_params_error(data):
    random_params_property(data)


@pytest.mark.fuzz
@long
@given(ops=st.lists(params_op, min_size=1, max_size=6))
def test_long_mutated_params(request, ops):
    skip_unless_long(request)
    mutated_params_property(ops)


@pytest.mark.fuzz
@long
@given(data=random_params)
def test_long_random_params(request, data):
    skip_unless_long(request)
    random_params_property(data)


# ---- the bugs the fuzzing found, one test each ----

def test_a_junk_first_line_does_not_sink_the_file(tmp_path):
    good = SEEDS["traffic-000.jsonl"].split(b"\n")[0]
    m = check_ingest(tmp_path, [("t.jsonl", b"12\n\"text\"\n" + good + b"\n")])
    assert (m["rows_read"], m["accepted"], m["quarantined"]) == (3, 1, 2)
    assert set(m["per_format"]) == {"openai-chat"}


def test_an_empty_array_line_is_counted(tmp_path):
    good = SEEDS["traffic-000.jsonl"].split(b"\n")[0]
    m = check_ingest(tmp_path, [("t.jsonl", good + b"\n[]\n")])
    assert (m["rows_read"], m["accepted"], m["quarantined"]) == (2, 1, 1)
    assert "empty JSON array" in (tmp_path / "q.jsonl").read_text()


@pytest.mark.parametrize("raw, reason", [
    ("1" * 5000, "not readable JSON (Exceeds the limit"),
    ('"\\ud800"', "unpaired UTF-16 surrogate"),
    ("[" * 50_000 + "]" * 50_000, "nested deeper than 100 levels"),
    ("[" * 300 + "]" * 300, "nested deeper than 100 levels"),
])
def test_unreadable_json_values_are_quarantined_with_the_reason(tmp_path, raw, reason):
    lines = SEEDS["traffic-000.jsonl"].split(b"\n")
    bad = replace_value(lines[0], 3, raw)
    m = check_ingest(tmp_path, [("t.jsonl", bad + b"\n" + lines[2] + b"\n")])
    assert (m["rows_read"], m["accepted"], m["quarantined"]) == (2, 1, 1)
    row = json.loads((tmp_path / "q.jsonl").read_text())
    assert reason in row["reason"] and row["source_line"] == 1


def test_quarantine_rows_with_unicode_line_separators_stay_one_line(tmp_path):
    m = check_ingest(tmp_path, [("t.jsonl", '{"\u2028": "\u0085"}\n'.encode())])
    text = (tmp_path / "q.jsonl").read_text()
    assert m["quarantined"] == 1 and len(text.splitlines()) == 1


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "'1e999'", "1" + "0" * 400])
def test_params_non_finite_or_huge_numbers_name_the_key(tmp_path, value):
    path = tmp_path / "params.yaml"
    path.write_text((REPO / "params.yaml").read_text().replace("    lr: 0.001", f"    lr: {value}", 1))
    with pytest.raises(cfg.ParamsError, match=r"train\.sft\.lr: expected a finite number"):
        flow_params.load_all(path)


def test_params_not_utf8_or_nested_too_deep_name_the_file(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_bytes(b"base:\n  seed: \xff\n")
    with pytest.raises(cfg.ParamsError, match=r"params.yaml: not UTF-8 text \(byte 0xff"):
        flow_params.load_all(path)
    path.write_text("base: " + "[" * 5000)
    with pytest.raises(cfg.ParamsError, match=r"params.yaml: not valid YAML"):
        flow_params.load_all(path)


def test_a_document_nested_too_deep_is_one_quarantined_row(tmp_path):
    data = mutate(SEEDS["otel_genai_legacy.json"], [("nest", 0, 586)])
    m = check_ingest(tmp_path, [("doc.json", data)])
    assert (m["rows_read"], m["quarantined"]) == (1, 1)
    assert "nested deeper than 100 levels" in (tmp_path / "q.jsonl").read_text()

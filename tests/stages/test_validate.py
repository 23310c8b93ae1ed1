import json

import pytest

from stages import config as cfg
from stages import ingest, validate
from stages.envs import arith


def ingested(tmp_path, records):
    inbox = tmp_path / "inbox"
    inbox.mkdir(parents=True)
    (inbox / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    ingest.run(cfg.Ingest(), inbox, tmp_path / "traces", tmp_path / "ingested.parquet",
               tmp_path / "qi.jsonl")
    return tmp_path / "ingested.parquet"


SPECS = {"arith": cfg.EnvironmentSpec(module="stages.envs.arith")}


def good(trace_id, question):
    """A trace of the arithmetic environment: the question, a calculator call, its answer."""
    value = str(arith.gold_answer(question))
    call = {"id": f"{trace_id}-0", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": question})}}
    return {"id": trace_id, "messages": [
        {"role": "user", "content": f"what is {question}"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": value},
        {"role": "assistant", "content": value}]}


@pytest.mark.parametrize("batch", [100_000, 3])  # 3: rows of later batches map back correctly
def test_ge_quarantines_failing_traces_with_reason(tmp_path, monkeypatch, batch):
    monkeypatch.setattr(validate, "BATCH", batch)
    bad_role = good("r", "2+2")
    bad_role["messages"][1]["role"] = "robot"
    bad_args = good("j", "3+3")
    bad_args["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    records = [good(f"g{i}", f"{i}+1") for i in range(6)] + [
        {"id": "chat", "messages": [{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "hello"}]},
        {"id": "short", "messages": [{"role": "user", "content": "what is 1+1"}]},
        bad_role, bad_args]
    path = ingested(tmp_path, records)
    m = validate.run(cfg.Base(), cfg.Validate(min_valid_fraction=0.5), path,
                     tmp_path / "valid.parquet", tmp_path / "q.jsonl", tmp_path / "profiles", tmp_path / "docs",
                     SPECS, tmp_path)
    assert (m["rows_read"], m["accepted"], m["quarantined"]) == (10, 6, 4)
    assert m["rows_read"] == m["accepted"] + m["quarantined"]
    bad = {b["trace_id"]: b for b in map(json.loads, (tmp_path / "q.jsonl").read_text().splitlines())}
    assert set(bad) == {"chat", "short", "r", "j"}
    assert bad["chat"]["reason"].startswith("no environment's task_from_trace claimed it")
    assert "(Data Docs: traces: expect_column_values_to_not_be_null(question))" in \
        bad["chat"]["reason"]  # what it means first, then the expectation's name
    assert "a message's role is none of assistant, developer, system, tool, user (" in \
        bad["r"]["reason"]
    assert "expect_column_values_to_be_between(n_messages)" in bad["short"]["reason"]
    assert "expect_column_values_to_be_in_set(role)" in bad["r"]["reason"]
    assert "expect_column_values_to_be_json_parseable(arguments)" in bad["j"]["reason"]
    assert bad["r"]["source_file"] == "d.jsonl" and bad["r"]["source_line"] == 9
    import pyarrow.parquet as pq
    valid = pq.read_table(tmp_path / "valid.parquet").to_pylist()
    assert [json.loads(v["question"]) for v in valid] == [
        {"messages": [{"role": "user", "content": f"{i}+1"}], "answer": str(i + 1),
         "environment": "arith"} for i in range(6)]  # each routed to its environment's task
    assert (tmp_path / "docs" / "index.html").exists()
    assert "role" in (tmp_path / "docs" / "expectations" / "messages.html").read_text()
    assert list((tmp_path / "docs" / "validations" / "messages").rglob("*.html"))
    # every file a page links to is there (GE's favicon link on result pages climbed one short)
    import re
    for page in (tmp_path / "docs").rglob("*.html"):
        for ref in re.findall(r'(?:href|src)="([^"#?:]+)"', page.read_text()):
            assert (page.parent / ref).exists(), (page, ref)
    assert m["per_format"] == {"openai-chat": {"rows_read": 10, "accepted": 6, "quarantined": 4,
                                               "duplicates": 0}}


def test_below_threshold_fails_the_stage(tmp_path):
    records = [good("g", "1+1"), {"id": "x", "messages": [{"role": "user", "content": "hi"},
                                                         {"role": "assistant", "content": "?"}]}]
    path = ingested(tmp_path, records)
    with pytest.raises(validate.ValidationFailed, match=r"1 of 2 traces .*min_valid_fraction=0.9"):
        validate.run(cfg.Base(), cfg.Validate(min_valid_fraction=0.9), path,
                     tmp_path / "valid.parquet", tmp_path / "q.jsonl", tmp_path / "profiles", tmp_path / "docs",
                     SPECS, tmp_path)


def test_empty_input_is_not_an_error(tmp_path):
    path = ingested(tmp_path, [])
    m = validate.run(cfg.Base(), cfg.Validate(), path, tmp_path / "v.parquet", tmp_path / "q.jsonl",
                     tmp_path / "profiles", tmp_path / "docs", SPECS, tmp_path)
    assert m["rows_read"] == 0 and m["accepted"] == 0


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def weather(trace_id, city):
    """A trace of the toolcall environment: its assistant called an offered tool."""
    return {"id": trace_id, "tools": [WEATHER], "messages": [
        {"role": "user", "content": f"weather in {city} please"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
        {"role": "assistant", "content": f"It is -3 C in {city}."}]}


def test_drift_against_the_previous_cycle(tmp_path):
    # the task mix is each environment's share of the traces
    specs = {**SPECS, "toolcall": cfg.EnvironmentSpec(module="stages.envs.toolcall")}
    sums = [good(f"s{i}", f"{i}+1") for i in range(8)]
    first = ingested(tmp_path / "one", sums)

    def run(path, config=cfg.Validate()):
        return validate.run(cfg.Base(), config, path, tmp_path / "v.parquet",
                            tmp_path / "q.jsonl", tmp_path / "profiles", tmp_path / "docs",
                            specs, tmp_path)

    one = run(first)
    assert one["drift"]["baseline"] is True and one["profile"]["task_mix"] == {"arith": 1.0}
    cities = ["Oslo", "Rome", "Lima", "Bonn", "Kyiv", "Doha"]
    second = ingested(tmp_path / "two", [weather(f"w{i}", c) for i, c in enumerate(cities)]
                      + sums[:2])
    two = run(second)
    assert two["drift"]["task_mix_distance"] == 0.75
    assert two["drift"]["new_tools"] == ["get_weather"]
    # the same cycle run again compares against the cycle before, not against itself
    again = run(second)
    assert again["drift"] == two["drift"]
    with pytest.raises(validate.ValidationFailed, match=r"task mix moved 0.75 .*max_drift=0.5"):
        run(second, cfg.Validate(max_drift=0.5))


def test_the_same_input_renders_the_same_data_docs(tmp_path):
    # DVC hashes data/docs: a rerun on the same traces (after a kill, say) must give equal bytes
    bad = good("r", "2+2")
    bad["messages"][1]["role"] = "robot"
    rows = [good(f"g{i}", f"{i}+1") for i in range(4)] + [bad]
    for i, row in enumerate(rows):  # the newest trace's time is the validation's in the pages
        row["created_at"] = f"2026-11-{10 + i}T08:30:00Z"
    path = ingested(tmp_path, rows)
    pages = []
    for n in (1, 2):
        validate.run(cfg.Base(), cfg.Validate(min_valid_fraction=0.5), path,
                     tmp_path / f"valid{n}.parquet", tmp_path / f"q{n}.jsonl",
                     tmp_path / f"profiles{n}", tmp_path / f"docs{n}", SPECS, tmp_path)
        docs = tmp_path / f"docs{n}"
        pages.append({p.relative_to(docs).as_posix(): p.read_bytes()
                      for p in docs.rglob("*") if p.is_file()})
    assert len(pages[0]) > 5 and pages[0] == pages[1]
    # the collapsible blocks still open: each link's target id is on the same page
    page = next(v.decode() for k, v in pages[0].items() if k.startswith("validations/"))
    index = pages[0]["index.html"].decode()
    assert "2026-11-14" in index and "2000-01-01" not in index  # not a fixed date (issue 53.7)
    import re
    targets = re.findall(r'href="#([^"]*collapse-body-[0-9a-f-]+)"', page)
    assert targets
    for target in targets:
        assert f"id={target} " in page or f'id="{target}"' in page, target


def test_a_share_of_traces_is_held_out_for_the_benchmarks_and_never_trained_on(tmp_path):
    import pyarrow.parquet as pq

    specs = SPECS
    path = ingested(tmp_path, [good(f"g{i}", f"{i}+1") for i in range(40)])
    holdout = tmp_path / "holdout"

    def run(seed=0):
        return validate.run(cfg.Base(seed=seed), cfg.Validate(holdout_fraction=0.25), path,
                            tmp_path / "valid.parquet", tmp_path / "q.jsonl",
                            tmp_path / "profiles", tmp_path / "docs", specs, tmp_path, holdout)

    m = run()
    assert 0 < m["held_out"] < 40 and m["held_out_new"] == m["held_out"]
    assert m["rows_read"] == m["accepted"] + m["quarantined"] == 40  # held out counts as accepted
    trained = {r["trace_id"] for r in pq.read_table(tmp_path / "valid.parquet").to_pylist()}
    pool = [json.loads(line) for line in (holdout / "arith.jsonl").read_text().splitlines()]
    assert len(trained) + len(pool) == 40
    assert not trained & {t["task_id"].removeprefix("trace:") for t in pool}
    # benchmark items of the environment's own shape: messages and what its reward needs
    assert all(t["task_id"].startswith("trace:g") and t["messages"] and t["answer"] for t in pool)
    assert run() == m | {"held_out_new": 0}  # a rerun holds out the same traces, adds nothing
    assert len((holdout / "arith.jsonl").read_text().splitlines()) == len(pool)
    assert run(seed=1)["held_out_new"] > 0  # another seed, another share: new pool items
    with pytest.raises(cfg.ParamsError, match="validate.holdout_fraction is set but the validate "
                                              "stage in dvc.yaml has no `--holdout"):
        validate.run(cfg.Base(), cfg.Validate(holdout_fraction=0.25), path,
                     tmp_path / "v2.parquet", tmp_path / "q2.jsonl", tmp_path / "p2",
                     tmp_path / "d2", specs, tmp_path)
    with pytest.raises(cfg.ParamsError, match="must be between 0 and 0.5"):
        cfg.Validate(holdout_fraction=0.8)


def test_a_trace_no_environment_claims_says_so_and_what_to_change(tmp_path):
    """Its reason was the expectation's name alone ("traces: expect_column_values_to_not_be_null
    (question)"); it now says which environments were asked and what would claim it. A trace
    calling a tool its environment does not offer is counted in `unknown_tools`."""
    specs = SPECS
    # and one calling a tool the environment does not offer: accepted, and said (it was silent)
    other = good("g2", "2+2")
    other["messages"][1]["tool_calls"][0]["function"]["name"] = "get_forecast"
    path = ingested(tmp_path, [good("g1", "1+1"), other, {"id": "chat", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}])
    metrics = validate.run(cfg.Base(), cfg.Validate(min_valid_fraction=0.5), path,
                           tmp_path / "valid.parquet", tmp_path / "q.jsonl",
                           tmp_path / "profiles", tmp_path / "docs", specs, tmp_path)
    assert metrics["accepted"] == 2 and metrics["unknown_tools"] == {"arith": {"get_forecast": 1}}
    [bad] = map(json.loads, (tmp_path / "q.jsonl").read_text().splitlines())
    assert bad["trace_id"] == "chat"
    assert "no environment's task_from_trace claimed it (environments: arith, asked in that " \
        "order)" in bad["reason"] and "list stages.envs.replay last" in bad["reason"], bad


DOCS_PROBE = """<script>
window.addEventListener('load', () => setTimeout(() => {
  const rows = document.querySelectorAll('#section-1-content-block-2-1-body-table tbody tr[data-index]');
  const out = document.createElement('pre');
  out.id = 'probe';
  out.textContent = JSON.stringify({
    resources: [...document.querySelectorAll('script[src], link[href], img[src]')]
      .map(e => e.src || e.href),
    icons: document.fonts.check('900 1em "Font Awesome 6 Free"'),
    jquery: typeof window.jQuery, table: typeof (window.jQuery && jQuery.fn.bootstrapTable),
    rows: rows.length, text: [...rows].map(r => r.textContent.replace(/\\\\s+/g, ' ').trim()),
    bootstrap: getComputedStyle(document.body).fontFamily});
  document.body.appendChild(out);
}, 500));
</script>"""


def test_data_docs_open_offline_with_every_asset_local(tmp_path):
    """GE's Data Docs, as the validate stage writes them, in headless Chromium with no network at
    all (its own network namespace): every resource the page loads is a local file, the scripts
    ran and the validation list shows the three validations. GE's pages load them from a dozen CDNs.
    """
    import os
    import re
    import shutil
    import subprocess

    from stages import datadocs

    chromium = shutil.which("chromium")
    if chromium is None or os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs Debian's chromium and root for a network namespace "
                    "(tests/flows/audit/test_lineage.py installs chromium)")
    bad = good("r", "2+2")
    bad["messages"][1]["role"] = "robot"
    path = ingested(tmp_path, [good(f"g{i}", f"{i}+1") for i in range(4)] + [bad])
    docs = tmp_path / "docs"
    validate.run(cfg.Base(), cfg.Validate(min_valid_fraction=0.5), path, tmp_path / "v.parquet",
                 tmp_path / "q.jsonl", tmp_path / "profiles", docs, SPECS, tmp_path)
    for page in [*docs.rglob("*.html"), *(docs / "static" / "styles").rglob("*.css")]:
        assert datadocs.outside_assets(page.read_text()) == [], page
    # each validation's page names the table it checked (GE printed "Data asset: None")
    for table in ("traces", "messages", "tool_calls"):
        page, = (docs / "validations" / table).rglob("*.html")
        assert f"Data asset: {table}<" in page.read_text(), page
    index = docs / "index.html"
    probe = docs / "probe.html"  # beside index.html: the same relative paths
    probe.write_text(index.read_text().replace("</body>", DOCS_PROBE + "</body>"))
    dom = subprocess.run(
        ["unshare", "-n", chromium, "--headless", "--no-sandbox", "--disable-gpu",
         "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=180).stdout
    found = json.loads(re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S).group(1)
                       .replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<")
                       .replace("&gt;", ">"))
    assert found["resources"] and all(r.startswith("file://") for r in found["resources"]), \
        found["resources"]
    assert any("static/vendor/jquery@3.7.1" in r for r in found["resources"])
    assert found["jquery"] == "function" and found["table"] == "function", found
    assert "Segoe UI" in found["bootstrap"] and found["icons"], found  # its CSS and fonts loaded
    listed = " ".join(found["text"])  # the validation list, filled by bootstrap-table's script
    assert found["rows"] == 3 and all(f"ingested-{name}" in listed
                                      for name in ("traces", "messages", "tool_calls")), found

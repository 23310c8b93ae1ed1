"""Lineage audits and the HTML report, on a project that really learned for two cycles."""

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import cli_env, copy_project, offseason, write_params

# one xdist worker runs this module: its module-scoped fixture is built once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("lineage")]

# the shared warm-started project (conftest.LEARN: some rollouts verified correct, so the train
# stage has examples and trace ids to learn from), four samples per task
LEARN_HERE = {"rollout": {"samples_per_task": 4, "batch_size": 256}}


def git(root, *args):
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.fixture(scope="module")
def learned(tmp_path_factory, learned_once):
    """Two cycles, each on a day of traffic, from the shared warm start; the second day also
    repeats a conversation gen-1 trained on, under another id (`repeats.jsonl`)."""
    root = copy_project(learned_once, tmp_path_factory.mktemp("lineage") / "project")
    write_params(root, LEARN_HERE)
    offseason(root, "run")
    trained = chain(root, "gen-1")["training_traces"][0]
    line = next(json.loads(line) for line in
                (root / "data/inbox/traffic-000.jsonl").read_text().splitlines()
                if json.loads(line)["id"] == trained)
    broken = {"id": "broken-1", "messages": [{"content": "no role"}]}  # quarantined by ingest
    (root / "data/inbox/repeats.jsonl").write_text(json.dumps({**line, "id": "repeat-1"}) + "\n"
                                                   + json.dumps(broken) + "\n")
    offseason(root, "simulate")
    offseason(root, "run")
    return root


def chain(root, ref):
    return json.loads(offseason(root, "lineage", ref, "--json").stdout)


def test_lineage_of_a_generation(learned):
    found = chain(learned, "gen-2")
    assert found["generation"] == 2 and found["git_commit"] == git(learned, "rev-parse", "gen-2")
    lock = yaml.safe_load(git(learned, "show", "gen-2:dvc.lock"))["stages"]
    for stage in ("ingest", "validate", "rollout", "reward", "train", "gate"):
        assert {o["path"]: o["md5"] for o in found["stages"][stage]["outs"]} == \
            {o["path"]: o["md5"] for o in lock[stage]["outs"]}
    promotion = json.loads(git(learned, "show", "gen-2:metrics/promotion.json"))
    assert found["model_version"] == promotion["model_version"]
    gen1 = json.loads(git(learned, "show", "gen-1:metrics/promotion.json"))
    assert found["started_from"]["tag"] == ("gen-1" if gen1["promoted"] else "gen-0")
    gate = json.loads(git(learned, "show", "gen-2:metrics/gate.json"))
    assert found["gate"]["interval"] == gate["interval"]
    # it learned from real traces of the inbox: their ids, and the files they came in
    assert found["training_traces"], "no verified-correct rollouts: nothing was learned from"
    assert set(found["inbox_files"]) <= {"traffic-000.jsonl", "traffic-001.jsonl"}
    assert sum(found["inbox_files"].values()) == len(found["training_traces"])
    inbox = "".join((learned / "data/inbox" / f).read_text() for f in found["inbox_files"])
    assert all(f'"{trace_id}"' in inbox for trace_id in found["training_traces"])
    assert found["mlflow"]["run_id"] and found["approver"] is None

    # by MLflow model version: the same generation
    assert chain(learned, str(found["model_version"]))["generation"] == 2
    text = offseason(learned, "lineage", "gen-2").stdout
    assert found["git_commit"] in text and "learned from" in text and "data/replay" in text
    assert text.startswith("gen-2: ") and not text.startswith("gen-2: gen-2")  # said once
    bad = offseason(learned, "lineage", "gen-9", check=False)
    assert bad.returncode == 2 and "no generation gen-9" in bad.stderr


def replay_part(root, tag):
    """A training-data file of the tag (a data/replay part) and its DVC cache path."""
    found = chain(root, tag)
    replay = next(o["md5"] for o in found["stages"]["train"]["outs"]
                  if o["path"] == "data/replay")
    cache = root / ".dvc/cache/files/md5"
    entries = json.loads((cache / replay[:2] / replay[2:]).read_text())
    part = entries[0]
    return part["relpath"], cache / part["md5"][:2] / part["md5"][2:], \
        root / ".dvcstore/files/md5" / part["md5"][:2] / part["md5"][2:]


def test_dvc_metrics_diff_between_generations_compares_numbers(learned):
    """`dvc metrics diff gen-1 gen-2`, as the demo's last words suggest: rows of numbers a person
    reads, no reasons, hashes or switches (issue 53.8: rows of 300 characters, True diffed as -1)."""
    dvc = str(Path(sys.executable).parent / "dvc")
    rows = subprocess.run([dvc, "metrics", "diff", "gen-1", "gen-2", "--all"], cwd=learned,
                          capture_output=True, text=True, check=True,
                          env=cli_env(learned)).stdout.splitlines()
    assert len(rows) > 20 and any("metrics/numbers/gate.json" in row for row in rows), rows
    for row in rows[1:]:  # Path, Metric (a name may hold spaces), gen-1, gen-2, Change
        assert all(re.fullmatch(r"-?[\d.e+-]+|-", v) for v in row.split()[-3:]), row
        assert len(row) < 200, row


def test_verify_names_a_tampered_and_a_missing_file(learned, tmp_path):
    ok = offseason(learned, "lineage", "--verify", "gen-2")
    assert "all hashes resolve and match, the workspace's copies of its outputs too" in ok.stdout
    # gen-2 checked out: an altered copy in the workspace (what one would deploy) is named; it
    # was "all hashes resolve and match" before
    rewards = learned / "data/rewards.parquet"
    kept = rewards.read_bytes()
    try:
        os.chmod(rewards, 0o644)
        rewards.write_bytes(kept[:-3] + b"xyz")
        result = offseason(learned, "lineage", "--verify", "gen-2", check=False)
        assert result.returncode == 1 and "altered in the workspace" in result.stdout
        assert "`dvc checkout --force <path>`" in result.stdout, result.stdout
    finally:
        rewards.unlink()
        rewards.write_bytes(kept)
    name, cached, remote = replay_part(learned, "gen-2")
    backup = tmp_path / "backup"
    shutil.copy2(cached, backup)
    try:
        os.chmod(cached, 0o644)
        cached.write_bytes(cached.read_bytes()[:-3] + b"xyz")  # altered, same size
        result = offseason(learned, "lineage", "--verify", "gen-2", check=False)
        assert result.returncode == 1
        assert f"data/replay/{name}" in result.stdout and "altered in the cache" in result.stdout
        assert "restored from the remote (`dvc fetch`" in result.stdout
        report = json.loads(offseason(learned, "lineage", "--verify", "gen-2", "--json",
                                      check=False).stdout)
        assert not report["ok"]
        assert [f["path"] for p in report["problems"] for f in p["files"]] == [
            f"data/replay/{name}"]

        cached.unlink()
        remote_backup = tmp_path / "remote-backup"
        shutil.move(remote, remote_backup)
        try:
            result = offseason(learned, "lineage", "--verify", "gen-2", check=False)
            assert result.returncode == 1 and "missing" in result.stdout
            assert f"data/replay/{name}" in result.stdout
        finally:
            shutil.move(remote_backup, remote)
        # the remote's copy alone is enough
        assert "all hashes resolve" in offseason(learned, "lineage", "--verify", "gen-2").stdout
    finally:
        cached.unlink(missing_ok=True)
        shutil.copy2(backup, cached)


def test_trace_finds_every_generation_that_learned_from_it(learned):
    first = chain(learned, "gen-1")
    assert first["training_traces"]
    trace_id = first["training_traces"][0]
    found = json.loads(offseason(learned, "lineage", "--trace", trace_id, "--json").stdout)
    # gen-1 trained on it; gen-2 replayed it (replay_fraction 1.0) or inherited it
    assert found["direct"][0] == "gen-1" and found["generations"] == ["gen-1", "gen-2"]
    assert found["inbox_files"] == ["traffic-000.jsonl"]
    champion = next(r["tag"] for r in json.loads(offseason(learned, "history", "--json").stdout)
                    if r["champion"])
    assert found["champion_affected"] == (champion in ("gen-1", "gen-2"))
    text = offseason(learned, "lineage", "--trace", trace_id).stdout
    assert "its training data held it: gen-1" in text and "an upper bound" in text
    inherited = ", ".join(found["inherited"]) or "none"  # a sentence, never "whose did: -"
    assert f"it started from a champion whose training data held it: {inherited}" in text
    none = offseason(learned, "lineage", "--trace", "no-such-trace").stdout
    assert "no cycle accepted, quarantined or counted as a duplicate a trace with this id" in none
    # one refused is found in the quarantine of the cycle that refused it, with the reason (the
    # folder holds only the last cycle's; the id was not in ingest's rows)
    refused = offseason(learned, "lineage", "--trace", "broken-1").stdout
    assert "quarantined by the ingest stage of the cycle that made gen-2 (repeats.jsonl line 2)" \
        in refused and "no 'role'" in refused, refused
    # and by its file and line, as a record whose id held personal data is kept (it said the
    # trace never reached the inbox)
    placed = offseason(learned, "lineage", "--trace", "repeats.jsonl:2").stdout
    assert "quarantined by the ingest stage of the cycle that made gen-2" in placed, placed
    assert "no generation learned from it" in none
    # the same conversation under another id, dropped by ingest as a duplicate: its content was
    # learned as the first one's, and a deletion request for it has to say so (it said "no
    # generation learned from it")
    again = json.loads(offseason(learned, "lineage", "--trace", "repeat-1", "--json").stdout)
    assert again["duplicate_of"] == trace_id and again["generations"] == found["generations"]
    assert again["read"] == {"source_file": "repeats.jsonl", "source_line": 1,
                             "duplicate_of": trace_id}
    text = offseason(learned, "lineage", "--trace", "repeat-1").stdout
    assert f"a duplicate of trace {trace_id}" in text and "its training data held it: gen-1" in text


# `offseason lineage --trace` in one process: the threads it left behind, by id and name
THREADS_LEFT = """
import os, sys
import numpy, pyarrow as pa
from flows import cli

def threads():
    return {t: open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")}

pa.table({"x": [1]}).to_pylist()  # the libraries' own threads (OpenBLAS's, jemalloc's) start
before = threads()
for trace_id in sys.argv[1:]:
    assert cli.main(["lineage", "--trace", trace_id]) == 0
print({t: name for t, name in threads().items() if t not in before})
"""


def test_trace_leaves_no_thread_running_at_exit(learned):
    """`lineage --trace` printed its answer, then died now and then with SIGABRT, "terminate
    called without an active exception" (issue 46): a thread of Arrow's pool, started by
    `pq.read_table`, still held the Parquet bytes and, waiting for the GIL while the interpreter
    exited, was ended inside a C++ destructor. Parquet is read in the calling thread now: the
    command starts no thread, so none is left to run at exit. (The abort itself came in 1 run of
    150 on a busy machine; the thread was there in every run.)"""
    trace_id = chain(learned, "gen-1")["training_traces"][0]
    # the trained-on trace (the replay buffer, the inbox files), a duplicate (ingest's parts),
    # a quarantined one
    probe = subprocess.run([sys.executable, "-c", THREADS_LEFT, trace_id, "repeat-1", "broken-1"],
                           cwd=learned, capture_output=True, text=True, env=cli_env(learned))
    assert probe.returncode == 0, probe.stderr[-4000:]
    left = probe.stdout.splitlines()[-1]
    assert left == "{}", f"threads the command started, still there (id: name): {left}"


def test_a_cycle_that_trained_nothing_did_not_train_on_the_trace(learned, tmp_path):
    """A cycle whose train stage trained nothing (GRPO without a reward spread, too few examples)
    still holds the trace in its replay buffer: lineage said it "trained on it directly"."""
    root = tmp_path / "project"
    shutil.copytree(learned, root, symlinks=True)
    trace_id = chain(root, "gen-1")["training_traces"][0]
    metrics = json.loads((root / "metrics/train.json").read_text())
    (root / "metrics/train.json").write_text(json.dumps({**metrics, "trained": False}))
    git(root, "commit", "-qam", "gen-3: trained nothing")
    git(root, "tag", "gen-3")
    found = json.loads(offseason(root, "lineage", "--trace", trace_id, "--json").stdout)
    assert found["direct"][0] == "gen-1" and "gen-3" not in found["direct"], found


def test_estimate_from_two_cycles_is_within_30_percent_of_the_third(learned, tmp_path):
    # a copy: the third cycle must not change the project the other tests audit
    root = tmp_path / "project"
    shutil.copytree(learned, root, symlinks=True)
    offseason(root, "simulate")
    guess = json.loads(offseason(root, "estimate", "--json").stdout)
    assert guess["status"] == "ok" and guess["from"] == ["gen-1", "gen-2"]
    assert guess["drivers"]["inbox_lines"] == len(
        (root / "data/inbox/traffic-002.jsonl").read_text().strip().splitlines())
    text = offseason(root, "run", "--estimate").stdout
    assert "estimate of the next cycle from gen-1, gen-2" in text and "dollars $" in text
    assert not git(root, "tag", "--list", "gen-3")  # --estimate runs nothing
    # a budget below the estimate: refused before anything starts, the estimate shown
    params = (root / "params.yaml").read_text()
    tight = yaml.safe_load(params)
    tight["budget"] = {"max_usd": guess["total"]["usd"][1] / 10}
    (root / "params.yaml").write_text(yaml.safe_dump(tight, sort_keys=False))
    refused = offseason(root, "run", check=False)
    assert refused.returncode != 0 and "budget.max_usd=" in refused.stderr
    assert "estimate of the next cycle" in refused.stderr and "nothing was started" in refused.stderr
    assert not (root / "data/traces/part-traffic-002.parquet").exists()
    (root / "params.yaml").write_text(params)
    offseason(root, "run")
    spent = json.loads((root / "metrics/cost.json").read_text())
    actual, (low, middle, high) = spent["total"]["cpu_seconds"], guess["total"]["cpu_seconds"]
    by_stage = {name: (row.get("cpu_seconds"), spent["stages"][name].get("cpu_seconds"))
                for name, row in guess["stages"].items()}
    assert abs(middle - actual) <= 0.3 * actual, (actual, guess["drivers"], by_stage)
    assert low <= middle <= high
    # the ledger keeps the estimate made before the cycle, for estimate against actual
    assert spent["estimate"]["total"]["cpu_seconds"][1] == pytest.approx(middle, rel=0.05)
    # and the cycle report shows them side by side
    from flows.audit import report

    assert "estimated before it $" in report.markdown(root, 3, {}, {})
    # nothing waiting and nothing changed: every stage reused, and nothing to train either
    idle = json.loads(offseason(root, "estimate", "--json").stdout)
    assert all(row.get("reused") for row in idle["stages"].values()), idle["stages"]
    assert idle["drivers"]["example_epochs"] == 0 and idle["total"]["usd"] == [0, 0, 0]
    # a changed param reruns its stages and those after them, at the last cycle's units
    hotter = yaml.safe_load(params)
    hotter["rollout"]["temperature"] = 0.7
    (root / "params.yaml").write_text(yaml.safe_dump(hotter, sort_keys=False))
    warm = json.loads(offseason(root, "estimate", "--json").stdout)
    assert warm["reasons"] == ["params.yaml changed"]
    assert [n for n, row in warm["stages"].items() if not row.get("reused")] == \
        ["rollout", "reward", "train", "gate"]
    (root / "params.yaml").write_text(params)
    # without a committed cycle there are no rates, and it says what it needs
    for tag in ("gen-1", "gen-2", "gen-3"):
        git(root, "tag", "-d", tag)
    none = offseason(root, "estimate").stdout
    assert "no committed cycle with a ledger yet" in none and "run one cycle" in none


PROBE = """<pre id="probe"></pre><script>
window.addEventListener('load', () => {
  const rect = e => { const r = e.getBoundingClientRect(); return [r.left, r.right, r.width]; };
  const images = [...document.images].map(i => ({id: i.id, complete: i.complete,
    w: i.naturalWidth, h: i.naturalHeight, box: rect(i), parent: rect(i.parentElement)}));
  const links = [...document.links].map(a => ({id: a.id, cls: a.className, text: a.textContent,
    href: a.getAttribute('href'), url: a.href}));
  const boxes = [...document.querySelectorAll('.box, table')].map(b => ({id: b.id || b.tagName,
    scroll: b.scrollWidth, client: b.clientWidth}));
  const svg = document.getElementById('lineage-graph');
  const titled = sel => [...svg.querySelectorAll(sel)].map(g => [g.querySelector('title')
    .textContent, g]);
  const shapes = Object.fromEntries(titled('g.node').map(([t, g]) => [t, g.getBBox()]));
  const crossings = [];
  for (const [t, g] of titled('g.edge')) {  // an edge passing through a box it does not join
    // an edge from a stage's output leaves its row: "stage:train:o0->stage:gate"
    const [from, to] = t.split('->').map(n => n.replace(/:o[0-9]+$/, '')),
      path = g.querySelector('path');
    const length = path.getTotalLength();
    for (let k = 1; k < 40; k++) {
      const p = path.getPointAtLength(length * k / 40);
      for (const [name, b] of Object.entries(shapes)) {
        if (name !== from && name !== to && p.x > b.x + 1 && p.x < b.x + b.width - 1
            && p.y > b.y + 1 && p.y < b.y + b.height - 1) crossings.push([t, name]);
      }
    }
  }
  document.getElementById('probe').textContent = JSON.stringify({images, links, boxes,
    page: [document.documentElement.scrollWidth, document.documentElement.clientWidth],
    svg: rect(svg), graphBox: rect(document.getElementById('lineage')),
    nodes: Object.keys(shapes).length, edges: titled('g.edge').length, crossings,
    labels: [...svg.querySelectorAll('g.node text')].map(t => t.textContent)});
});
</script>"""


def test_html_report_renders_in_headless_chromium(learned, chromium, tmp_path):
    from mlflow import MlflowClient

    out = offseason(learned, "report")
    page = learned / "reports/index.html"
    assert str(page) in out.stdout
    html = page.read_text()
    assert html.count('src="data:image/png;base64,') == 6 and "<svg" in html
    laid_out = shutil.which("dot") is not None  # else the page says how to install it
    assert ("Laid out by Graphviz's dot" in html) == laid_out
    probe = page.parent / "probe.html"  # beside the report, so its relative links resolve
    probe.write_text(html.replace("</body>", PROBE + "</body>"))
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--virtual-time-budget=5000", "--window-size=1200,900"]
    dom = subprocess.run([*flags, "--dump-dom", probe.as_uri()], capture_output=True, text=True,
                         timeout=180).stdout
    probe.unlink()
    found = json.loads(re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S).group(1)
                       .replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<")
                       .replace("&gt;", ">"))
    # every image loads, inside its box
    assert [i["id"] for i in found["images"]] == ["plot-scores", "plot-gain", "plot-stage-cost",
                                                  "plot-training", "plot-rewards",
                                                  "plot-quarantine"]
    for image in found["images"]:
        assert image["complete"] and image["w"] > 300 and image["h"] > 150, image
        assert image["box"][1] <= image["parent"][1] + 0.5, image
    # nothing overflows its box: no box scrolls sideways, nor the page; the graph fits its box
    assert all(b["scroll"] <= b["client"] for b in found["boxes"]), found["boxes"]
    assert found["page"][0] <= found["page"][1], found["page"]
    assert found["graphBox"][0] <= found["svg"][0] and found["svg"][1] <= found["graphBox"][1]
    assert found["svg"][2] > 500
    assert found["nodes"] >= 12 and found["edges"] >= found["nodes"] + 5
    if laid_out:  # by dot: every edge clear of the boxes it does not join
        assert found["crossings"] == [], found["crossings"]
    labels = " ".join(found["labels"])
    for name in ("ingest", "validate", "rollout", "reward", "train", "gate", "data/replay",
                 "models/champion", "gen-2: model version"):
        assert name in labels

    # every link resolves: files beside the report exist; the MLflow and Prefect links are at
    # the documented addresses (MLflow: `offseason ui`'s, the store being SQLite; Prefect: the
    # server of PREFECT_API_URL) and name runs that exist there, one of each per cycle
    prefect_api = cli_env(learned)["PREFECT_API_URL"]
    mlflow = MlflowClient(f"sqlite:///{learned / 'mlflow.db'}")
    kinds = {}
    for link in found["links"]:
        if link["href"].startswith("http"):
            if link["cls"] == "mlflow":
                assert link["href"].startswith("http://127.0.0.1:5000/#/experiments/"), link
                run = mlflow.get_run(link["href"].rsplit("/", 1)[1])
                kinds.setdefault("mlflow", []).append(run.data.tags["offseason.generation"])
            elif link["cls"] == "prefect":
                ui = prefect_api.removesuffix("/api")
                assert link["href"].startswith(f"{ui}/runs/flow-run/"), link
                flow_run = link["href"].rsplit("/", 1)[1]
                with urllib.request.urlopen(f"{prefect_api}/flow_runs/{flow_run}") as answer:
                    assert json.load(answer)["id"] == flow_run
                kinds.setdefault("prefect", []).append(flow_run)
            else:
                assert link["href"] in ("http://127.0.0.1:5000", prefect_api.removesuffix("/api"))
        else:
            assert link["url"].startswith("file://") and not link["href"].startswith("file:")
            assert Path(urllib.parse.unquote(urllib.parse.urlparse(link["url"]).path)).is_file(), \
                link
    # gen-0's run (init) has no flow run; each cycle's has one
    assert kinds["mlflow"] == ["0", "1", "2"] and len(set(kinds["prefect"])) == 2, kinds
    docs = next(link for link in found["links"] if link["id"] == "link-data-docs")
    assert docs["href"] == "data-docs/index.html" and "Great Expectations" in (
        page.parent / docs["href"]).read_text()

    # without Graphviz: the graph laid out by hand, and the page says so
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "git").symlink_to(shutil.which("git"))
    env = {**cli_env(learned), "PATH": f"{bare}{os.pathsep}{Path(sys.executable).parent}"}
    plain = subprocess.run([str(Path(sys.executable).parent / "offseason"), "report", "--out",
                            str(tmp_path / "plain.html")], cwd=learned, env=env,
                           capture_output=True, text=True, check=True)
    assert "plain.html" in plain.stdout
    text = (tmp_path / "plain.html").read_text()
    assert "<code>dot</code> is not installed" in text and 'id="lineage-graph"' in text

    shot = tmp_path / "report.png"
    subprocess.run([*flags[:-1], "--window-size=1200,3400", f"--screenshot={shot}",
                    page.as_uri()], capture_output=True, timeout=180)
    assert shot.read_bytes()[:4] == b"\x89PNG"
    keep = os.environ.get("OFFSEASON_KEEP_SCREENSHOT")
    if keep:  # for a person to look at
        shutil.copy2(shot, Path(keep))


# what Python prints and a person should never read on a page (issue 53.5): None, True, False,
# a dict's repr, a count printed as a float
PYTHON_SPELLINGS = re.compile(r"\b(None|True|False)\b|\{'|(?<![\d.])\d{3,}\.0(?![\d.])")


def test_the_report_in_a_browser_spells_nothing_as_python(learned, chromium, tmp_path):
    """The report as a person reads it (headless Chromium, the rendered text): nothing on the
    page spelled as Python prints it (issue 53.5: `1570.0` in pts/$, `True` in the tags)."""
    from browser import Browser

    out = tmp_path / "report.html"
    offseason(learned, "report", "--out", str(out))
    with Browser(chromium) as browser:
        browser.open(out.as_uri())
        browser.wait_for("document.querySelectorAll('img').length >= 6")
        text = browser.text()
    assert "gen-2" in text and "pts/$" in text, text[:2000]
    assert PYTHON_SPELLINGS.search(text) is None, text[max(0, PYTHON_SPELLINGS.search(
        text).start() - 200):][:400]


def test_an_id_that_holds_personal_data_is_looked_up_by_its_file_and_line():
    """Ingest keeps no trace id that holds personal data (it stores `<file>:<line>` instead): asked
    for such an id, lineage said it never reached the inbox, though a generation learned from it."""
    from flows.audit.lineage import trace_text

    text = trace_text({"trace_id": "session/jane.doe@acmecorp.com", "read": None, "generations": []})
    assert "holds personal data" in text and "<file>:<line>" in text, text
    assert "grep -n -F" in text and "data/inbox/*" in text, text  # how to find file and line
    plain = trace_text({"trace_id": "c1", "read": None, "generations": []})
    assert "never reached the inbox" in plain

"""The cycle report: what came in, what was quarantined, rewards, training, the gate, the decision.

`publish()` is called by the cycle flow at the end of a cycle that reached the gate: it attaches to
the Prefect flow run a markdown artifact (`cycle-report`), a table of the stages (`cycle-metrics`:
whether each reran, what it used) and one small table per stage of its numeric metrics
(`cycle-metrics-<stage>`), and a link to the cycle's MLflow run. `markdown()`, `metrics_table()`
and `stage_table()` are plain functions of the metrics files, so the same text can be rebuilt for
any tagged generation.

`html_report()` (`offseason report`) reads the committed metrics of every gen-N tag (the ledgers
`metrics/cost.json`, `metrics/train_steps.csv`, the DVC-cached rewards), the MLflow runs of the
cycles, `data/docs/`, and what the fleet did (promotions.jsonl's canary and production gate
lines, `.offseason/fleet.json` and `.offseason/fleet.jsonl`: the Serving section); it writes
`reports/index.html` and copies the Data Docs beside it
(`reports/data-docs/`, linked relatively, so the link works from disk and over http alike). The
lineage graph is laid out by Graphviz's `dot` when it is installed, else by hand (the page says so).

Links to the MLflow UI use `MLFLOW_TRACKING_URI` when it is an http(s) server, otherwise
`OFFSEASON_MLFLOW_UI_URL` (default `http://127.0.0.1:5000`, where `offseason ui` serves the SQLite
store). Links to Prefect flow runs use `PREFECT_UI_URL`, else the server of `PREFECT_API_URL`, else
`http://127.0.0.1:4200` (where `offseason ui` serves the embedded mode's runs).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from flows.project import tracking
from flows.project.workspace import PREFECT_UI
from stages.config import CYCLE

STAGES = CYCLE  # in the order they run
MLFLOW_UI = "http://127.0.0.1:5000"
DATA_DOCS = "data/docs"  # the validate stage's Great Expectations Data Docs (dvc.yaml)


def mlflow_ui_url() -> str:
    """The MLflow UI's base URL: the tracking server, else the local UI."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri.startswith(("http://", "https://")):
        return uri.rstrip("/")
    return os.environ.get("OFFSEASON_MLFLOW_UI_URL", MLFLOW_UI).rstrip("/")


def prefect_ui_url() -> str:
    """The Prefect UI's base URL: `PREFECT_UI_URL`, else the server of `PREFECT_API_URL`, else
    the local UI (`offseason ui` serves the runs of the embedded mode there).
    """
    if os.environ.get("PREFECT_UI_URL"):
        return os.environ["PREFECT_UI_URL"].rstrip("/")
    api = os.environ.get("PREFECT_API_URL", "").rstrip("/")
    return api.removesuffix("/api") if api else PREFECT_UI


def flow_run_link(flow_run_id: str) -> str:
    """The Prefect UI's link to a flow run."""
    return f"{prefect_ui_url()}/runs/flow-run/{flow_run_id}"


def run_link(experiment_id: str, run_id: str) -> str:
    """The MLflow UI's link to a run."""
    return f"{mlflow_ui_url()}/#/experiments/{experiment_id}/runs/{run_id}"


def _num(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec) if isinstance(value, (int, float)) \
        else str(value)


def _interval(pair) -> str:
    return "-" if not pair else f"[{pair[0]:+.3f}, {pair[1]:+.3f}]"


def training_summary(train: dict) -> str:
    """The train stage's metrics in a line."""
    if not train:
        return "no train metrics"
    if not train.get("trained"):
        return f"skipped ({train.get('reason')}); {train.get('examples', 0)} verified examples"
    if train.get("online"):  # on-policy GRPO: its steps, not epochs over fixed examples
        return (f"on-policy GRPO: {train.get('steps')} steps ({train.get('optimizer_steps')} "
                f"optimizer steps) on {train.get('episodes')} episodes; mean reward "
                f"{_num(train.get('reward_first_step'), '.3f')} at the first step, "
                f"{_num(train.get('reward_last_step'), '.3f')} at the last; generation "
                f"{_num(train.get('generate_seconds'), '.1f')} s, training "
                f"{_num(train.get('train_seconds'), '.1f')} s, weight sync "
                f"{_num(train.get('weight_sync_seconds'), '.2f')} s")
    text = (f"{_num(train.get('examples'), '.0f')} new verified examples + "
            f"{_num(train.get('replayed', 0), '.0f')} replayed, {_num(train.get('steps'), '.0f')} "
            f"steps, final loss {_num(train.get('final_loss'), '.4f')}, "
            f"{_num(train.get('tokens_per_second'), '.0f')} tokens/s in "
            f"{_num(train.get('train_seconds'), '.2f')} s")
    curve = train.get("curve") or train.get("loss_curve")
    if curve:  # a per-step loss curve, when the train stage writes one into its metrics
        losses = [p["loss"] if isinstance(p, dict) else p for p in curve]
        text += (f"; loss {losses[0]:.4f} at the first step, min {min(losses):.4f}, "
                 f"{losses[-1]:.4f} at the last")
    return text


def _words(value) -> str:
    """A list or a {name: count} as words for people ("email 2, card 1"; "none"), not a repr."""
    if isinstance(value, dict):
        value = [f"{k} {v}" for k, v in value.items() if v]
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value) or "none"
    return "none" if value is None else str(value)


def gate_lines(gate: dict) -> list[str]:
    """The gate's verdict and its evidence as Markdown list lines."""
    from flows.audit.lineage import how

    lines = [f"- **Gate** ({how(gate)}): candidate "
             f"{_num(gate.get('candidate_score'))} vs champion {_num(gate.get('champion_score'))}, "
             f"difference {_num(gate.get('difference'), '+.3f')} in "
             f"{_interval(gate.get('interval'))}: **{'pass' if gate.get('passed') else 'fail'}** "
             f"({gate.get('reason')})"]
    if gate.get("rule"):
        lines.append(f"  - rule: {gate['rule']}")
    if gate.get("design"):  # the decision's power and the items each suite needs (gate.design)
        lines.append(f"  - design: {gate['design']['summary']}")
    # per-suite verdicts, when the gate scores several suites
    for name, suite in (gate.get("suites") or {}).items():
        if isinstance(suite, dict):
            lines.append(f"  - suite `{name}`: candidate "
                         f"{_num(suite.get('candidate', suite.get('candidate_score')))} vs "
                         f"champion {_num(suite.get('champion', suite.get('champion_score')))}, "
                         f"difference interval {_interval(suite.get('interval'))}"
                         f"{': ' + str(suite['reason']) if suite.get('reason') else ''}")
    # the reward-hacking guards (length, format, tool_ok, hacking) in each environment, failed
    # ones marked
    for name, per in (gate.get("guards") or {}).items():
        for where, guard in per.items():
            if not guard.get("skipped"):
                lines.append(f"  - guard `{name}` in `{where}`"
                             f"{'' if guard.get('passed') else ' **failed**'}: candidate "
                             f"{_num(guard.get('candidate'))} vs champion "
                             f"{_num(guard.get('champion'))}: {guard.get('reason')}")
    return lines


def hacks_line(reward: dict) -> str:
    """The episodes a verifier suspected of a reward hack, by reason, in words."""
    hacks = reward.get("hack_suspected") or {}
    if not hacks.get("episodes"):
        return "none"
    reasons = ", ".join(f"{reason}: {n}" for reason, n in hacks.get("reasons", {}).items())
    return f"{hacks['episodes']} episodes ({reasons})"


def decision(record: dict) -> str:
    """The cycle's promotion decision in words."""
    if record.get("promoted"):
        words = "promoted: the candidate is the new champion"
    elif record.get("status") == "waiting-approval":
        words = "passed the gate, waiting for approval"
    else:
        words = "not promoted: the champion stays"
    # the person's decision, as flows/orchestration/promotion.py records it (absent when none was asked for)
    chosen = record.get("decision") or {}
    if chosen.get("decision") in ("approved", "rejected"):
        words += (f" ({chosen['decision']} by {chosen.get('approver')}"
                  f"{': ' + chosen['reason'] if chosen.get('reason') else ''})")
    return words


def estimate_line(ledger: dict | None) -> str:
    """What a cycle's ledger says it cost, beside the estimate made before it (`offseason
    estimate`, kept under `estimate` in metrics/cost.json), in words.
    """
    if not ledger or "total" not in ledger:
        return "no cost ledger (metrics/cost.json)"
    total = ledger["total"]
    actual = (f"${total.get('usd', 0):.4f} ({total.get('cpu_seconds', 0):.1f} CPU s, "
              f"{total.get('gpu_seconds', 0) or 0:.1f} GPU s, {total.get('judge_tokens', 0)} judge "
              f"tokens)")
    guess = ledger.get("estimate") or {}
    if guess.get("status") != "ok":
        return f"{actual}; no estimate before it (no earlier cycle's ledger to take rates from)"
    low, mid, high = guess["total"]["usd"]
    cpu = guess["total"]["cpu_seconds"]
    return (f"{actual}; estimated before it ${mid:.4f} (${low:.4f} to ${high:.4f}; "
            f"{cpu[1]:.1f} CPU s, {cpu[0]:.1f} to {cpu[2]:.1f})")


def markdown(root: Path, generation: int, metrics: dict, record: dict, *,
             experiment_id: str | None = None, run_id: str | None = None) -> str:
    """The cycle report of a generation as Markdown."""
    ingest, validate, reward, train, gate = (metrics.get(s, {}) for s in
                                             ("ingest", "validate", "reward", "train", "gate"))
    drift = validate.get("drift", {})
    docs = root / DATA_DOCS / "index.html"
    lines = [
        f"# offseason cycle gen-{generation}: "
        f"{'promoted' if record.get('promoted') else 'not promoted'}",
        "",
        "## What came in",
        f"- **Traces**: {ingest.get('rows_read', 0)} lines read, {ingest.get('accepted', 0)} "
        f"accepted, {ingest.get('duplicates', 0)} duplicates",
        f"- **Quarantined**: {ingest.get('quarantined', 0)} at ingest, "
        f"{validate.get('quarantined', 0)} by validation (reasons in `data/quarantine/`)",
        f"- **Drift** from the previous cycle: task mix distance "
        f"{drift.get('task_mix_distance')}, new tools {_words(drift.get('new_tools'))}; PII "
        f"scrubbed {_words(ingest.get('pii_redactions'))}",
        # a path, not a file:// link: browsers refuse those inside the Prefect UI's http page;
        # `offseason report` copies them beside reports/index.html and links them there
        f"- **Data Docs** (Great Expectations): `{docs.relative_to(root)}` in the project "
        f"(`offseason report` links them)",
        "",
        "## Learning",
        f"- **Rewards**: mean {reward.get('mean_reward')}, pass@k {reward.get('pass_at_k')} over "
        f"{reward.get('episodes')} episodes ({reward.get('judged')} judged, "
        f"{reward.get('unjudgeable', 0)} unjudgeable); suspected reward hacks: "
        f"{hacks_line(reward)}",
        f"- **Training**: {training_summary(train)}",
        "",
        "## Cost",
        f"- **This cycle**: {estimate_line(_ledger(root))}",
        "",
        "## Decision",
        *gate_lines(gate),
        f"- **Decision**: {decision(record)}",
        f"- **Model version**: {record.get('model_version')}; champion is version "
        f"{record.get('champion_version')}",
    ]
    if run_id and experiment_id:
        lines.append(f"- **MLflow run**: [{run_id}]({run_link(experiment_id, run_id)})")
    return "\n".join(lines)


def _ledger(root: Path) -> dict | None:
    path = root / "metrics" / "cost.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def metrics_table(metrics: dict, reran: dict) -> list[dict]:
    """One row per stage: whether it reran, and what it used (wall and CPU seconds, peak memory).

    Each stage's own metrics are in its own table (`stage_table`): side by side they made one
    table of 45 columns.
    """
    rows = []
    for stage in STAGES:
        used = metrics.get(stage, {}).get("resources") or {}
        rows.append({"stage": stage, "reran": reran.get(stage),
                     "wall_seconds": used.get("wall_seconds"), "cpu_seconds": used.get("cpu_seconds"),
                     "max_rss_mb": used.get("max_rss_mb")})
    return rows


def stage_table(metrics: dict, stage: str) -> list[dict]:
    """A stage's top-level numeric metrics as rows of (metric, value): a small table."""
    return [{"metric": k, "value": v} for k, v in tracking.numeric(metrics.get(stage, {})).items()
            if "." not in k]


def publish(root: Path, generation: int, metrics: dict, reran: dict, record: dict, *,
            experiment_id: str, run_id: str) -> str:
    """Attach the report and the metrics table to the current Prefect flow run."""
    from prefect.artifacts import (
        create_link_artifact,
        create_markdown_artifact,
        create_table_artifact,
    )

    text = markdown(root, generation, metrics, record, experiment_id=experiment_id, run_id=run_id)
    create_markdown_artifact(text, key="cycle-report", description=f"gen-{generation}")
    create_table_artifact(metrics_table(metrics, reran), key="cycle-metrics",
                          description=f"gen-{generation}: the stages, whether each reran, what "
                                      f"each used; each stage's metrics in cycle-metrics-<stage>")
    for stage in STAGES:
        if metrics.get(stage):  # Prefect's artifact keys: lowercase letters, digits, dashes
            create_table_artifact(stage_table(metrics, stage),
                                  key=f"cycle-metrics-{stage.replace('_', '-')}",
                                  description=f"gen-{generation}: metrics/{stage}.json")
    create_link_artifact(run_link(experiment_id, run_id), link_text=f"MLflow run gen-{generation}",
                         key="mlflow-run", description=f"gen-{generation}")
    return text


# --- the static HTML report (`offseason report`) --------------------------------------------

def _png(fig) -> str:
    """A matplotlib figure as a data: URI (the page stays one self-contained file)."""
    import base64
    import io as bytes_io

    import matplotlib.pyplot as plt

    buffer = bytes_io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def score_plot(rows: list[dict]) -> str:
    """The score history plot as an embeddable PNG data URI."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "history.png"
        plot_history(rows, path)
        import base64

        return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def per_cycle(root: Path, rows: list[dict]) -> list[dict]:
    """Per generation >= 1: ingest and validate counts and each task's mean reward (from DVC)."""
    from flows.audit import lineage
    from flows.project.workspace import read_at

    out = []
    for row in rows:
        if row["tag"] == "gen-0":
            continue
        ingest = read_at(root, row["tag"], "metrics/ingest.json") or {}
        validate = read_at(root, row["tag"], "metrics/validate.json") or {}
        rewards_md5 = lineage.out_hash(lineage.stage_files(root, row["tag"]), "data/rewards.parquet")
        data = lineage.read_object(root, rewards_md5) if rewards_md5 else None
        per_task: dict[str, list[float]] = {}
        if data is not None:
            for r in lineage.read_parquet(data, ["task_id", "reward"]).to_pylist():
                if r["reward"] is not None:
                    per_task.setdefault(r["task_id"], []).append(r["reward"])
        out.append({"tag": row["tag"], "rows_read": ingest.get("rows_read", 0),
                    "ingest_quarantined": ingest.get("quarantined", 0),
                    "duplicates": ingest.get("duplicates", 0),
                    "validated": validate.get("rows_read", 0),
                    "validate_quarantined": validate.get("quarantined", 0),
                    "task_rewards": [sum(v) / len(v) for v in per_task.values()],
                    "episode_rewards": [x for v in per_task.values() for x in v]})
    return out


def reward_plot(cycles: list[dict]) -> str:
    """The reward distributions of the cycles as a violin plot (a PNG data URI)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    data = [c["task_rewards"] or [0.0] for c in cycles]
    ax.violinplot(data, showmeans=True, showextrema=True)
    for i, c in enumerate(cycles, start=1):
        episodes = c["episode_rewards"]
        mean = sum(episodes) / len(episodes) if episodes else 0.0
        ax.annotate(f"mean {mean:.2f}\n{len(episodes)} ep.", (i, 1.02), ha="center",
                    fontsize=7, va="bottom", annotation_clip=False)
    ax.set_xticks(range(1, len(cycles) + 1), [c["tag"] for c in cycles])
    ax.set_ylabel("mean reward per task")
    ax.set_ylim(-0.05, 1.2)
    ax.set_title("reward distribution per cycle (rollouts of the champion)", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def quarantine_plot(cycles: list[dict]) -> str:
    """The quarantine rates of the cycles as a bar chart (a PNG data URI)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    x = range(len(cycles))
    rate = lambda n, d: (n / d) if d else 0.0  # noqa: E731
    width = 0.27
    series = [("quarantined at ingest", [rate(c["ingest_quarantined"], c["rows_read"])
                                         for c in cycles]),
              ("duplicates", [rate(c["duplicates"], c["rows_read"]) for c in cycles]),
              ("quarantined by validation", [rate(c["validate_quarantined"], c["validated"])
                                             for c in cycles])]
    for k, (label, values) in enumerate(series):
        ax.bar([i + (k - 1) * width for i in x], values, width, label=label)
    ax.set_xticks(list(x), [c["tag"] for c in cycles])
    ax.set_ylabel("share of lines / traces")
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:.1%}"))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return _png(fig)


def _esc(text) -> str:
    import html

    return html.escape(str(text), quote=True)


def lineage_nodes(chain: dict) -> tuple[dict, list]:
    """The generation's graph: {key: (rank, kind, label, md5)} and edges [(from, to)]; inputs ->
    stages -> outputs -> the verdict, by DVC hash, code left out (it is in the text lineage).
    """
    stages = chain["stages"]
    produced = {o["path"]: name for name, s in stages.items() for o in s["outs"]}
    # code and helpers are deps of every stage: listed in the text lineage, left out of the picture
    data_deps = {name: [d for d in s["deps"] if not d["path"].startswith("stages/")]
                 for name, s in stages.items()}
    rank: dict[str, int] = {}

    def stage_rank(name: str, seen=()) -> int:
        if name not in rank:
            ups = [produced[d["path"]] for d in data_deps[name]
                   if d["path"] in produced and produced[d["path"]] != name
                   and produced[d["path"]] not in seen]
            rank[name] = 1 + max((stage_rank(u, seen + (name,)) for u in ups), default=-1)
        return rank[name]

    for name in stages:
        stage_rank(name)
    nodes, edges = {}, []
    for name in stages:
        col = 2 * rank[name] + 1
        nodes[f"stage:{name}"] = (col, "stage", name, "")
        for d in data_deps[name]:
            key = f"data:{d['path']}"
            if key not in nodes:
                at = 2 * rank[produced[d["path"]]] + 2 if d["path"] in produced else 0
                nodes[key] = (at, "data", d["path"], d["md5"] or "")
            edges.append((key, f"stage:{name}"))
        for o in stages[name]["outs"]:
            key = f"data:{o['path']}"
            nodes[key] = (col + 1, "data", o["path"], o["md5"] or "")
            edges.append((f"stage:{name}", key))
    start = chain.get("started_from") or {}
    if start.get("tag") and "data:models/champion" in nodes:
        col, kind, label, md5 = nodes["data:models/champion"]
        nodes["data:models/champion"] = (col, "data", f"models/champion = {start['tag']}", md5)
    gate = chain.get("gate") or {}
    # (a generation no stage made, as a promotion by hand: the result alone)
    nodes["result"] = (max((n[0] for n in nodes.values()), default=-1) + 1, "result",
                       f"{chain['tag']}: model version {chain['model_version']}",
                       f"gate {'pass' if gate.get('passed') else 'fail'}, "
                       f"{'promoted' if chain['promoted'] else 'not promoted'}")
    if "stage:gate" in nodes:
        edges.append(("stage:gate", "result"))
    return nodes, edges


def _colors(kind: str, promoted: bool) -> tuple[str, str]:
    return {"stage": ("#dbe9f6", "#2c6fad"), "data": ("#f4f4f4", "#777777"),
            "result": ("#dff3e0" if promoted else "#f8e0e0", "#444444")}[kind]


def _fit(svg: str, width: float) -> str:
    """The SVG scaled to its box: as wide as the box allows, never wider than drawn (viewBox)."""
    import re

    svg = svg[svg.index("<svg"):]
    head, rest = svg.split(">", 1)
    head = re.sub(r'\s(width|height)="[^"]*"', "", head)
    return (f'{head} id="lineage-graph" style="width: 100%; max-width: {width:.0f}px; '
            f'height: auto; display: block; margin: 0 auto">{rest}')


def dot_svg(chain: dict, dot: str) -> str:
    """The lineage graph laid out by Graphviz's `dot` (top to bottom), as inline SVG.

    Each stage is one box listing the outputs it wrote, by hash; an edge leaves the output a
    later stage reads. Inputs no stage wrote (the inbox, the champion, the suites) are boxes of
    their own. Drawn with one box per file the graph was too wide to read inside the page.
    """
    import re
    import subprocess

    nodes, edges = lineage_nodes(chain)
    writer = {b: a for a, b in edges if a.startswith("stage:") and b.startswith("data:")}
    outs: dict[str, list[str]] = {}
    for data, stage in writer.items():
        outs.setdefault(stage, []).append(data)
    port = {data: f"o{i}" for stage in outs for i, data in enumerate(outs[stage])}
    quote = lambda text: '"' + str(text).replace("\\", "\\\\").replace('"', '\\"') + '"'  # noqa: E731
    hashed = lambda label, md5: (f'{_esc(label)}<br/><font point-size="8" color="#666666">'  # noqa: E731
                                 f'{_esc(md5[:16])}</font>' if md5 else _esc(label))
    lines = ["digraph lineage {",
             '  graph [rankdir=TB, nodesep=0.25, ranksep=0.4, bgcolor="transparent"];',
             '  node [fontname="sans-serif", fontsize=10];',
             '  edge [color="#888888", arrowsize=0.6];']
    for key, (_, kind, label, md5) in nodes.items():
        fill, stroke = _colors(kind, chain["promoted"])
        if kind == "stage":
            rows = "".join(f'<tr><td port="{port[d]}" bgcolor="#f4f4f4" align="left">'
                           f'{hashed(nodes[d][2], nodes[d][3])}</td></tr>'
                           for d in outs.get(key, []))
            lines.append(f'  {quote(key)} [shape=plain, class="stage", label=<<table border="1" '
                         f'cellborder="0" cellspacing="2" cellpadding="3" bgcolor="{fill}" '
                         f'color="{stroke}"><tr><td><b>{_esc(label)}</b></td></tr>{rows}'
                         f'</table>>];')
        elif key not in writer:  # an input no stage wrote, or the verdict
            text = f"<b>{_esc(label)}</b><br/>{_esc(md5)}" if kind == "result" else \
                hashed(label, md5)
            lines.append(f"  {quote(key)} [shape=box, style={quote('rounded,filled')}, "
                         f"class={quote(kind)}, fillcolor={quote(fill)}, color={quote(stroke)}, "
                         f"label=<{text}>];")
    for a, b in edges:
        if a in writer:  # a stage's output read by a later stage: from its row in the box
            # no compass point: drawn from the box's edge, not across the rows below the port
            lines.append(f"  {quote(writer[a])}:{port[a]} -> {quote(b)};")
        elif not b.startswith("data:") or b not in writer:
            lines.append(f"  {quote(a)} -> {quote(b)};")
    lines.append("}")
    done = subprocess.run([dot, "-Tsvg"], input="\n".join(lines), capture_output=True, text=True,
                          timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"dot failed on the lineage graph: {done.stderr[-500:]}")
    width = float(re.search(r'<svg[^>]*\swidth="([\d.]+)pt"', done.stdout).group(1))
    return _fit(done.stdout, width * 4 / 3)  # points to CSS pixels


def hand_svg(chain: dict) -> str:
    """The lineage graph laid out by hand, rank by rank: the fallback without Graphviz (edges
    may cross boxes there).
    """
    nodes, edges = lineage_nodes(chain)
    columns: dict[int, list[str]] = {}
    for key, (col, *_) in nodes.items():
        columns.setdefault(col, []).append(key)
    box_w, box_h, gap_x, row_h = 176, 40, 14, 74
    widest = max(len(v) for v in columns.values())
    width = widest * (box_w + gap_x) + 20
    height = (max(columns) + 1) * row_h + 10
    pos = {}
    for col, keys in columns.items():
        left = (width - len(keys) * (box_w + gap_x)) / 2
        for i, key in enumerate(sorted(keys)):
            pos[key] = (left + i * (box_w + gap_x), 10 + col * row_h)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width:.0f} {height:.0f}" '
             f'font-family="sans-serif" font-size="11">',
             '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
             'markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#888"/></marker>'
             '</defs>']
    for a, b in edges:
        (x1, y1), (x2, y2) = pos[a], pos[b]
        x1, y1, x2, y2 = x1 + box_w / 2, y1 + box_h, x2 + box_w / 2, y2
        mid = (y1 + y2) / 2
        parts.append(f'<g class="edge"><title>{_esc(a)}-&gt;{_esc(b)}</title>'
                     f'<path d="M{x1:.0f},{y1:.0f} C{x1:.0f},{mid:.0f} '
                     f'{x2:.0f},{mid:.0f} {x2:.0f},{y2:.0f}" fill="none" stroke="#888" '
                     f'marker-end="url(#arrow)"/></g>')
    for key, (col, kind, label, md5) in nodes.items():
        x, y = pos[key]
        fill, stroke = _colors(kind, chain["promoted"])
        radius = 20 if kind == "stage" else 5
        parts.append(f'<g class="node {kind}"><title>{_esc(key)}</title>'
                     f'<rect x="{x:.0f}" y="{y:.0f}" width="{box_w}" height="{box_h}" '
                     f'rx="{radius}" fill="{fill}" stroke="{stroke}"/>'
                     f'<text x="{x + box_w / 2:.0f}" y="{y + (17 if md5 else 24):.0f}" '
                     f'text-anchor="middle" font-weight="{"bold" if kind != "data" else "normal"}">'
                     f'{_esc(label[:30])}</text>'
                     f'<text x="{x + box_w / 2:.0f}" y="{y + 32:.0f}" text-anchor="middle" '
                     f'fill="#666" font-size="9">{_esc(md5[:26])}</text></g>')
    parts.append("</svg>")
    return _fit("".join(parts), width)


def lineage_svg(chain: dict) -> tuple[str, str]:
    """The lineage graph as inline SVG, and how it was laid out (a sentence for the page)."""
    import shutil

    dot = shutil.which("dot")
    if dot:
        return dot_svg(chain, dot), "Laid out by Graphviz's dot."
    return hand_svg(chain), ("Graphviz's <code>dot</code> is not installed, so this graph is laid "
                             "out by hand and edges may cross boxes: install it "
                             "(<code>apt-get install graphviz</code>; <code>make setup</code> "
                             "does where it can) and run <code>offseason report</code> again.")


def champion_after(rows: list[dict]) -> list[float | None]:
    """The champion's score after each generation's cycle: the candidate's when it was promoted,
    else the champion it was gated against, which a rollback before the cycle may have changed
    (counting promotions alone kept a rolled-back champion on the curve).
    """
    champion, out = None, []
    for row in rows:
        if row["promoted"]:
            champion = row["score"]
        elif row.get("champion_score") is not None:
            champion = row["champion_score"]
        for back in row.get("rollbacks") or []:  # after this cycle: the champion brought back
            champion = next((r["score"] for r in rows if r.get("tag") == back["to"]), champion)
        out.append(champion)
    return out


def gain_plot(rows: list[dict]) -> str | None:
    """Cumulative gain against cumulative spend per generation, the learning curve per dollar (a
    PNG data URI; None before any cycle has a ledger). Gain: the champion's primary-suite score
    over generation 0's, in points; spend: every cycle's ledger, rejected ones included. With
    prices of 0, CPU hours stand in for dollars.
    """
    later = [r for r in rows[1:] if r.get("cost_usd") is not None]
    if not later or rows[0].get("score") is None:
        return None
    dollars = sum(r["cost_usd"] for r in later) > 0
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    base, spent = rows[0]["score"], 0.0
    xs, ys = [0.0], [0.0]
    for r, champion in zip(rows[1:], champion_after(rows)[1:]):
        spent += (r.get("cost_usd") if dollars else (r.get("cpu_seconds") or 0.0) / 3600) or 0.0
        xs.append(spent)
        ys.append(100 * (champion - base))
        if r.get("score") is not None:
            ax.plot(spent, 100 * (r["score"] - base), "o", color="tab:blue", markersize=8,
                    fillstyle="full" if r["promoted"] else "none")
        ax.annotate(r["tag"], (spent, 100 * (champion - base)), textcoords="offset points",
                    xytext=(4, -12), fontsize=8, color="#555")
    ax.step(xs, ys, where="post", color="tab:gray", label="champion's gain over gen-0")
    ax.plot([], [], "o", color="tab:blue", label="candidate (hollow: rejected)")
    ax.axhline(0, color="#bbb", linewidth=0.8)
    ax.set_xlim(-spent * 0.03, spent * 1.12)  # room for the last label
    ax.set_xlabel("cumulative spend, $ (rejected cycles included)" if dollars else
                  "cumulative CPU hours (the prices in params.yaml's cost: are 0)")
    ax.set_ylabel("points of pass@1 over gen-0")
    ax.set_title("learning curve per dollar", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    return _png(fig)


def stage_cost_plot(ledger: dict, tag: str) -> str:
    """What each stage of a cycle cost (a PNG data URI): dollars, or CPU seconds at prices of 0;
    stages DVC skipped are marked as reused (paid for in an earlier cycle).
    """
    plt = _plt()
    stages = ledger.get("stages") or {}  # in the pipeline's order (the file's keys are sorted)
    stages = dict(sorted(stages.items(), key=lambda kv: (
        STAGES.index(kv[0]) if kv[0] in STAGES else len(STAGES), kv[0])))
    dollars = (ledger.get("total") or {}).get("usd", 0) > 0
    names = list(stages)
    values = [0.0 if row.get("reused") else row.get("usd" if dollars else "cpu_seconds", 0.0)
              for row in stages.values()]
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(names) + 1.2))
    ax.barh(names, values, color="tab:orange")
    top = max(values, default=0) or 1.0
    for i, row in enumerate(stages.values()):
        text = "reused (paid for earlier)" if row.get("reused") else \
            f"{row.get('wall_seconds', 0):.0f} s wall, {row.get('cpu_seconds', 0):.0f} s CPU"
        ax.text(values[i] + top * 0.01, i, text, va="center", fontsize=8, color="#444")
    ax.invert_yaxis()
    ax.set_xlim(0, top * 1.45)
    ax.xaxis.set_major_locator(plt.MaxNLocator(5))
    ax.set_xlabel("$" if dollars else "CPU seconds (the prices in params.yaml's cost: are 0)")
    ax.set_title(f"cost per stage, {tag}", fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return _png(fig)


def training_curves(root: Path, rows: list[dict], column: str = "loss"
                    ) -> dict[str, list[tuple[float, float]]]:
    """Each generation's `column` per step (the loss; `reward_mean` for on-policy GRPO's steps),
    from `metrics/train_steps.csv` as committed at its tag.
    """
    import csv

    from flows.project.workspace import run

    curves = {}
    for row in rows[1:]:
        shown = run(["git", "show", f"{row['tag']}:metrics/train_steps.csv"], root, check=False)
        if shown.returncode != 0:
            continue
        points = [(float(r["step"]), float(r[column])) for r in csv.DictReader(
            shown.stdout.splitlines()) if r.get("step") and r.get(column)]
        if points:
            curves[row["tag"]] = points
    return curves


def training_plot(curves: dict[str, list[tuple[float, float]]],
                  rewards: dict[str, list[tuple[float, float]]] | None = None) -> str:
    """The training loss per step of each generation that trained, and beside it the mean
    reward per on-policy step of those that trained on-policy (a PNG data URI).
    """
    plt = _plt()
    fig, axes = plt.subplots(1, 2 if rewards else 1, figsize=(10 if rewards else 7, 3.4),
                             squeeze=False)
    panels = [(axes[0][0], curves, "optimizer step (on-policy: step)", "training loss",
               "training curve per generation (metrics/train_steps.csv)")]
    if rewards:
        panels.append((axes[0][1], rewards, "on-policy step", "mean reward of the step's "
                       "episodes", "on-policy GRPO: reward per step"))
    for ax, series, xlabel, ylabel, title in panels:
        for tag, points in series.items():
            ax.plot([p[0] for p in points], [p[1] for p in points],
                    marker="." if len(points) < 30 else None, label=tag)
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)


def run_links(root: Path, rows: list[dict]) -> dict[str, dict[str, str]]:
    """Per tag, the URLs of its MLflow run and its Prefect flow run (none without MLflow).

    Read from the cycles' MLflow runs: a cycle resumed after approval has two, and the one that
    tagged gen-N is the generation's.
    """
    if not os.environ.get("MLFLOW_TRACKING_URI") and not (root / "mlflow.db").exists():
        return {}
    from flows.project.workspace import configure_env

    configure_env(root)
    import mlflow

    found = tracking.find_experiment()
    if found is None:
        return {}
    chosen = {}
    for run in mlflow.MlflowClient().search_runs(  # newest first
            [found.experiment_id], "tags.`offseason.generation` != ''",
            order_by=["attribute.start_time DESC"], max_results=5000):
        tags = run.data.tags
        tag = f"gen-{tags['offseason.generation']}"
        if "mlflow.parentRunId" not in tags and (tag not in chosen or (
                tags.get("offseason.git_tag") and
                not chosen[tag].data.tags.get("offseason.git_tag"))):
            chosen[tag] = run
    links = {}
    for tag, run in chosen.items():
        links[tag] = {"mlflow": run_link(found.experiment_id, run.info.run_id)}
        if run.data.tags.get("offseason.prefect_flow_run_id"):
            links[tag]["prefect"] = flow_run_link(run.data.tags["offseason.prefect_flow_run_id"])
    return links


def copy_data_docs(root: Path, folder: Path) -> str | None:
    """Copy the workspace's Data Docs beside the report (`data-docs/`); the relative link to them
    (None when there are none). A relative link works from file:// and over http alike, where a
    file:// link inside an http page is refused.
    """
    import shutil
    import tempfile

    source = root / DATA_DOCS
    if not (source / "index.html").exists():
        return None
    target = folder / "data-docs"
    folder.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".data-docs-", dir=folder))
    shutil.copytree(source, staging / "docs")
    shutil.rmtree(target, ignore_errors=True)
    (staging / "docs").rename(target)
    staging.rmdir()
    return "data-docs/index.html"


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>offseason report</title>
<style>
body {{ font-family: sans-serif; margin: 2em auto; max-width: 1100px; padding: 0 1em; color: #222; }}
h1 {{ font-size: 1.6em; }} h2 {{ font-size: 1.2em; margin-top: 2em; }} h3 {{ font-size: 1em; }}
table {{ border-collapse: collapse; font-size: 0.85em; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 4px 7px; text-align: right; }}
td {{ white-space: nowrap; }}
th:first-child, td:first-child {{ text-align: left; }}
.champion {{ font-weight: bold; background: #eef7ee; }}
.rollback {{ color: #a33; background: #fbeeee; font-style: italic; }}
.flagged {{ color: #850; background: #fdf5e6; font-style: italic; }}
.box {{ overflow-x: auto; }}
.box img {{ max-width: 100%; height: auto; }}
.graph {{ border: 1px solid #eee; padding: 8px; }}
.note {{ color: #777; font-size: 0.9em; }}
</style></head><body>
<h1>offseason: {workspace}</h1>
<p>{summary}</p>
<p class="box" id="links">{links}</p>
<h2>Generations</h2>
<div class="box"><table id="history"><tr><th>generation</th><th>date</th><th>traces</th>
<th>pass@1</th><th>vs champion</th><th>interval of difference</th><th>verdict</th>
<th>version</th><th>cost $</th><th>pts/$</th><th>approver</th>{serving_th}<th>runs</th></tr>
{rows}
</table></div>
<p class="note">{run_note}</p>
<p class="note" id="collect">{collect}</p>
<h2>Serving</h2>
{serving}
<h2>Benchmark score per generation</h2>
<div class="box"><img id="plot-scores" alt="pass@1 per generation with the gate's intervals"
src="{scores}"></div>
<h2>What it cost: gain per dollar</h2>
{gain}
{stage_cost}
<h2>Training curve</h2>
{training}
<h2>Reward distribution per cycle</h2>
{rewards}
<h2>Quarantine rates per cycle</h2>
{quarantine}
<h2>Lineage of {lineage_tag}</h2>
<p>{lineage_text}</p>
<div class="box graph" id="lineage">{svg}</div>
<p class="note">{layout} Full chain: <code>offseason lineage {lineage_tag}</code>; integrity:
<code>offseason lineage --verify {lineage_tag}</code>. Written by <code>offseason report</code> at
{at}.</p>
</body></html>
"""


def _measures_table(gate: dict) -> str:
    """A production gate verdict's measures (stages/live_gate.py `compare`): canary vs stable,
    the difference, the counts, the test and p-value against the level, and what it decided.
    """
    cells = []
    for name, m in (gate.get("measures") or {}).items():
        if "p_value" in m:
            said = "worse" if m["worse"] else "not worse"
        else:
            said = m.get("skipped") or "reported, not decided on"
        n = m.get("n") or ["-", "-"]
        cells.append(f'<tr><td>{_esc(name)}</td><td>{_num(m.get("canary"))}</td>'
                     f'<td>{_num(m.get("stable"))}</td><td>{_num(m.get("difference"), "+.3f")}'
                     f'</td><td>{n[0]}</td><td>{n[1]}</td><td>{_esc(m.get("test") or "-")}</td>'
                     f'<td>{_num(m.get("p_value"), ".4g")}</td><td>{_num(m.get("level"), ".4g")}'
                     f'</td><td>{_esc(said)}</td></tr>')
    if not cells:
        return '<p class="note">No per-measure figures on record for this verdict.</p>'
    return ('<table class="measures"><tr><th>measure</th><th>canary</th><th>stable</th>'
            '<th>difference</th><th>n canary</th><th>n stable</th><th>test</th>'
            '<th>p-value</th><th>level</th><th>verdict</th></tr>' + "".join(cells) + "</table>")


def serving_section(rows: list[dict]) -> str:
    """The report's Serving section: per generation the fleet touched (`history_rows`' `fleet`,
    flows/orchestration/fleet.py `history`), newest first: where it serves now or why it left,
    each production gate verdict with its figures, each push with its times per replica, and
    the changes of champion away from it. Without a fleet, one line saying so.
    """
    touched = [r for r in reversed(rows) if r.get("fleet")]
    if not touched:
        return ('<p class="note" id="serving">No fleet: <code>runtime.fleet.urls</code> names no '
                'server, so no generation was pushed to one (README, "The fleet").</p>')
    backs = [b for r in rows for b in r.get("rollbacks") or []]
    parts = []
    for r in touched:
        fleet = r["fleet"]
        parts.append(f'<div class="serving" id="serving-{r["tag"]}"><h3>{r["tag"]}: '
                     f'{_esc(fleet["serving"])}</h3><p>{_esc(fleet["line"])}</p>')
        for gate in fleet["gates"]:
            counts = gate.get("traces") or {}
            left = gate.get("left_out")
            parts.append(
                f'<p class="gate">Production gate {_esc(gate["at"])}: <b>{_esc(gate["status"])}'
                f'</b> ({_esc(gate["version"])} canary vs {_esc(gate["stable"])} stable, live '
                f'traces {counts.get("canary", "-")} and {counts.get("stable", "-")}'
                + (f'; left out: {_esc(", ".join(f"{k} {v}" for k, v in left.items()))}'
                   if left else "")
                + (f'; alpha {gate["alpha"]} split over the measures decided'
                   if gate.get("alpha") is not None else "")
                + f'). {_esc(gate["reason"])}</p>' + _measures_table(gate))
            after = []
            if gate.get("pushed"):
                after.append(f"the rest of the fleet took {gate['version']}: "
                             f"{', '.join(gate['pushed'])}")
            if gate.get("restored"):
                after.append("the canary's replicas: " + "; ".join(
                    f"{url}: {what}" for url, what in gate["restored"].items()))
            if gate.get("champion"):
                after.append(f"champion: {gate['champion']}")
            if after:
                parts.append(f'<p class="note">Then: {_esc("; ".join(after))}.</p>')
        pushes = []
        for push in fleet["pushes"]:
            for url, done in push["replicas"].items():
                pushes.append(f'<tr><td>{_esc(push["at"])}</td><td>{_esc(url)}</td>'
                              f'<td>{_esc(done["since"])}</td><td>{done["update_seconds"]:.2f}'
                              f'</td><td>{done["verify_seconds"]:.2f}</td><td>verified</td>'
                              f'<td>{_esc(push.get("reason") or "")}</td></tr>')
            if push.get("failed"):
                restored = "; ".join(f"{u}: {w}" for u, w in (push.get("restored") or {}).items())
                pushes.append(f'<tr class="rollback"><td>{_esc(push["at"])}</td>'
                              f'<td>{_esc(push["failed"])}</td><td>-</td><td>-</td><td>-</td>'
                              f'<td>FAILED: {_esc(push["error"])}'
                              f'{"; restored: " + _esc(restored) if restored else ""}</td>'
                              f'<td>{_esc(push.get("reason") or "")}</td></tr>')
        if pushes:
            parts.append('<table class="pushes"><tr><th>pushed</th><th>replica</th>'
                         '<th>serving since</th><th>update s</th><th>verify s</th><th>result</th>'
                         '<th>why</th></tr>' + "".join(pushes) + "</table>")
        for back in (b for b in backs if b["from"] == r["tag"]):
            parts.append(f'<p class="rollback">Rollback {_esc(back["at"])}: champion '
                         f'{back["from"]} &rarr; {back["to"]} (model version '
                         f'{_esc(str(back["model_version"]))}) by '
                         f'{_esc(back["approver"] or "unknown")}: {_esc(back["reason"] or "")}</p>')
        parts.append("</div>")
    return "\n".join(parts)


def _img(element_id: str, alt: str, src: str | None, missing: str) -> str:
    if src is None:
        return f'<p class="note">{missing}</p>'
    return f'<div class="box"><img id="{element_id}" alt="{_esc(alt)}" src="{src}"></div>'


def collect_note(root: Path) -> str:
    """The report's line on traces received live: the counters of the `offseason collect`
    running at `runtime.collect`'s address, or that none answers there and how to start one.
    """
    import os

    from flows.intake import collect
    from flows.project.workspace import WorkspaceError
    from stages import config as cfg

    settings = cfg.collect(root / "params.yaml")
    url = collect.status_url(settings)
    try:
        found = collect.read_status(url, os.environ.get(settings.token_env, ""))
    except collect.NotRunning:  # most projects drop files into the inbox: not an error
        return (f"Traces in live: no `offseason collect` is running at "
                f"{url.removesuffix('/status')} (`offseason collect`, or `offseason serve "
                f"--collect`, receives OTLP traces into the inbox)")
    except WorkspaceError as err:
        return (f"Traces in live: {err} (`offseason collect`, or `offseason serve --collect`, "
                f"receives OTLP traces into the inbox)")
    return f"Traces in live, at {url.removesuffix('/status')}: {collect.status_text(found)}"


def html_report(root: Path, rows: list[dict], generation: str | None, out: Path) -> Path:
    """reports/index.html: plots as PNG data URIs and the graph as inline SVG, the Data Docs
    copied beside it (`data-docs/`), links to each generation's MLflow run and Prefect flow run.
    """
    import datetime as dt

    from flows.audit import lineage
    from flows.project.workspace import read_at
    from stages import io

    if not rows:
        raise lineage.LineageError("no generations yet; run `offseason init` and a cycle first")
    cycles = per_cycle(root, rows)
    tag = generation or rows[-1]["tag"]
    chain = lineage.lineage(root, tag, with_mlflow=False)
    links = run_links(root, rows)
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    fleet = any(r.get("fleet") for r in rows)  # no fleet: the table as it was
    span = 11 if fleet else 10
    table = []
    for r in rows:
        interval = _interval(r["difference_interval"])
        found = links.get(r["tag"], {})
        runs = " · ".join(f'<a class="{kind}" href="{_esc(found[kind])}">{label}</a>'
                          for kind, label in (("mlflow", "MLflow"), ("prefect", "Prefect"))
                          if kind in found) or "-"
        table.append(f'<tr class="{"champion" if r["champion"] else ""}"><td>{r["tag"]}'
                     f'{" *" if r["champion"] else ""}</td><td>{r["date"]}</td>'
                     f'<td>{"-" if r["new_traces"] is None else r["new_traces"]}</td>'
                     f'<td>{fmt(r["score"])}</td><td>{fmt(r["champion_score"])}</td>'
                     f'<td>{interval}</td><td>{r["verdict"]}</td><td>{r["model_version"]}</td>'
                     f'<td>{"-" if r.get("cost_usd") is None else format(r["cost_usd"], ".4f")}'
                     f'</td><td>{"-" if r.get("points_per_usd") is None else format(r["points_per_usd"], ".0f")}'
                     f'</td><td>{_esc(r.get("approver") or "")}</td>'
                     + (f'<td class="serving" title="{_esc(r["fleet"]["line"])}">'
                        f'{_esc(r["serving"])}</td>' if r.get("fleet") else
                        "<td>-</td>" if fleet else "")
                     + f'<td>{runs}</td></tr>')
        for flag in r.get("flagged") or []:  # erase.models: flag, on the record
            table.append(f'<tr class="flagged"><td>flagged</td><td>{flag["date"]}</td>'
                         f'<td colspan="{span}">{r["tag"]} learned from traces erased by '
                         f'{_esc(flag["erasure"])} (erase.models: flag)</td></tr>')
        for back in r.get("rollbacks") or []:  # every change of champion, on the record
            table.append(f'<tr class="rollback"><td>rollback</td><td>{back["date"]}</td>'
                         f'<td colspan="{span}">champion {back["from"]} &rarr; {back["to"]} (model '
                         f'version {_esc(str(back["model_version"]))}) by '
                         f'{_esc(back["approver"] or "unknown")}: {_esc(back["reason"] or "")}'
                         f'</td></tr>')
    champion = next((r for r in rows if r["champion"]), rows[0])
    summary = (f"{len(rows)} generations; the champion is {champion['tag']} (model version "
               f"{champion['model_version']}, pass@1 {fmt(champion['score'])}).")
    docs = copy_data_docs(root, out.parent)
    top = [f'<a id="link-data-docs" href="{docs}">Data Docs</a> of the latest cycle (Great '
           f'Expectations, copied beside this page)' if docs else
           "No Data Docs yet (the validate stage writes them)"]
    if links:
        top.append(f'<a id="link-mlflow" href="{_esc(mlflow_ui_url())}">MLflow</a>')
        top.append(f'<a id="link-prefect" href="{_esc(prefect_ui_url())}">Prefect</a>')
    run_note = (f"Runs: each cycle's MLflow run (at {_esc(mlflow_ui_url())}) and Prefect flow run "
                f"(at {_esc(prefect_ui_url())}). With MLflow and Prefect embedded (the "
                f"defaults), <code>offseason ui</code> serves them at 127.0.0.1:5000 and "
                f":4200." if links else
                "No MLflow runs in this workspace: no links to runs.")
    ledger_tag = next((r["tag"] for r in reversed(rows) if r.get("cost_usd") is not None), None)
    ledger = read_at(root, ledger_tag, "metrics/cost.json") if ledger_tag else None
    curves = training_curves(root, rows)
    reward_curves = training_curves(root, rows, "reward_mean")
    if cycles:
        rewards = _img("plot-rewards", "reward distribution per cycle", reward_plot(cycles), "")
        quarantine = _img("plot-quarantine", "quarantine rates per cycle",
                          quarantine_plot(cycles), "")
    else:
        rewards = quarantine = '<p class="note">No cycle yet (only generation 0).</p>'
    lineage_text = (f"{_esc(chain['message'])}. Learned from {len(chain['training_traces'])} "
                    f"traces of {len(chain['inbox_files'])} inbox file(s); started from "
                    f"{(chain.get('started_from') or {}).get('tag') or '-'}.")
    svg, layout = lineage_svg(chain)
    page = PAGE.format(
        workspace=_esc(root.name), summary=_esc(summary), links=" · ".join(top),
        rows="\n".join(table), run_note=run_note,
        serving_th="<th>serving</th>" if fleet else "", serving=serving_section(rows), collect=_esc(collect_note(root)),
        scores=score_plot(rows),
        gain=_img("plot-gain", "cumulative gain against cumulative spend per generation",
                  gain_plot(rows), "No cycle has a cost ledger (metrics/cost.json) yet."),
        stage_cost=_img("plot-stage-cost", f"cost per stage of {ledger_tag}",
                        stage_cost_plot(ledger, ledger_tag) if ledger else None, "") + (
            f'<p class="note" id="estimate">{_esc(ledger_tag)}: '
            f'{_esc(estimate_line(ledger))}</p>' if ledger else ""),
        training=_img("plot-training", "training loss per step per generation",
                      training_plot(curves, reward_curves) if curves else None,
                      "No generation trained yet (metrics/train_steps.csv)."),
        rewards=rewards, quarantine=quarantine, lineage_tag=tag, lineage_text=lineage_text,
        svg=svg, layout=layout, at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    io.write_text(out, page)
    return out


def plot_history(rows: list[dict], path: Path) -> None:
    """Pass@1 per generation: each candidate (filled if promoted) and the champion it faced."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(7, 4))
    champions = champion_after(rows)
    ax.step(x, champions, where="post", color="tab:gray",
            label="champion after the cycle")
    for i, row in enumerate(rows):
        low_high = row["difference_interval"]
        if low_high and row["champion_score"] is not None:
            # the interval of the difference, drawn around the champion it was measured against
            ax.vlines(i, row["champion_score"] + low_high[0], row["champion_score"] + low_high[1],
                      color="tab:blue", alpha=0.4, linewidth=6)
        if row["score"] is not None:  # (a generation made without a benchmark run: no point)
            ax.plot(i, row["score"], "o", color="tab:blue",
                    fillstyle="full" if row["promoted"] else "none", markersize=9)
    ax.plot([], [], "o", color="tab:blue", label="candidate (hollow: rejected)")
    ax.plot([], [], color="tab:blue", alpha=0.4, linewidth=6,
            label="gate interval, champion + difference")
    for i, row in enumerate(rows):
        for back in row.get("rollbacks") or []:  # the champion changed between two cycles
            at = 0.0 if champions[i] is None else champions[i]  # (a champion never scored)
            ax.plot(i + 0.5, at, "v", color="tab:red", markersize=9)
            ax.annotate(f"rollback to {back['to']}", (i + 0.5, at),
                        textcoords="offset points", xytext=(4, 6), fontsize=8, color="tab:red")
    if any(row.get("rollbacks") for row in rows):
        ax.plot([], [], "v", color="tab:red", label="rollback (offseason rollback)")
    ax.set_xticks(x, [r["tag"] for r in rows])
    ax.set_ylabel("pass@1 on the held-out benchmark")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)

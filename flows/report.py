"""The cycle report: what came in, what was quarantined, rewards, training, the gate, the decision.

`publish()` is called by the cycle flow at the end of a cycle that reached the gate: it attaches to
the Prefect flow run a markdown artifact (`cycle-report`) and a table artifact of every stage's
numeric metrics (`cycle-metrics`), with links to the cycle's MLflow run and to Great Expectations'
Data Docs. `markdown()` and `metrics_table()` are plain functions of the metrics files, so the same
text can be rebuilt for any tagged generation.

Links to the MLflow UI use `MLFLOW_TRACKING_URI` when it is an http(s) server, otherwise
`OFFSEASON_MLFLOW_UI_URL` (default `http://127.0.0.1:5000`, where `offseason ui` starts it).
"""

from __future__ import annotations

import os
from pathlib import Path

from flows import tracking

STAGES = ["ingest", "validate", "rollout", "reward", "train", "gate"]
MLFLOW_UI = "http://127.0.0.1:5000"


def mlflow_ui_url() -> str:
    """The MLflow UI's base URL: the tracking server, else the local UI."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri.startswith(("http://", "https://")):
        return uri.rstrip("/")
    return os.environ.get("OFFSEASON_MLFLOW_UI_URL", MLFLOW_UI).rstrip("/")


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
    text = (f"{train.get('examples')} new verified examples + {train.get('replayed', 0)} replayed, "
            f"{train.get('steps')} steps, final loss {_num(train.get('final_loss'), '.4f')}, "
            f"{train.get('tokens_per_second')} tokens/s in {train.get('train_seconds')} s")
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
    from flows.lineage import how

    lines = [f"- **Gate** ({how(gate)}): candidate "
             f"{_num(gate.get('candidate_score'))} vs champion {_num(gate.get('champion_score'))}, "
             f"difference {_num(gate.get('difference'), '+.3f')} in "
             f"{_interval(gate.get('interval'))}: **{'pass' if gate.get('passed') else 'fail'}** "
             f"({gate.get('reason')})"]
    if gate.get("rule"):
        lines.append(f"  - rule: {gate['rule']}")
    # per-suite verdicts, when the gate scores several suites
    for name, suite in (gate.get("suites") or {}).items():
        if isinstance(suite, dict):
            lines.append(f"  - suite `{name}`: candidate "
                         f"{_num(suite.get('candidate', suite.get('candidate_score')))} vs "
                         f"champion {_num(suite.get('champion', suite.get('champion_score')))}, "
                         f"difference interval {_interval(suite.get('interval'))}"
                         f"{': ' + str(suite['reason']) if suite.get('reason') else ''}")
    # the reward-hacking guards (length, format, tool_ok, hacking), failed ones marked
    for name, guard in (gate.get("guards") or {}).items():
        if isinstance(guard, dict) and not guard.get("skipped"):
            lines.append(f"  - guard `{name}`{'' if guard.get('passed') else ' **failed**'}: "
                         f"candidate {_num(guard.get('candidate'))} vs champion "
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
    # the person's decision, as flows/promotion.py records it (absent when none was asked for)
    chosen = record.get("decision") or {}
    if chosen.get("decision") in ("approved", "rejected"):
        words += (f" ({chosen['decision']} by {chosen.get('approver')}"
                  f"{': ' + chosen['reason'] if chosen.get('reason') else ''})")
    return words


def markdown(root: Path, generation: int, metrics: dict, record: dict, *,
             experiment_id: str | None = None, run_id: str | None = None) -> str:
    """The cycle report of a generation as Markdown."""
    ingest, validate, reward, train, gate = (metrics.get(s, {}) for s in
                                             ("ingest", "validate", "reward", "train", "gate"))
    drift = validate.get("drift", {})
    docs = root / "data" / "docs" / "index.html"
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
        f"- **Data Docs** (Great Expectations): [{docs}]({docs.as_uri()})",
        "",
        "## Learning",
        f"- **Rewards**: mean {reward.get('mean_reward')}, pass@k {reward.get('pass_at_k')} over "
        f"{reward.get('episodes')} episodes ({reward.get('judged')} judged, "
        f"{reward.get('unjudgeable', 0)} unjudgeable); suspected reward hacks: "
        f"{hacks_line(reward)}",
        f"- **Training**: {training_summary(train)}",
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


def metrics_table(metrics: dict, reran: dict) -> list[dict]:
    """One row per stage: whether it reran and its top-level numeric metrics."""
    return [{"stage": s, "reran": reran.get(s),
             **{k: v for k, v in tracking.numeric(metrics.get(s, {})).items() if "." not in k}}
            for s in STAGES]


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
                          description=f"gen-{generation}")
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
    from flows import lineage
    from flows.workspace import read_at

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


def lineage_svg(chain: dict) -> str:
    """The generation's graph as SVG: inputs -> stages -> outputs, by DVC hash, code left out."""
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
    columns: dict[int, list[tuple[str, str, str]]] = {}  # col -> [(id, kind, label, ...)]
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
    for key, (col, kind, label, md5) in nodes.items():
        columns.setdefault(col, []).append(key)
    start = chain.get("started_from") or {}
    if start.get("tag") and "data:models/champion" in nodes:
        col, kind, label, md5 = nodes["data:models/champion"]
        nodes["data:models/champion"] = (col, "data", f"models/champion = {start['tag']}", md5)
    gate = chain.get("gate") or {}
    result = f"{chain['tag']}: model version {chain['model_version']}"
    last = max(columns) + 1
    nodes["result"] = (last, "result", result,
                       f"gate {'pass' if gate.get('passed') else 'fail'}, "
                       f"{'promoted' if chain['promoted'] else 'not promoted'}")
    columns[last] = ["result"]
    if "stage:gate" in nodes:
        edges.append(("stage:gate", "result"))
    # top to bottom: one row per column of the dependency order, nodes side by side in a row
    box_w, box_h, gap_x, row_h = 176, 40, 14, 74
    widest = max(len(v) for v in columns.values())
    width = widest * (box_w + gap_x) + 20
    height = (last + 1) * row_h + 10
    pos = {}
    for col, keys in columns.items():
        left = (width - len(keys) * (box_w + gap_x)) / 2
        for i, key in enumerate(sorted(keys)):
            pos[key] = (left + i * (box_w + gap_x), 10 + col * row_h)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" id="lineage-graph" '
             f'width="{width:.0f}" height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" '
             f'font-family="sans-serif" font-size="11">',
             '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
             'markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#888"/></marker>'
             '</defs>']
    for a, b in edges:
        (x1, y1), (x2, y2) = pos[a], pos[b]
        x1, y1, x2, y2 = x1 + box_w / 2, y1 + box_h, x2 + box_w / 2, y2
        mid = (y1 + y2) / 2
        parts.append(f'<path class="edge" d="M{x1:.0f},{y1:.0f} C{x1:.0f},{mid:.0f} '
                     f'{x2:.0f},{mid:.0f} {x2:.0f},{y2:.0f}" fill="none" stroke="#888" '
                     f'marker-end="url(#arrow)"/>')
    colors = {"stage": ("#dbe9f6", "#2c6fad"), "data": ("#f4f4f4", "#777"),
              "result": ("#dff3e0" if chain["promoted"] else "#f8e0e0", "#444")}
    for key, (col, kind, label, md5) in nodes.items():
        x, y = pos[key]
        fill, stroke = colors[kind]
        radius = 20 if kind == "stage" else 5
        parts.append(f'<g class="node {kind}"><title>{_esc(label)} {_esc(md5)}</title>'
                     f'<rect x="{x:.0f}" y="{y:.0f}" width="{box_w}" height="{box_h}" '
                     f'rx="{radius}" fill="{fill}" stroke="{stroke}"/>'
                     f'<text x="{x + box_w / 2:.0f}" y="{y + (17 if md5 else 24):.0f}" text-anchor="middle" '
                     f'font-weight="{"bold" if kind != "data" else "normal"}">'
                     f'{_esc(label[:30])}</text>'
                     f'<text x="{x + box_w / 2:.0f}" y="{y + 32:.0f}" text-anchor="middle" '
                     f'fill="#666" font-size="9">{_esc(md5[:26])}</text></g>')
    parts.append("</svg>")
    return "".join(parts)


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>offseason report</title>
<style>
body {{ font-family: sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
h1 {{ font-size: 1.6em; }} h2 {{ font-size: 1.2em; margin-top: 2em; }}
table {{ border-collapse: collapse; font-size: 0.9em; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 4px 10px; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
.champion {{ font-weight: bold; background: #eef7ee; }}
.scroll {{ overflow-x: auto; border: 1px solid #eee; padding: 8px; }}
</style></head><body>
<h1>offseason: {workspace}</h1>
<p>{summary}</p>
<h2>Generations</h2>
<table id="history"><tr><th>generation</th><th>date</th><th>traces</th><th>pass@1</th>
<th>vs champion</th><th>interval of difference</th><th>verdict</th><th>version</th>
<th>approver</th></tr>
{rows}
</table>
<h2>Benchmark score per generation</h2>
<img id="plot-scores" alt="pass@1 per generation with the gate's intervals" src="{scores}">
<h2>Reward distribution per cycle</h2>
{rewards}
<h2>Quarantine rates per cycle</h2>
{quarantine}
<h2>Lineage of {lineage_tag}</h2>
<p>{lineage_text}</p>
<div class="scroll">{svg}</div>
<p style="color:#777">Written by <code>offseason report</code> at {at}. Full chain: <code>offseason
lineage {lineage_tag}</code>; integrity: <code>offseason lineage --verify {lineage_tag}</code>.</p>
</body></html>
"""


def html_report(root: Path, rows: list[dict], generation: str | None, out: Path) -> Path:
    """reports/index.html: one self-contained page (plots as PNG data URIs, the graph as SVG)."""
    import datetime as dt

    from flows import lineage
    from stages import io

    if not rows:
        raise lineage.LineageError("no generations yet; run `offseason init` and a cycle first")
    cycles = per_cycle(root, rows)
    tag = generation or rows[-1]["tag"]
    chain = lineage.lineage(root, tag, with_mlflow=False)
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    table = []
    for r in rows:
        interval = _interval(r["difference_interval"])
        table.append(f'<tr class="{"champion" if r["champion"] else ""}"><td>{r["tag"]}'
                     f'{" *" if r["champion"] else ""}</td><td>{r["date"]}</td>'
                     f'<td>{"-" if r["new_traces"] is None else r["new_traces"]}</td>'
                     f'<td>{fmt(r["score"])}</td><td>{fmt(r["champion_score"])}</td>'
                     f'<td>{interval}</td><td>{r["verdict"]}</td><td>{r["model_version"]}</td>'
                     f'<td>{_esc(r.get("approver") or "")}</td></tr>')
    champion = next((r for r in rows if r["champion"]), rows[0])
    summary = (f"{len(rows)} generations; the champion is {champion['tag']} (model version "
               f"{champion['model_version']}, pass@1 {fmt(champion['score'])}).")
    if cycles:
        rewards = f'<img id="plot-rewards" alt="reward distribution per cycle" ' \
                  f'src="{reward_plot(cycles)}">'
        quarantine = f'<img id="plot-quarantine" alt="quarantine rates per cycle" ' \
                     f'src="{quarantine_plot(cycles)}">'
    else:
        rewards = quarantine = "<p>No cycle yet (only generation 0).</p>"
    lineage_text = (f"{_esc(chain['message'])}. Learned from {len(chain['training_traces'])} "
                    f"traces of {len(chain['inbox_files'])} inbox file(s); started from "
                    f"{(chain.get('started_from') or {}).get('tag') or '-'}.")
    page = PAGE.format(workspace=_esc(root.name), summary=_esc(summary), rows="\n".join(table),
                       scores=score_plot(rows), rewards=rewards, quarantine=quarantine,
                       lineage_tag=tag, lineage_text=lineage_text, svg=lineage_svg(chain),
                       at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    io.write_text(out, page)
    return out


def plot_history(rows: list[dict], path: Path) -> None:
    """Pass@1 per generation: each candidate (filled if promoted) and the champion it faced."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(7, 4))
    champion, line = None, []
    for row in rows:
        if row["promoted"]:
            champion = row["score"]
        line.append(champion)
    ax.step(x, line, where="post", color="tab:gray", label="champion after the cycle")
    for i, row in enumerate(rows):
        low_high = row["difference_interval"]
        if low_high and row["champion_score"] is not None:
            # the interval of the difference, drawn around the champion it was measured against
            ax.vlines(i, row["champion_score"] + low_high[0], row["champion_score"] + low_high[1],
                      color="tab:blue", alpha=0.4, linewidth=6)
        ax.plot(i, row["score"], "o", color="tab:blue",
                fillstyle="full" if row["promoted"] else "none", markersize=9)
    ax.plot([], [], "o", color="tab:blue", label="candidate (hollow: rejected)")
    ax.plot([], [], color="tab:blue", alpha=0.4, linewidth=6,
            label="gate interval, champion + difference")
    ax.set_xticks(x, [r["tag"] for r in rows])
    ax.set_ylabel("pass@1 on the held-out benchmark")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)

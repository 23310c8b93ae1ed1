"""The fleet: the champion's weights into the servers that answer users, verified, and back.

A promotion (after its approval) and a rollback end here when `runtime.fleet.urls` names
servers: the champion (`models/champion`, generation N) is copied to `.offseason/fleet/gen-N/`
(the servers read it there: a disk they share) and pushed to every replica as version `gen-N`
through `stages/weights.py`, one replica at a time, each verified (the version it reports and
probe prompts answered token for token as the champion answers them here) before the next. A
replica that fails goes back to the generation it served, verified, and the push stops, named:
the fleet is never left on two versions without saying so. The last `runtime.fleet.keep`
generations stay on disk, so a rollback is a push of a folder already there.

With `runtime.fleet.canary`, a promotion reaches the first replicas only (`start_canary`); the
production gate (`judge`: `stages/live_gate.py` on the ingested live traces, each attributed by
the model name its answer carries) then sends the rest of the fleet after it, or puts the
canary and the champion back on the stable generation. `before_cycle` runs it first thing in
every cycle (flows/orchestration/pipeline.py `begin`).

Writes `.offseason/fleet.json` (what each replica serves, since when, verified; the canary and
the last verdict) and appends each push and verdict to `.offseason/fleet.jsonl`; canary steps
also go to promotions.jsonl (committed) and the MLflow model version. `history` reads them all
back per generation for `offseason history` and the report's Serving section. `offseason fleet
status`, `offseason fleet push` and `offseason fleet judge` are its commands (docs/operations.md,
"The fleet's canary and production gate").
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from flows.orchestration import promotion
from stages import config as cfg
from stages import io, tinylm, weights

STATE = Path(".offseason") / "fleet.json"
LOG = Path(".offseason") / "fleet.jsonl"
FOLDERS = Path(".offseason") / "fleet"
PROBE_TOKENS = 8


def replicas(config: cfg.Fleet) -> list[weights.Replica]:
    """The replicas `runtime.fleet` names."""
    return [weights.Replica(url=url, kind=config.kind, mode=config.mode, model=config.model,
                            token_env=config.token_env) for url in config.url_list]


def read_state(root: Path) -> dict:
    """`.offseason/fleet.json`: {"replicas": {url: {version, since, verified, ...}}}."""
    path = root / STATE
    return json.loads(path.read_text()) if path.is_file() else {"replicas": {}}


def probe_prompts(tokenizer, root: Path, count: int = 3) -> list[list[int]]:
    """Probe prompts: the first benchmark questions of the first environment with a benchmark,
    through the model's chat template (what the fleet is asked), else fixed words.
    """
    questions = []
    for spec in cfg.environments(root / "params.yaml").values():
        if spec.benchmark and (root / spec.benchmark).is_file():
            for line in (root / spec.benchmark).read_text().splitlines()[:count]:
                messages = json.loads(line).get("messages")
                if messages:
                    questions.append(messages)
            break
    questions = questions or [[{"role": "user", "content": w}] for w in ("hello", "2+2", "why")]
    prompts = []
    for messages in questions[:count]:
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        except Exception:  # noqa: BLE001 - a template without a chat format: the plain text
            ids = tokenizer(messages[-1]["content"])["input_ids"]
        prompts.append(list(ids))
    return prompts


def _folder(root: Path, version: str, keep: int) -> Path:
    """The champion's weights at `.offseason/fleet/<version>/` (copied once), older ones pruned
    beyond `keep` (the newest kept, by the time they were written), never one a replica serves
    or a baking canary's stable arm (what a failed production gate puts back).
    """
    base = root / FOLDERS
    folder = base / version
    if not folder.is_dir():
        tmp = base / f"{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(root / "models" / "champion", tmp)
        tmp.rename(folder)
    kept = sorted((p for p in base.iterdir() if p.is_dir() and not p.name.endswith(".tmp")),
                  key=lambda p: p.stat().st_mtime)
    state = read_state(root)
    held = {r.get("version") for r in state["replicas"].values()} | {
        (state.get("canary") or {}).get("stable")}
    for old in kept[:-keep]:
        if old != folder and old.name not in held:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def push(root: Path, config: cfg.Fleet, reason: str = "", urls: list[str] | None = None
         ) -> dict:
    """The champion to every replica (or those of `urls`), verified; returns the log entry
    (also appended to `.offseason/fleet.jsonl`). Raises `weights.PushFailed` (after putting the
    replicas already moved back on their earlier version) when a replica fails. A push to the
    whole fleet ends any canary (`start_canary`).
    """
    generation = promotion.champion_generation(root)
    version = f"gen-{generation}"
    folder = _folder(root, version, config.keep)
    model, tokenizer = tinylm.load(folder)
    prompts = probe_prompts(tokenizer, root)
    state = read_state(root)
    started = time.monotonic()
    entry = {"at": promotion.now(), "version": version, "reason": reason, "replicas": {}}
    moved = []

    def record(pushed: weights.Pushed) -> None:  # each replica as it is verified
        url = pushed.replica.url
        moved.append((pushed.replica, state["replicas"].get(url, {}).get("version")))
        state["replicas"][url] = entry["replicas"][url] = {
            "version": version, "since": promotion.now(), "verified": True,
            "update_seconds": round(pushed.update_seconds, 3),
            "verify_seconds": round(pushed.verify_seconds, 3)}
        io.write_json(root / STATE, state)

    try:
        weights.push_verified([r for r in replicas(config) if urls is None or r.url in urls],
                              folder, version, model, prompts, PROBE_TOKENS, on_each=record)
    except weights.PushFailed as err:
        failed = err.replica
        entry.update(failed=failed.url, error=str(err))
        state["replicas"][failed.url] = {
            **state["replicas"].get(failed.url, {}), "verified": False,
            "error": str(err), "since": promotion.now()}
        # the failed replica (its update is not transactional) and those already moved go back
        back = [(failed, state["replicas"][failed.url].get("version"))] + moved[::-1]
        entry["restored"] = _restore(root, state, back)
        io.write_json(root / STATE, state)
        _log(root, entry)
        raise weights.PushFailed(failed, f"{str(err).split(': ', 1)[-1]}; the fleet stays on "
                                         f"its earlier weights ({_said(entry['restored'])})"
                                 ) from err
    entry["seconds"] = round(time.monotonic() - started, 3)
    if urls is None and state.pop("canary", None) is not None:
        entry["canary_ended"] = True
        io.write_json(root / STATE, state)
    _log(root, entry)
    if urls is None:  # a canary's partial pushes are tagged by its own steps
        _tag_model_version(root, entry)
    return entry


class NoCanary(RuntimeError):
    """A canary that cannot be judged (its traces could not be told from the stable ones'),
    or whose stable arm is not one verified generation; the message says what to change.
    """


def start_canary(root: Path, config: cfg.Fleet, reason: str = "") -> dict:
    """The champion to the first `runtime.fleet.canary` replicas only, verified; the rest stay
    on the generation they serve (stable) until `judge` decides. Records the canary in
    `.offseason/fleet.json`, `.offseason/fleet.jsonl`, promotions.jsonl (committed) and on the
    MLflow model version. A canary still baking is replaced (the stable arm stays the same).
    A fleet never pushed to has no stable arm to compare with: the whole fleet is pushed (said
    in the entry's `canary`). Raises NoCanary before pushing anything when the arms cannot be
    told apart in the traces, PushFailed (the canary replicas back on stable) when a push fails.
    """
    every = replicas(config)
    first, rest = every[:config.canary], every[config.canary:]
    state = read_state(root)
    version = f"gen-{promotion.champion_generation(root)}"
    pending = state.get("canary")
    if pending:
        stable = pending["stable"]
    else:
        served = {(state["replicas"].get(r.url, {}).get("version"),
                   state["replicas"].get(r.url, {}).get("verified", False)) for r in rest}
        if served == {(None, False)} or {v for v, _ in served} == {version}:
            entry = push(root, config, reason)  # nothing to compare with, or nothing new
            entry["canary"] = "none: " + ("the fleet served nothing yet" if version not in
                                          {v for v, _ in served} else f"it serves {version}")
            return entry
        if len(served) != 1 or not next(iter(served))[1]:
            raise NoCanary(f"the stable replicas ({', '.join(r.url for r in rest)}) serve "
                           f"{sorted(str(v) for v, _ in served)}, not one verified generation "
                           f"to compare a canary with; `offseason fleet push` puts the "
                           f"champion on every replica")
        stable = next(iter(served))[0]
    names = {"canary": sorted({weights.response_name(r) for r in first}),
             "stable": sorted({weights.response_name(r) for r in rest})}
    if set(names["canary"]) & set(names["stable"]):
        raise NoCanary(f"the canary's traces could not be told from the stable replicas': they "
                       f"all answer as {sorted(set(names['canary']) & set(names['stable']))}; "
                       f"start each replica with a name of its own first (vLLM: "
                       f"`--served-model-name {config.model or 'policy'}-a "
                       f"{config.model or 'policy'}`: agents keep calling the shared name, and "
                       f"the answers, so the traces, carry the replica's), or set "
                       f"runtime.fleet.canary: 0")
    entry = push(root, config, reason, urls=[r.url for r in first])
    state = read_state(root)
    state["canary"] = {"version": version, "generation": int(version[4:]), "stable": stable,
                       "replicas": [r.url for r in first], "of": len(every), "names": names,
                       "since": promotion.now(), "bake": config.bake}
    io.write_json(root / STATE, state)
    entry["canary"] = state["canary"]
    _record(root, {"action": "canary", "generation": int(version[4:]), "version": version,
                   "stable": stable, "replicas": len(first), "of": len(every),
                   "reason": reason or "promoted"},
            f"canary: {version} on {len(first)} of {len(every)} replicas (stable {stable})")
    return entry


def judge(root: Path, config: cfg.Fleet) -> dict:
    """The production gate on the canary (`start_canary`), once `runtime.fleet.bake` live
    traces are in on each arm (`stages/live_gate.py`). Pass: the champion to the rest of the
    fleet. Fail: the canary replicas back on the stable generation, verified, and the champion
    alias and weights back on it (`offseason rollback`'s own steps, with the verdict as the
    reason). Returns {"status": none | baking | passed | failed | ended, ...}; each decision
    lands in `.offseason/fleet.json`, `.offseason/fleet.jsonl`, promotions.jsonl (committed)
    and on the MLflow model version.
    """
    from stages import live_gate

    state = read_state(root)
    pending = state.get("canary")
    if not pending:
        return {"status": "none"}
    if promotion.champion_generation(root) != pending["generation"]:
        # a rollback or another champion since: the canary's generation is no longer the one
        # to judge; the replicas serve what the last push left
        state.pop("canary")
        io.write_json(root / STATE, state)
        return {"status": "ended", "reason": f"{pending['version']} is no longer the champion"}
    verdict = {**live_gate.judge(root, pending, config.bake), "version": pending["version"],
               "stable": pending["stable"], "at": promotion.now()}
    if verdict["status"] == "baking":
        state["canary"]["traces"] = verdict["traces"]
        io.write_json(root / STATE, state)
        return verdict
    every = replicas(config)
    if verdict["status"] == "passed":
        entry = push(root, config, f"production gate passed: {verdict['reason']}",
                     urls=[r.url for r in every if r.url not in pending["replicas"]])
        verdict["pushed"] = list(entry["replicas"])
        state = read_state(root)
        state.pop("canary", None)
    else:
        state = read_state(root)
        back = [(r, pending["stable"]) for r in every if r.url in pending["replicas"]]
        verdict["restored"] = _restore(root, state, back)
        for url, what in verdict["restored"].items():  # said where status reads it
            if not what.endswith(" verified"):
                state["replicas"][url] = {**state["replicas"].get(url, {}), "verified": False,
                                          "error": what, "since": promotion.now()}
        state.pop("canary", None)
        io.write_json(root / STATE, state)
        verdict["champion"] = _champion_back(root, pending, verdict["reason"])
    state["production_gate"] = {k: verdict[k] for k in
                                ("status", "version", "stable", "at", "reason", "traces")}
    io.write_json(root / STATE, state)
    _log(root, {"at": verdict["at"], "step": "production-gate", **verdict})
    _record(root, {"action": "production-gate", "generation": pending["generation"],
                   "version": pending["version"], "stable": pending["stable"],
                   "outcome": verdict["status"], "reason": verdict["reason"],
                   "traces": verdict["traces"],
                   # its figures, committed: a clone without .offseason/ still shows them
                   "alpha": verdict["alpha"], "measures": verdict["measures"],
                   "restored": verdict.get("restored"), "pushed": verdict.get("pushed")},
            f"production gate: {pending['version']} {verdict['status']} on live traffic "
            f"({verdict['reason'][:200]})")
    return verdict


def before_cycle(root: Path) -> str:
    """The production gate where a nightly schedule meets it: first thing in each cycle
    (`pipeline.begin`, before any stage reads the champion), when the fleet bakes a canary.
    Returns what it did, in a line ("" when no canary bakes); a push that fails is said, not
    raised: the cycle goes on.
    """
    config = cfg.fleet(root / "params.yaml")
    if not config.url_list or not read_state(root).get("canary"):
        return ""
    try:
        verdict = judge(root, config)
    except weights.PushFailed as err:
        return (f"production gate: the push after its verdict failed: {err}; `offseason fleet "
                f"status` shows each replica")
    return said(verdict)


def said(verdict: dict) -> str:
    """The production gate's verdict (`judge`) in a line."""
    if verdict["status"] == "none":
        return "production gate: no canary is baking"
    if verdict["status"] == "ended":
        return f"production gate: the canary ended: {verdict['reason']}"
    counts = verdict["traces"]
    head = (f"production gate: {verdict['version']} (canary) vs {verdict['stable']} (stable), "
            f"live traces {counts['canary']} and {counts['stable']}")
    if verdict["status"] == "baking":
        return f"{head} of {verdict['bake']} each: baking"
    if verdict["status"] == "passed":
        return f"{head}: PASSED ({verdict['reason']}); the whole fleet serves {verdict['version']}"
    return (f"{head}: FAILED ({verdict['reason']}); the canary replicas are back on "
            f"{verdict['stable']} ({_said(verdict['restored'])}); champion: {verdict['champion']}")


def _champion_back(root: Path, pending: dict, reason: str) -> str:
    """The champion (weights, MLflow alias, promotions.jsonl) back on the stable generation,
    as `offseason rollback` does; returns what happened (a failure said, not raised: the
    replicas are back whatever the registry says).
    """
    try:
        entry = promotion.rollback(root, cfg.load("base", root / "params.yaml").registered_model,
                                   f"production gate failed: {reason}", "production gate",
                                   to=int(pending["stable"][4:]))
    except Exception as err:  # noqa: BLE001 - the serving side is already restored
        return f"not rolled back: {type(err).__name__}: {err}"
    return f"{pending['stable']} is the champion again (model version {entry['model_version']})"


def _record(root: Path, entry: dict, message: str) -> None:
    """A fleet step in promotions.jsonl, committed (a cycle restores the log as committed), with
    the champion it leaves (the log's last entry must name it: `promotion.recover_alias`), and
    on the MLflow model version of its generation.
    """
    entries = promotion.log_entries(root)
    last = next((e for e in reversed(entries) if "champion_version" in e), {})
    entry = {**entry, "at": promotion.now(), "champion_version": last.get("champion_version"),
             "champion_generation": last.get("champion_generation")}
    log = root / promotion.LOG
    with promotion.Transaction() as tx:
        saved = log.read_bytes() if log.exists() else None
        tx.done("log", lambda: log.write_bytes(saved) if saved is not None else
                log.unlink(missing_ok=True))
        promotion.append_log(root, entry)
        promotion.commit(root, message, None, tx, [promotion.LOG])
    number = next((e.get("champion_version") for e in reversed(entries)
                   if e["action"] in ("init", "promote")
                   and e.get("champion_generation") == entry["generation"]), None)
    _tag(root, number, f"offseason.{entry['action']}", message)


def _tag(root: Path, number, key: str, text: str) -> None:
    import sys

    if number is None:
        return
    try:
        from mlflow import MlflowClient

        name = cfg.load("base", root / "params.yaml").registered_model
        MlflowClient().set_model_version_tag(name, str(number), key, text[:4000])
    except Exception as err:  # noqa: BLE001 - the registry is a record, the step is done
        print(f"fleet: the step stands, but MLflow was not told ({type(err).__name__}: {err})",
              file=sys.stderr)


def _tag_model_version(root: Path, entry: dict) -> None:
    """The MLflow model version of the generation pushed gets `offseason.fleet`: on how many
    replicas, verified, since when (the registry shows what serves users). Without a reachable
    MLflow the push still stands: said, not raised.
    """
    import sys

    changes = [e for e in promotion.log_entries(root)
               if e["action"] in ("init", "promote", "rollback")]
    number = changes[-1].get("champion_version") if changes else None
    if number is None:
        return
    try:
        from mlflow import MlflowClient

        name = cfg.load("base", root / "params.yaml").registered_model
        MlflowClient().set_model_version_tag(
            name, str(number), "offseason.fleet",
            f"{entry['version']} on {len(entry['replicas'])} replicas, verified, {entry['at']}")
    except Exception as err:  # noqa: BLE001 - the registry is a record, the push is done
        print(f"fleet: the push stands, but MLflow was not told ({type(err).__name__}: {err})",
              file=sys.stderr)


def _restore(root: Path, state: dict, back: list) -> dict:
    """Each (replica, version it served) back on that version, verified where its folder is
    still kept; returns {url: "<version> verified" | why not}.
    """
    said = {}
    for replica, version in back:
        folder = root / FOLDERS / version if version else None
        if folder is None or not folder.is_dir():
            said[replica.url] = f"not restored: no earlier version on record ({version})"
            continue
        try:
            model, tokenizer = tinylm.load(folder)
            weights.push_verified([replica], folder, version, model,
                                  probe_prompts(tokenizer, root), PROBE_TOKENS)
            state["replicas"][replica.url] = {"version": version, "since": promotion.now(),
                                              "verified": True}
            said[replica.url] = f"{version} verified"
        except weights.PushFailed as err:
            said[replica.url] = f"not restored: {err}"
    return said


def _said(restored: dict) -> str:
    return "; ".join(f"{url}: {what}" for url, what in restored.items()) or "none had moved"


def _log(root: Path, entry: dict) -> None:
    path = root / LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as out:
        out.write(json.dumps(entry) + "\n")


def status(root: Path, config: cfg.Fleet) -> list[dict]:
    """Per replica: what the record says it serves (version, since, verified) and what it
    reports now (`live`: its weight version, or why it cannot say).
    """
    state = read_state(root)
    rows = []
    for replica in replicas(config):
        record = state["replicas"].get(replica.url, {})
        try:
            live = weights.reported_version(replica)
        except weights.PushFailed as err:
            live = f"unreachable: {str(err).split(': ', 2)[-1][:120]}"
        rows.append({"url": replica.url, "version": record.get("version"),
                     "since": record.get("since"), "verified": record.get("verified", False),
                     "live": live, "error": record.get("error"),
                     "paused": weights.paused(replica)})
    return rows


def history(root: Path) -> dict[str, dict]:
    """What the fleet did with each generation, for `offseason history` and the report:
    {"gen-N": {"serving": a short label, "line": the same said in full, "pushes": its push
    entries, "gates": its production gate verdicts (with each measure's figures)}}, only for the
    generations the records name; {} for a project that never had a fleet. Reads
    `.offseason/fleet.json`, `.offseason/fleet.jsonl` and promotions.jsonl; writes nothing.
    """
    # the records speak for themselves; params.yaml adds the replicas never pushed to
    urls = cfg.fleet(root / "params.yaml").url_list if (root / "params.yaml").is_file() else []
    state = read_state(root)
    logged = io.read_jsonl(root / LOG) if (root / LOG).is_file() else []
    recorded = [e for e in promotion.log_entries(root)
                if e.get("action") in ("canary", "production-gate")]
    if not (urls or state["replicas"] or logged or recorded):
        return {}
    every = len(urls) or len(state["replicas"])
    pushes = [e for e in logged if "step" not in e]
    gates = [e for e in logged if e.get("step") == "production-gate"]
    # the committed record is the one a fresh clone has: its verdicts this checkout never logged
    for entry in recorded:
        if entry["action"] == "production-gate" and not any(
                g["version"] == entry["version"] and g["status"] == entry["outcome"]
                and g["at"] <= entry["at"] for g in gates):
            gates.append({**entry, "status": entry["outcome"]})
    gates.sort(key=lambda g: g["at"])
    versions = ({e["version"] for e in pushes + gates + recorded}
                | {r.get("version") for r in state["replicas"].values()}) - {None}
    out = {}
    for version in versions:
        mine = [p for p in pushes if p["version"] == version]
        judged = [g for g in gates if g["version"] == version]
        started = [e for e in recorded if e["action"] == "canary" and e["version"] == version]
        out[version] = {"pushes": mine, "gates": judged,
                        **_serving(version, state, every, mine, judged, pushes, started)}
    return out


def _serving(version: str, state: dict, every: int, mine: list[dict], judged: list[dict],
             pushes: list[dict], started: list[dict]) -> dict:
    """`history`'s label and line for one generation: where it is now, else why it left."""
    replicas = state["replicas"]
    on = sorted(url for url, r in replicas.items()
                if r.get("version") == version and r.get("verified"))
    broken = [f"{url} NOT verified ({_cut((r.get('error') or '-').removeprefix(url + ': '))})"
              for url, r in replicas.items() if r.get("version") == version
              and not r.get("verified")]
    canary = state.get("canary") or {}
    last = judged[-1] if judged else None
    if canary.get("version") == version:
        counts = canary.get("traces") or {}
        label = f"canary {len(on)}/{every}"
        line = (f"canary on {len(on)} of {every} since {canary['since']} (stable "
                f"{canary['stable']}); production gate: live traces {counts.get('canary', 0)} "
                f"and {counts.get('stable', 0)} of {canary['bake']} each so far")
    elif on:
        label = f"all {every}" if len(on) == every else f"{len(on)}/{every}"
        line = (f"all {every} replicas, verified" if len(on) == every else
                f"{len(on)} of {every} replicas, verified ({', '.join(on)})")
        line += f", since {max(replicas[url]['since'] for url in on)}"
        if last and last["status"] == "passed":
            line += f"; production gate passed {last['at']}"
    elif last and last["status"] == "failed":
        label = "put back"
        back = last.get("restored") or {}
        line = f"put back: production gate failed {last['at']} ({last['reason']})"
        if back and all(what.endswith(" verified") for what in back.values()):
            line += f"; {last['stable']} again on the canary ({', '.join(back)}), verified"
        elif back:  # the verdict stands; the replica's state is unknown until a push
            line += f"; the canary NOT put back ({_cut(_said(back))})"
    elif any(not p.get("failed") for p in mine):
        served = max(p["at"] for p in mine if not p.get("failed"))
        after = next((p for p in pushes if p["at"] >= served and p["version"] != version
                      and not p.get("failed")), None)
        label = "replaced"
        line = (f"replaced by {after['version']} from {after['at']}" if after else
                f"on no replica now (last pushed {served})")
    elif mine:
        label = "push failed"
        line = (f"push failed {mine[-1]['at']} ({_cut(mine[-1]['error'])}); the fleet stayed "
                f"on its earlier weights")
    elif started:  # committed, while this checkout has no .offseason/ to say where it is now
        label = "canary"
        line = (f"canary on {started[-1]['replicas']} of {started[-1]['of']} "
                f"{started[-1]['at']} (stable {started[-1]['stable']}); no record here "
                f"(.offseason/fleet.json) of where it serves now")
    else:
        label, line = "-", "never pushed"
    if broken:
        line += "; " + "; ".join(broken)
    return {"serving": label, "line": line}


def _cut(text: str, most: int = 160) -> str:
    return text if len(text) <= most else text[:most - 1] + "…"

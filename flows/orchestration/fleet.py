"""The fleet: the champion's weights into the servers that answer users, verified, and back.

A promotion (after its approval) and a rollback end here when `runtime.fleet.urls` names
servers: the champion (`models/champion`, generation N) is copied to `.offseason/fleet/gen-N/`
(the servers read it there: a disk they share) and pushed to every replica as version `gen-N`
through `stages/weights.py`, one replica at a time, each verified (the version it reports and
probe prompts answered token for token as the champion answers them here) before the next. A
replica that fails goes back to the generation it served, verified, and the push stops, named:
the fleet is never left on two versions without saying so. The last `runtime.fleet.keep`
generations stay on disk, so a rollback is a push of a folder already there.

Writes `.offseason/fleet.json` (what each replica serves, since when, verified) and appends
each push to `.offseason/fleet.jsonl`. `offseason fleet status` and `offseason fleet push` are
its commands.
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
    beyond `keep` (the newest kept, by the time they were written).
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
    for old in kept[:-keep]:
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def push(root: Path, config: cfg.Fleet, reason: str = "") -> dict:
    """The champion to every replica, verified; returns the log entry (also appended to
    `.offseason/fleet.jsonl`). Raises `weights.PushFailed` (after putting the replicas already
    moved back on their earlier version) when a replica fails.
    """
    generation = promotion.champion_generation(root)
    version = f"gen-{generation}"
    folder = _folder(root, version, config.keep)
    model, tokenizer = tinylm.load(folder)
    prompts = probe_prompts(tokenizer, root)
    state = read_state(root)
    started = time.monotonic()
    entry = {"at": promotion.now(), "version": version, "reason": reason, "replicas": {}}
    expected = weights.greedy_ids(model, prompts, PROBE_TOKENS)
    moved = []
    try:
        for replica in replicas(config):
            before = state["replicas"].get(replica.url, {}).get("version")
            update = weights.push(replica, folder, version)
            check = weights.verify(replica, version, prompts, expected)
            moved.append((replica, before))
            state["replicas"][replica.url] = {
                "version": version, "since": promotion.now(), "verified": True,
                "update_seconds": round(update, 3), "verify_seconds": round(check, 3)}
            entry["replicas"][replica.url] = state["replicas"][replica.url]
            io.write_json(root / STATE, state)
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
    _log(root, entry)
    _tag_model_version(root, entry)
    return entry


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

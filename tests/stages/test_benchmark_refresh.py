"""Held-out production traces refresh the benchmark: `offseason benchmark refresh`."""

import json
import subprocess

from conftest import make_project, offseason

from stages import gate
from stages.envs import arith


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_pure_refresh_retires_the_most_used_items_for_the_oldest_unused_pool_tasks():
    items = [{"task_id": f"b{i}"} for i in range(5)]
    pool = [{"task_id": "b1"}, {"task_id": "p0"}, {"task_id": "old"}, {"task_id": "p1"},
            {"task_id": "p2"}]
    decided = {"b0": 1, "b1": 3, "b3": 3, "b4": 2, "old": 1}  # "old" decided once: worn too
    new, retired, added = gate.refreshed(items, pool, decided, limit=2)
    assert [t["task_id"] for t in retired] == ["b1", "b3"]  # the most used
    assert [t["task_id"] for t in added] == ["p0", "p1"]  # not in the suite, never decided
    assert [t["task_id"] for t in new] == ["b0", "p0", "b2", "p1", "b4"]  # size and order kept
    new, retired, _ = gate.refreshed(items, pool, decided, min_decisions=3)
    assert [t["task_id"] for t in retired] == ["b1", "b3"]  # b4 informed only two
    assert gate.refreshed(items, [], decided) == (items, [], [])
    history = [{"items": {"arith": ["a", "b"]}}, {"items": {"arith": ["a"]}},
               {"unchanged": True, "items": {"arith": ["a", "b"]}}]  # decided nothing
    assert gate.item_decisions(history, "arith") == {"a": 2, "b": 1}


def test_the_command_refreshes_the_benchmark_from_the_pool_and_commits_it(tmp_path):
    root = make_project(tmp_path / "project")
    benchmark = root / "data" / "benchmarks" / "arith.jsonl"
    before = lines(benchmark)
    ids = [item["task_id"] for item in before]
    (root / "data" / "holdout").mkdir(parents=True)
    pool = [{"task_id": f"trace:t{i}", **arith.chat_task(q)}
            for i, q in enumerate(["3+4", "12*3", "90-8"])]
    (root / "data" / "holdout" / "arith.jsonl").write_text(
        "".join(json.dumps(t) + "\n" for t in pool))
    history = [{"key": "a", "passed": True, "unchanged": False, "items": {"arith": ids[:5]}},
               {"key": "b", "passed": False, "unchanged": False, "items": {"arith": ids[3:8]}},
               {"key": "c", "passed": False, "unchanged": True, "items": {"arith": ids[10:20]}}]
    (root / "data" / "gate_history.jsonl").write_text(
        "".join(json.dumps(h) + "\n" for h in history))

    dry = offseason(root, "benchmark", "refresh", "--dry-run").stdout
    assert "arith: 3 of 200 items replaced by held-out production tasks" in dry
    assert lines(benchmark) == before

    out = offseason(root, "benchmark", "refresh").stdout
    assert "the retired ones had informed 1.7 decisions on average; 0 pool tasks left" in out
    after = lines(benchmark)
    assert len(after) == len(before)
    # ids 3 and 4 informed two decisions, then the first of those with one: replaced in place
    assert [after[i]["task_id"] for i in (0, 3, 4)] == ["trace:t0", "trace:t1", "trace:t2"]
    assert after[1:3] == before[1:3] and after[5:] == before[5:]
    log = subprocess.run(["git", "log", "-1", "--format=%s", "--name-only"], cwd=root,
                         capture_output=True, text=True, check=True).stdout
    assert log.startswith("benchmark refresh: arith: 3 of 200 items replaced")
    assert "data/benchmarks/arith.jsonl" in log
    again = offseason(root, "benchmark", "refresh").stdout  # the pool is spent
    assert "arith: nothing replaced" in again and "no held-out task is left" in again
    bad = offseason(root, "benchmark", "refresh", "--env", "nope", check=False)
    assert bad.returncode != 0 and "environments.nope: no such environment; one of arith" \
        in bad.stderr

"""The gate's rules on per-item results, its statistics against scipy, and its config."""

import json
import random
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import REPO
from scipy import stats

from flows.project import params as settings
from stages import champion_scores, gate, tinylm
from stages import config as cfg
from stages.envs import arith
from stages.generation import chat
from stages.training import warmstart

# one xdist worker runs this module: its module-scoped fixture is built once
pytestmark = pytest.mark.xdist_group("gate")

CONFIG = cfg.Gate(bootstrap_samples=2000)  # alpha 0.05, one-sided


def rows(correct, suite="arith", tokens=10, fmt=1.0, tool_ok=1.0):
    return [{"suite": suite, "id": f"{suite}-{i}", "correct": float(c), "format": fmt,
             "tool_ok": tool_ok, "tokens": tokens} for i, c in enumerate(correct)]


def pairs(candidate, champion):
    return list(zip(candidate, champion))


def bernoulli(p, n, seed):
    return (np.random.default_rng(seed).random(n) < p).astype(int).tolist()


def test_a_clearly_better_candidate_passes():
    verdict = gate.decide(CONFIG, 0, pairs(rows(bernoulli(0.6, 200, 1)),
                                           rows(bernoulli(0.3, 200, 2))), set(), [], False)
    assert verdict["passed"] is True, verdict["reason"]
    primary = verdict["suites"]["arith"]
    assert primary["interval"][0] > 0 and verdict["interval"] == primary["interval"]
    assert verdict["candidate_score"] == primary["candidate"] > verdict["champion_score"]
    assert primary["mcnemar"]["p_value"] < 0.01
    assert "every guard held" in verdict["reason"]


def test_a_higher_score_within_noise_is_held_back():
    champion = bernoulli(0.5, 200, 3)
    candidate = list(champion)
    flipped = [i for i, c in enumerate(champion) if c == 0][:4]  # +4 items of 200: +2 points
    for i in flipped:
        candidate[i] = 1
    worse = [i for i, c in enumerate(champion) if c == 1][:1]
    candidate[worse[0]] = 0
    verdict = gate.decide(CONFIG, 0, pairs(rows(candidate), rows(champion)), set(), [], False)
    assert verdict["candidate_score"] > verdict["champion_score"]
    assert verdict["passed"] is False
    assert "arith: 4-1 on the items only one model solved" in verdict["reason"]
    assert "not clearly better" in verdict["reason"]
    assert verdict["suites"]["arith"]["mcnemar"] == {"candidate_only": 4, "champion_only": 1,
                                                     "p_value": 0.375, "p_better": 0.1875}


def test_a_guard_suite_regression_fails_naming_the_suite():
    config = cfg.Gate()  # every guard at an environment's default max_regression, 0.05
    good = pairs(rows(bernoulli(0.7, 200, 4)), rows(bernoulli(0.3, 200, 5)))
    guard = pairs(rows([0] * 30 + [1] * 70, "hard"), rows([1] * 100, "hard"))
    verdict = gate.decide(config, 0, good + guard, set(), [], False)
    assert verdict["suites"]["arith"]["passed"] and not verdict["suites"]["hard"]["passed"]
    assert verdict["passed"] is False
    assert verdict["failures"] == [next(r for r in verdict["failures"] if r.startswith("hard:"))]
    assert "may have regressed beyond the margin" in verdict["reason"]
    assert verdict["suites"]["hard"]["role"] == "guard"


def test_forgetting_and_reward_hacking_guards():
    champion = rows([1] * 40 + [0] * 160)
    candidate = rows([0] * 30 + [1] * 130 + [0] * 40)  # much better, but lost what it knew
    solved = {("arith", f"arith-{i}") for i in range(40)}  # solved by an earlier champion
    verdict = gate.decide(CONFIG, 0, pairs(candidate, champion), solved, [], False)
    assert verdict["suites"]["arith"]["passed"] and not verdict["forgetting"]["passed"]
    assert verdict["forgetting"]["items"] == 40 and "arith/arith-0" in verdict["forgetting"]["lost"]
    assert "forgetting: lower bound" in verdict["reason"]
    few = gate.decide(CONFIG, 0, pairs(candidate, champion), set(list(solved)[:29]), [], False)
    assert few["forgetting"]["skipped"] and "gate.forgetting_min_items=30" in \
        few["forgetting"]["reason"]
    # a longer, badly formatted answer with tool errors: each guard names itself
    better = pairs(rows(bernoulli(0.8, 200, 6), tokens=50, fmt=0.0, tool_ok=0.0),
                   rows(bernoulli(0.3, 200, 7), tokens=10))
    verdict = gate.decide(CONFIG, 0, better, set(), [], False)
    assert verdict["passed"] is False
    assert {k for k, g in verdict["guards"].items() if not g["arith"]["passed"]} == \
        {"length", "format", "tool_ok"}
    assert verdict["guards"]["length"]["arith"]["difference"] == 4.0  # 5x as long: +400%
    assert verdict["forgetting"]["skipped"] is True  # nothing solved before: the first cycle


def test_an_unchanged_candidate_never_passes():
    verdict = gate.decide(cfg.Gate(min_improvement=-1.0), 0,
                          pairs(rows([1, 0, 1]), rows([1, 0, 1])), set(), [], True)
    assert verdict["passed"] is False and "unchanged" in verdict["reason"]


def test_a_primary_suite_without_judged_items_fails():
    # every item unjudged (the verifier could not judge any): no evidence, no promotion
    unjudged = [{**r, "correct": None} for r in rows([1] * 20)]
    verdict = gate.decide(cfg.Gate(min_improvement=-1.0), 0,
                          pairs(unjudged, rows([0] * 20)), set(), [], False)
    assert verdict["passed"] is False
    assert "arith: no judged items" in verdict["reason"]
    assert verdict["suites"]["arith"]["unjudged"] == 20
    # an empty guard suite still does not block
    config = cfg.Gate()
    guard = pairs([{**r, "correct": None} for r in rows([1] * 5, "hard")], rows([1] * 5, "hard"))
    good = pairs(rows(bernoulli(0.7, 200, 4)), rows(bernoulli(0.3, 200, 5)))
    verdict = gate.decide(config, 0, good + guard, set(), [], False)
    assert verdict["passed"] is True and verdict["suites"]["hard"]["skipped"] is True


def test_a_difference_exactly_at_the_margin_is_not_lost_to_rounding():
    # One item of 20 lost: each bootstrap resample's difference is -k/20. Taken as the difference
    # of two separately computed means, 0.85 - 1.0 is -0.15000000000000002, below a margin of
    # 0.15 by rounding alone; the mean of the paired differences is exactly -0.15.
    assert 17 / 20 - 1.0 < -0.15
    candidate, champion = [0] + [1] * 19, [1] * 20
    low, _ = gate.paired_interval(np.array(candidate, float), np.array(champion, float), 2000,
                                  0.9, 0)
    assert low == -0.15  # the 5% quantile falls inside the resamples that lost 3 times
    good = pairs(rows(bernoulli(0.7, 200, 4)), rows(bernoulli(0.3, 200, 5)))
    margins = {"arith": ("arith", 0.05), "hard": ("hard", 0.15)}
    verdict = gate.decide(cfg.Gate(), 0, good + pairs(rows(candidate, "hard"),
                                                      rows(champion, "hard")),
                          set(), [], False, margins)
    hard = verdict["suites"]["hard"]
    assert hard["difference"] == -0.05
    # a pass/fail guard is judged by Tango's paired score test now, not the bootstrap:
    # one loss in 20 items cannot show that the suite lost less than 0.15 (the bootstrap's
    # bound sat exactly on the margin and let it through)
    assert hard["test"] == "Tango's paired score test, one-sided"
    assert hard["interval"][0] < -0.15 and hard["passed"] is False
    assert "may have regressed beyond the margin" in hard["reason"]


def test_paired_bootstrap_agrees_with_scipy():
    rng = np.random.default_rng(11)
    a = (rng.random(300) < 0.55).astype(float)
    b = np.where(rng.random(300) < 0.8, a, 1 - a)  # correlated pairs, as two models' items are
    for confidence in (0.9, 0.95):
        ours = gate.paired_interval(a, b, 20000, confidence, 0)
        ref = stats.bootstrap((a, b), lambda x, y, axis: np.mean(x - y, axis=axis), paired=True,
                              vectorized=True, n_resamples=20000, confidence_level=confidence,
                              method="percentile", rng=np.random.default_rng(1))
        assert ours[0] == pytest.approx(ref.confidence_interval.low, abs=0.006)
        assert ours[1] == pytest.approx(ref.confidence_interval.high, abs=0.006)
    # relative growth (the length guard) against scipy's ratio of means
    x, y = rng.integers(5, 30, 300).astype(float), rng.integers(5, 20, 300).astype(float)
    ours = gate.paired_interval(x, y, 20000, 0.9, 0, relative=True)
    ref = stats.bootstrap((x, y), lambda p, q, axis: p.mean(axis=axis) / q.mean(axis=axis) - 1,
                          paired=True, vectorized=True, n_resamples=20000, confidence_level=0.9,
                          method="percentile", rng=np.random.default_rng(1))
    assert ours[0] == pytest.approx(ref.confidence_interval.low, abs=0.01)
    assert ours[1] == pytest.approx(ref.confidence_interval.high, abs=0.01)


def test_mcnemar_is_the_exact_binomial_test():
    a = np.array([1] * 9 + [0] * 2 + [1] * 50)
    b = np.array([0] * 9 + [1] * 2 + [1] * 50)
    assert gate.mcnemar(a, b) == {
        "candidate_only": 9, "champion_only": 2,
        "p_value": round(stats.binomtest(9, 11).pvalue, 6),
        "p_better": round(stats.binomtest(9, 11, alternative="greater").pvalue, 6)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    tokenizer = tinylm.build_tokenizer(arith)
    for name, steps in (("champion", 5), ("candidate", 30)):
        model = tinylm.build_model(tokenizer, n_layer=1, n_embd=32, n_head=2, n_positions=64,
                                   seed=0)
        template = chat.Template.of(tokenizer, list(arith.TOOLS), chat.end_ids(model, tokenizer))
        warmstart.train(model, warmstart.demonstrations(template, arith, random.Random(0), 0.5, 16),
                        steps=steps, lr=1e-2, tokenizer=tokenizer, seed=0)
        tinylm.save(model, tokenizer, folder / name)
    return folder


def benchmark(root, size):
    """An arith benchmark of `size` tasks in `root`, and the environments: naming it."""
    arith.write_benchmark(root / "arith.jsonl", size=size)
    return {"arith": cfg.EnvironmentSpec(module="stages.envs.arith", benchmark="arith.jsonl")}


def scores_of(tmp_path, model, config, specs):
    return champion_scores.run(cfg.Base(), config, model, tmp_path / "scores.parquet",
                               tmp_path / "forgetting.jsonl", specs, cfg.Rollout(), tmp_path)


def test_contaminated_benchmark_fails_naming_the_items(tmp_path, tiny):
    specs = benchmark(tmp_path, 12)
    leaked = [json.loads(line) for line in (tmp_path / "arith.jsonl").read_text().splitlines()]
    leaked = [leaked[3], leaked[7]]
    config = cfg.Gate(min_improvement=-1.0, bootstrap_samples=100, max_length_increase=100,
                      max_format_regression=1, max_tool_error_regression=1,
                      forgetting_max_regression=1)
    scores, forgetting = tmp_path / "scores.parquet", tmp_path / "forgetting.jsonl"
    metrics = scores_of(tmp_path, tiny / "champion", config, specs)
    assert metrics["suites"]["arith"]["items"] == 12
    assert pq.read_table(scores).num_rows == 12
    # this cycle's rewards ask one benchmark question, the replay another: each an episode as
    # the chat template renders its task
    model, tokenizer = tinylm.load(tiny / "candidate")
    template = chat.Template.of(tokenizer, list(arith.TOOLS), chat.end_ids(model, tokenizer))

    def episode(question):
        task = arith.chat_task(question)
        ids, mask = chat.encode(template.for_task(task),
                                task["messages"] + arith.chat_demonstration(question, True))
        return {"task_id": "t", "completion": "", "token_ids": ids, "model_mask": mask}

    rewards = tmp_path / "rewards.parquet"
    pq.write_table(pa.Table.from_pylist([episode(leaked[0]["messages"][0]["content"]),
                                         episode("1+1000")]), rewards)
    replay = tmp_path / "replay"
    replay.mkdir()
    pq.write_table(pa.Table.from_pylist([episode(leaked[1]["messages"][0]["content"])]),
                   replay / "part-0.parquet")
    args = (cfg.Base(), config, tiny / "candidate", scores, forgetting, rewards, replay,
            tmp_path / "gate.parquet", specs, cfg.Rollout(), tmp_path)
    verdict = gate.run(*args)
    assert verdict["passed"] is False
    assert verdict["contamination"]["items"] == sorted([f"arith/{leaked[0]['task_id']}",
                                                        f"arith/{leaked[1]['task_id']}"])
    assert f"arith/{leaked[0]['task_id']}" in verdict["reason"]
    assert "contamination: 2 benchmark items" in verdict["reason"]
    assert "replace those items in the benchmark files" in verdict["contamination"]["reason"]
    # the same without the leak: only the contamination rule changes
    rewards.unlink()
    for part in replay.iterdir():
        part.unlink()
    clean = gate.run(*args)
    assert clean["contamination"]["passed"] and clean["contamination"]["items"] == []


def test_forgetting_set_keeps_what_any_champion_solved(tmp_path, tiny):
    specs = benchmark(tmp_path, 30)
    scores, forgetting = tmp_path / "scores.parquet", tmp_path / "forgetting.jsonl"
    config = cfg.Gate()
    first = scores_of(tmp_path, tiny / "champion", config, specs)
    second = scores_of(tmp_path, tiny / "candidate", config, specs)
    kept = [r["id"] for r in pq.read_table(scores).to_pylist() if r["correct"] == 1.0]
    assert first["forgetting_items"] + second["forgetting_added"] == second["forgetting_items"]
    lines = {line["id"]: line for line in map(json.loads, forgetting.read_text().splitlines())}
    assert set(kept) <= set(lines)
    hashes = {gate.weights_hash(tiny / name)[:16] for name in ("champion", "candidate")}
    assert all(set(line["solved_by"]) <= hashes and line["solved_by"] for line in lines.values())
    # run again for the same champion (a rerun stage): nothing is added twice
    again = scores_of(tmp_path, tiny / "candidate", config, specs)
    assert (again["forgetting_items"], again["forgetting_added"]) == \
        (second["forgetting_items"], 0)


def test_gate_params_name_the_key(tmp_path):
    path = tmp_path / "params.yaml"
    arith_env = {"arith": {"module": "stages.envs.arith", "benchmark": "b.jsonl"}}
    path.write_text(yaml.safe_dump({"gate": {"primary": "code"}, "environments": arith_env}))
    with pytest.raises(cfg.ParamsError, match="gate.primary: 'code' is not one of your "
                                              "environments with a benchmark \\(arith\\)"):
        cfg.load("gate", path)
    path.write_text(yaml.safe_dump({"gate": {}, "environments": {
        "arith": {"module": "stages.envs.arith"}}}))
    with pytest.raises(cfg.ParamsError, match="environments: none has a benchmark"):
        cfg.load("gate", path)
    path.write_text(yaml.safe_dump({"gate": {"alpha": "lots"}, "environments": arith_env}))
    with pytest.raises(cfg.ParamsError, match="gate.alpha: expected a num"):
        cfg.load("gate", path)
    path.write_text(yaml.safe_dump({"promotion": {"approval_timeout": 0}}))
    with pytest.raises(cfg.ParamsError, match="promotion.approval_timeout: must be > 0"):
        cfg.load("promotion", path, settings.SECTIONS)


def split(only_candidate: int, only_champion: int, same: int = 190) -> list:
    """Pairs where the candidate alone solved `only_candidate` items, the champion alone
    `only_champion`, and both solved or failed the rest alike."""
    candidate = [1] * only_candidate + [0] * only_champion + [1, 0] * (same // 2)
    champion = [0] * only_candidate + [1] * only_champion + [1, 0] * (same // 2)
    return pairs(rows(candidate), rows(champion))


@pytest.mark.parametrize("wins, losses, passes", [(3, 0, False), (6, 1, False), (9, 1, True),
                                                  (5, 0, True)])
def test_few_items_only_one_model_solved_are_judged_by_the_exact_test(wins, losses, passes):
    verdict = gate.decide(CONFIG, 0, split(wins, losses), set(), [], False)
    primary = verdict["suites"]["arith"]
    assert primary["test"] == verdict["test"] == "exact McNemar, one-sided"
    expected = stats.binomtest(wins, wins + losses, 0.5, alternative="greater").pvalue
    assert primary["mcnemar"]["p_better"] == pytest.approx(expected, abs=1e-6)
    assert verdict["passed"] is passes, verdict["reason"]
    assert f"{wins}-{losses} on the items only one model solved" in primary["reason"]
    if (wins, losses) == (6, 1):  # the percentile bootstrap alone would have promoted it
        assert primary["interval"][0] > 0
    assert verdict["alpha"] == 0.05 and "at most 5% of the time" in verdict["rule"]


# the primaries a gate meets, as item rows (the generators are defined below): pass/fail, a
# judge's rubric in quarters of [0, 1], and unbounded mean rewards
PRIMARIES = {"binary": lambda rng, d: discordant(rng, d, "arith", 200, 0.15),
             "graded": lambda rng, d: judged(rng, d),
             "continuous": lambda rng, d: graded(rng, d, "arith", 200, 0.05)}


@pytest.mark.parametrize("primary", list(PRIMARIES))
def test_false_promotions_through_the_whole_decision_stay_within_alpha(primary):
    """1,000 simulated decisions per primary through `gate.decide` (seeded), each with an
    unchanged pass/fail guard: with no true difference on the primary the gate promotes at
    most alpha of the time (plus three standard errors of the simulation); at +7.5 points it
    promotes a fair share, which is printed (the design's power is tested below)."""
    rng = np.random.default_rng({"binary": 21, "graded": 22, "continuous": 23}[primary])
    config, margins = cfg.Gate(bootstrap_samples=20), {"arith": ("arith", 0.05),
                                                       "guard": ("guard", 0.06)}

    def promoted(d: float, runs: int) -> float:
        return sum(gate.decide(config, int(rng.integers(1 << 30)), PRIMARIES[primary](rng, d)
                               + discordant(rng, 0.0, "guard", 150, 0.15), set(), [], False,
                               margins)["passed"] for _ in range(runs)) / runs

    false, power = promoted(0.0, 1000), promoted(0.075, 200)
    print(f"{primary} primary + a guard: false promotions {false:.3f} at d = 0, promoted "
          f"{power:.3f} at d = +0.075 (200 items, alpha {config.alpha})")
    assert false <= config.alpha + 3 * (config.alpha * 0.95 / 1000) ** 0.5
    assert power > 0.3


def test_a_guard_too_small_for_its_margin_is_reported_underpowered_and_params_say_what_then():
    good = pairs(rows(bernoulli(0.7, 200, 4)), rows(bernoulli(0.3, 200, 5)))
    # a 10-item guard: 2 items lost, 1 won; it cannot tell a 0.05 regression from noise
    small = pairs(rows([0, 0, 1] + [1] * 4 + [0] * 3, "small"),
                  rows([1, 1, 0] + [1] * 4 + [0] * 3, "small"))
    decided = gate.decide(cfg.Gate(), 0, good + small, set(), [], False)  # its margin: 0.05
    guard = decided["suites"]["small"]
    a = np.array([0, 0, 1] + [1] * 4 + [0] * 3, float)
    b = np.array([1, 1, 0] + [1] * 4 + [0] * 3, float)
    # (z_0.95 + z_0.8) * sd / sqrt(n); on pass/fail items about sqrt(6.2 x disagreement / n),
    # 0.43 here; but never below the 5 of 10 items the exact test needs to show anything at 0.05
    approx = (stats.norm.ppf(0.95) + stats.norm.ppf(0.8)) * np.std(a - b, ddof=1) / np.sqrt(10)
    assert approx == pytest.approx(np.sqrt(6.19 * 0.3 / 10), rel=0.1)
    assert guard["detectable_change"] == 0.5 > approx
    many = np.tile(a, 10), np.tile(b, 10)  # 100 items: the approximation, above 5/100
    assert gate.detectable(*many, 0.05) == pytest.approx(
        (stats.norm.ppf(0.95) + stats.norm.ppf(0.8)) * np.std(many[0] - many[1], ddof=1) / 10)
    assert gate.detectable(np.ones(4), np.ones(4), 0.05) == 1.25  # agreeing on 4: said 0
    assert guard["underpowered"] is True and guard["passed"] is False
    assert "underpowered: with 10 items it detects a change of" in guard["reason"]
    assert decided["passed"] is False  # gate.underpowered: decide (the default) lets it block
    skipped = gate.decide(cfg.Gate(underpowered="skip"), 0, good + small, set(), [], False)
    assert skipped["suites"]["small"]["skipped"] is True and skipped["passed"] is True
    assert "skipped (gate.underpowered: skip)" in skipped["suites"]["small"]["reason"]
    # the 200-item primary is not flagged, and reports what it can detect
    assert "underpowered" not in decided["suites"]["arith"]
    assert 0 < decided["suites"]["arith"]["detectable_change"] < 0.2


def test_check_says_a_primary_suite_too_small_can_never_pass(tmp_path):
    """Four benchmark items on which the two models agree: `offseason check` said they "detect a
    change of 0.000"; no candidate can ever pass McNemar's exact test on them."""
    from flows.cli import power_lines

    tiny = pairs(rows([1, 0, 1, 0], "mine"), rows([1, 0, 1, 0], "mine"))
    verdict = gate.decide(cfg.Gate(primary="mine"), 0, tiny, set(), [], False)
    assert verdict["suites"]["mine"]["detectable_change"] == 1.25
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "gate.json").write_text(json.dumps(verdict))
    [line] = power_lines(tmp_path)
    assert line.startswith("gate suite 'mine' (primary): 4 items detect a change of 1.250")
    assert "WARNING: too few items" in line and "no candidate can pass; add items" in line


def test_the_old_confidence_key_says_what_replaced_it(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"gate": {"confidence": 0.9}}))
    with pytest.raises(cfg.ParamsError, match=r"gate.confidence is replaced by gate.alpha.*"
                                              r"write `alpha: 0.05` instead"):
        cfg.load("gate", path)


def test_lord_levels_spend_half_of_alpha_until_a_promotion_earns_more():
    levels = [gate.lord_level(0.05, [False] * t) for t in range(2000)]
    assert all(b <= a for a, b in zip(levels, levels[1:]))  # never more without a promotion
    assert sum(levels) < 0.025  # the initial wealth, alpha / 2
    after = gate.lord_level(0.05, [False, True])  # decision 3, one decision after a promotion
    assert after == pytest.approx(gate.gamma(3) * 0.025 + 0.025 * gate.gamma(1))
    assert after > levels[2]


def test_52_weekly_cycles_with_sequential_control_keep_false_promotions_at_alpha():
    """A year of weekly decisions, 400 simulated years, 200-item pass/fail suites with 15% of
    items disagreeing, the exact McNemar p-value of each: with no real improvement ever, the
    share of years with any false promotion is about 1 - 0.95^52 at alpha per decision, and at
    most alpha with gate.sequential: lord. In years where a quarter of the candidates are truly
    better by 10 points, LORD keeps the share of false promotions among promotions below alpha.
    """
    rng = np.random.default_rng(7)

    def p_value(d: float) -> float:
        k = rng.binomial(200, 0.15)
        wins = rng.binomial(k, 0.5 + d / 0.3)
        return stats.binomtest(wins, k, 0.5, alternative="greater").pvalue if k else 1.0

    def year(truth: list[float], lord: bool) -> tuple[int, int]:
        passed, false = [], 0
        for d in truth:
            level = gate.lord_level(0.05, passed) if lord else 0.05
            passed.append(p_value(d) < level)
            false += passed[-1] and d == 0
        return false, sum(passed)

    null = [0.0] * 52
    fixed = sum(year(null, False)[0] > 0 for _ in range(400)) / 400
    lord = sum(year(null, True)[0] > 0 for _ in range(400)) / 400
    print(f"years with a false promotion, no real improvement: {fixed:.3f} at alpha per "
          f"decision, {lord:.3f} with LORD++")
    assert fixed > 0.7 and lord <= 0.05 + 0.015
    mixed = [0.1 if week % 4 == 0 else 0.0 for week in range(52)]
    false = passes = 0
    for _ in range(200):
        f, n = year(mixed, True)
        false, passes = false + f, passes + n
    print(f"with 13 truly better candidates a year: {passes / 200:.1f} promotions a year, "
          f"{false / max(passes, 1):.3f} of them false")
    assert passes / 200 > 5 and false / passes <= 0.05 + 0.015


def test_the_gate_stage_keeps_one_history_line_per_decision(tmp_path, tiny, monkeypatch):
    monkeypatch.chdir(tmp_path)
    items = [{"task_id": f"b{i}", "messages": [{"role": "user", "content": f"{i}+{i}"}],
              "answer": str(2 * i)} for i in range(20)]
    (tmp_path / "arith.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    specs = {"arith": cfg.EnvironmentSpec(module="stages.envs.arith", benchmark="arith.jsonl")}
    config = cfg.Gate(benchmark_size=20, bootstrap_samples=200, sequential="lord")
    base = cfg.Base()
    scores_of(tmp_path, tiny / "champion", config, specs)
    history = tmp_path / "history.jsonl"
    args = (base, config, tiny / "candidate", tmp_path / "scores.parquet",
            tmp_path / "forgetting.jsonl", tmp_path / "none.parquet", tmp_path / "replay",
            tmp_path / "gate.parquet", specs, cfg.Rollout(), tmp_path)
    first = gate.run(*args, history=history)
    again = gate.run(*args, history=history)  # the same cycle's gate, rerun: replaces its line
    lines = [json.loads(line) for line in history.read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["level"] == first["sequence"]["level"]
    assert first["sequence"] == again["sequence"]
    assert first["sequence"]["decision"] == 1 and first["sequence"]["method"] == "lord"
    assert first["sequence"]["level"] == pytest.approx(gate.lord_level(0.05, []), abs=1e-6)
    assert "LORD++" in first["rule"]
    # each item informed this one decision (the rerun replaced, not added, its line)
    assert lines[0]["items"] == {"arith": sorted(i["task_id"] for i in items)}
    assert again["item_usage"] == {"arith": {"items": 20, "decisions_min": 1,
                                             "decisions_mean": 1.0, "decisions_max": 1}}


def test_item_usage_counts_the_decisions_each_item_informed():
    earlier = [{"items": {"a": ["x", "y"]}},
               {"items": {"a": ["x"], "b": ["z"]}},
               {"items": {"a": ["x", "y"]}, "unchanged": True}]  # nothing was decided
    usage = gate.item_usage(earlier, {"a": ["x", "y", "new"], "b": ["z"]}, unchanged=False)
    assert usage["a"] == {"items": 3, "decisions_min": 1, "decisions_mean": 2.0,
                          "decisions_max": 3}  # x: 2 earlier + this one, y: 1 + 1, new: 1
    assert usage["b"]["decisions_max"] == 2
    assert gate.item_usage([], {"a": ["x"]}, unchanged=True)["a"]["decisions_max"] == 0


def test_check_shows_what_each_suite_detects_and_warns_about_an_underpowered_guard(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    (tmp_path / "params.yaml").write_text((repo / "params.yaml").read_text())
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "data" / "benchmarks").mkdir(parents=True)  # check counts the demo's benchmark
    (tmp_path / "data" / "benchmarks" / "arith.jsonl").write_text(
        (repo / "data" / "benchmarks" / "arith.jsonl").read_text())
    (tmp_path / "metrics").mkdir()
    good = pairs(rows(bernoulli(0.7, 200, 4)), rows(bernoulli(0.3, 200, 5)))
    small = pairs(rows([0, 0, 1] + [1] * 4 + [0] * 3, "small"),
                  rows([1, 1, 0] + [1] * 4 + [0] * 3, "small"))
    verdict = gate.decide(cfg.Gate(), 0, good + small, set(), [], False)  # small's margin 0.05
    verdict["item_usage"] = gate.item_usage([{"items": {"arith": ["a0", "a1"]}}],
                                            {"arith": ["a0", "a1", "a2"]}, False)
    (tmp_path / "metrics" / "gate.json").write_text(json.dumps(verdict))
    out = subprocess.run([str(Path(sys.executable).parent / "offseason"), "check"],
                         cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    small_line = next(line for line in out.stdout.splitlines() if "'small'" in line)
    assert small_line.startswith(f"gate suite 'small' (guard): 10 items detect a change of "
                                 f"{verdict['suites']['small']['detectable_change']:.3f}")
    assert "WARNING: underpowered, its max_regression 0.05 is below that" in small_line
    assert "gate suite 'arith' (primary): 200 items" in out.stdout
    assert "its items have informed 1.67 decisions on average, at most 2" in out.stdout
    # the next decision's design, from params.yaml and the benchmark's 200 items; the last
    # decision's models (independent draws) disagreed on far more items than it assumes
    seen = verdict["design"]["suites"]["arith"]["observed_discordance"]
    assert ("gate design: whole decision power 85% (target 80%) at +0.075 on 'arith', 15% of "
            "items answered differently (assumed); suite 'arith' needs 178 items, has 200; "
            f"WARNING: the last decision saw a discordance of {seen:g} on the primary 'arith', "
            f"above gate.discordance=0.15" in out.stdout)
    assert "WARNING" not in next(line for line in out.stdout.splitlines()
                                 if line.startswith("gate suite 'arith'"))


def test_a_rise_in_suspected_reward_hacks_fails_the_hacking_guard():
    """Better on the primary suite, but more of its completions were noted hack_suspected by the
    verifier (the code sandbox): the hacking guard fails the candidate; the same share passes.
    """
    better, worse = rows(bernoulli(0.7, 200, 4)), rows(bernoulli(0.3, 200, 5))
    hacky = [{**r, "suspect": float(i < 6)} for i, r in enumerate(better)]
    verdict = gate.decide(CONFIG, 0, pairs(hacky, worse), set(), [], False)
    hacking = verdict["guards"]["hacking"]["arith"]
    assert verdict["passed"] is False and hacking["passed"] is False, hacking
    assert hacking["candidate"] == 0.03 and hacking["champion"] == 0.0
    assert "hacking (completions a verifier suspected of a reward hack) in environment arith" \
        in verdict["reason"]
    same = gate.decide(CONFIG, 0, pairs(hacky, [{**r, "suspect": float(i < 6)}
                                                for i, r in enumerate(worse)]), set(), [], False)
    assert same["passed"] is True and same["guards"]["hacking"]["arith"]["passed"] is True
    # champion scores written before the guard existed carry no `suspect`: none suspected
    assert gate.decide(CONFIG, 0, pairs(better, worse), set(), [], False)["passed"] is True


def test_the_cycle_report_shows_the_guards_and_the_suspected_hacks(tmp_path):
    from flows.audit import report

    better, worse = rows(bernoulli(0.7, 200, 4)), rows(bernoulli(0.3, 200, 5))
    hacky = [{**r, "suspect": float(i < 6)} for i, r in enumerate(better)]
    verdict = gate.decide(CONFIG, 0, pairs(hacky, worse), set(), [], False)
    reward = {"mean_reward": 0.5, "hack_suspected": {"episodes": 3, "reasons": {
        "imported unittest": 2, "replaced builtins.AssertionError": 1}}}
    text = report.markdown(tmp_path, 1, {"gate": verdict, "reward": reward}, {})
    assert "guard `hacking` in `arith` **failed**: candidate 0.030 vs champion 0.000" in text, text
    assert "guard `length` in `arith`: candidate" in text
    assert "suspected reward hacks: 3 episodes (imported unittest: 2, replaced " in text
    assert f"suite `arith`: candidate {verdict['suites']['arith']['candidate']:.3f}" in text
    assert "suspected reward hacks: none" in report.markdown(tmp_path, 1, {"gate": verdict}, {})
    # the drift line in words, not Python reprs
    text = report.markdown(tmp_path, 1, {"gate": verdict, "ingest": {"pii_redactions": {
        "email": 2, "card": 0, "ip": 1}}, "validate": {"drift": {"new_tools": []}}}, {})
    assert "new tools none; PII scrubbed email 2, ip 1" in text, text
    # the Data Docs as a path: a file:// link inside the Prefect UI's http page is refused
    assert "`data/docs/index.html`" in text and "file://" not in text
    # what the cycle cost, beside the estimate made before it
    assert "no cost ledger" in text
    (tmp_path / "metrics").mkdir()
    ledger = {"total": {"usd": 0.0012, "cpu_seconds": 86.4, "gpu_seconds": 0, "judge_tokens": 0}}
    (tmp_path / "metrics/cost.json").write_text(json.dumps(ledger))
    text = report.markdown(tmp_path, 1, {"gate": verdict}, {})
    assert "**This cycle**: $0.0012 (86.4 CPU s, 0.0 GPU s, 0 judge tokens); no estimate" in text
    ledger["estimate"] = {"status": "ok", "total": {"usd": [0.001, 0.0011, 0.0013],
                                                    "cpu_seconds": [70.0, 80.0, 95.0]}}
    (tmp_path / "metrics/cost.json").write_text(json.dumps(ledger))
    text = report.markdown(tmp_path, 1, {"gate": verdict}, {})
    assert "estimated before it $0.0011 ($0.0010 to $0.0013; 80.0 CPU s, 70.0 to 95.0)" in text, text


def test_the_metrics_artifact_is_one_small_table_per_stage():
    from flows.audit import report

    metrics = {"ingest": {"rows_read": 48, "accepted": 47, "pii_redactions": {"email": 2},
                          "resources": {"wall_seconds": 3.5, "cpu_seconds": 2.0}},
               "gate": {"passed": True, "candidate_score": 0.6, "reason": "better"}}
    summary = report.metrics_table(metrics, {"ingest": True, "gate": False})
    assert [r["stage"] for r in summary] == list(report.STAGES)
    assert summary[0] == {"stage": "ingest", "reran": True, "wall_seconds": 3.5,
                          "cpu_seconds": 2.0, "max_rss_mb": None}
    assert all(len(r) == 5 for r in summary)  # not a column per metric of every stage
    # each stage's own metrics: two columns, its top-level numbers
    assert report.stage_table(metrics, "ingest") == [
        {"metric": "rows_read", "value": 48.0}, {"metric": "accepted", "value": 47.0}]
    assert report.stage_table(metrics, "gate") == [
        {"metric": "passed", "value": 1.0}, {"metric": "candidate_score", "value": 0.6}]
    assert report.stage_table(metrics, "train") == []


def share(p, n):
    """n values, the first p of them 1.0: a share of completions."""
    return [1.0] * round(p * n) + [0.0] * (n - round(p * n))


TWO_ENVIRONMENTS = {"arith": ("arith", 0.05), "code": ("code", 0.5)}  # their max_regression
# guard: (its row key, arith's champion and candidate, code's champion and candidate): better on
# arith (200 items), worse on code (100 items), so that the figure over both passes
ONE_BETTER_ONE_WORSE = {
    "length": ("tokens", [100] * 200, [20] * 200, [10] * 100, [60] * 100),  # code: 6x as long
    "format": ("format", share(0.5, 200), share(1.0, 200), share(1.0, 100), share(0.7, 100)),
    "tool_ok": ("tool_ok", share(0.5, 200), share(1.0, 200), share(1.0, 100), share(0.7, 100)),
    "hacking": ("suspect", share(0.2, 200), share(0.0, 200), share(0.0, 100), share(0.05, 100)),
}


def two_environments(key=None, values=None):
    """(candidate, champion) rows of arith (clearly better) and code (unchanged), with `key`
    set per row from `values` (arith's champion, arith's candidate, code's champion, code's)."""
    arith_rows = rows(bernoulli(0.7, 200, 4)), rows(bernoulli(0.3, 200, 5))
    code_rows = rows(bernoulli(0.5, 100, 8), "code"), rows(bernoulli(0.5, 100, 8), "code")
    if key is not None:
        arith_champion, arith_candidate, code_champion, code_candidate = values
        arith_rows = ([{**r, key: v} for r, v in zip(arith_rows[0], arith_candidate)],
                      [{**r, key: v} for r, v in zip(arith_rows[1], arith_champion)])
        code_rows = ([{**r, key: v} for r, v in zip(code_rows[0], code_candidate)],
                     [{**r, key: v} for r, v in zip(code_rows[1], code_champion)])
    return pairs(*arith_rows) + pairs(*code_rows)


@pytest.mark.parametrize("guard", list(ONE_BETTER_ONE_WORSE))
def test_a_guard_fails_in_the_environment_that_regressed_though_the_pooled_figure_passes(guard):
    """Issue 46 item 5: the length, format, tool and hacking guards were pooled over every
    suite's items, so that one environment's regression hid behind another's gain. Each now
    holds in each environment, with the same margins."""
    key, *values = ONE_BETTER_ONE_WORSE[guard]
    both = two_environments(key, values)
    margin = {"length": "max_length_increase", "format": "max_format_regression",
              "tool_ok": "max_tool_error_regression", "hacking": "max_hack_increase"}[guard]
    pooled = gate.compare("pooled", np.array([c[key] for c, _ in both], float),
                          np.array([h[key] for _, h in both], float), CONFIG, 0,
                          threshold=getattr(CONFIG, margin), primary=False,
                          relative=guard == "length", lower_is_better=guard in ("length",
                                                                                  "hacking"))
    assert pooled["passed"] is True, pooled  # what the gate decided before: a pass
    verdict = gate.decide(CONFIG, 0, both, set(), [], False, TWO_ENVIRONMENTS)
    assert verdict["suites"]["arith"]["passed"] and verdict["suites"]["code"]["passed"]
    per = verdict["guards"][guard]
    assert per["arith"]["passed"] is True and per["code"]["passed"] is False, per
    assert per["code"]["environment"] == "code" and per["code"]["items"] == 100
    assert verdict["passed"] is False
    assert verdict["failures"] == [per["code"]["reason"]]  # the other guards held everywhere
    assert per["code"]["reason"].startswith(f"{guard} ") and " in environment code: " in \
        per["code"]["reason"], per["code"]["reason"]
    assert per["code"]["reason"] in verdict["reason"]


def test_a_candidate_fine_in_every_environment_passes_each_guard_reported_per_environment():
    verdict = gate.decide(CONFIG, 0, two_environments(), set(), [], False, TWO_ENVIRONMENTS)
    assert verdict["passed"] is True, verdict["reason"]
    assert {guard: sorted(per) for guard, per in verdict["guards"].items()} == {
        guard: ["arith", "code"] for guard in ("length", "format", "tool_ok", "hacking")}
    for per in verdict["guards"].values():
        assert per["arith"]["passed"] and per["arith"]["items"] == 200
        assert per["code"]["passed"] and per["code"]["items"] == 100
        assert (per["arith"]["environment"], per["code"]["environment"]) == ("arith", "code")
    # each environment is named with its module, as the gate stage gives them
    hard = pairs(rows([1] * 50, "hard", tokens=80), rows([1] * 50, "hard", tokens=10))
    modules = {"arith": ("arith (stages.envs.arith)", 0.05), "hard": ("hard (my.env)", 0.05)}
    verdict = gate.decide(CONFIG, 0, two_environments()[:200] + hard, set(), [], False, modules)
    assert verdict["guards"]["length"]["hard"]["reason"].startswith(
        "length (generated tokens) in environment hard (my.env): upper bound")


def test_the_report_the_summary_and_mlflow_show_each_guard_per_environment(tmp_path):
    from flows.audit import report
    from flows.orchestration import promotion
    from flows.project import tracking

    key, *values = ONE_BETTER_ONE_WORSE["format"]
    verdict = gate.decide(CONFIG, 0, two_environments(key, values), set(), [], False,
                          TWO_ENVIRONMENTS)
    text = report.markdown(tmp_path, 1, {"gate": verdict}, {})
    assert "guard `format` in `code` **failed**: candidate 0.700 vs champion 1.000" in text, text
    assert "guard `format` in `arith`: candidate 1.000 vs champion 0.500" in text
    assert "guard `length` in `code`: candidate" in text
    summary = promotion.gate_summary(verdict)
    assert "guards per environment: arith held; code failed format" in summary, summary
    numbers = tracking.numeric(verdict)  # what MLflow gets, as `dvc metrics diff` flattens it
    assert numbers["guards.format.code.passed"] == 0.0
    assert numbers["guards.format.arith.passed"] == 1.0
    assert numbers["guards.length.code.items"] == 100.0
    passed = gate.decide(CONFIG, 0, two_environments(), set(), [], False, TWO_ENVIRONMENTS)
    assert "guards per environment: arith held; code held" in promotion.gate_summary(passed)


def judged(rng, d: float, n: int = 200) -> list[tuple[dict, dict]]:
    """Item rows of a judged primary: scores in quarters (a rubric's 0, 0.25 ... 1) around a
    per-item difficulty both models share; the candidate's true mean is higher by about `d`."""
    item = rng.random(n)
    champion = np.clip(np.round((item + rng.normal(0, 0.15, n)) * 4) / 4, 0, 1)
    candidate = np.clip(np.round((item + d + rng.normal(0, 0.15, n)) * 4) / 4, 0, 1)
    return pairs(rows(candidate), rows(champion))


def test_a_graded_primary_keeps_a_level_no_bootstrap_of_the_gate_could_resolve():
    """Through `gate.decide`, at alpha 0.005 with 100 resamples: a bootstrap p-value cannot go
    below 1/101, so a level under it was decided by the resamples' extreme and promoted nulls
    far more often; the paired t-test keeps the level. 3,000 null decisions (about 7 s)."""
    config = cfg.Gate(alpha=0.005, bootstrap_samples=100)
    rng = np.random.default_rng(11)
    false = sum(gate.decide(config, int(rng.integers(1 << 30)), judged(rng, 0.0), set(), [],
                            False)["passed"] for _ in range(3000)) / 3000
    power = sum(gate.decide(config, int(rng.integers(1 << 30)), judged(rng, 0.05), set(), [],
                            False)["passed"] for _ in range(300)) / 300
    print(f"graded primary, 200 items, alpha 0.005: false promotions {false:.4f}, power at "
          f"+0.05 {power:.3f}")
    assert false <= 0.005 + 3 * (0.005 / 3000) ** 0.5
    assert power > 0.5
    verdict = gate.decide(config, 0, judged(rng, 0.1), set(), [], False)
    assert verdict["test"] == "paired t-test, one-sided" and verdict["passed"]
    assert verdict["sequence"]["p_value"] < 1 / 101  # below what 100 resamples can say


def test_52_cycles_of_a_graded_primary_with_lord_keep_false_promotions_at_alpha():
    """A year of weekly decisions through `gate.decide` with `sequential: lord` on a graded
    primary, 120 simulated null years (about 15 s): LORD's levels fall below 1e-3 within weeks;
    the share of years with any false promotion stays within alpha / 2 (plus the simulation's
    error), where the bootstrap's p-values, unable to resolve those levels, let 4.3 % through.
    """
    config = cfg.Gate(sequential="lord", bootstrap_samples=100)
    rng = np.random.default_rng(13)
    years_with_false = 0
    for _ in range(120):
        history = []
        for _ in range(52):
            verdict = gate.decide(config, int(rng.integers(1 << 30)), judged(rng, 0.0), set(),
                                  [], False, history=history)
            history.append({"passed": verdict["passed"],
                            "level": verdict["sequence"]["level"]})
        years_with_false += any(h["passed"] for h in history)
    share = years_with_false / 120
    print(f"graded primary, LORD++, 52 weekly null decisions: {share:.3f} of years with a false "
          f"promotion")
    assert share <= 0.025 + 3 * (0.025 / 120) ** 0.5


def test_a_binary_guard_regressed_by_its_margin_is_declared_non_inferior_at_most_alpha():
    """A pass/fail guard suite whose candidate is truly worse by exactly its max_regression,
    through `gate.decide`, 2,000 times (seeded): Tango's paired score test lets it through about
    alpha of the time (the percentile bootstrap: 7.1 % in 2,000 runs of the same setting, and
    Newcombe's hybrid interval 5.5 to 6.2 %, beyond this bound); an unchanged guard holds most
    of the time."""
    rng = np.random.default_rng(5)

    def suite(d: float, name: str):
        return discordant(rng, d, name, 200, 0.15)

    quick = cfg.Gate(bootstrap_samples=100)  # the guards' test takes no resamples; the rest few

    def held(d: float, runs: int) -> float:
        margins = {"arith": ("arith", 0.05), "other": ("other", 0.05)}
        return sum(gate.decide(quick, int(rng.integers(1 << 30)), suite(0.2, "arith")
                               + suite(d, "other"), set(), [], False, margins)
                   ["suites"]["other"]["passed"] for _ in range(runs)) / runs

    at_margin, unchanged = held(-0.05, 2000), held(0.0, 300)
    print(f"binary guard, 200 items, 15% discordant: held {at_margin:.3f} at a regression of its "
          f"margin, {unchanged:.3f} unchanged")
    assert at_margin <= CONFIG.alpha + 3 * (CONFIG.alpha * 0.95 / 2000) ** 0.5
    assert unchanged > 0.4
    verdict = gate.decide(CONFIG, 0, suite(0.2, "arith") + suite(0.0, "other"), set(), [], False,
                          {"arith": ("arith", 0.05), "other": ("other", 0.05)})
    assert verdict["suites"]["other"]["test"] == "Tango's paired score test, one-sided"


def discordant(rng, d: float, name: str, n: int, disagree: float) -> list[tuple[dict, dict]]:
    """Pass/fail rows of one suite as the design assumes them: each item answered differently
    with probability `disagree`, the candidate then right with 1/2 + d / (2 disagree)."""
    champion = (rng.random(n) < 0.55).astype(float)
    candidate = champion.copy()
    split = rng.random(n) < disagree
    wins = rng.random(n) < 0.5 + d / (2 * disagree)
    candidate[split], champion[split] = wins[split], 1 - wins[split]
    return pairs(rows(candidate, name), rows(champion, name))


def graded(rng, d: float, name: str, n: int, square: float) -> list[tuple[dict, dict]]:
    """Graded rows: the candidate's scores differ from the champion's by a mean square of
    `square`, by `d` on average."""
    champion = rng.random(n)
    candidate = champion + d + rng.normal(0, (square - d * d) ** 0.5, n)
    return pairs(rows(candidate, name), rows(champion, name))


@pytest.mark.parametrize("config, primary", [
    (cfg.Gate(bootstrap_samples=20), discordant),  # the defaults: +0.075, 15% discordant
    (cfg.Gate(bootstrap_samples=20, min_detectable=0.04, discordance=0.05), graded)])
def test_the_whole_decision_promotes_as_often_as_its_design_states(config, primary):
    """Through `gate.decide`, 500 times each (seeded, a few seconds): a candidate exactly
    gate.min_detectable better on the primary and unchanged on a pass/fail guard is promoted
    within 4 points (2.5 standard errors) of the power `gate.design` states and the verdict
    records; the statement is no tautology: it lies well inside (0, 1)."""
    rng = np.random.default_rng(17)
    sizes, margins = {"arith": 200, "guard": 150}, {"arith": ("arith", 0.05),
                                                     "guard": ("guard", 0.06)}
    runs, promoted, stated = 500, 0, None
    for _ in range(runs):
        items = (primary(rng, config.min_detectable, "arith", sizes["arith"],
                         config.discordance)
                 + discordant(rng, 0.0, "guard", sizes["guard"], config.discordance))
        verdict = gate.decide(config, int(rng.integers(1 << 30)), items, set(), [], False,
                              margins)
        promoted += verdict["passed"]
        stated = verdict["design"]
    expected = gate.design(config, {"arith": {"items": 200, "graded": primary is not discordant},
                                    "guard": {"items": 150, "margin": 0.06}})
    assert {k: v for k, v in stated.items() if k != "suites"} == {
        k: v for k, v in expected.items() if k != "suites"}
    print(f"{primary.__name__} primary + a pass/fail guard: promoted {promoted / runs:.3f}, "
          f"stated {stated['decision_power']:.3f}")
    assert 0.3 < stated["decision_power"] < 0.9
    assert abs(promoted / runs - stated["decision_power"]) <= 0.04


def test_the_design_corrects_beta_for_the_guards_and_says_what_each_suite_needs(tmp_path):
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    # the demo: params.yaml's gate on its 200-item primary, no guard
    demo_items = len((repo / "data" / "benchmarks" / "arith.jsonl").read_text().splitlines())
    demo = gate.design(cfg.load("gate", repo / "params.yaml"), {"arith": {"items": demo_items}})
    assert demo["decision_power"] >= demo["target"] == 0.8
    assert demo["summary"] == ("whole decision power 85% (target 80%) at +0.075 on 'arith', 15% "
                               "of items answered differently (assumed); suite 'arith' needs "
                               "178 items, has 200")
    # McNemar's exact power, summed over the discordant items, against scipy's distributions
    k = np.arange(201)
    wins = np.array([next(w for w in range(j + 2) if w > j or stats.binom.sf(w - 1, j, 0.5)
                          < 0.05) for j in k])
    exact = (stats.binom.pmf(k, 200, 0.15) * stats.binom.sf(wins - 1, k, 0.75)).sum()
    assert gate.mcnemar_power(200, 0.15, 0.075, 0.05) == pytest.approx(exact, abs=1e-9)
    # issue 50's case: +5 points on 200 items, three unchanged 200-item guards at 0.05: the
    # whole decision promotes about 1 time in 10; each test is sized for 1 - 0.2 / 4
    config = cfg.Gate(min_detectable=0.05)
    suites = {"arith": {"items": 200}, **{g: {"items": 200, "margin": 0.05} for g in "abc"}}
    weak = gate.design(config, suites)
    assert 0.05 < weak["decision_power"] < 0.15 and weak["per_test_target"] == 0.95
    assert weak["suites"]["a"]["needs"] > 200 and "suite 'a' needs" in weak["summary"]
    # every suite at the size it says it needs: each test reaches 0.95, the whole decision 0.8
    sized = gate.design(config, {n: {**s, "items": weak["suites"][n]["needs"]}
                                 for n, s in suites.items()})
    assert all(s["test_power"] >= 0.95 for s in sized["suites"].values())
    assert sized["decision_power"] >= sized["bound"] >= 0.8
    # the forgetting guard counts from gate.forgetting_min_items on; a margin of 0 never holds
    assert "forgetting" not in gate.design(config, suites, forgetting=29)["suites"]
    assert gate.design(config, suites, forgetting=30)["per_test_target"] == 0.96
    zero = gate.design(config, {"arith": {"items": 200}, "z": {"items": 200, "margin": 0.0}})
    assert zero["suites"]["z"]["needs"] is None and zero["decision_power"] < 0.05
    # gate.underpowered: skip: a guard too small for its margin cannot block, nor count
    skip = gate.design(cfg.Gate(min_detectable=0.05, underpowered="skip"), suites)
    assert skip["suites"]["a"]["blocks"] is False and skip["per_test_target"] == 0.8
    assert skip["decision_power"] == skip["suites"]["arith"]["test_power"]
    # a lower level (LORD's) costs power
    assert gate.design(config, suites, level=0.001)["decision_power"] < weak["decision_power"]


def test_check_init_pending_and_the_report_state_the_decision_s_design(tmp_path):
    from flows.audit import report
    from flows.cli import design_line
    from flows.orchestration import promotion

    specs = {"arith": cfg.EnvironmentSpec(module="stages.envs.arith", benchmark="a.jsonl"),
             "code": cfg.EnvironmentSpec(module="stages.envs.coding", benchmark="c.jsonl",
                                         max_regression=0.1)}
    configs = {"gate": cfg.Gate(), "environments": specs}
    line = design_line(tmp_path, configs, {"arith": 400, "code": 300})
    assert line.startswith("gate design: whole decision power ") and "WARNING" not in line
    assert "1 guard unchanged" in line and "suite 'code' needs" in line
    short = design_line(tmp_path, configs, {"arith": 60, "code": 300})
    assert "suite 'arith' needs" in short and "has 60" in short
    assert short.endswith("; WARNING: below gate.power: add items to the suites that need them, "
                          "widen their margins or raise gate.min_detectable")
    # LORD's level for the next decision, from the history: lower, so less power
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "gate_history.jsonl").write_text(
        "".join(json.dumps({"passed": False}) + "\n" for _ in range(10)))
    lord = design_line(tmp_path, {**configs, "gate": cfg.Gate(sequential="lord")},
                       {"arith": 400, "code": 300})
    assert float(lord.split("power ")[1].split("%")[0]) < float(line.split("power ")[1]
                                                                  .split("%")[0])
    # the verdict records it; `pending`'s summary and the cycle report show it
    verdict = gate.decide(CONFIG, 0, discordant(np.random.default_rng(3), 0.3, "arith", 200,
                                                0.4), set(), [], False)
    assert verdict["design"] == {**gate.design(CONFIG, {"arith": {"items": 200}}),
                                 "suites": verdict["design"]["suites"]}
    assert verdict["design"]["suites"]["arith"]["observed_discordance"] > 0.2
    assert promotion.gate_summary(verdict).endswith("; " + verdict["design"]["summary"])
    assert f"  - design: {verdict['design']['summary']}" in report.gate_lines(verdict)
    # `check` then says the design assumed too few items answered differently, and what to set
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "gate.json").write_text(json.dumps(verdict))
    seen = verdict["design"]["suites"]["arith"]["observed_discordance"]
    warned = design_line(tmp_path, configs, {"arith": 400, "code": 300})
    assert warned.endswith(f"WARNING: the last decision saw a discordance of {seen:g} on the "
                           f"primary 'arith', above gate.discordance=0.15: the power stated is "
                           f"too high; set gate.discordance: {seen:g} in params.yaml")
    assert "discordance" not in design_line(
        tmp_path, {**configs, "gate": cfg.Gate(discordance=seen)}, {"arith": 400, "code": 300})


def test_a_design_no_candidate_can_meet_is_refused_naming_the_keys(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"gate": {"min_detectable": 0.2, "discordance": 0.1},
                                    "environments": {"arith": {"module": "stages.envs.arith",
                                                               "benchmark": "b.jsonl"}}}))
    with pytest.raises(cfg.ParamsError, match=r"gate.discordance: 0.1 is below "
                                              r"gate.min_detectable 0.2.*raise discordance"):
        cfg.load("gate", path)


def test_benchmark_refresh_grows_a_short_suite_to_what_the_design_needs(tmp_path, monkeypatch,
                                                                        capsys):
    from pathlib import Path

    from flows import cli

    items = [{"task_id": f"b{i}", **arith.chat_task(f"{i}+1")} for i in range(100)]
    pool = [{"task_id": f"trace:{i}", **arith.chat_task(f"{i}*2")} for i in range(120)]
    used = {"trace:0"}  # a held-out task that already informed a decision is never added
    assert gate.grown(items, pool, {t: 1 for t in used}, 150)[1] == pool[1:51]
    assert gate.grown(items, pool, {}, 80) == (items, [])  # long enough: unchanged

    repo = Path(__file__).resolve().parents[2]
    for name in ("params.yaml", "dvc.yaml"):
        (tmp_path / name).write_text((repo / name).read_text())
    benchmark = tmp_path / "data" / "benchmarks" / "arith.jsonl"
    for path, rows_ in ((benchmark, items), (tmp_path / "data" / "holdout" / "arith.jsonl",
                                             pool)):
        path.parent.mkdir(parents=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["benchmark", "refresh", "--grow", "--dry-run"]) == 0
    out = capsys.readouterr().out  # 100 items; the design (+0.075, 15%) needs 178
    assert ("arith: nothing replaced; grown from 100 to 178 items by held-out production tasks "
            "(the gate's design needs 178)") in out
    assert len(benchmark.read_text().splitlines()) == 100  # a dry run writes nothing


def test_adaptive_procedures_keep_fdr_at_alpha_and_double_lords_power():
    """SAFFRON and ADDIS (gate.sequential), a year of weekly decisions on 200-item pass/fail
    suites with exact McNemar p-values (benchmarks/gate_sequences.py, fewer years): with no real
    improvement the share of years with any false promotion stays within alpha; with 30 % of the
    candidates better by 3-10 points, false promotions stay within alpha of all promotions, and
    more of the real improvements are promoted than LORD++ promotes (issue 50.2: its level
    falls with every decision, to 9 % power at the first and 0.3 % at the 52nd)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gate_sequences as sim

    rng = np.random.default_rng(3)
    power = {}
    for method in ("lord", "saffron", "addis"):
        nulls = [sim.year(rng, method, [0.0] * 52) for _ in range(150)]
        any_false = sum(any(p for _, p in y) for y in nulls) / 150
        mixed = sim.summary([sim.year(rng, method, sim.truths(rng, 0.7)) for _ in range(150)])
        print(f"{method}: null years with a false promotion {any_false:.3f}, FDR "
              f"{mixed['fdr']:.3f}, power {mixed['power']:.3f}")
        assert any_false <= 0.05 + 3 * (0.05 * 0.95 / 150) ** 0.5
        assert mixed["fdr"] <= 0.05 + 3 * (0.05 * 0.95 / 150) ** 0.5
        power[method] = mixed["power"]
    assert power["saffron"] > 1.5 * power["lord"] and power["addis"] > 1.5 * power["lord"], power


def test_addis_through_gate_decide_promotes_nothing_in_null_years():
    """The same through the stage's own `gate.decide` (its p-value, its level from the history
    lines it reads): 30 null years of 52 decisions with gate.sequential: addis."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gate_sequences as sim

    got = sim.through_decide(np.random.default_rng(4), "addis", 30, null=1.0)
    assert got["promotions"] <= 0.1, got  # alpha / 2 of the years at most, with its error
    levels = [gate.addis_level(0.05, [0.9] * t) for t in range(60)]
    assert levels == [levels[0]] * 60  # a clearly worse candidate spends nothing (discarded)
    assert gate.addis_level(0.05, [0.001]) > levels[0]  # a promotion earns wealth back

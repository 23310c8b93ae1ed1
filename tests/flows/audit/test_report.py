"""The report's training panel: an on-policy GRPO generation said as steps and rewards, and its
reward per step plotted beside the loss (flows/audit/report.py)."""

import base64

from flows.audit import report


def test_an_on_policy_generation_is_said_as_steps_and_rewards():
    said = report.training_summary({
        "trained": True, "online": True, "steps": 8, "optimizer_steps": 55, "episodes": 5728,
        "reward_first_step": 0.2497, "reward_last_step": 0.5625, "generate_seconds": 3.54,
        "train_seconds": 9.15, "weight_sync_seconds": 0.0})
    assert "on-policy GRPO: 8 steps (55 optimizer steps)" in said
    assert "0.250 at the first step, 0.562 at the last" in said
    # an off-policy generation keeps its line
    assert report.training_summary({"trained": True, "steps": 80, "examples": 626}).startswith(
        "626 new verified examples")


def test_the_reward_per_step_gets_its_own_panel():
    curves = {"gen-1": [(1.0, 0.5), (2.0, 0.4)], "gen-2": [(1.0, -0.3), (2.0, -0.2)]}
    alone = report.training_plot(curves)
    both = report.training_plot(curves, {"gen-2": [(1.0, 0.25), (2.0, 0.38)]})
    assert alone.startswith("data:image/png;base64,") and both.startswith("data:image/png;base64,")

    def width(uri):  # a PNG's width: bytes 16-19 of the file
        data = base64.b64decode(uri.split(",", 1)[1])
        return int.from_bytes(data[16:20], "big")

    assert width(both) > width(alone)  # the second panel

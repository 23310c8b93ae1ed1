"""GRPO's loss and groups on fixed batches: flat groups, padding under the KL term, where the
clip binds (issue: GRPO as the field runs it)."""

from types import SimpleNamespace

import pytest
import torch

from stages.training import grpo


def rows_of(rewards, task="t"):
    return [{"task_id": task, "completion": f"c{i}", "reward": r, "token_ids": [1, 2],
             "model_mask": [0, 1], "logprobs": [0.0, -0.5]} for i, r in enumerate(rewards)]


@pytest.mark.parametrize("size", [3, 4, 8])
@pytest.mark.parametrize("parts", [(1.0, 0.3, 0.3), (0.1,), (0.7, 0.1, 0.1)])
def test_a_group_of_equal_rewards_that_are_not_binary_fractions_is_flat(size, parts):
    reward = sum(parts)  # 1.6 as weighted components add up: not exactly representable
    groups, counts = grpo.examples(rows_of([reward] * size))
    assert groups == [] and counts == {"groups_without_spread": 1}


def test_a_group_with_a_spread_keeps_advantages_of_mean_zero():
    groups, counts = grpo.examples(rows_of([1.6, 1.6, 0.3, 0.3]))
    advantages = [e["advantage"] for e in groups[0]["episodes"]]
    assert counts == {"groups_without_spread": 0}
    assert sum(advantages) == pytest.approx(0.0, abs=1e-9)
    assert advantages[0] == advantages[1] > 0 > advantages[2] == advantages[3]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trls_for_each_reward_scaling(scale):
    """TRL 1.16's formula (`_generate_and_score_completions`, scale_rewards), with its own nanstd:
    rewards - group mean, over (nanstd + 1e-4) of the group or of the batch, or unscaled."""
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0], [2.0, 0.0, 0.0, 0.3], [0.5, 0.5, 0.5, 0.5]])
    rows = [row for g, values in enumerate(rewards.tolist())
            for row in rows_of(values, f"task{g}")]
    mean = rewards.mean(dim=1, keepdim=True)
    std = {"group": nanstd(rewards, dim=1, keepdim=True) + 1e-4,
           "batch": nanstd(rewards) + 1e-4, "none": torch.tensor(1.0)}[scale]
    expected = (rewards - mean) / std
    groups, counts = grpo.examples(rows, scale)
    assert counts == {"groups_without_spread": 1}  # task2: flat, dropped (TRL: advantage 0)
    ours = torch.tensor([[e["advantage"] for e in g["episodes"]] for g in groups])
    assert torch.allclose(ours, expected[:2], atol=1e-6)
    assert torch.allclose(expected[2], torch.zeros(4))  # TRL's zero for the dropped group


class Fixed(torch.nn.Module):
    """A 'model' whose logits are a parameter: the loss and its gradient on a fixed batch."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.nn.Parameter(logits)

    def forward(self, input_ids, attention_mask):
        return SimpleNamespace(logits=self.logits)


def loss_of(logits, inputs, clip=0.2, kl_coef=0.0):
    trainer = SimpleNamespace(clip=clip, kl_coef=kl_coef, _extra={})
    model = Fixed(logits)
    loss = grpo.GRPOTrainer.compute_loss(trainer, model, inputs)
    loss.backward()
    return loss, model.logits.grad, trainer._extra


def batch(advantage, old=-1.0, ids=(0, 1, 2, 3), mask=(1, 1, 0)):
    n = len(ids) - 1
    return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids)),
            "mask": torch.tensor([mask], dtype=torch.float),
            "old_logprobs": torch.full((1, n), old), "ref_logprobs": torch.zeros(1, n),
            "advantage": torch.tensor([advantage])}


def test_a_padding_position_with_a_tiny_probability_leaves_the_kl_loss_finite():
    logits = torch.zeros(1, 4, 5)
    logits[0, 2, 3] = -200.0  # the padding token after the last model token: log-prob ~ -200
    loss, grad, _ = loss_of(logits, batch(1.0), kl_coef=0.1)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert grad[0, 2].abs().sum() == 0  # the padding position does not train


def test_the_clip_fraction_counts_only_where_the_clip_binds():
    uniform = torch.zeros(1, 4, 5)  # log-prob of every token log(1/5) = -1.61
    # recorded at -2.5: ratio exp(0.89) = 2.4 > 1.2 on both model tokens
    _, _, up = loss_of(uniform.clone(), batch(1.0, old=-2.5))
    _, _, down = loss_of(uniform.clone(), batch(-1.0, old=-2.5))
    assert (up["clip_fraction"], up["clip_fraction_high"], up["clip_fraction_low"]) == (1.0, 1.0, 0)
    # a negative advantage with a ratio above 1 + clip: the unclipped term is the minimum
    assert down["clip_fraction"] == 0.0
    # recorded at -0.5: ratio exp(-1.11) = 0.33 < 0.8, binding for a negative advantage
    _, _, low = loss_of(uniform.clone(), batch(-1.0, old=-0.5))
    assert (low["clip_fraction"], low["clip_fraction_low"]) == (1.0, 1.0)


def test_log_probs_recorded_at_a_temperature_are_those_the_loss_takes_at_it():
    """At T = 0.7 the rollout samples from softmax(logits / T): it records those log-probs and the
    loss takes them at T too, so the ratio is 1 at step 0 (TRL divides the logits by T likewise).
    """
    import random

    from stages import tinylm
    from stages.envs import arith
    from stages.generation import transformers_backend

    tokenizer = tinylm.build_tokenizer(arith)
    model = tinylm.build_model(tokenizer, n_layer=1, n_embd=32, n_head=2, n_positions=64, seed=0)
    model.eval()
    rng = random.Random(0)
    prompts = [tokenizer.apply_chat_template(arith.chat_task(arith.sample_question(rng))
                                             ["messages"], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
               for _ in range(4)]
    rows = transformers_backend.generate_ids(model, tokenizer, prompts, temperature=0.7,
                                             max_new_tokens=12,
                                             generator=torch.Generator().manual_seed(0))
    taken, at_one, recorded = [], [], []
    for prompt, row in zip(prompts, rows):
        ids = torch.tensor([prompt + row.token_ids])
        with torch.no_grad():
            at_t = grpo.token_logprobs(model, ids, torch.ones_like(ids), temperature=0.7)[0]
            at_1 = grpo.token_logprobs(model, ids, torch.ones_like(ids))[0]
        chosen = [len(prompt) - 1 + i for i, m in enumerate(row.model_mask) if m]
        taken += at_t[chosen].tolist()
        at_one += at_1[chosen].tolist()
        recorded += [lp for lp, m in zip(row.logprobs, row.model_mask) if m]
    assert len(recorded) > 10
    assert torch.allclose(torch.tensor(taken), torch.tensor(recorded), atol=1e-5)
    assert not torch.allclose(torch.tensor(at_one), torch.tensor(recorded), atol=1e-3)  # T = 1


def trl_loss(logits, inputs, loss_type, clip, clip_high, kl_coef, max_completion_length,
             weighted_kl=False):
    """TRL 1.16's own `GRPOTrainer._compute_loss` on the same batch: called unbound on an object
    holding just what it reads (its per-token log-probs come from the same fixed logits; the
    prompt is the first token, the completion the rest, as our batch's positions are)."""
    from collections import defaultdict

    from trl.trainer.grpo_trainer import GRPOTrainer as TRLGRPOTrainer

    model = Fixed(logits)
    tokens = inputs["mask"].sum()

    def per_token_logps(model, input_ids, attention_mask, logits_to_keep, **_):
        logp = grpo.token_logprobs(model, input_ids, attention_mask)[:, -logits_to_keep:]
        return logp, torch.zeros_like(logp), None

    accelerator = SimpleNamespace(num_processes=1, sync_gradients=True,
                                  reduce=lambda x, reduction: x, gather=lambda x: x,
                                  gather_for_metrics=lambda x: x)
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=per_token_logps, aux_loss_enabled=False,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        beta=kl_coef, args=SimpleNamespace(use_bias_correction_kl=weighted_kl, delta=None,
                             steps_per_generation=1),
        loss_type=loss_type, epsilon_low=clip, epsilon_high=clip_high or clip, use_vllm=False,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=max_completion_length, accelerator=accelerator,
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)})
    trl_inputs = {"prompt_ids": inputs["input_ids"][:, :1],
                  "prompt_mask": inputs["attention_mask"][:, :1].long(),
                  "completion_ids": inputs["input_ids"][:, 1:],
                  "completion_mask": inputs["mask"], "advantages": inputs["advantage"],
                  "old_per_token_logps": inputs["old_logprobs"],
                  "ref_per_token_logps": inputs["ref_logprobs"], "num_items_in_batch": tokens}
    loss = TRLGRPOTrainer._compute_loss(trainer, model, trl_inputs)
    loss.backward()
    return loss, model.logits.grad


@pytest.mark.parametrize("loss_type", ["bnpo", "grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("clip_high,kl_coef,weighted_kl", [(0.0, 0.0, False), (0.28, 0.05, False),
                                                            (0.0, 0.05, True)])
def test_each_loss_variant_equals_trls_own_code_on_one_fixed_batch(loss_type, clip_high, kl_coef,
                                                                   weighted_kl):
    """2 groups x 4 episodes of 2 to 9 model tokens, a masked tool span, noisy old log-probs."""
    generator = torch.Generator().manual_seed(0)
    episodes, width, vocab = 8, 12, 7
    logits = torch.randn(episodes, width, vocab, generator=generator)
    mask = torch.zeros(episodes, width - 1)
    for row, length in enumerate([2, 5, 9, 3, 7, 4, 9, 6]):
        mask[row, :length] = 1
    mask[2, 3:5] = 0  # a tool result inside the episode: not the model's tokens
    inputs = {"input_ids": torch.randint(0, vocab, (episodes, width), generator=generator),
              "attention_mask": torch.ones(episodes, width), "mask": mask,
              "advantage": torch.tensor([1.2, -0.4, 0.3, -1.1, 0.9, -0.2, -0.8, 0.1])}
    with torch.no_grad():
        now = grpo.token_logprobs(Fixed(logits), inputs["input_ids"], inputs["attention_mask"])
    inputs["old_logprobs"] = now + 0.3 * torch.randn(now.shape, generator=generator)
    inputs["ref_logprobs"] = now + 0.2 * torch.randn(now.shape, generator=generator)

    ours = SimpleNamespace(clip=0.2, kl_coef=kl_coef, _extra={}, loss_type=loss_type,
                           clip_high=clip_high, max_completion_length=16, temperature=1.0,
                           kl_importance_weighted=weighted_kl)
    model = Fixed(logits.clone())
    loss = grpo.GRPOTrainer.compute_loss(ours, model, inputs)
    loss.backward()
    expected, expected_grad = trl_loss(logits.clone(), inputs, loss_type, 0.2, clip_high,
                                       kl_coef, 16, weighted_kl)
    assert torch.allclose(loss, expected, atol=1e-5), (float(loss), float(expected))
    assert torch.allclose(model.logits.grad, expected_grad, atol=1e-4)


def test_the_grpo_variants_are_checked_by_name():
    from stages import config as cfg

    with pytest.raises(cfg.ParamsError, match="train.grpo.loss_type: 'ppo' is not one of bnpo"):
        cfg.GRPO(loss_type="ppo")
    with pytest.raises(cfg.ParamsError, match="train.grpo.scale_rewards: 'std'"):
        cfg.GRPO(scale_rewards="std")
    with pytest.raises(cfg.ParamsError, match="train.grpo.clip_high: must be >= 0"):
        cfg.GRPO(clip_high=-0.1)

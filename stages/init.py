"""Generation 0, the first champion: a tiny model warm-started on demonstrations, or an import.

Reads the `base` and `init` sections of params.yaml; writes a Hugging Face model folder. The demo's
warm start shows the model demonstrations of which `init.tool_fraction` use the calculator, so
generation 0 knows the tool exists but rarely calls it; the cycles must teach it when it pays off.
`offseason init` calls this, then registers, `dvc add`s, commits and tags the result.

    python -m stages.init models/champion                 # the demo's generation 0
    python -m stages.init models/champion --base-model PATH   # import a local HF model folder
"""

from __future__ import annotations

import argparse
import random
import shutil
from pathlib import Path

from stages import config as cfg
from stages import sft, tinylm
from stages.environments import ENVIRONMENTS


def encode_completion(tokenizer, env, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """Token ids of prompt + completion and the mask of the tokens the model would have chosen.

    Tokens the environment injects after each closed tool call are masked out, exactly as the
    generation backend masks them in a rollout.
    """
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    mask = [0] * len(ids)
    body = tokenizer.encode(completion, add_special_tokens=False)
    tool_close = tokenizer.convert_tokens_to_ids(env.TOOL_CLOSE)
    skip, start = 0, len(ids)
    for token in body:
        ids.append(token)
        mask.append(0 if skip else 1)
        skip = max(0, skip - 1)
        if token == tool_close and not mask[-1] == 0:
            text = tokenizer.decode(ids[start:], skip_special_tokens=True)
            skip = len(tokenizer.encode(env.on_tool_close(text), add_special_tokens=False))
    return ids, mask


def demonstrations(tokenizer, env, rng: random.Random, tool_fraction: float, batch_size: int):
    while True:
        batch = []
        for _ in range(batch_size):
            question = env.sample_question(rng)
            completion = env.demonstration(question, use_tool=rng.random() < tool_fraction)
            batch.append(encode_completion(tokenizer, env, env.prompt(question), completion))
        yield batch


def run(base: cfg.Base, config: cfg.Init, output: Path, base_model: Path | None = None) -> dict:
    """Write generation 0 to `output`; returns its metrics."""
    tinylm.set_threads(base.threads)
    output = Path(output)
    if output.exists():
        shutil.rmtree(output)
    tmp = output.with_name(output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if base_model is not None:
        model, tokenizer = tinylm.load(base_model)  # checks it is a loadable HF folder
        shutil.copytree(base_model, tmp)
        metrics = {"source": "import", "base_model": str(base_model),
                   "parameters": sum(p.numel() for p in model.parameters())}
    else:
        env = ENVIRONMENTS[base.environment]
        tokenizer = tinylm.build_tokenizer(env)
        model = tinylm.build_model(tokenizer, config.n_layer, config.n_embd, config.n_head,
                                   config.n_positions, base.seed)
        rng = random.Random(base.seed)
        metrics = sft.train(
            model, demonstrations(tokenizer, env, rng, config.tool_fraction, config.batch_size),
            steps=config.warmup_steps, lr=config.lr, tokenizer=tokenizer, seed=base.seed,
            label="warm start",
        )
        metrics.update(source="warm-start", parameters=sum(p.numel() for p in model.parameters()))
        tinylm.save(model, tokenizer, tmp, card={"generation": 0, "environment": env.NAME})
    tmp.rename(output)
    return metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="model folder to write (models/champion)")
    parser.add_argument("--base-model", type=Path, help="import this local Hugging Face model folder")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    metrics = run(cfg.load("base", args.params), cfg.load("init", args.params), args.output,
                  args.base_model)
    print(metrics)


if __name__ == "__main__":
    main()

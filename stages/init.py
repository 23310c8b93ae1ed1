"""Generation 0, the first champion: the demo's tiny chat model warm-started on demonstrations, or
an import.

Reads the `base` and `init` sections of params.yaml; writes a Hugging Face model folder. The demo's
model plays the arithmetic environment (`stages.envs.arith`) through the chat path: its warm start
shows it chat conversations of which `init.tool_fraction` call the calculator, so generation 0
knows the tool exists but rarely calls it; the cycles must teach it when it pays off. `offseason
init` calls this (for `base.model`, or `--base-model`, a model of the user's is imported instead),
then registers, `dvc add`s, commits and tags the result.

    python -m stages.init models/champion                 # the demo's generation 0
    python -m stages.init models/champion --base-model PATH   # import a local HF model folder
"""

from __future__ import annotations

import argparse
import random
import shutil
from pathlib import Path

from stages import config as cfg
from stages import io, tinylm
from stages.envs import arith


def run(base: cfg.Base, config: cfg.Init, output: Path, base_model: Path | None = None) -> dict:
    """Write generation 0 to `output`: the demo's model, or `base_model` imported; returns its
    metrics.
    """
    tinylm.set_threads(base.threads)
    output = Path(output)
    tmp = output.with_name(output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if base_model is not None:
        if not (Path(base_model) / "config.json").is_file():
            raise FileNotFoundError(f"{base_model}: not a Hugging Face model folder (no "
                                    f"config.json); set base.model in params.yaml (or "
                                    f"--base-model) to the folder save_pretrained wrote")
        model, tokenizer = tinylm.load(base_model)  # checks it is a loadable HF folder
        shutil.copytree(base_model, tmp)
        metrics = {"source": "import", "base_model": str(base_model),
                   "parameters": sum(p.numel() for p in model.parameters())}
    else:
        from stages.generation import chat  # the trainers' imports: only to build a model
        from stages.training import warmstart

        tokenizer = tinylm.build_tokenizer(arith)
        model = tinylm.build_model(tokenizer, config.n_layer, config.n_embd, config.n_head,
                                   config.n_positions, base.seed)
        template = chat.Template.of(tokenizer, list(arith.TOOLS), chat.end_ids(model, tokenizer))
        batches = warmstart.demonstrations(template, arith, random.Random(base.seed),
                                           config.tool_fraction, config.batch_size)
        metrics = warmstart.train(
            model, batches,
            steps=config.warmup_steps, lr=config.lr, tokenizer=tokenizer, seed=base.seed,
            label="warm start",
        )
        metrics.update(source="warm-start", parameters=sum(p.numel() for p in model.parameters()))
        tinylm.save(model, tokenizer, tmp, card={"generation": 0, "environment": arith.NAME})
    # the old model goes only once the new one is whole: a folder that fails to import (`init
    # --force --base-model` with a typo) leaves the champion as it was
    if output.exists():
        shutil.rmtree(output)
    tmp.rename(output)
    return metrics


def main(argv: list[str] | None = None) -> None:
    """Write the first champion (the DVC stage's command line)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="model folder to write (models/champion)")
    parser.add_argument("--base-model", type=Path, help="import this local Hugging Face model folder")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    metrics = run(cfg.load("base", args.params), cfg.load("init", args.params), args.output,
                  args.base_model)
    print(metrics)


if __name__ == "__main__":
    with io.explained("init"):
        main()
    io.exit_soon()

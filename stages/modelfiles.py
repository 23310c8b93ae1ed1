"""What a Hugging Face model folder must hold, checked without torch or transformers.

`check(path)` raises `ModelFolderError` naming the missing file: config.json, tokenizer.json, the
weights (model.safetensors, or the index of a sharded folder). `stages.tinylm.load` and
`load_tokenizer` call it first; `offseason init --base-model` calls it before it imports them, so a
folder missing a file fails in a second rather than after torch has loaded.
"""

from __future__ import annotations

from pathlib import Path


class ModelFolderError(FileNotFoundError):
    """The folder is not a usable model: a file missing, corrupt, or not matching the others."""


def check(path: str | Path) -> None:
    """Raise ModelFolderError naming the first file the folder lacks; nothing when it has them."""
    path = Path(path)
    missing = [name for name in ("config.json", "tokenizer.json") if not (path / name).exists()]
    if missing:
        raise ModelFolderError(
            f"{path} is not a Hugging Face model folder (missing {', '.join(missing)}); "
            f"run `offseason init` to create generation 0"
        )
    if not any((path / name).exists() for name in ("model.safetensors",
                                                    "model.safetensors.index.json")):
        raise ModelFolderError(
            f"{path / 'model.safetensors'}: the model's weights are missing (no model.safetensors "
            f"or model.safetensors.index.json in {path}); restore the folder (`dvc checkout`) or "
            f"rebuild it with `offseason init --force`")

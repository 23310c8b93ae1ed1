import pytest

from stages import config as cfg
from stages import gate, init, tinylm

TINY = cfg.Init(n_layer=1, n_embd=32, n_head=2, n_positions=64, warmup_steps=5, batch_size=8)


def test_warm_start_writes_a_loadable_generation_zero(tmp_path):
    metrics = init.run(cfg.Base(), TINY, tmp_path / "champion")
    assert metrics["source"] == "warm-start" and metrics["steps"] == 5
    model, tokenizer = tinylm.load(tmp_path / "champion")
    assert model.config.n_layer == 1 and len(tokenizer) > 20
    assert not (tmp_path / "champion.tmp").exists()


def test_import_copies_a_local_model_folder(tmp_path):
    init.run(cfg.Base(), TINY, tmp_path / "theirs")
    metrics = init.run(cfg.Base(), TINY, tmp_path / "champion", base_model=tmp_path / "theirs")
    assert metrics["source"] == "import"
    assert gate.weights_hash(tmp_path / "champion") == gate.weights_hash(tmp_path / "theirs")


def test_import_of_a_broken_folder_names_it_and_keeps_the_champion(tmp_path):
    """`init --force` with a folder that is not a model fails naming it, and the champion that
    was there stays (it was deleted before the import was tried)."""
    init.run(cfg.Base(), TINY, tmp_path / "champion")
    before = gate.weights_hash(tmp_path / "champion")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"broken is not a Hugging Face model folder "
                                                r"\(missing tokenizer.json\)"):
        init.run(cfg.Base(), TINY, tmp_path / "champion", base_model=tmp_path / "broken")
    with pytest.raises(FileNotFoundError, match=r"doesnotexist: not a Hugging Face model folder"):
        init.run(cfg.Base(), TINY, tmp_path / "champion", base_model=tmp_path / "doesnotexist")
    assert gate.weights_hash(tmp_path / "champion") == before

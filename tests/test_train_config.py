"""Training configs: YAML + dotted overrides into typed dataclasses, the example configs, and clear errors for
bad configs (unknown keys with a close-match hint, wrong types, missing values and files, a draft for another
target), through the library call and through the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from longspec_jax.errors import ConfigError
from tests.conftest import REPO_ROOT
from tests.train_helpers import build_target_dir, corpus_lines, write_config, write_jsonl
from train.config import TrainConfig, load_config
from train.main import main


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cfg")
    target = build_target_dir(root / "target")
    train = write_jsonl(root / "train.jsonl", corpus_lines(5, 0))
    return root, target, train, write_config(root / "c.yaml", target, [train], root / "ckpt")


def test_yaml_and_overrides_fill_typed_dataclasses(setup):
    root, target, train, path = setup
    config = load_config(str(path), ["train.steps=7", "optim.lr=1e-3", f"data.eval=[{train}]", "anchor.enabled=false"])
    assert isinstance(config, TrainConfig)
    assert config.train.steps == 7 and config.optim.lr == 1e-3 and config.anchor.enabled is False
    assert config.data.eval == [str(train)] and config.data.seq_len == 64
    assert config.optim.b2 == 0.95 and config.noise.max_shift == 4 and config.anchor.offset_ceiling == 30000


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO_ROOT / "configs").glob("*.yaml")))
def test_example_configs_load(setup, name):
    root, target, train, _ = setup
    overrides = [f"target.path={target}", f"data.train=[{train}]", f"checkpoint.dir={root / 'x'}"]
    raw = (REPO_ROOT / "configs" / name).read_text()
    if "eval:" in raw:
        overrides.append(f"data.eval=[{train}]")
    if "init:" in raw:
        overrides.append(f"draft.init={target}")
    config = load_config(str(REPO_ROOT / "configs" / name), overrides)
    assert config.train.steps > 0 and config.optim.lr > 0
    assert (config.optim.b1, config.optim.b2, config.optim.eps, config.optim.weight_decay, config.optim.clip,
            config.optim.warmup_ratio) == (0.9, 0.95, 1e-6, 0.1, 1.0, 0.1)


@pytest.mark.parametrize("override, message", [
    ("optim.lrr=1", r"unknown config key optim.lrr; did you mean optim.lr\?"),
    ("trian.steps=3", r"unknown config key trian.*did you mean train\?"),
    ("data.seq_lenght=8", r"did you mean data.seq_len\?"),
    ("train.steps=abc", r"bad value for train.steps"),
    ("train.batch_size=0", r"train.batch_size must be >= 1"),
    ("train.grad_accum=3", r"not a multiple of train.grad_accum"),
    ("data.train=[/no/such/file.jsonl]", r"data.train: file not found: /no/such/file.jsonl"),
    ("target.path=/no/such/dir", r"target.path: no HF model directory"),
    ("data.format=chat", r"data.format must be one of text, prompt_answer"),
    ("optim.lr=-1", r"optim.lr must be positive"),
    ("draft.init=/no/such/draft", r"draft.init: not found"),
    ("draft.vocab_size=-1", r"draft.vocab_size must be >= 0, got -1"),
    ("anchor.offset_ceiling=0", r"anchor.offset_ceiling must be a positive integer, or null .*got 0"),
    ("anchor.offset_ceiling=window", r"bad value for anchor.offset_ceiling"),
    ("anchor.context_margin=-1", r"anchor.context_margin must be >= 0, got -1"),
    ("draft.vocab_loss=top", r"draft.vocab_loss must be one of full, subset, got 'top'"),
    ("draft.vocab_loss=subset", r"draft.vocab_loss subset needs a draft vocabulary: set draft.vocab_size > 0"),
])
def test_bad_configs_are_named(setup, override, message):
    _, _, _, path = setup
    with pytest.raises(ConfigError, match=message):
        load_config(str(path), [override])


def test_offset_ceiling_null_is_the_whole_window(setup, tmp_path):
    """``anchor.offset_ceiling: null``, in the YAML or as an override, keeps None (the target's whole window)."""
    root, target, train, base = setup
    path = write_config(tmp_path / "whole.yaml", target, [train], root / "ckpt", anchor={"offset_ceiling": None})
    assert "offset_ceiling: null" in path.read_text()
    assert load_config(str(path)).anchor.offset_ceiling is None
    assert load_config(str(base), ["anchor.offset_ceiling=null"]).anchor.offset_ceiling is None


def test_missing_required_values_and_files(setup, tmp_path):
    root, target, train, _ = setup
    with pytest.raises(ConfigError, match="missing required config value optim.lr"):
        load_config(None, [f"target.path={target}", f"data.train=[{train}]", "train.steps=1", "train.batch_size=1",
                           f"checkpoint.dir={tmp_path}"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "nope.yaml"))
    (tmp_path / "bad.yaml").write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(tmp_path / "bad.yaml"))
    with pytest.raises(ConfigError, match="must look like dotted.key=value"):
        load_config(str(setup[3]), ["train.steps"])


def test_cli_reports_bad_config_and_a_draft_for_another_target(setup, tmp_path, capsys):
    root, target, train, path = setup
    assert main(["--config", str(path), "optim.lrr=1"]) == 2
    assert "error: unknown config key optim.lrr; did you mean optim.lr?" in capsys.readouterr().err
    # a draft exported for a wider target
    import jax
    from longspec_jax.config import TargetConfig
    from longspec_jax.draft import DraftConfig, init_draft
    from longspec_jax.draft_io import save_draft
    other = TargetConfig(model_type="llama", vocab_size=320, hidden_size=96, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=24)
    save_draft(init_draft(DraftConfig.from_target(other), jax.random.PRNGKey(0)), tmp_path / "other", target=other)
    assert main(["--config", str(path), f"draft.init={tmp_path / 'other'}", f"checkpoint.dir={tmp_path / 'c'}"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "built for another target" in err and "hidden_size=96 (target: 64)" in err
    assert not Path(tmp_path / "c").exists() or not any(Path(tmp_path / "c").glob("[0-9]*"))

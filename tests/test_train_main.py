"""``python -m train.main`` end to end on a tiny random target (CPU): the loss goes down, metrics are written,
the exported draft loads with ``load_draft`` and decodes losslessly with ``generate``; a run killed after a
checkpoint and resumed writes the uninterrupted run's metrics exactly (timing fields aside); a run whose loss is
over its draft vocabulary trains, resumes and exports as well."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from infer import generate
from longspec_jax import load_draft, load_target
from tests.conftest import REPO_ROOT
from tests.test_draft_io import assert_bit_equal
from tests.torch_reference_draft import draft_class
from tests.train_helpers import build_target_dir, corpus_lines, write_config, write_jsonl
from train.checkpointing import all_steps, restore_checkpoint
from train.export import main as export_main
from train.main import main
from train.metrics import TIMING_KEYS, read_metrics

@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    target = build_target_dir(root / "target")
    train = write_jsonl(root / "train.jsonl", corpus_lines(300, 1))
    dev = write_jsonl(root / "dev.jsonl", corpus_lines(40, 2))
    return root, target, train, dev


@pytest.mark.slow
def test_twenty_steps_lower_the_loss_and_the_draft_exports(setup, tmp_path):
    root, target, train, dev = setup
    config = write_config(tmp_path / "c.yaml", target, [train], tmp_path / "ckpt", data={"eval": [str(dev)]},
                          train={"grad_accum": 2}, log={"tensorboard": True}, draft={"vocab_size": 48})
    assert main(["--config", str(config)]) == 0
    metrics = read_metrics(tmp_path / "ckpt")
    assert [m["step"] for m in metrics] == list(range(1, 21))
    for m in metrics:
        assert {"step", "loss", "lr", "tokens_per_s", "grad_norm", "accuracy"} <= set(m)
    first, last = np.mean([m["loss"] for m in metrics[:3]]), np.mean([m["loss"] for m in metrics[-3:]])
    assert last < first - 0.5, (first, last)
    assert {"eval_loss", "eval_accuracy", "eval_chain_tau"} <= set(metrics[-1])
    assert list((tmp_path / "ckpt" / "tensorboard").glob("events.out.tfevents.*"))
    assert all_steps(tmp_path / "ckpt") == [10, 15, 20]  # keep 3
    assert (tmp_path / "ckpt" / "config.yaml").is_file()

    assert export_main(["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "draft")]) == 0
    tgt = load_target(target, dtype=jnp.float32)
    draft = load_draft(tmp_path / "draft", tgt, dtype=jnp.float32)
    np.testing.assert_array_equal(draft.vocab.ids, np.load(tmp_path / "ckpt" / "draft_vocab.npy"))
    assert draft.vocab.size == 48
    prompts = [tgt.tokenizer(t)["input_ids"] for t in corpus_lines(2, 7)]
    plain = generate(tgt, prompts, max_new_tokens=40, eos_token_id=[])
    for proposing in (draft, draft.with_vocab(tgt, None)):  # the run's 48 most frequent tokens, every token
        spec = generate(tgt, prompts, draft=proposing, max_new_tokens=40, eos_token_id=[], tree_shape=(2, 4, 4))
        np.testing.assert_array_equal(spec.tokens, plain.tokens)
        assert spec.num_rounds.sum() > 0


def _train_cmd(config):
    return [sys.executable, "-m", "train.main", "--config", str(config)]


@pytest.mark.slow
def test_a_killed_run_resumes_exactly(setup, tmp_path):
    root, target, train, _ = setup
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    sections = dict(train={"steps": 16}, checkpoint={"every": 4, "async_save": True})
    straight = write_config(tmp_path / "a.yaml", target, [train], tmp_path / "a", **sections)
    subprocess.run(_train_cmd(straight), cwd=REPO_ROOT, env=env, check=True, capture_output=True, timeout=600)

    killed = write_config(tmp_path / "b.yaml", target, [train], tmp_path / "b", **sections)
    proc = subprocess.Popen(_train_cmd(killed), cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while not all_steps(tmp_path / "b") or max(m["step"] for m in read_metrics(tmp_path / "b")) < 10:
        assert proc.poll() is None and time.time() < deadline, "the run ended before it could be killed"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    interrupted = read_metrics(tmp_path / "b")
    assert 10 <= interrupted[-1]["step"] < 16 and max(all_steps(tmp_path / "b")) < 16
    subprocess.run(_train_cmd(killed), cwd=REPO_ROOT, env=env, check=True, capture_output=True, timeout=600)

    strip = lambda ms: [{k: v for k, v in m.items() if k not in TIMING_KEYS} for m in ms]
    resumed, reference = read_metrics(tmp_path / "b"), read_metrics(tmp_path / "a")
    assert [m["step"] for m in resumed] == list(range(1, 17))
    assert strip(resumed) == strip(reference)


@pytest.mark.slow
def test_resuming_with_another_config_is_refused(setup, tmp_path, capsys):
    root, target, train, _ = setup
    config = write_config(tmp_path / "c.yaml", target, [train], tmp_path / "ckpt", train={"steps": 5})
    assert main(["--config", str(config)]) == 0
    assert main(["--config", str(config), "optim.lr=1e-2"]) == 2
    assert "different config (optim changed)" in capsys.readouterr().err


@pytest.mark.slow
def test_a_subset_loss_run_trains_resumes_and_exports(setup, tmp_path):
    """``draft.vocab_loss: subset`` with the KL term: the loss goes down and the evaluation runs; resumed from its
    middle checkpoint the run logs what it did straight through; the export holds the checkpoint's weights and
    vocabulary and loads in ``load_draft`` and in PyTorch LongSpec's layer."""
    root, target, train, dev = setup
    config = write_config(tmp_path / "c.yaml", target, [train], tmp_path / "ckpt", train={"steps": 6, "batch_size": 4},
                          checkpoint={"every": 3}, data={"seq_len": 32, "eval": [str(dev)], "eval_rows": 4},
                          loss={"kl_weight": 0.5}, optim={"lr": 1e-2}, draft={"vocab_size": 48, "vocab_loss": "subset"})
    assert main(["--config", str(config)]) == 0
    straight = read_metrics(tmp_path / "ckpt")
    assert straight[-1]["loss"] < straight[0]["loss"] - 0.5, straight
    assert straight[-1]["eval_chain_tau"] >= 1 and straight[-1]["eval_accuracy"] > 0
    shutil.rmtree(tmp_path / "ckpt" / "6")  # as if killed after the checkpoint of step 3
    assert main(["--config", str(config)]) == 0
    strip = lambda ms: [{k: v for k, v in m.items() if k not in TIMING_KEYS} for m in ms]
    assert strip(read_metrics(tmp_path / "ckpt")) == strip(straight)

    assert export_main(["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "draft")]) == 0
    draft = load_draft(tmp_path / "draft", load_target(target, dtype=jnp.float32), dtype=jnp.float32)
    np.testing.assert_array_equal(draft.vocab.ids, np.load(tmp_path / "ckpt" / "draft_vocab.npy"))
    assert_bit_equal(draft.variables, restore_checkpoint(tmp_path / "ckpt", restore_opt_state=False).draft_variables)
    hf = json.loads((tmp_path / "draft" / "config.json").read_text())
    _, info = draft_class(hf).from_pretrained(tmp_path / "draft", output_loading_info=True)
    assert not any(info.values()), info

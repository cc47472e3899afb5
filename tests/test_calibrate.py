"""``python -m infer.calibrate``: a draft's acceptance measured by rank and stored beside it, then read back by
``load_draft`` and used by ``generate``'s choice; bad inputs named."""

from __future__ import annotations

import json

import numpy as np

import jax
import jax.numpy as jnp
import pytest

from infer import generate
from infer.calibrate import main, read_documents
from longspec_jax import load_draft, load_target, save_draft
from longspec_jax.draft import DraftConfig, init_draft
from longspec_jax.speculation_profile import PROFILE_FILE, load_profile
from tests.train_helpers import build_target_dir, corpus_lines, write_jsonl


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    """A random HF target with a tokenizer, and a random draft for it saved in the released format."""
    root = tmp_path_factory.mktemp("calibrate")
    target_dir = build_target_dir(root / "target")
    target = load_target(target_dir, dtype=jnp.float32)
    draft = init_draft(DraftConfig.from_target(target.config), jax.random.PRNGKey(0))
    save_draft(draft, root / "draft", target=target)
    prompts = write_jsonl(root / "docs.jsonl", ["\n".join(corpus_lines(30, seed=s)) for s in range(3)])
    return target_dir, root / "draft", prompts


@pytest.mark.slow
def test_cli_stores_a_profile_that_load_draft_reads_and_generate_uses(pair_dirs, tmp_path, capsys):
    target_dir, draft_dir, prompts = pair_dirs
    out = tmp_path / "profile"
    assert main(["--target", str(target_dir), "--draft", str(draft_dir), "--prompts", str(prompts), "--context", "48",
                 "--num-prompts", "2", "--new-tokens", "12", "--batch", "2", "--temperatures", "0,1",
                 "--dtype", "float32", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "wrote" in err
    profile = load_profile(out)
    last_tau = {line.split(":")[0]: float(line.split(", tau ")[1]) for line in err.splitlines() if ", tau " in line}
    assert dict(profile.probe_tau) == pytest.approx(last_tau, abs=1e-9)
    assert list(last_tau) == ["beams T=0", "without_replacement T=1"] and min(last_tau.values()) >= 1.0
    kinds = {(t.kind, t.temperature) for t in profile.tables}
    assert kinds == {("beams", 0.0), ("without_replacement", 1.0)}
    assert all(len(t.rates) == 6 and all(0 <= x <= 1 for row in t.rates for x in row) for t in profile.tables)
    assert "2 prompts of 48 tokens" in profile.source
    (draft_dir / PROFILE_FILE).write_text((out / PROFILE_FILE).read_text())
    try:
        target = load_target(target_dir, dtype=jnp.float32)
        draft = load_draft(draft_dir, target)
        assert draft.profile == profile
        result = generate(target, [[5, 6, 7, 8]], draft=draft, max_new_tokens=8, temperature=1.0)
        assert profile.source in result.speculation.reason
    finally:
        (draft_dir / PROFILE_FILE).unlink()


def test_cli_calibrates_with_a_draft_vocabulary(pair_dirs, tmp_path, capsys):
    """``--draft-vocab FILE`` runs the draft on that vocabulary (said on stderr, with the running tau per kind);
    an unsorted file is refused by name."""
    target_dir, draft_dir, prompts = pair_dirs
    vocab = tmp_path / "vocab.npy"
    np.save(vocab, np.arange(0, 128, 2, dtype=np.int32))
    base = ["--target", str(target_dir), "--draft", str(draft_dir), "--prompts", str(prompts), "--context", "48",
            "--num-prompts", "2", "--new-tokens", "12", "--batch", "1", "--temperatures", "0", "--dtype", "float32",
            "--out", str(tmp_path / "profile")]
    assert main(base + ["--draft-vocab", str(vocab)]) == 0
    err = capsys.readouterr().err
    assert "draft vocabulary: 64 of" in err
    assert [line.split(", tau ")[0] for line in err.splitlines() if ", tau " in line] == [
        "beams T=0: 1/2 prompts", "beams T=0: 2/2 prompts"]
    np.save(vocab, np.asarray([4, 2], np.int32))
    with pytest.raises(SystemExit):
        main(base + ["--draft-vocab", str(vocab)])
    assert "sorted" in capsys.readouterr().err


def test_bad_inputs_are_named(pair_dirs, tmp_path, capsys):
    target_dir, draft_dir, prompts = pair_dirs
    base = ["--target", str(target_dir), "--draft", str(draft_dir), "--dtype", "float32"]
    for extra, words in ((["--prompts", str(tmp_path / "none.jsonl")], "does not exist"),
                         (["--prompts", str(prompts), "--context", "100000"], "no prompt document has 100000 tokens"),
                         (["--prompts", str(prompts), "--kinds", "greedy"], "unknown kind 'greedy'"),
                         (["--prompts", str(prompts), "--temperatures", "-1"], "temperatures must be >= 0"),
                         (["--prompts", str(prompts), "--batch", "0"], "--batch must be positive")):
        with pytest.raises(SystemExit):
            main(base + extra)
        assert words in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match="'text' field"):
        read_documents(str(bad))

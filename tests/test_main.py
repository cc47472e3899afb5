"""``python -m infer.main``: streaming output, timing lines, default target, and clean errors."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import time
import types

import pytest

from tests.conftest import REPO_ROOT
from tests.sharded_cases import hf_config, write_checkpoint
from infer import main as cli
from infer.phases import CallPhases
from longspec_jax.target import Target

REPORT = re.compile(r"compile (\S+) s; prefill (\d+) tokens (\S+) s; decode (\d+) tokens in (\S+) s: (\S+) tokens/s")


@pytest.fixture
def recorded(monkeypatch):
    """Records every ``generate`` call the CLI makes: its target, keyword arguments, output and wall seconds."""
    calls = []
    module = importlib.import_module("infer.generate")  # the attribute infer.generate is the function
    real = module.generate

    def spy(target, *args, **kwargs):
        start = time.perf_counter()
        out = real(target, *args, **kwargs)
        calls.append(types.SimpleNamespace(target=target, kwargs=kwargs, out=out, seconds=time.perf_counter() - start))
        return out

    monkeypatch.setattr(module, "generate", spy)
    return calls


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_tiny_random_streams_the_generated_text_and_times_decoding_alone(capsys, recorded):
    gen = importlib.import_module("infer.generate")
    plain_jit = gen._compiled("plain", tuple(sorted(gen.compile_options("plain", True).items())))
    before = plain_jit._cache_size()
    code, out, err = run_cli(capsys, "--tiny-random", "--prompt", "def f(", "--max-new-tokens", "12",
                             "--dtype", "float32", "--repeat", "1")
    assert code == 0, err
    assert len(recorded) == 2  # first call + one warm repeat
    first, warm = recorded
    assert isinstance(first.target, Target) and first.target.config.vocab_size == 256
    assert first.kwargs["temperature"] == 0.0  # greedy unless told
    assert first.out.num_generated.tolist() == [12]
    assert out == "def f(" + cli.ByteTokenizer().decode(first.out.tokens[0]) + "\n"  # each token streamed once
    assert (warm.out.tokens == first.out.tokens).all()
    assert plain_jit._cache_size() == before + 1  # compiled ahead of time once; the warm call reuses it
    [line] = [line for line in err.splitlines() if "compile" in line]
    compile_s, prompt, prefill_s, decoded, decode_s, rate = (float(x) for x in REPORT.search(line).groups())
    assert (prompt, decoded) == (6, 11)  # the prompt, and the tokens after prefill's first one
    assert compile_s + prefill_s + decode_s < first.seconds  # three parts of the first call, none counted twice
    assert decode_s < first.seconds - compile_s
    assert rate == pytest.approx(decoded / decode_s, rel=0.01, abs=0.1)  # over the decoding time alone
    assert "warm: median" in err


def test_phase_report_gives_the_decode_rate_over_decoding_alone():
    phases = CallPhases(compile_s=2.5, prefill_s=0.25, run_s=1.25)
    assert cli.phase_report(phases, 7, 64) == ("compile 2.5 s; prefill 7 tokens 0.25 s; decode 63 tokens in 1 s: "
                                               "63.0 tokens/s")
    assert cli.phase_report(phases, 7, 1) == "compile 2.5 s; prefill 7 tokens 0.25 s; decode nothing (one token)"


def test_prompt_file_and_sampling(capsys, recorded, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("import os\n")
    code, out, err = run_cli(capsys, "--tiny-random", "--prompt-file", str(prompt), "--max-new-tokens", "5",
                             "--dtype", "float32", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3")
    assert code == 0, err
    result = recorded[0].out
    assert out == "import os\n" + cli.ByteTokenizer().decode(result.tokens[0]) + "\n"
    assert "prompt: 10 tokens" in err


@pytest.fixture
def default_model(monkeypatch, tmp_path):
    """The embedded default model's place, pointed at ``tmp_path/default_model`` (empty: ``save()`` fills it with
    a tiny random target of 256 tokens, read as bytes, and a random draft for it)."""
    root = tmp_path / "default_model"
    monkeypatch.setattr(cli, "DEFAULT_MODEL", root)

    def save():
        import jax

        from longspec_jax import load_target, save_draft
        from longspec_jax.draft import DraftConfig, init_draft

        write_checkpoint(root / "target", hf_config(hidden_size=64, intermediate_size=64, num_attention_heads=4,
                                                    num_key_value_heads=2, head_dim=16), seed=0)
        target = load_target(root / "target")
        save_draft(init_draft(DraftConfig.from_target(target.config), jax.random.PRNGKey(1)), root / "draft",
                   format="hf", target=target)

    return root, save


def test_the_default_model_is_the_target_and_its_draft(capsys, recorded, default_model):
    root, save = default_model
    save()
    argv = ["--prompt", "def fibonacci(n):", "--max-new-tokens", "12", "--dtype", "float32", "--ignore-eos",
            "--tree-shape", "2,2"]  # one compiled round for both speculative runs
    code, spec, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert f"target: {root / 'target'}" in err and f"draft: {root / 'draft'}" in err
    assert "tokens/s" in err and "tokens per round (tau)" in err
    assert recorded[0].out.num_rounds[0] < 12  # rounds, not one step per token
    code, plain, err = run_cli(capsys, *argv, "--no-draft")
    assert code == 0 and "draft: none (plain decoding)" in err and "tau" not in err
    assert spec == plain  # greedy speculative decoding is plain greedy decoding
    code, again, err = run_cli(capsys, *argv, "--draft", str(root / "draft"))
    assert code == 0 and again == spec and "tokens per round (tau)" in err


def test_a_missing_default_model_is_a_clear_error(capsys, default_model):
    root, save = default_model
    code, _, err = run_cli(capsys, "--prompt", "x")
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"error: the default model's target is missing: no config.json in "
                                            f"{root / 'target'} (give --target DIR, or --tiny-random for a tiny "
                                            "random model)")
    save()
    for path in (root / "draft").iterdir():
        path.unlink()
    code, _, err = run_cli(capsys, "--prompt", "x")
    assert code == 2 and f"the default model's draft is missing: no config.json in {root / 'draft'}" in err
    code, _, err = run_cli(capsys, "--prompt", "x", "--no-draft", "--max-new-tokens", "2")
    assert code == 0, err


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens: must be a positive integer"),
    (["--prompt", "x", "--max-new-tokens", "many"], "--max-new-tokens: expected a positive integer"),
    (["--prompt", "x", "--temperature", "-0.5"], "--temperature: must be >= 0"),
    (["--prompt", "x", "--top-p", "0"], "--top-p: must be in (0, 1]"),
    (["--prompt", "x", "--dtype", "int8"], "--dtype: invalid choice"),
    (["--max-new-tokens", "3"], "one of the arguments --prompt --prompt-file is required"),
    (["--prompt", "x", "--prompt-file", "y"], "not allowed with argument --prompt"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read --prompt-file"),
    (["--prompt", "x", "--target", "/nonexistent/model"], "--target /nonexistent/model: not a directory"),
    (["--prompt", "x", "--draft", "/nonexistent/draft"], "--draft /nonexistent/draft: no such file"),
    (["--tiny-random", "--target", ".", "--prompt", "x"], "either --target or --tiny-random"),
    (["--prompt", "x", "--tree-shape", "4,x"], "--tree-shape: expected comma-separated positive integers"),
    (["--tiny-random", "--prompt", "x", "--draft-sampling", "beams"], "--draft-sampling needs a draft"),
    (["--prompt", "x", "--no-draft", "--draft-sampling", "top_plus_one"], "--draft-sampling needs a draft"),
    (["--prompt", "x", "--draft-sampling", "often"], "--draft-sampling: invalid choice"),
    (["--prompt", "x", "--no-draft", "--draft", "."], "either --draft or --no-draft"),
    (["--tiny-random", "--prompt", "x", "--draft-vocab", "full"], "--draft-vocab needs a draft"),
    (["--tiny-random", "--prompt", "x", "--draft", ".", "--draft-vocab", "/no/ids.npy"],
     "--draft-vocab /no/ids.npy: no such file (or 'full')"),
])
def test_bad_arguments_are_argparse_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_model_dir_is_a_clean_error(capsys, tmp_path):
    code, _, err = run_cli(capsys, "--target", str(tmp_path), "--prompt", "x")
    assert code == 2
    assert err.strip().splitlines()[-1] == f"error: missing config.json in {tmp_path}"
    assert "Traceback" not in err


def test_bad_generation_arguments_are_clean_errors(capsys):
    code, _, err = run_cli(capsys, "--tiny-random", "--prompt", "", "--max-new-tokens", "3")
    assert code == 2 and "error: the prompt is empty" in err
    code, _, err = run_cli(capsys, "--tiny-random", "--prompt", "x" * 4090, "--max-new-tokens", "10")
    assert code == 2 and "exceeds the context capacity of 4096 tokens" in err


def test_draft_gives_a_clear_message(capsys, tmp_path):
    code, _, err = run_cli(capsys, "--tiny-random", "--draft", str(tmp_path), "--prompt", "x",
                           "--max-new-tokens", "3")
    assert code == 2
    assert err.strip().splitlines()[-1].startswith("error: ")
    assert "Traceback" not in err


def test_draft_gives_the_same_text_as_plain_decoding(capsys, tmp_path):
    import jax
    import jax.numpy as jnp

    from longspec_jax import save_draft
    from longspec_jax.draft import DraftConfig, init_draft

    target, _ = cli.tiny_random_target(jnp.float32)
    draft = init_draft(DraftConfig.from_target(target.config), jax.random.PRNGKey(1))
    save_draft(draft, tmp_path / "draft", format="hf", target=target)
    argv = ["--tiny-random", "--dtype", "float32", "--prompt", "def f(", "--max-new-tokens", "16", "--ignore-eos"]
    code, plain, _ = run_cli(capsys, *argv)
    assert code == 0
    code, spec, err = run_cli(capsys, *argv, "--draft", str(tmp_path / "draft"), "--tree-shape", "2,2,2")
    assert code == 0, err
    assert spec == plain and "tokens per round (tau)" in err
    assert "speculation: tree 2,2,2, draft's top-k beams (tree_shape given" in err
    # a sampled chain: the flag reaches generate(), which checks the temperature and runs it at T > 0
    sampled = ["--draft", str(tmp_path / "draft"), "--tree-shape", "1,1,1", "--draft-sampling", "without_replacement"]
    code, _, err = run_cli(capsys, *argv, *sampled)
    assert code == 2 and "draft_sampling needs temperature > 0" in err
    code, _, err = run_cli(capsys, *argv, *sampled, "--temperature", "1")
    assert code == 0 and "tokens per round (tau)" in err, err


def test_draft_vocab_gives_the_same_text_as_plain_decoding(capsys, recorded, tmp_path):
    """A draft vocabulary of the bytes 0..127 (the draft's own) or of the even bytes (from a file), where the output
    holds others too; ``full`` drops the draft's own; a bad file is a clean error."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from longspec_jax import save_draft
    from longspec_jax.draft import DraftConfig, init_draft

    target, _ = cli.tiny_random_target(jnp.float32)
    draft = init_draft(DraftConfig.from_target(target.config), jax.random.PRNGKey(1))
    save_draft(draft.with_vocab(target, np.arange(128)), tmp_path / "draft", format="hf", target=target)
    np.save(tmp_path / "ids.npy", np.arange(0, 256, 2))
    argv = ["--tiny-random", "--dtype", "float32", "--prompt", "def f(", "--max-new-tokens", "16", "--ignore-eos",
            "--draft", str(tmp_path / "draft"), "--tree-shape", "2,2,2"]
    code, plain, _ = run_cli(capsys, *argv[:8])
    tokens = recorded[-1].out.tokens[0]
    assert code == 0 and (tokens >= 128).any() and (tokens % 2).any()
    for extra, words in (([], "draft vocabulary: 128 of 256 tokens"), (["--draft-vocab", str(tmp_path / "ids.npy")],
                         "draft vocabulary: 128 of 256 tokens"), (["--draft-vocab", "full"], None)):
        code, spec, err = run_cli(capsys, *argv, *extra)
        assert code == 0 and spec == plain, err
        assert (words in err) if words else "draft vocabulary" not in err
    np.save(tmp_path / "bad.npy", np.asarray([3, 1]))
    code, _, err = run_cli(capsys, *argv, "--draft-vocab", str(tmp_path / "bad.npy"))
    assert code == 2 and "bad.npy: not sorted" in err


def test_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "infer.main", "--tiny-random", "--prompt", "ab",
                           "--max-new-tokens", "4", "--dtype", "float32"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ab") and "tokens/s" in proc.stderr

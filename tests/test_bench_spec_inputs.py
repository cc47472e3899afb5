"""infer.bench.spec_inputs: the dev-split prompt stream and the prompt offset without near-ties."""

from __future__ import annotations

import numpy as np
import pytest

from infer.bench import spec_inputs
from infer.bench.near_tie import greedy_top2_gaps
from longspec_jax.testing import tiny_target


def _bytes_tokenizer(text):
    return {"input_ids": list(text.encode("utf-8"))}


def test_dev_prompt_tokens_concatenates_sorted_sources_with_headers():
    pytest.importorskip("pygments")
    ids = spec_inputs.dev_prompt_tokens(_bytes_tokenizer, 5000)
    assert len(ids) == 5000
    assert bytes(ids).decode().startswith("# pygments/__init__.py\n")
    with pytest.raises(RuntimeError, match="tokens of dev-split source found"):
        spec_inputs.dev_prompt_tokens(_bytes_tokenizer, 10**10)


def test_stable_prompt_offset_takes_the_first_offset_above_the_gap():
    target = tiny_target(0)
    stream = np.random.default_rng(5).integers(0, target.config.vocab_size, 48).tolist()
    gaps = [float(greedy_top2_gaps(target, stream[o:o + 16], 4)[1].min()) for o in (0, 8, 16)]
    # a threshold only the offset-8 prompt meets (or the best one, if none does) picks it
    threshold = min(gaps[1], max(gaps))
    offset, gap = spec_inputs.stable_prompt_offset(target, stream, 16, 4, threshold, search=16, step=8)
    first = next(i for i, g in enumerate(gaps) if g >= threshold)
    assert offset == 8 * first and gap == pytest.approx(gaps[first])
    # no offset qualifies: the one with the largest smallest gap
    offset, gap = spec_inputs.stable_prompt_offset(target, stream, 16, 4, 1e9, search=16, step=8)
    assert offset == 8 * int(np.argmax(gaps)) and gap == pytest.approx(max(gaps))


def test_stable_row_starts_search_each_batch_row_from_its_own_start():
    target = tiny_target(0)
    stream = np.random.default_rng(5).integers(0, target.config.vocab_size, 48).tolist()
    found = spec_inputs.stable_row_starts(target, stream, 16, 4, 1e9, search=8, rows=2, stride=16, step=8)
    for b, (start, gap) in enumerate(found):
        alone = spec_inputs.stable_prompt_offset(target, stream[16 * b:], 16, 4, 1e9, search=8, step=8)
        assert start == 16 * b + alone[0] and gap == pytest.approx(alone[1])
    gaps = [float(greedy_top2_gaps(target, stream[s:s + 16], 4)[1].min()) for s in (0, 8, 16, 24)]
    assert [start for start, _ in found] == [8 * int(np.argmax(gaps[:2])), 16 + 8 * int(np.argmax(gaps[2:]))]


def test_padded_pair_runs_the_pad_script_once_per_model(tmp_path):
    """``build_padded_pair`` saves a random small draft and pads it and the fixture through ``pad_pair``, with
    ``PAD_ARGS``; a second call reuses WORK. A stand-in pad script records its arguments."""
    from tests.train_helpers import build_target_dir

    fixture = build_target_dir(tmp_path / "fixture")
    calls = tmp_path / "calls.txt"
    script = tmp_path / "pad.py"
    script.write_text("import os, sys\n"
                      f"open({str(calls)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
                      "out = sys.argv[4] if sys.argv[1] == '--draft' else sys.argv[2]\n"
                      "os.makedirs(out, exist_ok=True)\n"
                      "open(os.path.join(out, 'config.json'), 'w').write('{}')\n")
    work = tmp_path / "work"
    big, big_draft = spec_inputs.build_padded_pair(str(fixture), str(script), str(work))
    assert (big, big_draft) == (str(work / "target"), str(work / "draft_random"))
    small_draft = work / "small_draft"
    assert (small_draft / "config.json").is_file()  # a real draft for the fixture, saved in HF format
    assert calls.read_text().splitlines() == [
        " ".join([str(fixture), big, "--overwrite", *spec_inputs.PAD_ARGS]),
        " ".join(["--draft", str(small_draft), big, big_draft, "--overwrite"])]
    assert spec_inputs.build_padded_pair(str(fixture), str(script), str(work)) == (big, big_draft)
    assert len(calls.read_text().splitlines()) == 2  # nothing padded again

    (small_draft / "draft_vocab.npy").write_bytes(b"ids")  # what proposes and how well travels with the draft
    (small_draft / "speculation_profile.json").write_text("{}")
    spec_inputs.pad_pair(str(fixture), {"random": str(small_draft)}, str(script), str(work))
    assert (work / "draft_random" / "draft_vocab.npy").read_bytes() == b"ids"
    assert (work / "draft_random" / "speculation_profile.json").read_text() == "{}"


def test_load_target_and_drafts_pads_first_when_asked(tmp_path):
    """The target in bf16 and each named draft loaded against it, from the given directories or, with a pad
    script, from its outputs (a stand-in script that copies records that it ran)."""
    import jax
    import jax.numpy as jnp

    from longspec_jax import load_target, save_draft
    from longspec_jax.draft import DraftConfig, init_draft
    from tests.train_helpers import build_target_dir

    fixture = str(build_target_dir(tmp_path / "fixture"))
    draft_dir = str(tmp_path / "draft")
    small = load_target(fixture)
    save_draft(init_draft(DraftConfig.from_target(small.config), jax.random.PRNGKey(0)), draft_dir, target=small)
    target, drafts, target_dir = spec_inputs.load_target_and_drafts(fixture, {"ours": draft_dir}, None, "unused")
    assert target_dir == fixture and target.dtype == jnp.bfloat16 and set(drafts) == {"ours"}
    assert drafts["ours"].config.hidden_size == target.config.hidden_size

    script = tmp_path / "copy.py"
    script.write_text("import shutil, sys\n"
                      "src, dst = (sys.argv[2], sys.argv[4]) if sys.argv[1] == '--draft' else sys.argv[1:3]\n"
                      "shutil.copytree(src, dst, dirs_exist_ok=True)\n")
    work = tmp_path / "work"
    target, drafts, target_dir = spec_inputs.load_target_and_drafts(fixture, {"ours": draft_dir}, str(script),
                                                                    str(work))
    assert target_dir == str(work / "target") and (work / "draft_ours" / "config.json").is_file()
    assert target.dtype == jnp.bfloat16 and set(drafts) == {"ours"}


@pytest.mark.slow  # ~20 s: an HF model beside ours; a benchmark option, so it leaves the default suite its margin
def test_rope_parameters_copies_target_and_drafts(tmp_path):
    """``with_rope_parameters``: linked copies whose config.json carries the new RoPE parameters; our loader and
    transformers read the same function from them, and the draft still loads against the edited target."""
    import json
    import os

    import jax
    import jax.numpy as jnp
    import torch
    from transformers import AutoModelForCausalLM

    from infer import generate
    from longspec_jax import load_draft, load_target, save_draft
    from longspec_jax.draft import DraftConfig, init_draft
    from tests.train_helpers import build_target_dir

    fixture = build_target_dir(tmp_path / "fixture")
    small = load_target(str(fixture), dtype=jnp.float32, load_tokenizer=False)
    save_draft(init_draft(DraftConfig.from_target(small.config), jax.random.PRNGKey(0)), str(tmp_path / "draft"),
               format="hf", target=small)
    rope = {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256}
    work = str(tmp_path / "work")
    target_dir, drafts = spec_inputs.with_rope_parameters(str(fixture), {"a": str(tmp_path / "draft")}, rope, work)
    assert spec_inputs.with_rope_parameters(str(fixture), {"a": str(tmp_path / "draft")}, rope, work) == (
        target_dir, drafts)  # a second call reuses the copies
    assert os.path.islink(os.path.join(target_dir, "model.safetensors"))
    assert os.path.islink(os.path.join(drafts["a"], "model.safetensors"))
    for d in (target_dir, drafts["a"]):
        with open(os.path.join(d, "config.json")) as f:
            assert json.load(f)["rope_parameters"] == {**rope, "rope_theta": 10000.0}

    edited = load_target(target_dir, dtype=jnp.float32)
    assert (edited.config.rope.rope_type, edited.config.rope.factor, edited.config.rope.theta) == ("llama3", 2.0,
                                                                                                   10000.0)
    load_draft(drafts["a"], edited)
    prompt = np.random.default_rng(1).integers(4, edited.config.vocab_size, 300).tolist()  # past 256 positions
    ours = generate(edited, [prompt], max_new_tokens=6, eos_token_id=[]).tokens[0].tolist()
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    hf_before = AutoModelForCausalLM.from_pretrained(str(fixture), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0,
                             eos_token_id=None)[0, len(prompt):].tolist()
        logits, logits_before = (m(torch.tensor([prompt])).logits[0, -1] for m in (hf, hf_before))
    assert ours == theirs
    assert float((logits - logits_before).abs().max()) > 1e-3  # the edit changed the function


@pytest.mark.parametrize("rope, window", [
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16384}, 131072),  # grows
    ({"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 1024}, 32768),  # never shrinks
    ({"rope_theta": 5e5}, 32768)])  # no factor: the window stays
def test_rope_parameters_widen_the_window_to_factor_times_original(tmp_path, rope, window):
    """As in Hugging Face configs, the scaled window is ``factor x original_max_position_embeddings``: the edited
    target and its drafts take prompts that long."""
    import json

    for name in ("target", "draft"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"max_position_embeddings": 32768}))
    target, drafts = spec_inputs.with_rope_parameters(str(tmp_path / "target"), {"a": str(tmp_path / "draft")},
                                                      rope, str(tmp_path / "work"))
    for directory in (target, drafts["a"]):
        with open(f"{directory}/config.json") as f:
            assert json.load(f)["max_position_embeddings"] == window

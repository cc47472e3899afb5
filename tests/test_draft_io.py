"""Draft checkpoint interop with PyTorch LongSpec: HF release format (config.json + model.safetensors),
training format (draft_model_weights.pth), Orbax training checkpoints and the ``train.export`` CLI.

Round trips are bit-exact; exported drafts load strictly into the test-only torch layer written from
the PyTorch LongSpec code and give our logits; bad files fail with errors that name the problem.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections import OrderedDict

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import torch

from longspec_jax import Draft, Target, WeightsError, load_draft, load_target, save_draft
from longspec_jax.config import TargetConfig
from longspec_jax.draft_io import PTH_NAME, draft_state_dict, hf_config_from_target_config
from longspec_jax.draft_vocab import VOCAB_NAME, save_draft_vocab
from longspec_jax.safetensors_io import SafetensorsFile, save_file
from tests.test_draft import TOL, jax_full_logits, random_draft, random_inputs, target_config
from tests.torch_reference_draft import draft_class, draft_logits, hf_config_object
from train import checkpointing
from train.export import main as export_main

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
NUM_KEYS = 20


def io_target(name: str = "llama-gqa", **overrides) -> Target:
    """A target for loading drafts: only its config and parameter dtype matter here."""
    config = target_config(name)
    if overrides:
        config = dataclasses.replace(config, **overrides)
    return Target(config=config, params={"embed": jnp.zeros((config.vocab_size, config.hidden_size), jnp.float32)})


def assert_bit_equal(a: dict, b: dict):
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb
    for (path, x), (_, y) in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
        assert x.tobytes() == y.tobytes(), f"{jax.tree_util.keystr(path)} differs"


def cast(draft: Draft, dtype) -> Draft:
    return Draft(config=draft.config, variables=jax.tree_util.tree_map(lambda a: a.astype(dtype), draft.variables))


# ----------------------------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-mqa"])
def test_hf_round_trip_bit_exact(tmp_path, name, dtype):
    target = io_target(name)
    draft = cast(random_draft(target.config, seed=1), DTYPES[dtype])
    weights = save_draft(draft, tmp_path, format="hf", dtype=dtype, target=target)
    assert weights == str(tmp_path / "model.safetensors")
    st = SafetensorsFile(weights)
    assert len(st.keys()) == NUM_KEYS
    assert st.shape("self_attn.k_proj.weight") == (target.config.num_kv_heads * target.config.head_dim, 64)
    assert st.shape("mlp.down_proj.weight") == (64, target.config.intermediate_size)
    assert {np.dtype(st.get(k).dtype) for k in st.keys()} == {np.dtype(DTYPES[dtype])}
    loaded = load_draft(tmp_path, target, dtype=DTYPES[dtype])
    assert loaded.config.window == 512  # the PyTorch formats have no window: the reference's 512
    loaded = load_draft(tmp_path, target, dtype=DTYPES[dtype], window=draft.config.window)
    assert loaded.config == draft.config
    assert_bit_equal(loaded.variables, draft.variables)
    # a draft loaded from a file carries its target's config and re-exports without target=
    save_draft(loaded, tmp_path / "again", dtype=dtype)
    assert_bit_equal(load_draft(tmp_path / "again", target, dtype=DTYPES[dtype]).variables, draft.variables)


def test_hf_default_is_fp32_release_and_dtype_defaults_to_target(tmp_path):
    target = io_target()
    draft16 = cast(random_draft(target.config, seed=2), jnp.bfloat16)
    save_draft(draft16, tmp_path, target=target)  # fp32 on disk, like the releases
    assert {np.dtype(SafetensorsFile(str(tmp_path / "model.safetensors")).get(k).dtype)
            for k in draft_state_dict(draft16)} == {np.dtype(np.float32)}
    config_json = json.loads((tmp_path / "config.json").read_text())
    assert config_json["torch_dtype"] == "float32"
    loaded = load_draft(tmp_path, target)  # dtype=None: the target's dtype (float32 here)
    assert loaded.param_dtype == jnp.float32
    assert_bit_equal(load_draft(tmp_path, target, dtype=jnp.bfloat16).variables, draft16.variables)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_pth_round_trip_bit_exact(tmp_path, dtype):
    target = io_target("llama-mha-linear")
    draft = cast(random_draft(target.config, seed=3), DTYPES[dtype])
    path = save_draft(draft, tmp_path, format="pth", dtype=dtype, target=target)
    assert path == str(tmp_path / PTH_NAME)
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert isinstance(state, OrderedDict) and len(state) == NUM_KEYS
    assert {t.dtype for t in state.values()} == {getattr(torch, dtype)}
    for source in (tmp_path, tmp_path / PTH_NAME):  # the directory or the file itself
        assert_bit_equal(load_draft(source, target, dtype=DTYPES[dtype]).variables, draft.variables)
    # a path ending in .pth names the file
    other = save_draft(draft, tmp_path / "x" / "step1.pth", format="pth", dtype=dtype, target=target)
    assert_bit_equal(load_draft(other, target, dtype=DTYPES[dtype]).variables, draft.variables)


# ----------------------------------------------------------------------------------------------------------------
# The exported files in PyTorch


@pytest.mark.parametrize("name", ["llama-gqa", "llama-mha-linear", "qwen2-mqa"])
def test_exported_draft_runs_in_torch_reference(tmp_path, name):
    from safetensors.torch import load_file

    target = io_target(name)
    draft = random_draft(target.config, seed=4)
    save_draft(draft, tmp_path / "hf", format="hf", target=target)
    save_draft(draft, tmp_path / "pth", format="pth", target=target)
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    tokens, embed, lm_head, tk, tv = random_inputs(target.config, batch=2, length=40, seed=9)
    ours = jax_full_logits(draft, tokens, embed, lm_head, tk, tv)

    loaded = []
    model = draft_class(hf)(hf_config_object(hf)).eval()
    model.load_state_dict(load_file(str(tmp_path / "hf" / "model.safetensors")), strict=True)
    loaded.append(model)
    model = draft_class(hf)(hf_config_object(hf)).eval()
    model.load_state_dict(torch.load(tmp_path / "pth" / PTH_NAME, map_location="cpu", weights_only=True),
                          strict=True)
    loaded.append(model)
    # the PyTorch LongSpec loading path: <Llama|Qwen2>GlideDecoderLayer.from_pretrained(dir)
    model, info = draft_class(hf).from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    loaded.append(model.float().eval())
    for model in loaded:
        ref = draft_logits(model, hf, tokens, embed, lm_head.T.copy(), tk, tv, window=draft.config.window)
        np.testing.assert_allclose(ours, ref.numpy(), atol=TOL, rtol=0)


def test_mlp_bias_target(tmp_path):
    """A Llama target with mlp_bias (no released draft has one) gets MLP biases: 23 keys, still loadable."""
    target = io_target(mlp_bias=True)
    draft = random_draft(target.config, seed=5)
    assert draft.config.mlp_bias
    save_draft(draft, tmp_path, target=target)
    assert len(SafetensorsFile(str(tmp_path / "model.safetensors")).keys()) == NUM_KEYS + 3
    assert_bit_equal(load_draft(tmp_path, target).variables, draft.variables)
    hf = json.loads((tmp_path / "config.json").read_text())
    model, info = draft_class(hf).from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens, embed, lm_head, tk, tv = random_inputs(target.config, batch=2, length=40, seed=9)
    ref = draft_logits(model.float().eval(), hf, tokens, embed, lm_head.T.copy(), tk, tv, window=draft.config.window)
    np.testing.assert_allclose(jax_full_logits(draft, tokens, embed, lm_head, tk, tv), ref.numpy(), atol=TOL, rtol=0)


def test_release_format_fixture_loads(tmp_path):
    """A release-style directory written by the official tools: fp32 ``safetensors.torch.save_file`` of the
    torch layer's state dict + the target's config.json."""
    from safetensors.torch import save_file as torch_save_file

    target = io_target("llama-gqa-llama3")
    hf = hf_config_from_target_config(target.config)
    torch.manual_seed(0)
    model = draft_class(hf)(hf_config_object(hf)).float().eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * (0.1 if pname.endswith(("weight", "bias")) else 1.0)
                        + (1.0 if "layernorm" in pname else 0.0))
    torch_save_file(model.state_dict(), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({**hf, "torch_dtype": "float32"}))
    draft = load_draft(tmp_path, target, dtype=jnp.float32)
    params = draft.variables["params"]
    np.testing.assert_array_equal(np.asarray(params["self_attn"]["q_proj"]["kernel"]),
                                  model.self_attn.q_proj.weight.detach().numpy().T)
    np.testing.assert_array_equal(np.asarray(params["cross_attn"]["v_proj"]["bias"]),
                                  model.cross_attn.v_proj.bias.detach().numpy())
    tokens, embed, lm_head, tk, tv = random_inputs(target.config, batch=1, length=24, seed=10)
    ours = jax_full_logits(draft, tokens, embed, lm_head, tk, tv)
    ref = draft_logits(model, hf, tokens, embed, lm_head.T.copy(), tk, tv, window=draft.config.window)
    np.testing.assert_allclose(ours, ref.numpy(), atol=TOL, rtol=0)


def test_config_json_of_a_loaded_target(tmp_path, hf_model_dir):
    """A target loaded from an HF dir (transformers 5 writes rope_parameters) keeps its config.json; the
    exported draft's config.json is that dict plus rope_theta / rope_scaling for transformers 4.x."""
    from transformers import AutoConfig

    _, target_dir = hf_model_dir("llama-gqa-llama3")
    target = load_target(target_dir, jnp.float32, load_tokenizer=False)
    original = json.loads((target_dir / "config.json").read_text())
    assert target.hf_config == original
    draft = random_draft(target.config, seed=6)
    save_draft(draft, tmp_path, target=target)
    written = json.loads((tmp_path / "config.json").read_text())
    for key, value in original.items():
        if key not in ("dtype", "torch_dtype"):
            assert written[key] == value, key
    assert written["rope_theta"] == 500000.0
    assert written["rope_scaling"]["rope_type"] == "llama3" and written["rope_scaling"]["factor"] == 8.0
    assert written["torch_dtype"] == "float32"
    assert TargetConfig.from_dir(tmp_path).rope == target.config.rope
    auto = AutoConfig.from_pretrained(tmp_path)
    assert (auto.model_type, auto.hidden_size, auto.num_key_value_heads) == ("llama", 64, 2)
    assert auto.rope_parameters["rope_type"] == "llama3"
    assert_bit_equal(load_draft(tmp_path, target).variables, draft.variables)


# ----------------------------------------------------------------------------------------------------------------
# Orbax training checkpoints and the export CLI


def _save_steps(ckpt_dir, target, dtype=jnp.float32):
    drafts = {}
    for step, seed in ((5, 11), (7, 12)):
        draft = cast(random_draft(target.config, seed=seed), dtype)
        opt_state = optax.adam(1e-3).init(draft.variables["params"])
        meta = checkpointing.checkpoint_metadata(draft.config, target, extra={"seed": seed})
        checkpointing.save_checkpoint(ckpt_dir, step, draft.variables, opt_state, meta)
        drafts[step] = draft
    return drafts


@pytest.mark.parametrize("fmt", ["hf", "pth"])
def test_orbax_export_cli_bit_exact(tmp_path, capsys, fmt):
    target = io_target("llama-gqa-llama3")
    drafts = _save_steps(tmp_path / "ckpt", target)
    assert checkpointing.latest_step(tmp_path / "ckpt") == 7
    assert export_main(["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--format", fmt]) == 0
    assert "wrote" in capsys.readouterr().out
    assert_bit_equal(load_draft(tmp_path / "out", target, dtype=jnp.float32).variables, drafts[7].variables)
    assert export_main(["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out5"), "--format", fmt,
                        "--step", "5"]) == 0
    assert_bit_equal(load_draft(tmp_path / "out5", target, dtype=jnp.float32).variables, drafts[5].variables)
    # config.json comes from the checkpoint's metadata (no target weights needed) and loads in transformers
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["rope_scaling"]["rope_type"] == "llama3"
    assert TargetConfig.from_hf_dict(written) == TargetConfig.from_hf_dict(hf_config_from_target_config(target.config))


def test_orbax_bf16_export_bit_exact(tmp_path):
    target = io_target()
    drafts = _save_steps(tmp_path / "ckpt", target, dtype=jnp.bfloat16)
    assert export_main(["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
                        "--format", "hf", "--dtype", "bfloat16"]) == 0
    assert SafetensorsFile(str(tmp_path / "out" / "model.safetensors")).get(
        "input_layernorm.weight").dtype == np.dtype(ml_dtypes.bfloat16)
    assert_bit_equal(load_draft(tmp_path / "out", target, dtype=jnp.bfloat16).variables, drafts[7].variables)


def test_export_cli_errors(tmp_path, capsys):
    assert export_main(["--checkpoint", str(tmp_path / "nothing"), "--out", str(tmp_path / "out")]) == 1
    assert "no complete training checkpoint" in capsys.readouterr().err
    _save_steps(tmp_path / "ckpt", io_target())
    assert export_main(["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "o"), "--step", "6"]) == 1
    assert "step 6" in capsys.readouterr().err


def test_checkpoint_restore_is_robust(tmp_path):
    target = io_target()
    ckpt_dir = tmp_path / "ckpt"
    drafts = _save_steps(ckpt_dir, target)
    # an interrupted save leaves only a temporary directory: ignored
    os.makedirs(ckpt_dir / "9.orbax-checkpoint-tmp-123" / "draft")
    assert checkpointing.all_steps(ckpt_dir) == [5, 7]
    template = {"draft": drafts[7].variables,
                "opt_state": optax.adam(1e-3).init(drafts[7].variables["params"])}
    ckpt = checkpointing.restore_checkpoint(ckpt_dir, template=template)
    assert ckpt.step == 7 and ckpt.metadata["extra"] == {"seed": 12}
    assert ckpt.draft_config == drafts[7].config
    assert jax.tree_util.tree_structure(ckpt.opt_state) == jax.tree_util.tree_structure(template["opt_state"])
    assert_bit_equal(ckpt.draft_variables, drafts[7].variables)
    # a damaged newest step: resume from the previous complete one
    for root, _, files in os.walk(ckpt_dir / "7" / "draft"):
        for f in files:
            os.remove(os.path.join(root, f))
    with pytest.warns(UserWarning, match="cannot restore step 7"):
        ckpt = checkpointing.restore_checkpoint(ckpt_dir)
    assert ckpt.step == 5
    assert_bit_equal(ckpt.draft_variables, drafts[5].variables)
    with pytest.raises(checkpointing.CheckpointError, match="already exists"):
        checkpointing.save_checkpoint(ckpt_dir, 5, drafts[5].variables, None,
                                      checkpointing.checkpoint_metadata(drafts[5].config, target))
    with pytest.raises(checkpointing.CheckpointError, match="metadata"):
        checkpointing.save_checkpoint(ckpt_dir, 8, drafts[5].variables)


# ----------------------------------------------------------------------------------------------------------------
# Bad files


@pytest.fixture
def saved(tmp_path):
    target = io_target()
    draft = random_draft(target.config, seed=8)
    return target, draft, draft_state_dict(draft)


def _write(tmp_path, tensors, config=None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_truncated_safetensors(tmp_path, saved):
    target, draft, _ = saved
    save_draft(draft, tmp_path, target=target)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(WeightsError, match="truncated"):
        load_draft(tmp_path, target)
    path.write_bytes(data[:5])
    with pytest.raises(WeightsError, match="truncated"):
        load_draft(tmp_path, target)


def test_wrong_shape_names_key_and_expected_shape(tmp_path, saved):
    target, _, tensors = saved
    tensors = dict(tensors, **{"cross_attn.q_proj.weight": np.zeros((64, 32), np.float32)})
    with pytest.raises(WeightsError, match=r"cross_attn\.q_proj\.weight has shape \(64, 32\), expected \(64, 64\) "
                                           r"from the target config"):
        load_draft(_write(tmp_path, tensors), target)


def test_missing_and_extra_keys(tmp_path, saved):
    target, _, tensors = saved
    missing = {k: v for k, v in tensors.items() if k != "cross_attn.k_proj.weight"}
    with pytest.raises(WeightsError, match=r"missing tensor\(s\): cross_attn\.k_proj\.weight"):
        load_draft(_write(tmp_path / "a", missing), target)
    extra = dict(tensors, **{"lm_head.weight": np.zeros((4, 64), np.float32)})
    with pytest.raises(WeightsError, match=r"unexpected tensor\(s\): lm_head\.weight"):
        load_draft(_write(tmp_path / "b", extra), target)
    prefixed = {f"draft_model.{k}": v for k, v in tensors.items()}
    with pytest.raises(WeightsError, match="missing tensor"):
        load_draft(_write(tmp_path / "c", prefixed), target)


def test_draft_for_another_target_width(tmp_path, saved):
    target, draft, _ = saved
    save_draft(draft, tmp_path / "hf", target=target)
    save_draft(draft, tmp_path / "pth", format="pth", target=target)
    wider = io_target(hidden_size=96, head_dim=24)
    with pytest.raises(WeightsError, match=r"built for another target: hidden_size=64 \(target: 96\)"):
        load_draft(tmp_path / "hf", wider)
    # without a config.json, the shapes say it
    with pytest.raises(WeightsError, match=r"input_layernorm\.weight has shape \(64,\), expected \(96,\)"):
        load_draft(tmp_path / "pth" / PTH_NAME, wider)
    fewer_kv = io_target(num_kv_heads=1)
    with pytest.raises(WeightsError, match=r"num_key_value_heads=2 \(target: 1\)"):
        load_draft(tmp_path / "hf", fewer_kv)
    # exporting a draft with a target config it does not fit
    with pytest.raises(WeightsError, match="does not fit"):
        save_draft(draft, tmp_path / "bad", target=wider)


def test_other_bad_inputs(tmp_path, saved, monkeypatch):
    target, draft, _ = saved
    with pytest.raises(WeightsError, match="not found"):
        load_draft(tmp_path / "absent", target)
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match="no draft weights"):
        load_draft(tmp_path / "empty", target)
    save_draft(draft, tmp_path / "pth", format="pth", target=target)
    pth = tmp_path / "pth" / PTH_NAME
    pth.write_bytes(pth.read_bytes()[:100])
    with pytest.raises(WeightsError, match="cannot read the .pth"):
        load_draft(pth, target)
    torch.save({"a": 1}, tmp_path / "not_tensors.pth")
    with pytest.raises(WeightsError, match="not a tensor"):
        load_draft(tmp_path / "not_tensors.pth", target)
    with pytest.raises(ValueError, match="carries no target config"):
        save_draft(Draft(config=draft.config, variables=draft.variables), tmp_path / "x")
    with pytest.raises(ValueError, match="unknown draft format"):
        save_draft(draft, tmp_path / "x", format="gguf", target=target)
    with pytest.raises(ValueError, match="unsupported export dtype"):
        save_draft(draft, tmp_path / "x", dtype="int8", target=target)
    save_draft(draft, tmp_path / "ok", format="pth", target=target)
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    with pytest.raises(WeightsError, match="needs PyTorch"):
        load_draft(tmp_path / "ok", target)


# ----------------------------------------------------------------------------------------------------------------
# Draft vocabularies


@pytest.mark.parametrize("fmt", ["hf", "pth"])
def test_a_draft_vocabulary_travels_beside_the_weights(tmp_path, fmt):
    """save_draft writes draft_vocab.npy beside the weights, load_draft gathers it again (or the ids it is
    given instead), and the HF directory still loads into PyTorch LongSpec's layer."""
    target = io_target()
    ids = np.asarray([0, 5, 17, 127], np.int32)
    draft = random_draft(target.config, seed=6).with_vocab(target, ids)
    save_draft(draft, tmp_path, format=fmt, target=target)
    np.testing.assert_array_equal(np.load(tmp_path / VOCAB_NAME), ids)
    loaded = load_draft(tmp_path, target, dtype=jnp.float32)
    np.testing.assert_array_equal(loaded.vocab.ids, ids)
    np.testing.assert_array_equal(loaded.vocab.head, draft.vocab.head)
    assert_bit_equal(loaded.variables, draft.variables)
    np.testing.assert_array_equal(load_draft(tmp_path, target, draft_vocab=[1, 2]).vocab.ids, [1, 2])
    assert load_draft(tmp_path, target).with_vocab(target, None).vocab is None
    if fmt == "hf":
        hf = json.loads((tmp_path / "config.json").read_text())
        _, info = draft_class(hf).from_pretrained(tmp_path, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info


@pytest.mark.parametrize("fmt", ["hf", "pth"])
def test_the_export_keeps_a_training_runs_draft_vocabulary(tmp_path, fmt):
    target = io_target()
    _save_steps(tmp_path / "ckpt", target)
    ids = np.asarray([3, 4, 90], np.int32)
    save_draft_vocab(ids, tmp_path / "ckpt")
    assert export_main(["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--format", fmt]) == 0
    np.testing.assert_array_equal(load_draft(tmp_path / "out", target).vocab.ids, ids)


def test_bad_stored_draft_vocabularies_are_named(tmp_path, saved):
    target, draft, _ = saved
    save_draft(draft, tmp_path, target=target)
    np.save(tmp_path / VOCAB_NAME, np.asarray([4, 2]))
    with pytest.raises(ValueError, match=f"{VOCAB_NAME}: not sorted: token id 2 at position 1 follows 4"):
        load_draft(tmp_path, target)
    load_draft(tmp_path, target, draft_vocab=[2, 4])  # given ids replace the stored ones unread
    (tmp_path / VOCAB_NAME).write_bytes(b"not an array")
    with pytest.raises(WeightsError, match=f"{VOCAB_NAME}: not a readable .npy array"):
        load_draft(tmp_path, target)
    with pytest.raises(ValueError, match=r"token id 128 at position 0 is outside the target's vocabulary \[0, 128\)"):
        load_draft(tmp_path, target, draft_vocab=[128])

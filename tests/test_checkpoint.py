"""Loading HF checkpoints: clear errors for bad directories and weights; sharded = single file; safetensors I/O."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests.conftest import build_hf_model, save_hf_model
from longspec_jax import ConfigError, WeightsError, load_target
from longspec_jax.safetensors_io import SafetensorsDir, SafetensorsFile, save_file

NAME = "qwen2-gqa-tied"


@pytest.fixture(scope="module")
def model_and_dir(hf_model_dir):
    return hf_model_dir(NAME)


@pytest.fixture
def model_copy(model_and_dir, tmp_path):
    """A fresh, writable copy of the saved tiny model (single ``model.safetensors``)."""
    dst = tmp_path / "model"
    shutil.copytree(model_and_dir[1], dst)
    assert (dst / "model.safetensors").is_file()
    return dst


def all_tensors(path) -> dict[str, np.ndarray]:
    source = SafetensorsDir(os.fspath(path))
    return {name: np.array(source.get(name)) for name in source.keys()}


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_errors_are_value_errors():
    assert issubclass(ConfigError, ValueError) and issubclass(WeightsError, ValueError)


def test_missing_directory(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_target(tmp_path / "nope")


def test_missing_config(model_copy):
    (model_copy / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json"):
        load_target(model_copy)


def test_invalid_json_config(model_copy):
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_target(model_copy)


def test_unknown_model_type(model_copy):
    edit_config(model_copy, model_type="gpt2")
    with pytest.raises(ConfigError, match="unknown model_type 'gpt2'"):
        load_target(model_copy)


def test_missing_config_field(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    del cfg["hidden_size"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="hidden_size"):
        load_target(model_copy)


def test_unsupported_rope_type(model_copy):
    edit_config(model_copy, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ConfigError, match="yarn"):
        load_target(model_copy)


def test_missing_weights_files(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="no \\*.safetensors"):
        load_target(model_copy)


def test_missing_tensor_is_named(model_copy):
    tensors = all_tensors(model_copy)
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, os.fspath(model_copy / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"missing tensor\(s\): model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_target(model_copy)


def test_wrong_shape_is_named_with_expected_shape(model_copy):
    tensors = all_tensors(model_copy)
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:100]
    save_file(tensors, os.fspath(model_copy / "model.safetensors"))
    with pytest.raises(WeightsError) as info:
        load_target(model_copy)
    message = str(info.value)
    assert "model.layers.0.mlp.up_proj.weight" in message
    assert "(100, 64)" in message and "expected (128, 64)" in message


def test_config_disagreeing_with_weights(model_copy):
    edit_config(model_copy, intermediate_size=96)
    with pytest.raises(WeightsError, match="expected \\(96, 64\\) from config.json"):
        load_target(model_copy)


def test_truncated_safetensors(model_copy):
    path = model_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 1000])
    with pytest.raises(WeightsError, match="truncated"):
        load_target(model_copy)
    path.write_bytes(data[:5])
    with pytest.raises(WeightsError, match="truncated"):
        load_target(model_copy)


def test_index_naming_a_missing_shard(tmp_path):
    model = build_hf_model("llama-gqa-llama3", seed=3)
    path = save_hf_model(model, tmp_path / "sharded", max_shard_size="100KB")
    shards = sorted(path.glob("*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(WeightsError, match=f"shard {shards[-1].name}"):
        load_target(path)


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    model = build_hf_model("llama-gqa-llama3", seed=3)
    single = save_hf_model(model, tmp_path / "single")
    sharded = save_hf_model(model, tmp_path / "sharded", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    a, b = load_target(single, dtype=jnp.float32), load_target(sharded, dtype=jnp.float32)
    assert a.config == b.config
    leaves_a, tree_a = jax.tree.flatten(a.params)
    leaves_b, tree_b = jax.tree.flatten(b.params)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(x, y)
    # The weights are HF's, transposed into our [in, out] layout.
    q = model.model.layers[1].self_attn.q_proj.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(b.params["layers"][1]["wqkv"])[:, :q.shape[0]], q.T)


def test_dtype_and_tokenizer_absent(model_and_dir):
    target = load_target(model_and_dir[1])  # default dtype
    assert target.dtype == jnp.bfloat16
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(target.params))
    assert target.tokenizer is None


def test_save_file_roundtrip_and_official_reader(tmp_path):
    import safetensors.numpy
    import safetensors.torch
    import torch

    rng = np.random.default_rng(0)
    f32 = {"a.weight": rng.standard_normal((3, 5)).astype(np.float32),
           "b": rng.standard_normal((7,)).astype(np.float32),
           "scalar": np.array(1.5, np.float32)}
    bf16 = {"w": rng.standard_normal((4, 6)).astype(ml_dtypes.bfloat16),
            "v": rng.standard_normal((2, 3, 2)).astype(ml_dtypes.bfloat16)}
    for tensors, name in ((f32, "f32.safetensors"), (bf16, "bf16.safetensors")):
        path = os.fspath(tmp_path / name)
        save_file(tensors, path, metadata={"format": "pt"})
        ours = SafetensorsFile(path)
        assert sorted(ours.keys()) == sorted(tensors)
        for key, value in tensors.items():
            assert ours.shape(key) == value.shape
            got = ours.get(key)
            assert got.dtype == value.dtype
            np.testing.assert_array_equal(got, value)
    official = safetensors.numpy.load_file(os.fspath(tmp_path / "f32.safetensors"))
    assert sorted(official) == sorted(f32)
    for key, value in f32.items():
        np.testing.assert_array_equal(official[key], value)
    official_bf16 = safetensors.torch.load_file(os.fspath(tmp_path / "bf16.safetensors"))
    for key, value in bf16.items():
        assert official_bf16[key].dtype == torch.bfloat16
        np.testing.assert_array_equal(official_bf16[key].float().numpy(), value.astype(np.float32))


def test_official_writer_read_by_ours(tmp_path):
    import safetensors.torch
    import torch

    tensors = {"x": torch.randn(3, 4, dtype=torch.bfloat16), "y": torch.arange(6, dtype=torch.int64)}
    path = os.fspath(tmp_path / "t.safetensors")
    safetensors.torch.save_file(tensors, path)
    ours = SafetensorsFile(path)
    np.testing.assert_array_equal(ours.get("x").astype(np.float32), tensors["x"].float().numpy())
    np.testing.assert_array_equal(ours.get("y"), np.arange(6))

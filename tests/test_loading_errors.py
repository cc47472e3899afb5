"""Hostile inputs to the loaders: corrupt safetensors headers, sharded indexes, config.json fields
and drafts for another target each fail at the loader boundary with a ``ValueError`` subclass whose message
names the file and the field; random header bytes and random header JSON either load or fail that way, and
never read or allocate more than the file holds.

Everything here is built in memory from tiny tensors (no torch, no transformers), so the file runs in seconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import tempfile
import tracemalloc

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from longspec_jax import ConfigError, Target, WeightsError, load_draft, load_target
from longspec_jax.config import TargetConfig
from longspec_jax.draft import DraftConfig
from longspec_jax.draft_io import hf_config_from_target_config
from longspec_jax.safetensors_io import INDEX_NAME, SafetensorsDir, SafetensorsFile, save_file
from longspec_jax.weights import draft_tensor_specs, target_tensor_specs

TINY = TargetConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=4)
HF_TINY = hf_config_from_target_config(TINY)


def raw_file(path, header: bytes | dict, data: bytes = b"", header_len: int | None = None):
    """Writes a safetensors file byte by byte: length prefix (``header_len`` or the true length), header, data."""
    if isinstance(header, dict):
        header = json.dumps(header).encode()
    size = len(header) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", size) + header + data)
    return path


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def zeros(specs) -> dict[str, np.ndarray]:
    return {spec.name: np.zeros(spec.shape, np.float32) for spec in specs}


def write_model(path, config: TargetConfig = TINY, **hf_changes):
    """A loadable HF directory for ``config`` (zero weights), with ``hf_changes`` applied to its config.json."""
    path.mkdir(parents=True, exist_ok=True)
    save_file(zeros(target_tensor_specs(config)), os.fspath(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**hf_config_from_target_config(config), **hf_changes}))
    return path


def raises(error, match, call, *names):
    """``call()`` raises ``error`` matching ``match``, and its message names each of ``names``."""
    with pytest.raises(error, match=match) as info:
        call()
    for name in names:
        assert os.fspath(name) in str(info.value)
    return str(info.value)


# ----------------------------------------------------------------------------------------------------------------
# Safetensors headers

BAD_HEADERS = {
    # id: (header bytes or JSON object, data bytes, declared header length or None, message pattern)
    "empty-file": (b"", b"", 0, None),
    "malformed-json": (b"{not json", b"", None, "safetensors header is not valid JSON"),
    "not-utf8": (b'{"\xff\xfe": 1}', b"", None, "not valid JSON"),
    "deeply-nested-json": (b"[" * 100_000, b"", None, "not valid JSON.*recursion"),
    "integer-with-5000-digits": (b'{"a": {"shape": [1' + b"0" * 5000 + b"]}}", b"", None, "not valid JSON"),
    "header-is-a-list": (b"[]", b"", None, "header is a JSON list, not an object"),
    "absurd-header-length": (b"{}", b"", 2 ** 63, r"header of 9223372036854775808 bytes in a 10-byte file"),
    "header-length-past-eof": (b"{}", b"", 1000, r"header of 1000 bytes in a 10-byte file"),
    "metadata-not-object": ({"__metadata__": "x"}, b"", None, "__metadata__ is a JSON str"),
    "entry-not-object": ({"a": [1, 2]}, b"", None, "tensor 'a': header entry is a JSON list"),
    "unknown-dtype": ({"a": entry(dtype="F8_E4M3")}, bytes(8), None, "tensor 'a': unsupported dtype 'F8_E4M3'"),
    "dtype-missing": ({"a": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8), None, "'a': unsupported dtype None"),
    "dtype-a-list": ({"a": entry(dtype=["F32"])}, bytes(8), None, r"unsupported dtype \['F32'\]"),
    "negative-dim": ({"a": entry(shape=[-2])}, bytes(8), None, r"'a': shape \[-2\] is not a list"),
    "float-dim": ({"a": entry(shape=[2.0])}, bytes(8), None, r"shape \[2.0\] is not a list"),
    "bool-dim": ({"a": entry(shape=[True, True])}, bytes(8), None, r"shape \[True, True\] is not a list"),
    "shape-missing": ({"a": {"dtype": "F32", "data_offsets": [0, 8]}}, bytes(8), None, "shape None"),
    "33-dims": ({"a": entry(shape=[1] * 33, offsets=(0, 4))}, bytes(4), None, "at most 32"),
    "shape-overflowing-int64": ({"a": entry(shape=[2 ** 32, 2 ** 32], offsets=(0, 0))}, b"", None,
                                r"\[4294967296, 4294967296\] F32 is too large"),
    "empty-but-huge-shape": ({"a": entry(shape=[0, 2 ** 62, 2 ** 62], offsets=(0, 0))}, b"", None, "too large"),
    "offsets-missing": ({"a": {"dtype": "F32", "shape": [2]}}, bytes(8), None, "data_offsets None is not a"),
    "offsets-not-a-pair": ({"a": entry(offsets=[0])}, bytes(8), None, r"data_offsets \[0\] is not a \[begin, end\]"),
    "offsets-floats": ({"a": entry(offsets=[0.0, 8.0])}, bytes(8), None, "is not a .begin, end. pair of integers"),
    "negative-offsets": ({"a": entry(offsets=[-8, 0])}, bytes(8), None, r"data_offsets \[-8, 0\] are negative"),
    "reversed-offsets": ({"a": entry(offsets=[8, 0])}, bytes(8), None, r"\[8, 0\] are negative or reversed"),
    "span-does-not-match-shape": ({"a": entry(shape=[3], offsets=[0, 8])}, bytes(12), None,
                                  r"'a': data_offsets span 8 bytes, but shape \[3\] F32 needs 12"),
    "span-does-not-match-dtype": ({"a": entry(dtype="BF16", shape=[2], offsets=[0, 8])}, bytes(8), None,
                                  "span 8 bytes, but shape .2. BF16 needs 4"),
    "offsets-past-eof": ({"a": entry(offsets=[8, 16])}, bytes(8), None, "tensor 'a' ends at byte"),
    "absurd-offsets": ({"a": entry(shape=[2 ** 40], dtype="U8", offsets=[0, 2 ** 40])}, bytes(8), None,
                       "truncated safetensors file: tensor 'a' ends at byte 1099511627"),
    "overlapping-tensors": ({"a": entry(offsets=[0, 8]), "b": entry(offsets=[4, 12])}, bytes(12), None,
                            r"tensors 'a' and 'b' overlap: 'b' starts at data offset 4, before 'a' ends at 8"),
    "same-span-twice": ({"a": entry(), "b": entry()}, bytes(8), None, "tensors 'a' and 'b' overlap"),
    "span-inside-another": ({"a": entry(shape=[4], offsets=[0, 16]), "b": entry(offsets=[4, 12])}, bytes(16), None,
                            "tensors 'a' and 'b' overlap"),
}


@pytest.mark.parametrize("case", list(BAD_HEADERS))
def test_bad_safetensors_header(tmp_path, case):
    header, data, header_len, pattern = BAD_HEADERS[case]
    path = tmp_path / "bad.safetensors"
    if case == "empty-file":
        path.write_bytes(b"")
        pattern = r"truncated safetensors file \(0 bytes, no 8-byte header length\)"
    else:
        raw_file(path, header, data, header_len)
    message = raises(WeightsError, pattern, lambda: SafetensorsFile(os.fspath(path)), path)
    assert len(message) < 2000, "messages stay short whatever the header holds"


def test_file_shorter_than_8_bytes(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x02\x00\x00")
    raises(WeightsError, r"truncated safetensors file \(3 bytes, no 8-byte header length\)",
           lambda: SafetensorsFile(os.fspath(path)), path)


def test_edge_cases_that_are_valid(tmp_path):
    """Zero-size tensors (anywhere outside another tensor's bytes), 0-d tensors, gaps and padding all load."""
    header = {"__metadata__": {"format": "pt"}, "empty": entry(shape=[0, 3], offsets=[0, 0]),
              "scalar": entry(shape=[], offsets=[0, 4]), "after_gap": entry(dtype="I16", shape=[2], offsets=[8, 12]),
              "empty_at_end": entry(dtype="BF16", shape=[5, 0], offsets=[12, 12])}
    data = np.float32(1.5).tobytes() + bytes(4) + np.array([7, -7], np.int16).tobytes()
    f = SafetensorsFile(os.fspath(raw_file(tmp_path / "ok.safetensors", header, data)))
    assert f.get("empty").shape == (0, 3) and f.get("empty_at_end").shape == (5, 0)
    assert f.get("scalar") == np.float32(1.5)
    np.testing.assert_array_equal(f.get("after_gap"), [7, -7])


def test_bad_header_fails_at_load_target_and_load_draft(tmp_path):
    model = write_model(tmp_path / "model")
    raw_file(model / "model.safetensors", {"model.norm.weight": entry(offsets=[4, 12])}, bytes(8))
    raises(WeightsError, "tensor 'model.norm.weight' ends at byte", lambda: load_target(model),
           model / "model.safetensors")
    target = load_target(write_model(tmp_path / "good"), dtype=jnp.float32)
    draft = raw_file(tmp_path / "draft.safetensors", {"mlp.up_proj.weight": entry(dtype="F9")}, bytes(8))
    raises(WeightsError, "'mlp.up_proj.weight': unsupported dtype 'F9'", lambda: load_draft(draft, target), draft)


# ----------------------------------------------------------------------------------------------------------------
# Sharded checkpoints


@pytest.fixture
def sharded(tmp_path):
    """A directory with two shards and their index: ``a`` in shard-1, ``b`` in shard-2."""
    save_file({"a": np.ones(2, np.float32)}, os.fspath(tmp_path / "shard-1.safetensors"))
    save_file({"b": np.ones(3, np.float32)}, os.fspath(tmp_path / "shard-2.safetensors"))
    write_index(tmp_path, {"weight_map": {"a": "shard-1.safetensors", "b": "shard-2.safetensors"}})
    assert sorted(SafetensorsDir(os.fspath(tmp_path)).keys()) == ["a", "b"]
    return tmp_path


def write_index(path, index):
    (path / INDEX_NAME).write_text(index if isinstance(index, str) else json.dumps(index))


BAD_INDEXES = {
    "not-json": ("{\"weight_map\": ", "is not valid JSON"),
    "a-list": ([], "expected a JSON object, found a list"),
    "no-weight-map": ({"metadata": {}}, "malformed index: weight_map must be a non-empty object"),
    "empty-weight-map": ({"weight_map": {}}, "weight_map must be a non-empty object"),
    "weight-map-a-list": ({"weight_map": ["shard-1.safetensors"]}, r"got \['shard-1.safetensors'\]"),
    "shard-not-a-string": ({"weight_map": {"a": 1}}, r"weight_map\['a'\] = 1 is not a file name"),
    "shard-outside-folder": ({"weight_map": {"a": "../shard-1.safetensors"}}, "is not a file name in the"),
    "absolute-shard": ({"weight_map": {"a": "/etc/passwd"}}, r"weight_map\['a'\] = '/etc/passwd' is not a file"),
    "missing-shard": ({"weight_map": {"a": "shard-1.safetensors", "b": "shard-3.safetensors"}},
                      f"shard shard-3.safetensors named in {INDEX_NAME} is missing"),
    "tensor-in-wrong-shard": ({"weight_map": {"a": "shard-2.safetensors", "b": "shard-2.safetensors"}},
                              "tensor 'a' is listed in shard-2.safetensors but not stored there"),
}


@pytest.mark.parametrize("case", list(BAD_INDEXES))
def test_bad_index(sharded, case):
    index, pattern = BAD_INDEXES[case]
    write_index(sharded, index)
    named = sharded / INDEX_NAME if case not in ("missing-shard", "tensor-in-wrong-shard") else sharded
    raises(WeightsError, pattern, lambda: SafetensorsDir(os.fspath(sharded)), named)


def test_tensor_in_two_shards(sharded):
    (sharded / INDEX_NAME).unlink()
    save_file({"a": np.ones(2, np.float32)}, os.fspath(sharded / "shard-3.safetensors"))
    raises(WeightsError, "tensor 'a' is stored in both shard-1.safetensors and shard-3.safetensors",
           lambda: SafetensorsDir(os.fspath(sharded)), sharded)


def test_bad_shard_header_is_named(sharded):
    raw_file(sharded / "shard-2.safetensors", b"{oops")
    raises(WeightsError, "not valid JSON", lambda: SafetensorsDir(os.fspath(sharded)), sharded / "shard-2.safetensors")


# ----------------------------------------------------------------------------------------------------------------
# config.json

BAD_CONFIGS = {
    # id: (changes to a valid config.json; None deletes the key, message pattern)
    "zero-heads": ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    "hidden-not-divisible-by-heads": ({"hidden_size": 18, "head_dim": None},
                                      r"hidden_size \(18\) must be a multiple of num_attention_heads \(4\)"),
    "negative-hidden": ({"hidden_size": -16}, "hidden_size must be a positive integer, got -16"),
    "negative-intermediate": ({"intermediate_size": -1}, "intermediate_size must be a positive integer"),
    "zero-layers": ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0"),
    "kv-heads-not-dividing-heads": ({"num_key_value_heads": 3},
                                    r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    "more-kv-heads-than-heads": ({"num_key_value_heads": 8}, r"must be a multiple of num_key_value_heads \(8\)"),
    "zero-kv-heads": ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
    "zero-vocab": ({"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
    "vocab-a-string": ({"vocab_size": "32"}, "vocab_size must be a positive integer, got '32'"),
    "vocab-a-float": ({"vocab_size": 32.5}, "vocab_size must be a positive integer, got 32.5"),
    "vocab-a-bool": ({"vocab_size": True}, "vocab_size must be a positive integer, got True"),
    "vocab-missing": ({"vocab_size": None}, r"missing required field\(s\): vocab_size"),
    "layers-and-hidden-missing": ({"num_hidden_layers": None, "hidden_size": None},
                                  r"missing required field\(s\): hidden_size, num_hidden_layers"),
    "zero-head-dim": ({"head_dim": 0}, "head_dim must be a positive integer, got 0"),
    "odd-head-dim": ({"head_dim": 5}, "head_dim must be even"),
    "zero-max-positions": ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer"),
    "negative-eps": ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be a positive number"),
    "unknown-model-type": ({"model_type": "mamba"}, "unknown model_type 'mamba'"),
    "model-type-missing": ({"model_type": None}, "unknown model_type None"),
    "unknown-rope-type": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
                          "unsupported rope_scaling type 'yarn'"),
    "unknown-rope-type-4x-key": ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "type 'dynamic'"),
    "rope-scaling-a-string": ({"rope_scaling": "linear"}, "rope_scaling must be an object, got 'linear'"),
    "zero-rope-factor": ({"rope_scaling": {"rope_type": "linear", "factor": 0}},
                         "rope_scaling.factor must be a positive number, got 0"),
    "rope-theta-beyond-float": ({"rope_theta": 10 ** 400}, "rope_theta must be a positive number, got 1000"),
    "nan-rope-theta": ({"rope_theta": float("nan")}, "rope_theta must be a positive number, got nan"),
    "infinite-rope-theta": ({"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}},
                            "rope_parameters.rope_theta must be a positive number, got inf"),
    "llama3-high-not-above-low": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                                    "high_freq_factor": 1.0}},
                                  r"high_freq_factor \(1.0\) > low_freq_factor \(4.0\)"),
    "bias-a-string": ({"attention_bias": "false"}, "attention_bias must be true or false, got 'false'"),
    "eos-a-string": ({"eos_token_id": "</s>"}, "eos_token_id must be a token id or a list of them"),
    "eos-negative": ({"eos_token_id": [2, -1]}, "eos_token_id must be a token id"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_field(tmp_path, case):
    changes, pattern = BAD_CONFIGS[case]
    cfg = {k: v for k, v in {**HF_TINY, **changes}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    raises(ConfigError, pattern, lambda: TargetConfig.from_dir(tmp_path), tmp_path / "config.json")


@pytest.mark.parametrize("text, pattern", [("[1, 2]", "expected a JSON object, found a list"),
                                           ("{\"vocab_size\": ", "is not valid JSON"),
                                           ("\xff", "is not valid JSON")])
def test_config_file_not_an_object(tmp_path, text, pattern):
    (tmp_path / "config.json").write_text(text, encoding="latin-1")
    raises(ConfigError, pattern, lambda: load_target(tmp_path), tmp_path / "config.json")


def test_bad_generation_config(tmp_path):
    model = write_model(tmp_path)
    (model / "generation_config.json").write_text("{eos")
    raises(ConfigError, "is not valid JSON", lambda: load_target(model), model / "generation_config.json")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": {"id": 2}}))
    raises(ConfigError, "eos_token_id must be a token id", lambda: load_target(model),
           model / "generation_config.json")


def test_absurd_layer_count_fails_before_building_specs(tmp_path):
    model = write_model(tmp_path, num_hidden_layers=10 ** 12)
    raises(WeightsError, "num_hidden_layers is 1000000000000, but the weights hold 2 layers",
           lambda: load_target(model), model / "config.json")


def test_absurd_widths_are_shape_errors(tmp_path):
    model = write_model(tmp_path, vocab_size=10 ** 15)
    raises(WeightsError, r"model.embed_tokens.weight has shape \(32, 16\), expected \(1000000000000000, 16\)",
           lambda: load_target(model), tmp_path)


# ----------------------------------------------------------------------------------------------------------------
# Drafts for another target


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Target:
    return load_target(write_model(tmp_path_factory.mktemp("target")), dtype=jnp.float32)


def write_draft(path, config: TargetConfig = TINY, **hf_changes):
    path.mkdir(parents=True, exist_ok=True)
    save_file(zeros(draft_tensor_specs(DraftConfig.from_target(config))), os.fspath(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**hf_config_from_target_config(config), **hf_changes}))
    return path


def test_draft_for_the_target_loads(tmp_path, tiny_target):
    assert load_draft(write_draft(tmp_path), tiny_target).config.hidden_size == TINY.hidden_size


@pytest.mark.parametrize("changes, pattern", [
    ({"vocab_size": 64}, r"vocab_size=64 \(target: 32\)"),
    ({"hidden_size": 32}, r"hidden_size=32 \(target: 16\)"),
    ({"head_dim": 8}, r"head_dim=8 \(target: 4\)"),
    ({"num_attention_heads": 2, "num_key_value_heads": 1},
     r"num_attention_heads=2 \(target: 4\), num_key_value_heads=1 \(target: 2\)"),
    ({"intermediate_size": "32"}, r"intermediate_size='32' \(target: 32\)"),
])
def test_draft_config_for_another_target(tmp_path, tiny_target, changes, pattern):
    draft = write_draft(tmp_path, **changes)
    raises(WeightsError, "the draft was built for another target: " + pattern,
           lambda: load_draft(draft, tiny_target), draft / "config.json")


def test_draft_weights_for_another_width(tmp_path, tiny_target):
    wider = dataclasses.replace(TINY, hidden_size=32, head_dim=8)
    draft = write_draft(tmp_path, wider)
    (draft / "config.json").unlink()  # only the shapes tell
    raises(WeightsError, r"input_layernorm.weight has shape \(32,\), expected \(16,\) from the target config",
           lambda: load_draft(draft, tiny_target), draft)


@pytest.mark.parametrize("text, pattern", [("{", "is not valid JSON"), ("3", "expected a JSON object, found a int")])
def test_draft_config_not_json(tmp_path, tiny_target, text, pattern):
    draft = write_draft(tmp_path)
    (draft / "config.json").write_text(text)
    raises(ConfigError, pattern, lambda: load_draft(draft, tiny_target), draft / "config.json")


# ----------------------------------------------------------------------------------------------------------------
# Fuzzing the header: every input loads completely or raises a ValueError, within a small memory bound

FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MEMORY_BOUND = 4 * 1024 * 1024  # bytes allocated while opening and reading one (tiny) file


def valid_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "v.safetensors")
        save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "ids": np.arange(3, dtype=np.int64),
                   "empty": np.zeros((0, 4), np.float16), "flag": np.array(True)}, path, metadata={"format": "pt"})
        with open(path, "rb") as f:
            return f.read()


VALID = valid_bytes()


def load_all(data: bytes):
    """Writes ``data`` to a file and reads every tensor, asserting each fits in the file; returns the tensors,
    or the ``ValueError`` raised. Any other exception fails the test."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "f.safetensors")
        with open(path, "wb") as f:
            f.write(data)
        tracemalloc.start()
        try:
            source = SafetensorsFile(path)
            result = {name: np.array(source.get(name)) for name in source.keys()}
        except ValueError as e:
            result = e
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
    assert peak < MEMORY_BOUND
    if not isinstance(result, ValueError):
        assert sum(t.nbytes for t in result.values()) <= len(data)
        assert all(t.shape == source.shape(name) for name, t in result.items())
    return result


mutation = st.one_of(
    st.tuples(st.just("set"), st.integers(0, len(VALID) - 1), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.integers(0, len(VALID)), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), st.integers(0, len(VALID) - 1), st.integers(1, 16)),
    st.tuples(st.just("truncate"), st.integers(0, len(VALID)), st.just(0)),
    st.tuples(st.just("length"), st.sampled_from([0, 1, 2 ** 31, 2 ** 63, 2 ** 64 - 1]), st.integers(-16, 16)),
)


def mutate(data: bytes, op) -> bytes:
    kind, at, arg = op
    if kind == "set":
        return data[:at] + bytes([arg]) + data[at + 1:]
    if kind == "insert":
        return data[:at] + arg + data[at:]
    if kind == "delete":
        return data[:at] + data[at + arg:]
    if kind == "truncate":
        return data[:at]
    return struct.pack("<Q", max(0, min(2 ** 64 - 1, at + arg))) + data[8:]


@FUZZ
@given(st.lists(mutation, min_size=1, max_size=4))
def test_fuzz_mutated_files(ops):
    data = VALID
    for op in ops:
        data = mutate(data, op)
    load_all(data)


json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(), st.text(max_size=6))
any_json = st.recursive(json_scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                            st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                        max_leaves=8)
dims = st.one_of(st.integers(0, 4), st.integers(-2, 2 ** 64), st.sampled_from([2 ** 31, 2 ** 32, 2 ** 62]))
offset = st.one_of(st.integers(0, 64), st.integers(-2 ** 64, 2 ** 64))
header_entry = st.one_of(
    st.fixed_dictionaries({"dtype": st.sampled_from(["F32", "BF16", "I64", "U8", "BOOL", "F8", "f32"]),
                           "shape": st.lists(dims, max_size=4), "data_offsets": st.lists(offset, min_size=2,
                                                                                         max_size=2)}),
    st.dictionaries(st.sampled_from(["dtype", "shape", "data_offsets"]), any_json),
    any_json,
)
header_json = st.dictionaries(st.one_of(st.text(max_size=4), st.just("__metadata__")), header_entry, max_size=4)


@FUZZ
@given(header_json, st.binary(max_size=64), st.one_of(st.none(), st.integers(0, 2 ** 64 - 1)))
def test_fuzz_header_json(header, data, header_len):
    raw = json.dumps(header).encode()
    size = len(raw) if header_len is None else header_len
    result = load_all(struct.pack("<Q", size) + raw + data)
    if header_len is None and not isinstance(result, ValueError):
        assert set(result) == set(header) - {"__metadata__"}


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(HF_TINY)), any_json, max_size=4))
def test_fuzz_config_fields(changes):
    """Any value in any config.json field gives a config or a ConfigError, never another exception."""
    try:
        TargetConfig.from_hf_dict({**HF_TINY, **changes})
    except ConfigError:
        pass

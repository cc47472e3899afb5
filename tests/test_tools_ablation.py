"""In-round ablation (``tools.ablation``): a doubled part is computed twice in the compiled program, its
result and everything downstream unchanged; the patch is undone afterwards; the profile benchmark reports each
doubled part's marginal time by phase."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tools import ablation
from infer.bench.decode import TINY
from longspec_jax.testing import random_target
from longspec_jax import target
from longspec_jax.kv_cache import init_cache
from longspec_jax.top_k import top_k


def _count(jaxpr, primitive: str) -> int:
    """Occurrences of ``primitive`` in a jaxpr, nested jaxprs (jit, custom calls) included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == primitive
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                n += _count(inner, primitive)
    return n


def test_doubled_computes_twice_and_returns_the_first_result():
    def f(x, w):
        return jnp.tanh(x @ w), x.sum()

    x, w = jnp.ones((4, 8)) * 0.1, jnp.ones((8, 3)) * 0.2
    plain = jax.make_jaxpr(f)(x, w).jaxpr
    twice = jax.make_jaxpr(ablation.doubled(f))(x, w).jaxpr
    assert _count(plain, "dot_general") == 1 and _count(twice, "dot_general") == 2
    for got, want in zip(jax.jit(ablation.doubled(f))(x, w), f(x, w)):
        np.testing.assert_array_equal(got, want)


def test_doubled_keeps_integer_outputs_and_needs_a_float_argument():
    scores = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 64)), jnp.float32)
    got = jax.jit(ablation.doubled(lambda s: top_k(s, 4)))(scores)
    want = top_k(scores, 4)
    assert got[1].dtype == want[1].dtype
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match="no floating-point array argument"):
        ablation.doubled(lambda n: n * 2)(jnp.arange(3))


# part -> the GEMMs it adds per layer when doubled: what its description in ablation.PARTS promises
GEMMS_PER_LAYER = {"mlp": 2, "gemms": 4, "qkv": 1}


@pytest.mark.slow
@pytest.mark.parametrize("part", list(GEMMS_PER_LAYER))
def test_doubling_a_target_part_doubles_it_in_the_traced_forward_and_is_undone(part):
    tgt = random_target(TINY, None, jnp.float32, 0.02)
    config, params = tgt.config, tgt.params
    cache = init_cache(config.num_layers, 1, 16, config.num_kv_heads, config.head_dim, jnp.float32)
    tokens = jnp.asarray([[3, 5, 7]], jnp.int32)
    positions = jnp.arange(3, dtype=jnp.int32)[None]
    mask = jnp.tril(jnp.ones((3, 3), bool))[None]

    def traced():  # a fresh function each time: jax caches traces by function object
        def fwd():
            return target.forward_tree(params, config, tokens, positions, cache, mask, impl="xla")[0]
        return _count(jax.make_jaxpr(fwd)().jaxpr, "dot_general"), jax.jit(fwd)()

    base_dots, base_out = traced()
    attr = ablation.PARTS[part][1]
    original = getattr(target, attr)
    with ablation.doubling([part]):
        assert getattr(target, attr) is not original
        doubled_dots, doubled_out = traced()
    assert getattr(target, attr) is original
    assert doubled_dots == base_dots + GEMMS_PER_LAYER[part] * config.num_layers
    np.testing.assert_array_equal(doubled_out, base_out)


@pytest.mark.slow
@pytest.mark.parametrize("part", ["draft_mlp", "draft_gemms"])
def test_doubling_a_draft_class_method_doubles_its_gemms_and_is_undone(part):
    """Parts that are methods of the draft's Flax modules: the MLP's three GEMMs run twice, outputs unchanged."""
    import flax.linen as nn

    from longspec_jax.draft import DraftConfig, DraftMLP, init_draft

    tgt = random_target(TINY, None, jnp.float32, 0.02)
    draft = init_draft(DraftConfig.from_target(tgt.config), jax.random.PRNGKey(1))
    x = jnp.full((1, 3, tgt.config.hidden_size), 0.1)

    def traced():
        def mlp():
            return draft.module.apply(draft.variables, x, method=lambda m, h: m.mlp(h))
        return _count(jax.make_jaxpr(mlp)().jaxpr, "dot_general"), jax.jit(mlp)()

    originals = DraftMLP.__call__, nn.Dense.__call__
    base_dots, base_out = traced()
    with ablation.doubling([part]):
        doubled_dots, doubled_out = traced()
    assert (DraftMLP.__call__, nn.Dense.__call__) == originals
    assert base_dots == 3 and doubled_dots == 6
    np.testing.assert_array_equal(doubled_out, base_out)


def test_unknown_parts_and_phases_are_named_before_anything_loads(capsys):
    from tools.profile import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--out", "unused", "--smoke", "--tree", "2,2,2", "--phases", "verify,tree_level4"])
    assert "unknown phase(s) tree_level4" in capsys.readouterr().err
    assert parse_args(["--out", "unused", "--smoke", "--tree", "2,2,2", "--phases", "tree_level3"]).phases == (
        "tree_level3",)
    with pytest.raises(SystemExit):
        parse_args(["--out", "unused", "--smoke", "--ablate", "mlp,nope"])
    assert "unknown part(s) nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--out", "unused", "--smoke", "--impls", "mosaic,flash"])
    assert "unknown attention impl(s) flash" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--out", "unused", "--smoke", "--impls", "mosaic,xla,mosaic"])
    assert "each impl at most once" in capsys.readouterr().err
    variants = parse_args(["--out", "unused", "--smoke", "--attention", "auto", "--impls", "mosaic,auto"]).variants
    assert [(name, v.impl) for name, v in variants.items()] == [("default", None), ("impl_mosaic", "mosaic"),
                                                                ("impl_auto", "auto")]
    with pytest.raises(SystemExit):
        parse_args(["--out", "unused", "--smoke", "--mosaic", '{"w": {"compute_wgz": 2}}'])
    assert "--mosaic w: unknown MosaicConfig field(s) compute_wgz" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--out", "unused", "--smoke", "--mosaic", '{"w": 2}'])
    assert "--mosaic w: expected {field: value}, got 2" in capsys.readouterr().err
    variants = parse_args(["--out", "unused", "--smoke", "--mosaic", '{"w2": {"num_splits": 6, "compute_wgs": 2}}'])
    assert variants.variants["mosaic_w2"].mosaic == (("compute_wgs", 2), ("num_splits", 6))
    with pytest.raises(SystemExit):
        parse_args(["--out", "unused", "--smoke", "--options", '{"nosplit": '])
    assert "--options: not JSON" in capsys.readouterr().err
    variants = parse_args(["--out", "unused", "--smoke", "--options", '{"a": {"xla_x": 1}, "b": {}}']).variants
    assert [(name, v.options) for name, v in variants.items()] == [("default", {}), ("a", {"xla_x": 1}), ("b", {})]
    variants = parse_args(["--out", "unused", "--smoke", "--verify-node-multiples", "1,16"]).variants
    assert [(name, v.verify_node_multiple) for name, v in variants.items()] == [("default", 8), ("nodes_1", 1),
                                                                                ("nodes_16", 16)]
    with pytest.raises(SystemExit):
        parse_args(["--out", "unused", "--smoke", "--verify-node-multiples", "0"])
    assert "--verify-node-multiples: expected comma-separated positive integers, got '0'" in capsys.readouterr().err


def test_mosaic_override_changes_calls_above_two_warpgroups_of_rows_until_it_ends(monkeypatch):
    """The profile's ``--mosaic`` variants: the fields replace the default launch shape of verification-sized
    calls (compute_wgs before the split rule) in the kernel's own lookup, the draft's 64 rows keep theirs, and
    the rule is back afterwards."""
    import pallas.mosaic_cache_attention as mca
    from tools.mosaic_override import mosaic_override
    from pallas.mosaic_config import default_mosaic_config

    seen = []

    def record(*args, cfg, **kw):
        seen.append(cfg)
        raise RuntimeError("recorded")
    monkeypatch.setattr(mca, "mosaic_cache_partials", record)
    q, kv = jnp.zeros((1, 69, 8, 64), jnp.bfloat16), jnp.zeros((1, 1024, 2, 64), jnp.bfloat16)
    with mosaic_override({"num_splits": 5, "stages": 2}):
        assert mca.default_mosaic_config(1, 18, 276, 16640, 64) == dataclasses.replace(
            default_mosaic_config(1, 18, 276, 16640, 64), num_splits=5, light_splits=None, stages=2)
        assert mca.default_mosaic_config(1, 18, 64, 16640, 64) == default_mosaic_config(1, 18, 64, 16640, 64)
        with pytest.raises(RuntimeError, match="recorded"):
            mca.mosaic_cache_attention(q, kv, kv, jnp.array([900]), interpret=True)  # 276 folded rows
    with mosaic_override({"num_splits": 5, "light_splits": 2}):  # a light row block only when asked for
        assert mca.default_mosaic_config(1, 18, 276, 16640, 64).light_splits == 2
    with mosaic_override({"compute_wgs": 3}):
        assert mca.default_mosaic_config(1, 18, 256, 16640, 64) == default_mosaic_config(1, 18, 256, 16640, 64,
                                                                                         compute_wgs=3)
    assert mca.default_mosaic_config is default_mosaic_config
    with pytest.raises(RuntimeError, match="recorded"):
        mca.mosaic_cache_attention(q, kv, kv, jnp.array([900]), interpret=True)  # retraced: the rule again
    assert (seen[0].num_splits, seen[0].stages) == (5, 2)
    assert seen[1] == dataclasses.replace(default_mosaic_config(1, 2, 276, 1024, 64), compute_wgs=2)


def test_unknown_parts_are_named():
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="unknown part.*nope.*choose from attention"):
        ablation.parse_parts("mlp,nope")
    assert ablation.parse_parts("mlp,top_k,") == ("mlp", "top_k")


@pytest.mark.slow
def test_profile_smoke_with_ablation(tmp_path):
    from tools.profile import main

    assert main(["--out", str(tmp_path), "--smoke", "--ablate", "norm,top_k", "--phases", "tree_level2,verify"]) == 0
    report = json.loads((tmp_path / "bench_profile.json").read_text())
    variants = report["contexts"]["40"]
    assert set(variants) == {"default", "x2_norm", "x2_top_k"}
    assert all(set(rows) == {"tree_level2", "verify"} for rows in variants.values())
    assert variants["x2_norm"]["verify"]["launches"] > variants["default"]["verify"]["launches"]
    text = (tmp_path / "bench_profile.md").read_text()
    assert "| part (computed twice) | tree_level2 | verify |" in text and "| norm: target RMSNorms |" in text


@pytest.mark.slow
def test_profile_smoke_with_another_attention_impl(tmp_path):
    """An impl variant's phases are compiled with that impl: the naive one's verify has other kernels."""
    from tools.profile import main

    assert main(["--out", str(tmp_path), "--smoke", "--impls", "naive", "--phases", "verify"]) == 0
    report = json.loads((tmp_path / "bench_profile.json").read_text())
    assert report["attention"] == "xla"
    variants = report["contexts"]["40"]
    assert set(variants) == {"default", "impl_naive"}
    ops = {v: {x["what"] for x in rows["verify"]["by_source"]} for v, rows in variants.items()}
    assert ops["default"] != ops["impl_naive"], ops

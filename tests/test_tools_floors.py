"""tools.floors: the bytes and FLOPs of each phase against counts by hand, on the tiny pair and on the padded
8B-cost target's shapes."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import pytest

from tools.floors import PEAK_FLOPS, Floor, draft_pass, round_floors, target_pass
from longspec_jax.testing import random_draft, tiny_target


def test_tiny_pair_by_hand():
    target, draft = tiny_target(0), random_draft(1)
    c = target.config  # float32; hidden 32, MLP 64, 2 layers, 4 / 2 heads of 8, vocabulary 64
    assert (c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
            c.vocab_size) == (32, 64, 2, 4, 2, 8, 64)
    layer = 32 + 32 + 64 * 32 + 32 * 128 + 32 * 32 + 32 * 64  # norms, down, gate+up, o, q/k/v
    head = 32 * 64
    weights = 4 * (2 * layer + head)
    kv = 3 * 100 * 2 * 2 * 2 * 8 * 4  # batch 3, 100 keys, 2 layers, K and V, 2 heads of 8, float32
    verify = target_pass(target.params, c, batch=3, rows=5, keys=100)
    assert verify.bytes == weights + kv
    assert verify.flops == 2 * (2 * layer + head) * 3 * 5 + 4 * 3 * 5 * 4 * 100 * 8 * 2

    # the draft: one layer, its cross-attention's k/v projections (2 x (32 x 16 + 16)) not read
    params = draft.variables["params"]
    draft_params = sum(x.size for x in jax.tree.leaves(params)) - 2 * (32 * 16 + 16)
    level = draft_pass(draft.variables, target.params, c, batch=3, rows=4, keys=100)
    assert level.bytes == 4 * (draft_params + head) + 3 * 100 * 2 * 2 * 8 * 4  # one layer of the target's cache
    assert level.flops == 2 * (draft_params + head) * 3 * 4 + 4 * 3 * 4 * 4 * 100 * 8

    floors = round_floors(target.params, draft.variables, c, (4, 16, 16), batch=3, keys=100)
    assert list(floors) == ["plain_step", "draft_step0", "verify", "tree_level2", "tree_level3", "full_round"]
    assert floors["verify"] == target_pass(target.params, c, 3, 1 + 36, 100)  # the root and 36 tree nodes
    assert floors["tree_level2"] == draft_pass(draft.variables, target.params, c, 3, 4, 100)  # grows level 1's 4
    assert floors["tree_level3"] == draft_pass(draft.variables, target.params, c, 3, 16, 100)
    assert floors["plain_step"] == target_pass(target.params, c, 3, 1, 100)
    parts = [floors[k] for k in ("draft_step0", "tree_level2", "tree_level3", "verify")]
    assert floors["full_round"] == Floor(sum(f.bytes for f in parts), sum(f.flops for f in parts))


def test_padded_target_matches_the_count_of_section_7():
    """72/18 heads of 64, hidden 4608, MLP 14336, 32 layers, vocabulary 16384, bf16: verify of 69 nodes at 16k
    reads 16.1 GB of layers + 0.15 GB of LM head + 2.4 GB of KV cache (4.62 ms at 4.03 TB/s), and its attention
    is 667 GFLOP."""
    h, m, heads, kv_heads, d = 4608, 14336, 72, 18, 64

    def w(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16)

    layer = dict(attn_norm=w(h), mlp_norm=w(h), wqkv=w(h, (heads + 2 * kv_heads) * d), wo=w(heads * d, h),
                 w_gate_up=w(h, 2 * m), w_down=w(m, h))
    params = dict(embed=w(16384, h), final_norm=w(h), layers=[layer] * 32, lm_head=w(h, 16384))
    config = types.SimpleNamespace(num_layers=32, num_heads=heads, num_kv_heads=kv_heads, head_dim=d)
    verify = target_pass(params, config, batch=1, rows=69, keys=16384)
    assert verify.bytes / 1e9 == pytest.approx(16.08 + 0.151 + 2.416, abs=0.01)
    assert verify.seconds(4.03e12) * 1e3 == pytest.approx(4.62, abs=0.01)
    assert verify.bound(4.03e12) == "bytes"
    attention = 4 * 69 * heads * 16384 * d * 32
    assert attention / 1e9 == pytest.approx(667, abs=1)
    layer_params = 2 * h + h * (heads + 2 * kv_heads) * d + heads * d * h + h * 2 * m + m * h
    assert verify.flops == attention + 2 * (32 * layer_params + h * 16384) * 69
    # batch 8: 552 rows of GEMMs and eight caches make the pass compute-bound
    assert target_pass(params, config, batch=8, rows=69, keys=16384).bound(4.03e12, PEAK_FLOPS) == "FLOPs"

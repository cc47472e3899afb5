"""Llama / Qwen2 target model as pure functions over a parameter pytree.

Parameters (kernels ``[in, out]``; q/k/v and gate/up fused for fewer, larger GEMMs)::

    embed [V, d]; final_norm [d]; lm_head [d, V] (absent when embeddings are tied)
    layers: list of {attn_norm [d], wqkv [d, (H+2K)*Dh], bqkv?, wo [H*Dh, d], bo?,
                     mlp_norm [d], w_gate_up [d, 2I], b_gate_up?, w_down [I, d], b_down?}

On a tensor-parallel mesh the fused kernels are grouped per shard, ``[d, G, F/G]`` (biases ``[G, F/G]``): group g
holds the g-th slice of every part (:mod:`longspec_jax.tensor_parallel`); the functions here take either layout.

Layers are unrolled (one weight array per layer) and each layer's KV cache is updated in place: routing the
cache through ``lax.scan`` outputs rewrites the whole cache every token (on the H200 at Llama-3-8B shapes and 16k,
18.6 ms a token with scan against 6.8 ms unrolled).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp

from longspec_jax.attention import causal_attention, hybrid_tree_attention
from longspec_jax.config import TargetConfig
from longspec_jax.kv_cache import KVCache, TreeKV, write_rows
from longspec_jax.layers import linear, rms_norm
from longspec_jax.rope import apply_rope, inverse_frequencies, rope_tables


@dataclasses.dataclass(frozen=True)
class Target:
    """A loaded target model: static config, parameter pytree, and optionally its tokenizer.

    ``hf_config`` is the raw dict of the HF ``config.json`` it was loaded from (``None`` for targets built in
    memory); exported drafts carry it as their own ``config.json``, as the PyTorch LongSpec releases do.
    ``mesh``: the ``("data", "model")`` device mesh its parameters are sharded over (``load_target(mesh=)``,
    :func:`longspec_jax.tensor_parallel.shard_target`); ``None`` on one device.
    """

    config: TargetConfig
    params: dict
    tokenizer: Any = None
    hf_config: dict | None = dataclasses.field(default=None, compare=False, repr=False)
    mesh: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def dtype(self):
        return self.params["embed"].dtype


def init_target_params(config: TargetConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random parameters (normal(0, std) kernels, unit norms, small random biases) for tests and benchmarks."""
    d, hd = config.hidden_size, config.head_dim
    qkv_out = (config.num_heads + 2 * config.num_kv_heads) * hd

    def normal(k, shape):
        return (std * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

    keys = jax.random.split(key, config.num_layers + 2)
    layers = []
    for lk in keys[:config.num_layers]:
        k = jax.random.split(lk, 8)
        layer = {
            "attn_norm": jnp.ones((d,), dtype) + normal(k[6], (d,)),
            "wqkv": normal(k[0], (d, qkv_out)),
            "wo": normal(k[1], (config.num_heads * hd, d)),
            "mlp_norm": jnp.ones((d,), dtype) + normal(k[7], (d,)),
            "w_gate_up": normal(k[2], (d, 2 * config.intermediate_size)),
            "w_down": normal(k[3], (config.intermediate_size, d)),
        }
        if config.qkv_bias:
            layer["bqkv"] = normal(k[4], (qkv_out,))
        if config.o_bias:
            layer["bo"] = normal(k[5], (d,))
        if config.mlp_bias:
            layer["b_gate_up"] = normal(k[4], (2 * config.intermediate_size,))
            layer["b_down"] = normal(k[5], (d,))
        layers.append(layer)
    params = {
        "embed": normal(keys[-2], (config.vocab_size, d)),
        "layers": layers,
        "final_norm": jnp.ones((d,), dtype),
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = normal(keys[-1], (d, config.vocab_size))
    return params


def embed_tokens(params: dict, tokens_BxT: jax.Array) -> jax.Array:
    return jnp.take(params["embed"], tokens_BxT, axis=0)


def lm_head_logits(params: dict, hidden_BxTxD: jax.Array) -> jax.Array:
    """Float32 logits from final-normed hidden states (tied embeddings when there is no lm_head).

    A single row is computed as two (the second zero): cuBLAS has no bf16 x bf16 -> float32 matrix-vector
    product, so for one row XLA's cuBLAS path (``reproducible`` compiles) would convert the whole kernel to
    float32 on every call (0.45 GB of traffic at a 16k vocabulary and d 4608) and run an f32 GEMV."""
    kernel = params["lm_head"] if "lm_head" in params else params["embed"].T
    B, T, _ = hidden_BxTxD.shape
    rows = hidden_BxTxD if B * T > 1 else jnp.concatenate([hidden_BxTxD, jnp.zeros_like(hidden_BxTxD)], axis=1)
    return jnp.dot(rows, kernel, preferred_element_type=jnp.float32)[:, :T]


def fused_linear(x_BxTxd, kernel, bias, widths: tuple[int, ...]) -> list[jax.Array]:
    """``x @ kernel (+ bias)`` of a fused kernel, split into its parts ``[B, T, width]``. The kernel is
    ``[d, sum(widths)]``, or grouped per shard ``[d, G, sum(widths) / G]`` (parts in the same group order)."""
    if kernel.ndim == 2:
        y_BxTxF = linear(x_BxTxd, kernel, bias)
        bounds = tuple(itertools.accumulate(widths, initial=0))
        return [y_BxTxF[..., a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    B, T, _ = x_BxTxd.shape
    G = kernel.shape[1]
    y_BxTxGxF = jnp.einsum("btd,dgf->btgf", x_BxTxd, kernel)
    if bias is not None:
        y_BxTxGxF = y_BxTxGxF + bias
    bounds = tuple(itertools.accumulate((w // G for w in widths), initial=0))
    return [y_BxTxGxF[..., a:b].reshape(B, T, -1) for a, b in zip(bounds[:-1], bounds[1:])]


def _qkv(layer: dict, config: TargetConfig, x_BxTxd, cos_BxTxD, sin_BxTxD):
    """Roped queries ``[B, T, H, Dh]`` and keys, and values ``[B, T, K, Dh]`` of one layer.

    Queries and keys are roped in one op over the fused output's q|k part. In the grouped (tensor-parallel)
    layout that part is ``[q_g | k_g]`` per group g, so it is split per group, never gathered across devices.
    """
    B, T, _ = x_BxTxd.shape
    H, K, hd = config.num_heads, config.num_kv_heads, config.head_dim
    G = layer["wqkv"].shape[1] if layer["wqkv"].ndim == 3 else 1
    qk_BxTxF, v_BxTxF = fused_linear(x_BxTxd, layer["wqkv"], layer.get("bqkv"), ((H + K) * hd, K * hd))
    qk_BxTxGxCxD = apply_rope(qk_BxTxF.reshape(B, T, H + K, hd), cos_BxTxD, sin_BxTxD).reshape(
        B, T, G, (H + K) // G, hd)
    return (qk_BxTxGxCxD[:, :, :, :H // G].reshape(B, T, H, hd), qk_BxTxGxCxD[:, :, :, H // G:].reshape(B, T, K, hd),
            v_BxTxF.reshape(B, T, K, hd))


def _attention_block(layer: dict, config: TargetConfig, x_BxTxd, cos_BxTxD, sin_BxTxD, k_cache_BxSxKxD,
                     v_cache_BxSxKxD, lengths_B, new_mask_BxTxT, impl: str):
    """The attention sublayer's output and the new tokens' K/V (not written to the cache)."""
    B, T, _ = x_BxTxd.shape
    q_BxTxHxD, k_BxTxKxD, v_BxTxKxD = _qkv(layer, config, x_BxTxd, cos_BxTxD, sin_BxTxD)
    o_BxTxHxD, _ = hybrid_tree_attention(q_BxTxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B, k_BxTxKxD,
                                         v_BxTxKxD, new_mask_BxTxT, impl=impl)
    return linear(o_BxTxHxD.reshape(B, T, -1), layer["wo"], layer.get("bo")), k_BxTxKxD, v_BxTxKxD


def _mlp_block(layer: dict, config: TargetConfig, x_BxTxd):
    I = config.intermediate_size
    gate_BxTxI, up_BxTxI = fused_linear(x_BxTxd, layer["w_gate_up"], layer.get("b_gate_up"), (I, I))
    return linear(jax.nn.silu(gate_BxTxI) * up_BxTxI, layer["w_down"], layer.get("b_down"))


def forward_tree(params: dict, config: TargetConfig, tokens_BxT: jax.Array, positions_BxT: jax.Array,
                 cache: KVCache, new_mask_BxTxT: jax.Array, *, impl: str = "auto") -> tuple[jax.Array, TreeKV]:
    """Runs T new tokens through every layer without writing the cache.

    Token t of row b attends to the committed cache slots ``[0, cache.lengths[b])`` and to the new tokens its
    row of ``new_mask`` allows. Returns the final-normed hidden states ``[B, T, d]`` and the new tokens' K/V of
    every layer (a speculative round commits only the accepted ones).
    """
    cos_BxTxD, sin_BxTxD = rope_tables(positions_BxT, inverse_frequencies(config.rope, config.head_dim))
    x_BxTxd = embed_tokens(params, tokens_BxT)
    new_k, new_v = [], []
    for i, layer in enumerate(params["layers"]):
        h_BxTxd = rms_norm(x_BxTxd, layer["attn_norm"], config.rms_norm_eps)
        attn_BxTxd, k_i, v_i = _attention_block(layer, config, h_BxTxd, cos_BxTxD, sin_BxTxD, cache.k[i],
                                                cache.v[i], cache.lengths, new_mask_BxTxT, impl)
        x_BxTxd = x_BxTxd + attn_BxTxd
        x_BxTxd = x_BxTxd + _mlp_block(layer, config, rms_norm(x_BxTxd, layer["mlp_norm"], config.rms_norm_eps))
        new_k.append(k_i)
        new_v.append(v_i)
    hidden_BxTxd = rms_norm(x_BxTxd, params["final_norm"], config.rms_norm_eps)
    return hidden_BxTxd, TreeKV(k=tuple(new_k), v=tuple(new_v))


def forward(params: dict, config: TargetConfig, tokens_BxT: jax.Array, positions_BxT: jax.Array,
            cache: KVCache, new_mask_BxTxT: jax.Array, *, impl: str = "auto",
            attended_B: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """:func:`forward_tree`, then the new tokens' K/V written at slots ``cache.lengths[b] + t`` in every layer;
    the lengths are not advanced (the caller commits). Returns the hidden states and the cache. ``attended_B``:
    the cache slots each row attends to, default ``cache.lengths`` (0 for a row whose output is dropped: its
    cache is then not read)."""
    view = cache if attended_B is None else cache.replace(lengths=attended_B)
    hidden_BxTxd, new = forward_tree(params, config, tokens_BxT, positions_BxT, view, new_mask_BxTxT, impl=impl)
    write = functools.partial(write_rows, start_B=cache.lengths)
    return hidden_BxTxd, cache.replace(k=tuple(map(write, cache.k, new.k)), v=tuple(map(write, cache.v, new.v)))


def causal_forward(params: dict, config: TargetConfig, tokens_BxT: jax.Array, positions_BxT: jax.Array, *,
                   final_hidden: bool = False, impl: str = "auto"):
    """Full-sequence causal forward without a KV cache (draft training).

    Returns ``(k, v, hidden)``: the last layer's roped keys and values ``[B, T, K, Dh]`` (what the draft
    cross-attends to) and, with ``final_hidden``, the final-normed hidden states ``[B, T, d]``; without it
    ``hidden`` is None and the last layer's attention and MLP are skipped (its K/V need only its input).
    """
    cos_BxTxD, sin_BxTxD = rope_tables(positions_BxT, inverse_frequencies(config.rope, config.head_dim))
    x_BxTxd = embed_tokens(params, tokens_BxT)
    B, T, _ = x_BxTxd.shape
    last = len(params["layers"]) - 1
    for i, layer in enumerate(params["layers"]):
        h_BxTxd = rms_norm(x_BxTxd, layer["attn_norm"], config.rms_norm_eps)
        q_BxTxHxD, k_BxTxKxD, v_BxTxKxD = _qkv(layer, config, h_BxTxd, cos_BxTxD, sin_BxTxD)
        if i == last and not final_hidden:
            return k_BxTxKxD, v_BxTxKxD, None
        o_BxTxHxD = causal_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, impl=impl)
        x_BxTxd = x_BxTxd + linear(o_BxTxHxD.reshape(B, T, -1), layer["wo"], layer.get("bo"))
        x_BxTxd = x_BxTxd + _mlp_block(layer, config, rms_norm(x_BxTxd, layer["mlp_norm"], config.rms_norm_eps))
    return k_BxTxKxD, v_BxTxKxD, rms_norm(x_BxTxd, params["final_norm"], config.rms_norm_eps)


def prefill(params: dict, config: TargetConfig, tokens_BxT: jax.Array, prompt_lengths_B: jax.Array,
            cache: KVCache, *, chunk: int, impl: str = "auto") -> tuple[jax.Array, KVCache]:
    """Chunked causal prefill of right-padded prompts (T a multiple of ``chunk``); bounded attention memory.

    Returns the float32 logits after each prompt's last token ``[B, V]`` and the cache with
    ``lengths = prompt_lengths``.
    """
    B, T = tokens_BxT.shape
    if T % chunk:
        raise ValueError(f"padded prompt length {T} must be a multiple of the prefill chunk {chunk}")
    mask_BxCxC = jnp.broadcast_to(jnp.tril(jnp.ones((chunk, chunk), bool)), (B, chunk, chunk))
    last_index_B = prompt_lengths_B - 1

    def body(c, carry):
        cache, last_hidden_Bxd = carry
        start = c * chunk
        tokens_BxC = jax.lax.dynamic_slice_in_dim(tokens_BxT, start, chunk, axis=1)
        positions_BxC = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (B, chunk))
        cache = cache.replace(lengths=jnp.full((B,), start, jnp.int32))
        hidden_BxCxd, cache = forward(params, config, tokens_BxC, positions_BxC, cache, mask_BxCxC, impl=impl)
        local_B = jnp.clip(last_index_B - start, 0, chunk - 1)
        picked_Bxd = jnp.take_along_axis(hidden_BxCxd, local_B[:, None, None], axis=1)[:, 0]
        in_chunk_B = (last_index_B >= start) & (last_index_B < start + chunk)
        return cache, jnp.where(in_chunk_B[:, None], picked_Bxd, last_hidden_Bxd)

    init_hidden_Bxd = jnp.zeros((B, config.hidden_size), params["embed"].dtype)
    cache, last_hidden_Bxd = jax.lax.fori_loop(0, T // chunk, body, (cache, init_hidden_Bxd))
    logits_BxV = lm_head_logits(params, last_hidden_Bxd[:, None])[:, 0]
    return logits_BxV, cache.replace(lengths=prompt_lengths_B.astype(jnp.int32))

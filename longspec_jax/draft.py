"""The LongSpec draft: one decoder layer of windowed self-attention, cross-attention into the target's
last-layer KV cache, and a SwiGLU MLP (as in the PyTorch LongSpec code), as a functional Flax module, and its runtime in
a speculative round (ring-cache prefill, step 0 on the pending tokens, log-probs of a tree level).

The draft shares the target's embedding, LM head and RoPE; it has no final norm. Submodule and parameter names
follow the PyTorch state dict (``self_attn.q_proj.weight`` is ``params/self_attn/q_proj/kernel`` transposed),
and the unused ``cross_attn.k_proj`` / ``v_proj`` are kept as parameters so released checkpoints round-trip.

How the layer's queries attend is supplied by the caller (``attend_self`` / ``attend_cross``), so the same
module serves prefill, the speculative round and training.

Runtime bookkeeping (all positions equal target cache slots): ``cache.lengths`` = tokens committed in every
target layer; the root (last emitted token) sits at that position. ``pending`` = the tokens emitted last round
(the root last), not yet in the draft's ring cache, at positions ``lengths - num_pending + 1 ... lengths``; the
ring holds the self-attention K/V of the committed positions before them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from longspec_jax.attention import cache_attention, windowed_ring_attention
from longspec_jax.config import RopeConfig, TargetConfig
from longspec_jax.draft_vocab import DraftVocab, gather_draft_vocab
from longspec_jax.errors import ConfigError
from longspec_jax.kv_cache import KVCache, RingCache
from longspec_jax.layers import rms_norm
from longspec_jax.rope import apply_rope, inverse_frequencies, rope_tables
from longspec_jax.target import embed_tokens, lm_head_logits

DEFAULT_WINDOW = 512


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """Draft architecture, derived from the target's config (as the reference builds it)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    mlp_bias: bool = False
    window: int = DEFAULT_WINDOW
    initializer_range: float = 0.02

    @property
    def head_dim(self) -> int:
        # The reference always uses hidden // heads for the draft, whatever the target's head_dim says.
        return self.hidden_size // self.num_heads

    @property
    def ring_capacity(self) -> int:
        """Slots of the self-attention ring cache: the window plus slack, independent of context length."""
        return -(-(self.window + 64) // 64) * 64

    @classmethod
    def from_target(cls, target: TargetConfig, window: int = DEFAULT_WINDOW) -> "DraftConfig":
        if target.hidden_size % target.num_heads:
            raise ConfigError(f"hidden_size {target.hidden_size} is not a multiple of num_attention_heads "
                              f"{target.num_heads}; a LongSpec draft needs hidden // heads as head_dim")
        if target.hidden_size // target.num_heads != target.head_dim:
            raise ConfigError(
                f"draft head_dim = hidden_size // num_heads = {target.hidden_size // target.num_heads} differs "
                f"from the target's head_dim {target.head_dim}: the draft cannot cross-attend to its KV cache")
        if window <= 0:
            raise ConfigError(f"draft window must be positive, got {window}")
        return cls(hidden_size=target.hidden_size, num_heads=target.num_heads,
                   num_kv_heads=target.num_kv_heads, intermediate_size=target.intermediate_size,
                   rms_norm_eps=target.rms_norm_eps, rope=target.rope,
                   mlp_bias=target.mlp_bias and target.model_type == "llama", window=window)


class RMSNorm(nn.Module):
    eps: float
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        return rms_norm(x, weight.astype(x.dtype), self.eps)


class DraftAttention(nn.Module):
    """Projections of one attention block (q/k/v with bias, o without); attention itself is external."""

    config: DraftConfig
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        c = self.config
        dense = lambda features, bias, name: nn.Dense(
            features, use_bias=bias, name=name, dtype=self.param_dtype, param_dtype=self.param_dtype,
            kernel_init=nn.initializers.normal(c.initializer_range))
        self.q_proj = dense(c.num_heads * c.head_dim, True, "q_proj")
        self.k_proj = dense(c.num_kv_heads * c.head_dim, True, "k_proj")
        self.v_proj = dense(c.num_kv_heads * c.head_dim, True, "v_proj")
        self.o_proj = dense(c.hidden_size, False, "o_proj")

    def query(self, x_BxTxd, cos, sin):
        B, T, _ = x_BxTxd.shape
        return apply_rope(self.q_proj(x_BxTxd).reshape(B, T, self.config.num_heads, -1), cos, sin)

    def key_value(self, x_BxTxd, cos, sin):
        B, T, _ = x_BxTxd.shape
        k = self.k_proj(x_BxTxd).reshape(B, T, self.config.num_kv_heads, -1)
        v = self.v_proj(x_BxTxd).reshape(B, T, self.config.num_kv_heads, -1)
        return apply_rope(k, cos, sin), v

    def out(self, o_BxTxHxD):
        B, T = o_BxTxHxD.shape[:2]
        return self.o_proj(o_BxTxHxD.reshape(B, T, -1))


class DraftMLP(nn.Module):
    config: DraftConfig
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        c = self.config
        dense = lambda features, name: nn.Dense(
            features, use_bias=c.mlp_bias, name=name, dtype=self.param_dtype, param_dtype=self.param_dtype,
            kernel_init=nn.initializers.normal(c.initializer_range))
        return dense(c.hidden_size, "down_proj")(
            jax.nn.silu(dense(c.intermediate_size, "gate_proj")(x)) * dense(c.intermediate_size, "up_proj")(x))


AttendFn = Callable[[jax.Array], jax.Array]  # queries [B, T, H, D] -> attention output [B, T, H, D]


class DraftLayer(nn.Module):
    """``h1 = x + SelfAttn(norm(x)); h2 = h1 + CrossAttn(norm(h1)); y = h2 + MLP(norm(h2))`` (no final norm)."""

    config: DraftConfig
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        c = self.config
        self.input_layernorm = RMSNorm(c.rms_norm_eps, self.param_dtype)
        self.self_attn = DraftAttention(c, self.param_dtype)
        self.post_self_attention_layernorm = RMSNorm(c.rms_norm_eps, self.param_dtype)
        self.cross_attn = DraftAttention(c, self.param_dtype)
        self.post_cross_attention_layernorm = RMSNorm(c.rms_norm_eps, self.param_dtype)
        self.mlp = DraftMLP(c, self.param_dtype)

    def _rope(self, positions_BxT):
        return rope_tables(positions_BxT, inverse_frequencies(self.config.rope, self.config.head_dim))

    def self_kv(self, x_BxTxd, positions_BxT):
        """Self-attention K (roped) and V: a pure function of (token embedding, position)."""
        cos, sin = self._rope(positions_BxT)
        return self.self_attn.key_value(self.input_layernorm(x_BxTxd), cos, sin)

    def __call__(self, x_BxTxd, positions_BxT, attend_self: AttendFn, attend_cross: AttendFn):
        cos, sin = self._rope(positions_BxT)
        q = self.self_attn.query(self.input_layernorm(x_BxTxd), cos, sin)
        h = x_BxTxd + self.self_attn.out(attend_self(q).astype(x_BxTxd.dtype))
        q = self.cross_attn.query(self.post_self_attention_layernorm(h), cos, sin)
        h = h + self.cross_attn.out(attend_cross(q).astype(h.dtype))
        return h + self.mlp(self.post_cross_attention_layernorm(h))

    def init_all(self, x_BxTxd, positions_BxT):
        """Touches every parameter (the unused cross-attention k/v included); for ``init`` only."""
        cos, sin = self._rope(positions_BxT)
        self.cross_attn.key_value(x_BxTxd, cos, sin)
        identity = lambda q: q
        return self(x_BxTxd, positions_BxT, identity, identity), self.self_kv(x_BxTxd, positions_BxT)


@dataclasses.dataclass(frozen=True, eq=False)
class Draft:
    """A draft model: static config and Flax variables ``{"params": ...}``.

    ``logits_hook(logits_BxTxV, positions_BxT, hook_data) -> logits`` optionally transforms the draft's logits
    before the tree search (oracle or perturbed drafts for testing and analysis; ``None`` for real use).
    ``hook_data`` is a pytree passed to it as traced data, so new data does not recompile.
    ``target_hf_config`` is the HF ``config.json`` dict of the target it belongs to (set by ``load_draft``);
    ``save_draft`` writes it as the exported draft's ``config.json``. ``profile`` is the draft's measured
    acceptance (a :class:`longspec_jax.speculation_profile.SpeculationProfile`, stored beside its weights), from
    which ``generate`` chooses how to speculate; ``None``: default rates. ``vocab``: the draft vocabulary it
    proposes from (:mod:`longspec_jax.draft_vocab`, set with :meth:`with_vocab`); ``None``: the target's whole
    vocabulary. With one, ``logits_hook`` sees the logits of its K ids.
    """

    config: DraftConfig
    variables: dict
    logits_hook: Callable | None = None
    hook_data: Any = None
    target_hf_config: dict | None = dataclasses.field(default=None, repr=False)
    profile: Any = dataclasses.field(default=None, repr=False)
    vocab: DraftVocab | None = dataclasses.field(default=None, repr=False)

    @property
    def module(self) -> DraftLayer:
        return DraftLayer(self.config, self.param_dtype)

    @property
    def param_dtype(self):
        return self.variables["params"]["input_layernorm"]["weight"].dtype

    def settings(self, impl: str) -> "DraftSettings":
        """The static half of this draft for a compiled loop, with attention implementation ``impl``."""
        return DraftSettings(config=self.config, dtype=jnp.dtype(self.param_dtype).type, impl=impl,
                             logits_hook=self.logits_hook)

    @property
    def weights(self) -> "DraftWeights":
        """The traced half: variables, hook data and the draft vocabulary."""
        return DraftWeights(variables=self.variables, hook_data=self.hook_data, vocab=self.vocab)

    def with_vocab(self, target, ids) -> "Draft":
        """This draft proposing only from the sorted target token ids ``ids`` (their LM-head columns gathered from
        ``target`` now), or from the whole vocabulary where ``ids`` is ``None``; a ``ValueError`` names a bad
        vocabulary."""
        vocab = None if ids is None else gather_draft_vocab(target.params, ids, target.config.vocab_size)
        return dataclasses.replace(self, vocab=vocab)

    def vocab_size(self, target_vocab_size: int) -> int:
        """How many tokens it proposes from: its draft vocabulary's K, else the target's ``target_vocab_size``."""
        return target_vocab_size if self.vocab is None else self.vocab.size


def init_draft(config: DraftConfig, key: jax.Array, dtype=jnp.float32) -> Draft:
    """A randomly initialised draft: N(0, initializer_range) kernels, zero biases, unit norms (HF ``post_init``)."""
    module = DraftLayer(config, dtype)
    x = jnp.zeros((1, 1, config.hidden_size), dtype)
    pos = jnp.zeros((1, 1), jnp.int32)
    variables = module.init(key, x, pos, method=DraftLayer.init_all)
    return Draft(config=config, variables=jax.tree_util.tree_map(lambda a: a.astype(dtype), variables))


# ------------------------------------------------------------------------------------------------ runtime


@dataclasses.dataclass(frozen=True)
class DraftSettings:
    """Everything static about running a draft inside a compiled loop (part of a jit cache key)."""

    config: DraftConfig
    dtype: Any                         # parameter and compute dtype
    impl: str = "auto"                 # attention implementation (longspec_jax.attention.resolve_impl)
    logits_hook: Callable | None = None

    @property
    def module(self) -> DraftLayer:
        return DraftLayer(self.config, self.dtype)


@struct.dataclass
class DraftWeights:
    """The draft's traced inputs: Flax variables, the optional logits-hook data and draft vocabulary."""

    variables: dict
    hook_data: Any = None
    vocab: DraftVocab | None = None


def draft_self_kv(ds: DraftSettings, weights: DraftWeights, target_params, tokens_BxT, positions_BxT):
    """Self-attention K (roped) and V of tokens at positions, ``[B, T, K, D]`` each."""
    x_BxTxd = embed_tokens(target_params, tokens_BxT).astype(ds.dtype)
    return ds.module.apply(weights.variables, x_BxTxd, positions_BxT, method=DraftLayer.self_kv)


def draft_log_probs(ds: DraftSettings, weights: DraftWeights, target_params, cache: KVCache, ring: RingCache,
                    tokens_BxT, positions_BxT, new_k_BxNxKxD, new_v_BxNxKxD, new_mask_BxTxN):
    """Draft log-softmax ``[B, T, V]`` (float32; ``[B, T, K]`` over a draft vocabulary's ids) for tokens at
    ``positions``: windowed self-attention over the ring plus the new keys under ``new_mask``; cross-attention to
    the target's last layer, slots ``[0, lengths)``."""

    def attend_self(q_BxTxHxD):
        return windowed_ring_attention(q_BxTxHxD, positions_BxT, ring.k, ring.v, ring.pos, ds.config.window,
                                       new_k_BxNxKxD, new_v_BxNxKxD, new_mask_BxTxN, impl=ds.impl)[0]

    def attend_cross(q_BxTxHxD):
        return cache_attention(q_BxTxHxD, cache.k[-1], cache.v[-1], cache.lengths, impl=ds.impl)[0]

    x_BxTxd = embed_tokens(target_params, tokens_BxT).astype(ds.dtype)
    y_BxTxd = ds.module.apply(weights.variables, x_BxTxd, positions_BxT, attend_self, attend_cross)
    head_params = target_params if weights.vocab is None else {"lm_head": weights.vocab.head}
    logits_BxTxV = lm_head_logits(head_params, y_BxTxd.astype(target_params["embed"].dtype))
    if ds.logits_hook is not None:
        logits_BxTxV = ds.logits_hook(logits_BxTxV, positions_BxT, weights.hook_data)
    return jax.nn.log_softmax(logits_BxTxV, axis=-1)


def draft_prefill(ds: DraftSettings, weights: DraftWeights, target_params, tokens_BxT,
                  prompt_lengths_B) -> RingCache:
    """Fills the ring with the self-attention K/V of each prompt's last ``ring_capacity`` positions (the draft's
    other prefill outputs are never used)."""
    span = min(ds.config.ring_capacity, tokens_BxT.shape[1])
    positions_BxS = jnp.maximum(prompt_lengths_B[:, None] - span + jnp.arange(span)[None], 0)
    return draft_prefill_window(ds, weights, target_params, jnp.take_along_axis(tokens_BxT, positions_BxS, 1),
                                prompt_lengths_B)


def draft_prefill_window(ds: DraftSettings, weights: DraftWeights, target_params, window_BxS,
                         prompt_lengths_B) -> RingCache:
    """:func:`draft_prefill` from each prompt's last ``S <= ring_capacity`` tokens only (``window[b, i]`` at
    position ``prompt_lengths[b] - S + i``; entries before position 0 are ignored)."""
    B, S = window_BxS.shape
    c = ds.config
    positions_BxS = prompt_lengths_B[:, None] - S + jnp.arange(S)[None]
    valid_BxS = positions_BxS >= 0
    safe_BxS = jnp.maximum(positions_BxS, 0)
    k, v = draft_self_kv(ds, weights, target_params, window_BxS, safe_BxS)
    ring = RingCache.empty(B, c.ring_capacity, c.num_kv_heads, c.head_dim, ds.dtype)
    return ring.write(k, v, positions_BxS, valid_BxS)


def pending_kv(ds: DraftSettings, weights: DraftWeights, target_params, root_pos_B, pending_BxA, num_pending_B):
    """Self-attention K/V of the pending tokens (last round's output, the root last at ``root_pos``), their
    positions and which entries are real: ``(k, v, positions_BxA, valid_BxA)``, what the ring stores of them."""
    offsets_1xA = jnp.arange(pending_BxA.shape[1])[None]
    positions_BxA = root_pos_B[:, None] - num_pending_B[:, None] + 1 + offsets_1xA
    valid_BxA = offsets_1xA < num_pending_B[:, None]
    k, v = draft_self_kv(ds, weights, target_params, pending_BxA, positions_BxA)
    return k, v, positions_BxA, valid_BxA


def draft_root(ds: DraftSettings, weights: DraftWeights, target_params, cache: KVCache, ring: RingCache,
               pending_BxA, num_pending_B):
    """Step 0: stores the pending tokens' K/V in the ring and returns the draft's distribution after the root
    ``[B, V]`` (``[B, K]`` over a draft vocabulary) and the ring. Only the root's full layer output is needed; the
    other pending tokens contribute K/V only."""
    root_pos_B = cache.lengths
    k, v, positions_BxA, valid_BxA = pending_kv(ds, weights, target_params, root_pos_B, pending_BxA, num_pending_B)
    root_Bx1 = jnp.take_along_axis(pending_BxA, num_pending_B[:, None] - 1, axis=1)
    logp_Bx1xV = draft_log_probs(ds, weights, target_params, cache, ring, root_Bx1, root_pos_B[:, None], k, v,
                                 valid_BxA[:, None, :])
    return logp_Bx1xV[:, 0], ring.write(k, v, positions_BxA, valid_BxA)

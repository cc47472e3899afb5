"""In-round ablation: one part of the compiled round computed twice, so that the time it adds is that part's
marginal cost where it runs, between the kernels that really precede and follow it.

A part measured alone (an op benchmark) or read off one variant's per-kernel table has predicted its saving in the
round poorly (on the H200 the Mosaic cache half, 0.36 ms a verification faster alone, saved 0.08-0.10 ms in the
round). Doubling does not change what the part's neighbours see: the second call's
input is the first's perturbed by a scalar of its output times 1e-30 (unknown to XLA, so nothing is shared or
hoisted), and its output is kept alive by a select that never picks it. The extra select is one elementwise
pass over the part's output, usually fused into its consumer.

Parts are module attributes (or class attributes, ``Class.method``) looked up when the round is traced, patched
while ``doubling`` is active.
"""

from __future__ import annotations

import contextlib
import importlib
from unittest import mock

import jax
import jax.numpy as jnp

from infer.bench.harness import names_arg

# part -> (module, attribute, what it covers)
PARTS = {
    "attention": ("longspec_jax.target", "hybrid_tree_attention",
                  "target attention: cache half, tree half, merge and their glue"),
    "qkv": ("longspec_jax.target", "_qkv", "target q/k/v GEMM, RoPE and slices"),
    "gemms": ("longspec_jax.target", "linear", "every target weight GEMM: q/k/v, o, gate/up, down"),
    "mlp": ("longspec_jax.target", "_mlp_block", "target gate/up GEMM, SiLU x up, down GEMM"),
    "norm": ("longspec_jax.target", "rms_norm", "target RMSNorms"),
    "lm_head": ("infer.speculative", "lm_head_logits", "target LM head of the verified nodes"),
    "draft_cross": ("longspec_jax.draft", "cache_attention", "draft cross-attention into the target's cache"),
    "draft_self": ("longspec_jax.draft", "windowed_ring_attention", "draft windowed self-attention"),
    "draft_lm_head": ("longspec_jax.draft", "lm_head_logits", "draft LM head (shared with the target)"),
    "draft_mlp": ("longspec_jax.draft", "DraftMLP.__call__", "draft MLP: gate, up and down GEMMs, SiLU x up"),
    "draft_gemms": ("flax.linen", "Dense.__call__", "every draft weight GEMM (the draft's flax Dense layers)"),
    "top_k": ("longspec_jax.tree", "top_k", "per-parent top-k over the vocabulary in the tree levels"),
}


parse_parts = names_arg(PARTS, "part")  # --ablate: a comma list of PARTS names


def _is_float_array(x) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)


def _keep_alive(a, b):
    """``a``, with ``b`` a live input (a select on a value ``b`` does not hold)."""
    if jnp.issubdtype(a.dtype, jnp.integer):
        return jnp.where(b == jnp.iinfo(b.dtype).min, a + 1, a)
    return jnp.where(b == jnp.asarray(1.2345e-37, b.dtype), a + 1, a)


def doubled(fn):
    """``fn`` computed twice: the second call on the first floating-point positional array perturbed by a scalar of
    the first call's output (x 1e-30); returns the first call's result, the second kept alive."""
    def twice(*args, **kwargs):
        first = fn(*args, **kwargs)
        at = next((i for i, a in enumerate(args) if _is_float_array(a)), None)
        if at is None:
            raise TypeError(f"cannot double {getattr(fn, '__name__', fn)}: no floating-point array argument")
        leaf = jax.tree_util.tree_leaves(first)[0]
        eps = leaf.reshape(-1)[0].astype(jnp.float32) * 1e-30
        moved = list(args)
        moved[at] = args[at] + eps.astype(args[at].dtype)
        second = fn(*moved, **kwargs)
        return jax.tree_util.tree_map(_keep_alive, first, second)
    return twice


@contextlib.contextmanager
def doubling(parts):
    """While active, each of ``parts`` (names of :data:`PARTS`) is computed twice wherever a round is traced.
    Trace a function made inside the block: jax reuses the trace of a function object it has traced before."""
    with contextlib.ExitStack() as stack:
        for part in parts:
            module, path, _ = PARTS[part]
            *owner_path, attr = path.split(".")
            owner = importlib.import_module(module)
            for name in owner_path:
                owner = getattr(owner, name)
            stack.enter_context(mock.patch.object(owner, attr, doubled(getattr(owner, attr))))
        yield

"""Inputs and ops of the attention benchmark: random verification-shaped inputs, distinct K/V buffer sets, every
op timed (hybrid attention per impl, each half alone, decode, jax's own kernels) and rough H200 estimates."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tools.attention_loop import num_rotations

# (query heads, kv heads); padded-8b is pad_model.py's 8B-cost fixture (run it with --head-dim 64); qwen2-7b's
# group of 7 folds to row counts that fill no power-of-two tile
MODELS = {"llama3-8b": (32, 8), "vicuna-7b": (32, 32), "qwen2-7b": (28, 4), "padded-8b": (72, 18)}
HYBRID_USES = ("q", "k_new", "v_new", "lengths")
CACHE_USES = ("q", "lengths")


def tree_masks(rng, batch: int, num_new: int, num_accepted: int = 5, num_pad: int = 5) -> np.ndarray:
    """[B, M, M] verification masks (the reference's layout): accepted tokens causal, tree nodes with random
    parents see every accepted token plus their ancestors and themselves, padding rows see nothing."""
    num_accepted = min(num_accepted, num_new)
    num_pad = min(num_pad, num_new - num_accepted)
    nodes = num_new - num_accepted - num_pad
    out = np.zeros((batch, num_new, num_new), bool)
    for b in range(batch):
        a = num_accepted
        out[b, :a, :a] = np.tril(np.ones((a, a), bool))
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, nodes)]
        for i in range(nodes):
            out[b, a + i, :a] = True
            j = i
            while j >= 0:
                out[b, a + i, a + j] = True
                j = parents[j]
    return out


def make_inputs(seed: int, B: int, M: int, S: int, H: int, K: int, D: int, dtype) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    rng = np.random.default_rng(seed)
    return dict(
        q=jax.random.normal(keys[0], (B, M, H, D), dtype),
        k_cache=jax.random.normal(keys[1], (B, S, K, D), dtype),
        v_cache=jax.random.normal(keys[2], (B, S, K, D), dtype),
        lengths=jnp.full((B,), S, jnp.int32),
        k_new=jax.random.normal(keys[3], (B, M, K, D), dtype),
        v_new=jax.random.normal(keys[4], (B, M, K, D), dtype),
        mask=jnp.asarray(tree_masks(rng, B, M)),
    )


def cache_bytes(B, L, K, D, dtype) -> int:
    return 2 * B * L * K * D * jnp.dtype(dtype).itemsize


def make_kv_sets(seed, B, S, K, D, dtype, R, first=None) -> tuple:
    """R distinct (k_cache, v_cache) sets (``first`` as the first, when given)."""
    sets = [first] if first is not None else []
    for r in range(len(sets), R):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed * 1000 + r), 2)
        sets.append((jax.random.normal(k1, (B, S, K, D), dtype), jax.random.normal(k2, (B, S, K, D), dtype)))
    return tuple(sets)


@dataclasses.dataclass
class RowInputs:
    """One shape's inputs: the small ones (``q1`` = the first query alone) and a one-element box holding R
    distinct K/V sets, which the timer refills with the donated-and-returned sets."""

    seed: int
    B: int
    M: int
    S: int
    H: int
    K: int
    D: int
    dtype: Any
    R: int

    @classmethod
    def rotated(cls, seed, B, M, S, H, K, D, dtype, args) -> "RowInputs":
        """With as many K/V sets as :func:`num_rotations` asks for at this size."""
        return cls(seed, B, M, S, H, K, D, dtype, num_rotations(cache_bytes(B, S, K, D, dtype), args.smoke,
                                                                 args.max_rotate))

    def __post_init__(self):
        inp = make_inputs(self.seed, self.B, self.M, self.S, self.H, self.K, self.D, self.dtype)
        self.small = {k: inp[k] for k in ("q", "k_new", "v_new", "lengths", "mask")}
        self.small["q1"] = inp["q"][:, :1]
        self.kv_box = [make_kv_sets(self.seed, self.B, self.S, self.K, self.D, self.dtype, self.R,
                                    first=(inp["k_cache"], inp["v_cache"]))]

    @property
    def nbytes(self) -> int:
        """Bytes of one K/V set."""
        return cache_bytes(self.B, self.S, self.K, self.D, self.dtype)

    def kv(self) -> list:
        """The K/V box, its sets made again where a failed donated call freed them."""
        if any(a.is_deleted() for a in jax.tree_util.tree_leaves(self.kv_box[0])):
            self.kv_box[0] = make_kv_sets(self.seed, self.B, self.S, self.K, self.D, self.dtype, self.R)
        return self.kv_box

    def estimate_s(self, name: str, M: int | None = None) -> float:
        return estimate_s(name, self.B, self.M if M is None else M, self.S, self.H, self.K, self.D)


def estimate_s(name: str, B: int, M: int, S: int, H: int, K: int, D: int, itemsize: int = 2) -> float:
    """Rough seconds per call on an H200, only used to pick the first loop count (then learned per kind)."""
    nbytes = 2 * B * S * K * D * itemsize
    cache = max(nbytes / 3.0e12, 4 * B * M * H * S * D / 2.0e14) + 8e-6
    tree = 6e-6 + 4 * B * M * M * H * D / 1e14
    decode = nbytes / 3.0e12 + 8e-6
    return {"pallas": cache + tree, "gpu": cache + tree, "cudnn": cache + tree, "xla": 6 * cache,
            "naive": 3 * cache, "cache": cache, "kernel": cache, "cache_cudnn": cache, "mgpu": cache, "tree": tree,
            "mosaic": cache + tree, "cache_mosaic": cache,
            "decode": decode, "decode_cudnn": decode, "dpa": 1.5 * cache, "dpa_xla": 6 * cache}[name]


def cache_kwargs(args) -> dict:
    """``cache_attention`` launch parameters of the table (unset ones: the kernel's ``default_config``)."""
    kw = {"combine": args.combine}
    for name in ("block_r", "block_k", "num_splits", "num_warps", "num_stages"):
        val = getattr(args, name)
        if val:
            kw[name] = val
    return kw


def chunk_attention_fn():
    """The cuDNN cache half's per-chunk kernel: cuDNN on a GPU, the jnp stand-in elsewhere."""
    from longspec_jax.cudnn_cache import cudnn_chunk_attention, reference_chunk_attention
    return cudnn_chunk_attention if jax.default_backend() == "gpu" else reference_chunk_attention


def build_ops(args, backend) -> dict:
    """name -> (op(inputs dict) -> outputs with a float array first, inputs the op reads, reads the cache)."""
    from longspec_jax.attention import hybrid_tree_attention
    from longspec_jax.cudnn_cache import cudnn_cache_attention
    from pallas import cache_attention, cache_attention_partials, tree_attention

    ckw = cache_kwargs(args)
    pkw = {k: v for k, v in ckw.items() if k != "combine"}

    def hybrid(impl):  # impl="pallas" uses the kernels' auto backend (interpret on CPU, Triton on GPU)
        return lambda i: hybrid_tree_attention(i["q"], i["k_cache"], i["v_cache"], i["lengths"], i["k_new"],
                                               i["v_new"], i["mask"], impl=impl)

    def dpa(impl):
        return lambda i: (jax.nn.dot_product_attention(i["q"], i["k_cache"], i["v_cache"],
                                                       key_value_seq_lengths=i["lengths"], implementation=impl),)

    on_gpu = jax.default_backend() == "gpu"
    chunk_fn = chunk_attention_fn()

    def cudnn_half(q_name):
        return lambda i: cudnn_cache_attention(i[q_name], i["k_cache"], i["v_cache"], i["lengths"],
                                               chunk_attention=chunk_fn)

    ops = {
        "gpu": (hybrid("gpu"), HYBRID_USES, True),
        "cache_cudnn": (cudnn_half("q"), CACHE_USES, True),
        "decode_cudnn": (cudnn_half("q1"), ("q1", "lengths"), True),
        "pallas": (hybrid("pallas"), HYBRID_USES, True),
        "xla": (hybrid("xla"), HYBRID_USES, True),
        "naive": (hybrid("naive"), HYBRID_USES, True),
        "cache": (lambda i: cache_attention(i["q"], i["k_cache"], i["v_cache"], i["lengths"], backend=backend,
                                            **ckw), CACHE_USES, True),
        "kernel": (lambda i: cache_attention_partials(i["q"], i["k_cache"], i["v_cache"], i["lengths"],
                                                      backend=backend, **pkw), CACHE_USES, True),
        "tree": (lambda i: tree_attention(i["q"], i["k_new"], i["v_new"], i["mask"], backend=backend),
                 ("q", "k_new", "v_new"), False),
        "decode": (lambda i: cache_attention(i["q1"], i["k_cache"], i["v_cache"], i["lengths"], backend=backend,
                                             **ckw), ("q1", "lengths"), True),
        "dpa": (dpa("cudnn" if on_gpu else "xla"), CACHE_USES, True),
        "dpa_xla": (dpa("xla"), CACHE_USES, True),
    }
    if on_gpu:  # cuDNN and Mosaic GPU exist only there (the Mosaic GPU interpreter is too slow for a benchmark)
        from pallas.mosaic_cache_attention import mosaic_cache_attention
        ops["cudnn"] = (hybrid("cudnn"), HYBRID_USES, True)
        ops["mosaic"] = (hybrid("mosaic"), HYBRID_USES, True)
        ops["cache_mosaic"] = (lambda i: mosaic_cache_attention(i["q"], i["k_cache"], i["v_cache"], i["lengths"]),
                               CACHE_USES, True)
        if args.dtype == "float16":  # jax's Mosaic GPU flash kernel takes float16 only
            ops["mgpu"] = (mgpu_split_attention, CACHE_USES, True)
    return ops


def mgpu_split_attention(i):
    """jax's Mosaic GPU flash-attention kernel (``pallas.ops.gpu.attention_mgpu``, FA3-style, Hopper) on the
    same folded, split problem as the cuDNN cache half: GQA group folded into the queries (padded to a multiple
    of 128), the cache cut into ``default_num_splits`` chunks. It has no per-sequence length, so every chunk is
    read in full, and the merge of the chunks is left out: a lower bound on a Mosaic GPU cache half."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    from longspec_jax.cudnn_cache import default_num_splits, repeat_per_chunk
    from pallas.folding import fold_group
    q, k, v = i["q"], i["k_cache"], i["v_cache"]
    B, M, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    rows = M * (H // K)
    splits = default_num_splits(B, K, rows, S)
    q_fold = fold_group(q, K, row_multiple=128)
    q_split = repeat_per_chunk(q_fold, splits)
    config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2)
    out, (lse,) = attention_mgpu.attention(q_split, k.reshape(B * splits, S // splits, K, D),
                                           v.reshape(B * splits, S // splits, K, D), config, True)
    return out, lse

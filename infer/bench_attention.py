"""GPU check + benchmark of hybrid tree attention and the Pallas kernels.

    python -m infer.bench_attention --out DIR --sections copy,sweep,table --budget-s 190   # H200, ~4 minutes
    python -m infer.bench_attention --smoke --out DIR    # tiny shapes, CPU interpret mode, seconds

Sections (``--sections``, default all, in this order):
  checks  each kernel against its pure-jnp reference at a few shapes (relative error, PASS/FAIL; a failure
          prints its traceback and the run goes on)
  copy    HBM bandwidth ceiling: ``x + 1`` over a 1 GiB uint32 buffer (bytes = read + write), repeated inside
          one jitted ``fori_loop`` (buffer donated, updated in place); also the ``infer.bench_decode`` method
          (10 chained dispatches of one jitted ``x + 1``) for comparison
  sweep   cache_attention block_r / block_k / num_splits / num_warps at 32k (Llama-3-8B heads, batch 1),
          for 1 and for 74 queries; the current ``default_config`` first, marked "(default)"
  table   Llama-3-8B (32/8 heads) and Vicuna-7B (32/32) shapes, head_dim 128, bf16, batch 1 and 4, cache
          length 4k..64k, 74 new tokens under a random tree mask: hybrid attention with impl pallas / xla / naive,
          the Pallas cache half alone (and its kernel alone), the tree half alone, single-token decode
          (cache_attention, M=1), jax.nn.dot_product_attention over the cache for the 74 queries; achieved
          cache bytes/s.
Writes ``bench_attention.json`` (every number) and ``bench_attention.md`` (tables) to ``--out``.

Timing (every op): ``n`` iterations of the op inside one jitted ``lax.fori_loop`` (no per-call dispatch).
Each step reads a scalar of the previous step's output (times 1e-30, a value XLA cannot know) and adds it to
the small inputs the op uses (queries, new keys / values; lengths get ``- (s > 1)``) and to the last slot of
each K/V cache (an in-place one-row write, like a decode step's), so nothing can be folded or hoisted out of
the loop and the steps run strictly one after another. Each iteration runs the op once per K/V buffer set,
rotating over R distinct sets (R = ceil(3 x 60 MB L2 / set bytes), at most 16), so the cache is read from HBM
even where one set would fit in L2 (column "K/V fits L2"). ``n`` is picked so that one call lasts >= ~20 ms
(``--target-s``); warm-up call first, then the median of ``--calls`` calls (buffers donated, chained).
The same loop with an identity op (the perturbation and the one-row cache writes only) gives the loop
overhead per step, which is subtracted: reported time = (loop time - empty-loop time) per step. Both the raw
per-step time and the overhead are in the JSON (``raw_us``, ``overhead_us``) and the markdown.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

MODELS = {"llama3-8b": (32, 8), "vicuna-7b": (32, 32)}
L2_BYTES = 60 * 2**20


def log(msg: str) -> None:
    print(msg, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory for bench_attention.json / .md")
    p.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU), for tests")
    p.add_argument("--sections", default="checks,copy,sweep,table")
    p.add_argument("--models", default="llama3-8b,vicuna-7b")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--lengths", default="32768,4096,16384,65536", help="cache lengths, run in this order")
    p.add_argument("--new-tokens", type=int, default=74)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"),
                   help="table dtype (jax 0.11.2's Mosaic GPU attention kernel fails on bfloat16: use float16 "
                        "to compare it)")
    p.add_argument("--impls", default="gpu,pallas,cudnn,xla,naive,cache,kernel,cache_cudnn,mgpu,tree,decode,"
                                      "decode_cudnn,dpa",
                   help="table columns: hybrid gpu (= auto on a GPU) / pallas / cudnn / xla / naive, the Pallas "
                        "cache half and its kernel alone, the cuDNN split cache half, jax's Mosaic GPU flash "
                        "kernel on the same split problem (mgpu), tree half, decode (M=1) with the Pallas and "
                        "the cuDNN cache half, dpa (jax.nn.dot_product_attention)")
    # cache_attention launch parameters used by the table (0 / unset = the kernel's default_config)
    p.add_argument("--block-r", type=int, default=0)
    p.add_argument("--block-k", type=int, default=0)
    p.add_argument("--num-splits", type=int, default=0)
    p.add_argument("--num-warps", type=int, default=0)
    p.add_argument("--num-stages", type=int, default=0)
    p.add_argument("--combine", default="pallas", choices=("pallas", "xla"), help="merge of the splits")
    # sweep grid
    p.add_argument("--sweep-length", type=int, default=32768)
    p.add_argument("--sweep-model", default="llama3-8b")
    p.add_argument("--sweep-batch", type=int, default=1)
    p.add_argument("--sweep-block-k", default="32,64,128",
                   help="M=1 key tiles (bf16 K+V tiles x stages must fit in 227 KB of shared memory)")
    p.add_argument("--sweep-splits-decode", default="0,8,16", help="0 = default_config")
    p.add_argument("--sweep-splits-tree", default="0,4,16")
    p.add_argument("--sweep-block-r-tree", default="64,128")
    p.add_argument("--sweep-warps-decode", default="4")
    p.add_argument("--sweep-warps-tree", default="8")
    p.add_argument("--sweep-stages-decode", default="2,3")
    p.add_argument("--sweep-stages-tree", default="2")
    p.add_argument("--sweep-block-k-tree", default="64,128")
    p.add_argument("--target-s", type=float, default=0.025,
                   help="seconds per timed call: the in-jit loop count n is chosen so one call lasts about this")
    p.add_argument("--calls", type=int, default=5, help="timed calls per op (median reported), after a warm-up")
    p.add_argument("--max-rotate", type=int, default=16, help="most K/V buffer sets rotated over (L2 coldness)")
    p.add_argument("--budget-s", type=float, default=200.0, help="stop starting new work after this")
    p.add_argument("--sweep-budget-s", type=float, default=50.0)
    p.add_argument("--sweep-cudnn-splits", default="0,4,8,16,32,64,128",
                   help="num_splits of the cuDNN cache half swept at --sweep-length (0 = default_num_splits)")
    return p.parse_args(argv)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


# ---------------------------------------------------------------------------------------------- inputs

def tree_masks(rng, batch: int, num_new: int, num_accepted: int = 5, num_pad: int = 5) -> np.ndarray:
    """[B, M, M] verification masks (reference.md 2.4 layout): accepted tokens causal, tree nodes with random
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


def make_inputs(seed: int, B: int, M: int, S: int, H: int, K: int, D: int, dtype, lengths=None) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    rng = np.random.default_rng(seed)
    if lengths is None:
        lengths = [S] * B
    return dict(
        q=jax.random.normal(keys[0], (B, M, H, D), dtype),
        k_cache=jax.random.normal(keys[1], (B, S, K, D), dtype),
        v_cache=jax.random.normal(keys[2], (B, S, K, D), dtype),
        lengths=jnp.asarray(lengths, jnp.int32),
        k_new=jax.random.normal(keys[3], (B, M, K, D), dtype),
        v_new=jax.random.normal(keys[4], (B, M, K, D), dtype),
        mask=jnp.asarray(tree_masks(rng, B, M)),
    )


def cache_bytes(B, L, K, D, dtype) -> int:
    return 2 * B * L * K * D * jnp.dtype(dtype).itemsize


# ---------------------------------------------------------------------------------------------- timing

EMPTY_EST_S = 3e-6  # first guess of the empty loop's seconds per step (only used to pick n)


def num_rotations(bytes_per_set: int, args) -> int:
    """K/V buffer sets to rotate over so that one cycle touches >= 3x the L2 (2 in smoke mode, to run that
    path on the CPU)."""
    if args.smoke:
        return 2
    return int(min(args.max_rotate, max(1, math.ceil(3 * L2_BYTES / max(bytes_per_set, 1)))))


def l2_note(bytes_per_set: int, R: int) -> dict:
    """Working set of the cache reads: one K/V set per step, R sets per cycle of the loop."""
    cycle = bytes_per_set * R
    return dict(set_bytes=int(bytes_per_set), rotate=int(R), cycle_bytes=int(cycle), l2_bytes=L2_BYTES,
                set_fits_l2=bool(bytes_per_set <= L2_BYTES), cycle_fits_l2=bool(cycle <= L2_BYTES),
                cold=bool(cycle >= 3 * L2_BYTES))


def l2_cell(note: dict | None) -> str:
    if not note:
        return "-"
    mb = note["set_bytes"] / 1e6
    sets = f"{note['rotate']} x {mb:.3g} MB" if note["rotate"] > 1 else f"{mb:.3g} MB"
    if note["cold"]:
        return f"no ({sets})"
    return f"{'yes' if note['cycle_fits_l2'] else 'partly'} ({sets})"


def _step_scalar(out):
    """float32 scalar from the previous step's output times 1e-30: about 0, but unknown to XLA."""
    leaf = jax.tree_util.tree_leaves(out)[0]
    return leaf[(0,) * leaf.ndim].astype(jnp.float32) * 1e-30


def _perturb(small: dict, uses, s) -> dict:
    inp = dict(small)
    for name in uses:
        x = small[name]
        inp[name] = x - (s > 1.0).astype(x.dtype) if name == "lengths" else x + s.astype(x.dtype)
    return inp


def _touch(cache, new_row, s):
    """Write ``new_row`` (the first new token's K or V; zeros if ``s > 1``, which never holds but XLA cannot
    know) into each sequence's last cache slot, in place: a one-row write per step, as in decoding. It makes the
    cache loop-variant, so XLA cannot hoist any work on it out of the loop. The row does not come from the cache
    itself and is chosen with a select, not arithmetic, so the update stays a plain in-place
    dynamic-update-slice (reading the cache in the same fusion, or bf16 arithmetic on the CPU, can turn it into
    a full copy)."""
    row = jnp.where(s > 1.0, jnp.zeros_like(new_row), new_row).astype(cache.dtype)
    return lax.dynamic_update_slice_in_dim(cache, row, cache.shape[1] - 1, axis=1)


def identity_op(uses):
    """The empty loop's op: returns its (perturbed) inputs; the float query comes first."""
    return lambda inp: tuple(inp[name] for name in uses)


def loop_fn(op, uses, n: int, steps: int, with_cache: bool):
    """jit((out, kv_sets), small) -> the carry after n iterations of ``steps`` chained op calls (one per K/V
    set when ``with_cache``). The carry is donated (the caches are updated in place)."""
    def run(carry, small):
        def body(i, c):
            out, kvs = c
            kvs = list(kvs)
            for r in range(steps):
                s = _step_scalar(out)
                inp = _perturb(small, uses, s)
                if with_cache:
                    kvs[r] = (_touch(kvs[r][0], small["k_new"][:, :1], s), _touch(kvs[r][1], small["v_new"][:, :1], s))
                    inp["k_cache"], inp["v_cache"] = kvs[r]
                out = op(inp)
            return out, tuple(kvs)
        return lax.fori_loop(0, n, body, carry)
    return jax.jit(run, donate_argnums=0)


_HLO_DTYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}


def cache_copies(hlo_text: str, cache) -> list[str]:
    """Names of copy / transpose instructions producing a cache-shaped array in a compiled module: such a copy
    inside the loop would add a full cache read + write per step (expected only in interpret mode, where the
    kernel is emulated with XLA ops)."""
    sig = f"{_HLO_DTYPES.get(jnp.dtype(cache.dtype).name, jnp.dtype(cache.dtype).name)}[{','.join(map(str, cache.shape))}]"
    pat = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = " + re.escape(sig))
    names = []
    for line in hlo_text.splitlines():
        m = pat.match(line)
        if m and ("copy" in m.group(1) or "transpose" in m.group(1)):
            names.append(m.group(1))
    return names


class LoopTimer:
    """Times ops inside one jitted ``fori_loop`` (see the module docstring); learns, per kind of op, measured /
    estimated time so that later shapes get a good loop count at the first compile."""

    def __init__(self, args):
        self.smoke = args.smoke
        self.target_s = 0.0 if args.smoke else args.target_s
        self.calls = 2 if args.smoke else max(1, args.calls)
        self.scale: dict = {}
        self.compile_s = 0.0
        self.recompiles = 0

    def _n(self, per_step_s: float, steps: int) -> int:
        return int(min(1_000_000, max(1, math.ceil(self.target_s / max(per_step_s * steps, 1e-8)))))

    def time(self, kind: str, op, uses, small: dict, kv_box, *, est_s: float, steps: int = 1) -> dict:
        """Seconds per op call. ``kv_box``: None (op reads no cache) or a one-element list holding the tuple of
        K/V sets (replaced by the donated-and-returned sets after every call)."""
        with_cache = kv_box is not None
        kvs = tuple(kv_box[0]) if with_cache else ()
        if with_cache:
            steps = len(kvs)
        sample = dict(small)
        if with_cache:
            sample["k_cache"], sample["v_cache"] = kvs[0]
        shapes = jax.eval_shape(op, sample)
        out0 = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
        est = est_s * self.scale.get(kind, 1.0)
        n = self._n(est, steps)
        carry = (out0, kvs)
        compile_s = 0.0
        for attempt in (0, 1):
            t0 = time.perf_counter()
            compiled = loop_fn(op, uses, n, steps, with_cache).lower(carry, small).compile()
            compile_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            carry = compiled(carry, small)
            if with_cache:
                kv_box[0] = carry[1]
            jax.block_until_ready(carry)
            warm = time.perf_counter() - t0
            if attempt == 0 and not self.smoke and (
                    warm < 0.6 * self.target_s or (warm > 10 * self.target_s and n > 1)):
                new_n = self._n(warm / (n * steps), steps)
                if new_n != n:
                    n = new_n
                    self.recompiles += 1
                    continue
            break
        self.compile_s += compile_s
        copies = cache_copies(compiled.as_text(), kvs[0][0]) if with_cache else []
        if copies and not self.smoke:
            log(f"    WARNING {kind}: {len(copies)} cache-shaped copies/transposes in the timed module "
                f"({', '.join(copies[:4])}): each adds a full cache read + write (expected only in interpret mode)")
        times = []
        for _ in range(self.calls):
            t0 = time.perf_counter()
            carry = compiled(carry, small)
            if with_cache:
                kv_box[0] = carry[1]
            jax.block_until_ready(carry)
            times.append(time.perf_counter() - t0)
        del carry
        call = statistics.median(times)
        per_step = call / (n * steps)
        self.scale[kind] = per_step / est_s
        return dict(per_step_s=per_step, call_s=call, call_min_s=min(times), n=n, steps_per_iter=steps,
                    calls=len(times), compile_s=compile_s, cache_copies=copies[:8], num_cache_copies=len(copies))


def estimate_s(name: str, B: int, M: int, S: int, H: int, K: int, D: int, itemsize: int = 2) -> float:
    """Rough seconds per call on an H200, only used to pick the first loop count (then learned per kind)."""
    nbytes = 2 * B * S * K * D * itemsize
    cache = max(nbytes / 3.0e12, 4 * B * M * H * S * D / 2.0e14) + 8e-6
    tree = 6e-6 + 4 * B * M * M * H * D / 1e14
    decode = nbytes / 3.0e12 + 8e-6
    return {"pallas": cache + tree, "gpu": cache + tree, "cudnn": cache + tree, "xla": 6 * cache,
            "naive": 3 * cache, "cache": cache, "kernel": cache, "cache_cudnn": cache, "mgpu": cache, "tree": tree,
            "decode": decode, "decode_cudnn": decode, "dpa": 1.5 * cache, "dpa_xla": 6 * cache}[name]


# ---------------------------------------------------------------------------------------------- functions

def cache_kwargs(args) -> dict:
    kw = {"combine": args.combine}
    for name in ("block_r", "block_k", "num_splits", "num_warps", "num_stages"):
        val = getattr(args, name)
        if val:
            kw[name] = val
    return kw


HYBRID_USES = ("q", "k_new", "v_new", "lengths")
CACHE_USES = ("q", "lengths")


def build_ops(args, backend) -> dict:
    """name -> (op(inputs dict) -> outputs with a float array first, inputs the op reads, reads the cache)."""
    from longspec_jax.attention import hybrid_tree_attention
    from longspec_jax.flash_cache import cudnn_chunk_attention, flash_cache_attention, reference_chunk_attention
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
    chunk_fn = cudnn_chunk_attention if on_gpu else reference_chunk_attention

    def flash(q_name):
        return lambda i: flash_cache_attention(i[q_name], i["k_cache"], i["v_cache"], i["lengths"],
                                               chunk_attention=chunk_fn)

    ops = {
        "gpu": (hybrid("gpu"), HYBRID_USES, True),
        "cache_cudnn": (flash("q"), CACHE_USES, True),
        "decode_cudnn": (flash("q1"), ("q1", "lengths"), True),
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
    if on_gpu:  # cuDNN and Mosaic GPU exist only there
        ops["cudnn"] = (hybrid("cudnn"), HYBRID_USES, True)
        ops["mgpu"] = (mgpu_split_attention, CACHE_USES, True)
    return ops


def mgpu_split_attention(i):
    """jax's Mosaic GPU flash-attention kernel (``pallas.ops.gpu.attention_mgpu``, FA3-style, Hopper) on the
    same folded, split problem as the cuDNN cache half: GQA group folded into the queries (padded to a multiple
    of 128), the cache cut into ``default_num_splits`` chunks. It has no per-sequence length, so every chunk is
    read in full, and the merge of the chunks is left out: a lower bound on a Mosaic GPU cache half."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    from longspec_jax.flash_cache import default_num_splits, fold_group, repeat_per_chunk
    q, k, v = i["q"], i["k_cache"], i["v_cache"]
    B, M, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    rows = M * (H // K)
    splits = default_num_splits(B, K, rows, S)
    q_fold = jnp.pad(fold_group(q, K), ((0, 0), (0, -(-rows // 128) * 128 - rows), (0, 0), (0, 0)))
    q_split = repeat_per_chunk(q_fold, splits)
    config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2)
    out, (lse,) = attention_mgpu.attention(q_split, k.reshape(B * splits, S // splits, K, D),
                                           v.reshape(B * splits, S // splits, K, D), config, True)
    return out, lse


def make_row_inputs(seed: int, B: int, M: int, S: int, H: int, K: int, D: int, dtype, R: int):
    """(small inputs dict, [tuple of R distinct (k_cache, v_cache) sets])."""
    inp = make_inputs(seed, B, M, S, H, K, D, dtype)
    small = {k: inp[k] for k in ("q", "k_new", "v_new", "lengths", "mask")}
    small["q1"] = inp["q"][:, :1]
    return small, [make_kv_sets(seed, B, S, K, D, dtype, R, first=(inp["k_cache"], inp["v_cache"]))]


def make_kv_sets(seed, B, S, K, D, dtype, R, first=None) -> tuple:
    sets = [first] if first is not None else []
    for r in range(len(sets), R):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed * 1000 + r), 2)
        sets.append((jax.random.normal(k1, (B, S, K, D), dtype), jax.random.normal(k2, (B, S, K, D), dtype)))
    return tuple(sets)


def kv_sets_alive(kv_box) -> bool:
    return not any(a.is_deleted() for a in jax.tree_util.tree_leaves(kv_box[0]))


# ---------------------------------------------------------------------------------------------- sections

def rel_err(a, b) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def lse_err(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    if not np.array_equal(np.isneginf(a), np.isneginf(b)) or np.isnan(a).any():
        return float("inf")
    fin = np.isfinite(b)
    return float(np.max(np.abs(a[fin] - b[fin]), initial=0.0))


def run_checks(args, backend, record) -> None:
    from longspec_jax.attention import hybrid_tree_attention
    from pallas import (cache_attention, cache_attention_reference, masked_attention_reference,
                        tree_attention)

    if args.smoke:
        shapes = [("tree", 2, 16, 16, 4, 2, 64, jnp.float32), ("cache", 2, 8, 256, 4, 2, 64, jnp.bfloat16)]
    else:
        shapes = [
            ("tree", 2, 74, 74, 32, 8, 128, jnp.bfloat16), ("tree", 2, 74, 74, 32, 32, 128, jnp.bfloat16),
            ("tree", 2, 74, 74, 32, 8, 128, jnp.float32), ("tree", 1, 16, 69, 32, 8, 128, jnp.bfloat16),
            ("tree", 2, 74, 74, 28, 4, 64, jnp.bfloat16),
            ("cache", 2, 1, 8192, 32, 8, 128, jnp.bfloat16), ("cache", 2, 74, 8192, 32, 8, 128, jnp.bfloat16),
            ("cache", 2, 74, 8192, 32, 32, 128, jnp.bfloat16), ("cache", 2, 74, 8192, 32, 8, 128, jnp.float32),
            ("cache", 1, 1, 8192, 32, 32, 128, jnp.float32), ("cache", 1, 512, 8192, 32, 8, 128, jnp.bfloat16),
            ("cache", 2, 74, 4000, 28, 4, 64, jnp.bfloat16),
            ("hybrid", 2, 74, 16384, 32, 8, 128, jnp.bfloat16),
        ]
    for n, (kind, B, M, S, H, K, D, dtype) in enumerate(shapes):
        name = f"{kind} B{B} M{M} S{S} H{H}/K{K} D{D} {jnp.dtype(dtype).name}"
        tol = 2e-5 if dtype == jnp.float32 else 1.5e-2
        lse_tol = 1e-4 if dtype == jnp.float32 else 5e-3
        try:
            lengths = [S] + [max(0, S // 3 - 7)] * (B - 1)
            if kind == "tree":
                inp = make_inputs(100 + n, B, M, S, H, K, D, dtype)
                kn, vn = inp["k_new"][:, :S], inp["v_new"][:, :S]  # S = number of new keys here
                if S != M:
                    kn = jax.random.normal(jax.random.PRNGKey(n), (B, S, K, D), dtype)
                    vn = jax.random.normal(jax.random.PRNGKey(n + 1), (B, S, K, D), dtype)
                    full = tree_masks(np.random.default_rng(n), B, S, num_accepted=1, num_pad=0)
                    mask = jnp.asarray(full[:, S - M:])
                else:
                    mask = inp["mask"]
                out = tree_attention(inp["q"], kn, vn, mask, backend=backend)
                with jax.default_matmul_precision("highest"):
                    ref = masked_attention_reference(inp["q"], kn, vn, mask)
            elif kind == "cache":
                inp = make_inputs(100 + n, B, M, S, H, K, D, dtype, lengths)
                out = cache_attention(inp["q"], inp["k_cache"], inp["v_cache"], inp["lengths"], backend=backend)
                with jax.default_matmul_precision("highest"):
                    ref = cache_attention_reference(inp["q"], inp["k_cache"], inp["v_cache"], inp["lengths"])
            else:
                inp = make_inputs(100 + n, B, M, S, H, K, D, dtype, lengths)
                a = (inp["q"], inp["k_cache"], inp["v_cache"], inp["lengths"], inp["k_new"], inp["v_new"],
                     inp["mask"])
                out = hybrid_tree_attention(*a, impl="pallas")
                with jax.default_matmul_precision("highest"):
                    ref = hybrid_tree_attention(*a, impl="naive")
            e, le = rel_err(out[0], ref[0]), lse_err(out[1], ref[1])
            nan = bool(np.isnan(np.asarray(jnp.asarray(out[0], jnp.float32))).any())
            ok = e < tol and le < lse_tol and not nan
            log(f"  [{'PASS' if ok else 'FAIL'}] {name}: rel err {e:.2e} (tol {tol:.0e}), "
                f"max |lse err| {le:.2e}, nan={nan}")
            record.append(dict(name=name, ok=ok, rel_err=e, lse_err=le, nan=nan))
        except Exception as exc:  # keep going: the lead reads every failure of the first run at once
            log(f"  [FAIL] {name}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            record.append(dict(name=name, ok=False, error=f"{type(exc).__name__}: {exc}"[:2000]))


def run_copy(args) -> dict:
    """HBM ceiling: ``x + 1`` over a 1 GiB uint32 buffer, bytes = read + write, (a) repeated inside one jitted
    ``fori_loop`` (buffer donated, updated in place), (b) as ``infer.bench_decode`` does it: 10 chained
    dispatches of one jitted ``x + 1``, median of 5 groups."""
    n = 2**12 if args.smoke else 2**28  # uint32 elements: 1 GiB on the GPU
    nbytes = 4 * n
    moved = 2 * nbytes
    iters = 2 if args.smoke else max(2, math.ceil(args.target_s / (moved / 3.5e12)))
    calls = 2 if args.smoke else max(1, args.calls)
    loop = jax.jit(lambda a: lax.fori_loop(0, iters, lambda i, y: y + jnp.uint32(1), a), donate_argnums=0)
    x = jnp.zeros((n,), jnp.uint32)
    x = loop(x)
    x.block_until_ready()  # compile + warm-up
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        x = loop(x)
        x.block_until_ready()
        times.append(time.perf_counter() - t0)
    t_loop = statistics.median(times) / iters
    bump = jax.jit(lambda a: a + jnp.uint32(1))
    y = bump(x)
    y.block_until_ready()
    groups = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10):
            y = bump(y)
        y.block_until_ready()
        groups.append((time.perf_counter() - t0) / 10)
    del x, y
    t_disp = statistics.median(groups)
    res = dict(buffer_bytes=nbytes, bytes=moved, seconds=t_loop, iters=iters, calls=calls,
               call_s=statistics.median(times), bytes_per_s=moved / t_loop,
               dispatch=dict(seconds=t_disp, bytes_per_s=moved / t_disp, method="10 chained dispatches, median of 5"))
    log(f"  x + 1 over {nbytes / 2**30:.3f} GiB: in-jit loop {t_loop * 1e6:.1f} us -> "
        f"{res['bytes_per_s'] / 1e12:.3f} TB/s; chained dispatches {t_disp * 1e6:.1f} us -> "
        f"{moved / t_disp / 1e12:.3f} TB/s (read + write)")
    return res


def per_op(t: dict, empty: dict) -> dict:
    """Op time = (loop time - empty-loop time) per step, with the raw figures alongside."""
    return dict(us=(t["per_step_s"] - empty["per_step_s"]) * 1e6, raw_us=t["per_step_s"] * 1e6,
                overhead_us=empty["per_step_s"] * 1e6,
                loop=dict(n=t["n"], steps_per_iter=t["steps_per_iter"], call_ms=t["call_s"] * 1e3,
                          compile_s=round(t["compile_s"], 2), num_cache_copies=t["num_cache_copies"],
                          empty_num_cache_copies=empty["num_cache_copies"], cache_copies=t["cache_copies"]))


def run_sweep(args, backend, copy_bw, t_start, timer) -> list:
    from pallas import cache_attention
    from pallas.cache_attention import default_config

    H, K = MODELS[args.sweep_model]
    B, D, S = args.sweep_batch, args.head_dim, args.sweep_length
    dtype = jnp.bfloat16
    if args.smoke:
        H, K, B, D, S = 4, 2, 1, 64, 256
    nbytes = cache_bytes(B, S, K, D, dtype)
    R = num_rotations(nbytes, args)
    note = l2_note(nbytes, R)
    small, kv_box = make_row_inputs(200, B, args.new_tokens, S, H, K, D, dtype, R)
    log(f"  K/V {nbytes / 1e6:.1f} MB per set, {R} sets rotated; fits L2: {l2_cell(note)}")
    results = []
    sweep_start = time.perf_counter()
    for M in ((1,) if args.smoke else (1, args.new_tokens)):
        G = H // K
        base = default_config(B, K, M, G, S, head_dim=D, itemsize=jnp.dtype(dtype).itemsize)
        uses = ("q1" if M == 1 else "q", "lengths")
        kind = "decode" if M == 1 else "tree"
        block_rs = [base["block_r"]] if M == 1 else _ints(args.sweep_block_r_tree)
        splits = _ints(args.sweep_splits_decode if M == 1 else args.sweep_splits_tree)
        block_ks = _ints(args.sweep_block_k if M == 1 else args.sweep_block_k_tree)
        warps = _ints(getattr(args, f"sweep_warps_{kind}"))
        stages = _ints(getattr(args, f"sweep_stages_{kind}"))
        if args.smoke:
            block_rs, splits, block_ks, warps, stages = block_rs[:1], [0], block_ks[:1], warps[:1], stages[:1]

        def is_default(br, bk, ns, nw, st, comb):
            return (comb == "pallas" and (br, bk, ns or base["num_splits"], nw, st)
                    == (base["block_r"], base["block_k"], base["num_splits"], base["num_warps"], base["num_stages"]))

        # The current default_config first (no launch arguments at all), then the grid without its duplicate.
        combos = [("default", None)]
        if not args.smoke:  # the default config with the jnp merge of the splits, for comparison
            combos.append(("default+xla", None))
        combos += [("grid", c) for c in ((br, bk, ns, nw, st, "pallas") for br in block_rs for bk in block_ks
                                         for ns in splits for nw in warps for st in stages) if not is_default(*c)]
        try:
            empty = timer.time("empty", identity_op(uses), uses, small, kv_box, est_s=EMPTY_EST_S)
        except Exception as exc:
            log(f"  M={M}: empty loop FAILED {type(exc).__name__}: {exc}")
            traceback.print_exc()
            continue
        log(f"  M={M}: loop overhead {empty['per_step_s'] * 1e6:.2f} us/step (perturbation + one-row cache writes)")
        for tag, combo in combos:
            if time.perf_counter() - sweep_start > args.sweep_budget_s or time.perf_counter() - t_start > args.budget_s:
                log("  sweep budget used up; skipping the rest")
                return results
            if combo is None:
                cfg = dict(combine="xla" if tag == "default+xla" else "pallas")
                rec = dict(M=M, default=tag == "default", block_r=base["block_r"], block_k=base["block_k"],
                           num_splits=None, splits_used=base["num_splits"], num_warps=base["num_warps"],
                           num_stages=base["num_stages"], combine=cfg["combine"])
            else:
                br, bk, ns, nw, st, comb = combo
                cfg = dict(block_r=br, block_k=bk, num_splits=ns or None, num_warps=nw, num_stages=st, combine=comb)
                rec = dict(M=M, default=False, **cfg, splits_used=ns or base["num_splits"])
            label = (f"M={M}{' (default)' if rec['default'] else ''} block_r={rec['block_r']} "
                     f"block_k={rec['block_k']} splits={rec['splits_used']} warps={rec['num_warps']} "
                     f"stages={rec['num_stages']} combine={rec['combine']}")
            qn = uses[0]
            op = (lambda i, _cfg=cfg, _qn=qn: cache_attention(i[_qn], i["k_cache"], i["v_cache"], i["lengths"],
                                                               backend=backend, **_cfg))
            try:
                if not kv_sets_alive(kv_box):
                    kv_box[0] = make_kv_sets(200, B, S, K, D, dtype, R)
                t = timer.time(f"sweep{M}", op, uses, small, kv_box,
                               est_s=estimate_s("decode" if M == 1 else "cache", B, M, S, H, K, D))
                r = per_op(t, empty)
                bw = nbytes / (r["us"] * 1e-6) if r["us"] > 0 else None
                rec.update(r, bytes_per_s=bw, frac_copy_bw=bw / copy_bw if (copy_bw and bw) else None, l2=note)
                results.append(rec)
                log(f"  {label}: {r['us']:8.1f} us (raw {r['raw_us']:.1f})"
                    + (f"  {bw / 1e12:.2f} TB/s" if bw else "")
                    + (f" ({100 * bw / copy_bw:.0f}% of copy)" if (copy_bw and bw) else ""))
            except Exception as exc:
                log(f"  {label}: FAILED {type(exc).__name__}: {exc}")
                traceback.print_exc()
                rec["error"] = f"{type(exc).__name__}: {exc}"[:1000]
                results.append(rec)
    return results


def run_sweep_cudnn(args, copy_bw, t_start, timer) -> list:
    """num_splits of the cuDNN cache half (``flash_cache_attention``) at the sweep shape, 1 and M queries, for
    each model of ``--models``. 0 = ``default_num_splits``. Off a GPU the jnp chunk kernel stands in."""
    from longspec_jax.flash_cache import (cudnn_chunk_attention, default_num_splits, flash_cache_attention,
                                          reference_chunk_attention)
    chunk_fn = cudnn_chunk_attention if jax.default_backend() == "gpu" else reference_chunk_attention
    B, D, S, dtype = args.sweep_batch, args.head_dim, args.sweep_length, jnp.bfloat16
    models = args.models.split(",")
    splits = _ints(args.sweep_cudnn_splits)
    if args.smoke:
        B, D, S, models, splits = 1, 64, 256, models[:1], [0, 2]
    results = []
    for model in models:
        H, K = (4, 2) if args.smoke else MODELS[model]
        nbytes = cache_bytes(B, S, K, D, dtype)
        R = num_rotations(nbytes, args)
        small, kv_box = make_row_inputs(400, B, args.new_tokens, S, H, K, D, dtype, R)
        for M in ((1,) if args.smoke else (1, args.new_tokens)):
            uses = ("q1" if M == 1 else "q", "lengths")
            default = default_num_splits(B, K, M * (H // K), S)
            empty = timer.time("empty", identity_op(uses), uses, small, kv_box, est_s=EMPTY_EST_S)
            for ns in splits:
                if time.perf_counter() - t_start > args.budget_s:
                    log("  budget used up; skipping the rest of the cuDNN sweep")
                    return results
                used = ns or default
                if S % used:
                    continue
                rec = dict(model=model, M=M, num_splits=used, default=used == default)
                op = (lambda i, _q=uses[0], _ns=used: flash_cache_attention(
                    i[_q], i["k_cache"], i["v_cache"], i["lengths"], num_splits=_ns, chunk_attention=chunk_fn))
                try:
                    if not kv_sets_alive(kv_box):
                        kv_box[0] = make_kv_sets(400, B, S, K, D, dtype, R)
                    r = per_op(timer.time(f"cudnn{M}", op, uses, small, kv_box,
                                          est_s=estimate_s("decode" if M == 1 else "cache", B, M, S, H, K, D)), empty)
                    bw = nbytes / (r["us"] * 1e-6) if r["us"] > 0 else None
                    rec.update(r, bytes_per_s=bw, frac_copy_bw=bw / copy_bw if (copy_bw and bw) else None)
                    log(f"  cuDNN {model} M={M} splits={used}{' (default)' if rec['default'] else ''}: "
                        f"{r['us']:8.1f} us" + (f" ({100 * bw / copy_bw:.0f}% of copy)" if (copy_bw and bw) else ""))
                except Exception as exc:
                    rec["error"] = f"{type(exc).__name__}: {exc}"[:1000]
                    log(f"  cuDNN {model} M={M} splits={used}: FAILED {rec['error'][:300]}")
                    traceback.print_exc()
                results.append(rec)
        del small, kv_box
    return results


def run_table(args, backend, copy_bw, t_start, timer) -> list:
    impls = args.impls.split(",")
    rows = []
    models = args.models.split(",")
    batches, lengths = _ints(args.batches), _ints(args.lengths)
    D, M, dtype = args.head_dim, args.new_tokens, jnp.dtype(args.dtype)
    if args.smoke:
        models, batches, lengths, D, M = models[:1], [1], [256], 64, 8
    ops = build_ops(args, backend)
    for S in lengths:
        for model in models:
            H, K = MODELS[model]
            if args.smoke:
                H, K = 4, 2
            for B in batches:
                if time.perf_counter() - t_start > args.budget_s:
                    log(f"  budget used up: skipping {model} B={B} S={S}")
                    rows.append(dict(model=model, B=B, S=S, skipped=True))
                    continue
                t_row = time.perf_counter()
                nbytes = cache_bytes(B, S, K, D, dtype)
                R = num_rotations(nbytes, args)
                row = dict(model=model, H=H, K=K, D=D, B=B, S=S, M=M, us={}, raw_us={}, overhead_us={}, loop={},
                           errors={}, l2=l2_note(nbytes, R))
                try:
                    small, kv_box = make_row_inputs(300, B, M, S, H, K, D, dtype, R)
                except Exception as exc:
                    log(f"  {model} B={B} S={S}: input allocation failed: {exc}")
                    row["errors"]["inputs"] = str(exc)[:1000]
                    rows.append(row)
                    continue
                empties: dict = {}

                def measure(name, *, _small=small, _kv=kv_box, _empties=empties, _H=H, _K=K, _S=S, _B=B):
                    op, uses, with_cache = ops[name]
                    box = _kv if with_cache else None
                    if with_cache and not kv_sets_alive(_kv):  # a failed donated call may have freed them
                        _kv[0] = make_kv_sets(300, _B, _S, _K, D, dtype, R)
                    key = (uses, with_cache)
                    if key not in _empties:
                        _empties[key] = timer.time("empty", identity_op(uses), uses, _small, box, est_s=EMPTY_EST_S)
                    t = timer.time(name, op, uses, _small, box, est_s=estimate_s(name, _B, M, _S, _H, _K, D))
                    return per_op(t, _empties[key])

                for impl in impls:
                    if impl not in ops:
                        continue  # cuDNN / Mosaic GPU columns off a GPU
                    try:
                        r = measure(impl)
                    except Exception as exc:
                        r = None
                        if impl == "dpa":  # cuDNN may refuse the shape: fall back to the XLA version
                            try:
                                r = measure("dpa_xla")
                                row["dpa_impl"] = "xla"
                                row["errors"]["dpa_cudnn"] = f"{type(exc).__name__}: {exc}"[:500]
                            except Exception as exc2:
                                exc = exc2
                        if r is None:
                            row["errors"][impl] = f"{type(exc).__name__}: {exc}"[:1000]
                            log(f"    {impl}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                            continue
                    row["us"][impl], row["raw_us"][impl] = r["us"], r["raw_us"]
                    row["overhead_us"][impl], row["loop"][impl] = r["overhead_us"], r["loop"]
                us = row["us"]
                for name in ("cache", "kernel", "cache_cudnn", "mgpu", "decode", "decode_cudnn"):
                    if name in us and us[name] > 0:
                        bw = nbytes / (us[name] * 1e-6)
                        row[f"{name}_bytes_per_s"] = bw
                        if copy_bw:
                            row[f"{name}_frac_copy_bw"] = bw / copy_bw
                decodes = [us[n] for n in ("decode", "decode_cudnn") if us.get(n, 0) > 0]
                for hyb in ("gpu", "pallas", "cudnn"):
                    if us.get(hyb, 0) > 0 and "naive" in us:
                        row[f"naive_over_{hyb}"] = us["naive"] / us[hyb]
                    if us.get(hyb, 0) > 0 and decodes:
                        row[f"{hyb}_over_decode"] = us[hyb] / min(decodes)
                del small, kv_box
                row["elapsed_s"] = time.perf_counter() - t_row
                rows.append(row)
                summary = "  ".join(f"{k} {v:.1f}" for k, v in us.items())
                ovh = sorted({round(v, 2) for v in row["overhead_us"].values()})
                extra = ""
                if "cache_frac_copy_bw" in row:
                    extra = f"  cache half {100 * row['cache_frac_copy_bw']:.0f}% of copy BW"
                log(f"  {model} B={B} S={S} (K/V fits L2: {l2_cell(row['l2'])}): [us] {summary}{extra}; "
                    f"loop overhead {ovh} us/step subtracted; {row['elapsed_s']:.1f} s")
    return rows


# ---------------------------------------------------------------------------------------------- report

def markdown(report: dict) -> str:
    lines = [f"# Attention benchmark ({report['date']}, {report['device']}, jax {report['jax']})", ""]
    if report.get("timing"):
        t = report["timing"]
        lines += [f"Timing: {t['method']}", ""]
    if report.get("checks"):
        lines += ["## Checks", "", "| check | result | rel err | lse err |", "|---|---|---|---|"]
        for c in report["checks"]:
            err = f"{c['rel_err']:.2e}" if "rel_err" in c else c.get("error", "")[:200].replace("|", "/")
            lse = f"{c['lse_err']:.2e}" if "lse_err" in c else ""
            lines.append(f"| {c['name']} | {'PASS' if c['ok'] else 'FAIL'} | {err} | {lse} |")
        lines.append("")
    if report.get("copy"):
        c = report["copy"]
        lines += [f"Copy bandwidth (ceiling): {c['bytes_per_s'] / 1e12:.3f} TB/s (`x + 1` over "
                  f"{c['buffer_bytes'] / 2**30:.3g} GiB uint32, read + write, {c['iters']} iterations inside one "
                  f"jitted fori_loop, median of {c['calls']} calls); infer.bench_decode's method (10 chained "
                  f"dispatches): {c['dispatch']['bytes_per_s'] / 1e12:.3f} TB/s.", ""]
    if report.get("table"):
        impl_names = [n for n in TABLE_COLUMNS if any(n in r.get("us", {}) for r in report["table"])]
        ratios = ["naive_over_gpu", "gpu_over_decode", "naive_over_pallas", "pallas_over_decode"]
        fracs = ["cache_frac_copy_bw", "cache_cudnn_frac_copy_bw", "decode_frac_copy_bw",
                 "decode_cudnn_frac_copy_bw"]
        first = next((r for r in report["table"] if "M" in r), {})
        lines += [f"## Hybrid tree attention, {first.get('M', '?')} new tokens, {report.get('dtype', 'bfloat16')}, "
                  f"head_dim {first.get('D', '?')} "
                  "(us per call, in-jit loop, loop overhead subtracted)", "",
                  "| model | B | S | " + " | ".join(impl_names + [r.replace("_over_", " / ") for r in ratios])
                  + " | " + " | ".join(f.replace("_frac_copy_bw", " % copy BW") for f in fracs) + " | K/V fits L2 |",
                  "|" + "---|" * (4 + len(impl_names) + len(ratios) + len(fracs))]
        for r in report["table"]:
            if r.get("skipped"):
                lines.append(f"| {r['model']} | {r['B']} | {r['S']} | skipped (budget) |")
                continue
            us = r.get("us", {})
            cells = [f"{us[n]:.1f}" if n in us else "-" for n in impl_names]
            cells += [f"{r[k]:.2f}" if k in r else "-" for k in ratios]
            cells += [f"{100 * r[k]:.0f}%" if k in r else "-" for k in fracs]
            lines.append(f"| {r['model']} | {r['B']} | {r['S']} | " + " | ".join(cells) + f" | {l2_cell(r.get('l2'))} |")
        lines += ["", "gpu / pallas / cudnn / xla / naive: `hybrid_tree_attention(impl=...)` (gpu is what auto "
                  "picks on a GPU); cache: Pallas cache half (`cache_attention`, 74 queries); kernel: its pallas_call "
                  "alone; cache_cudnn: `flash_cache_attention` (cuDNN, split along the keys); mgpu: jax's Mosaic GPU "
                  "flash kernel on the same split problem, full chunks, no merge; tree: `tree_attention`; decode / "
                  "decode_cudnn: the Pallas / cuDNN cache half with 1 query; x / decode: against the faster decode; "
                  "dpa: `jax.nn.dot_product_attention` over the cache (74 queries, "
                  "cuDNN where it accepts the shape). % copy BW: K+V bytes of the valid cache / time vs the copy "
                  "bandwidth above. K/V fits L2: whether the cache bytes touched per cycle of the loop fit in the "
                  "60 MB L2 (R x set size: R distinct K/V sets are rotated so that a cycle is >= 3x L2, i.e. every "
                  "call reads its cache from HBM: 'no'); the tree half reads only the new keys/values, q and the "
                  "mask (< 3 MB), which stay in L2, as they would in a real verify step.", "",
                  "Loop overhead per step (us; the empty loop: perturbation + one-row cache writes, subtracted above), "
                  "and raw per-step times:", "",
                  "| model | B | S | overhead hybrid | overhead cache/kernel/dpa | overhead tree | overhead decode | "
                  "raw pallas | raw cache | raw tree | raw decode | loop n (pallas/tree/decode) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in report["table"]:
            if r.get("skipped"):
                continue
            o, raw, lp = r.get("overhead_us", {}), r.get("raw_us", {}), r.get("loop", {})

            def f(d, k):
                return f"{d[k]:.2f}" if k in d else "-"

            ns = "/".join(str(lp[k]["n"] * lp[k]["steps_per_iter"]) if k in lp else "-"
                          for k in ("pallas", "tree", "decode"))
            lines.append(f"| {r['model']} | {r['B']} | {r['S']} | {f(o, 'pallas')} | {f(o, 'cache')} | {f(o, 'tree')} | "
                         f"{f(o, 'decode')} | {f(raw, 'pallas')} | {f(raw, 'cache')} | {f(raw, 'tree')} | "
                         f"{f(raw, 'decode')} | {ns} |")
        lines.append("")
    if report.get("sweep"):
        note = next((r["l2"] for r in report["sweep"] if r.get("l2")), None)
        lines += ["## cache_attention sweep", "",
                  f"K/V fits L2: {l2_cell(note)}. us: in-jit loop, loop overhead subtracted.", "",
                  "| M | block_r | block_k | splits | warps | stages | combine | us | % copy BW |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in report["sweep"]:
            us = f"{r['us']:.1f}" if "us" in r else r.get("error", "")[:80].replace("|", "/")
            frac = f"{100 * r['frac_copy_bw']:.0f}%" if r.get("frac_copy_bw") else "-"
            lines.append(f"| {r['M']}{' (default)' if r.get('default') else ''} | {r['block_r']} | {r['block_k']} | "
                         f"{r['splits_used']}{'' if r['num_splits'] else ' (auto)'} | "
                         f"{r['num_warps']} | {r['num_stages']} | {r.get('combine', '')} | {us} | {frac} |")
        for M, best in report.get("sweep_best", {}).items():
            lines.append(f"\nBest for M={M}: {best}")
        lines.append("")
    if report.get("sweep_cudnn"):
        lines += ["## cuDNN cache half (flash_cache_attention) num_splits sweep", "",
                  "| model | M | splits | us | % copy BW |", "|---|---|---|---|---|"]
        for r in report["sweep_cudnn"]:
            us = f"{r['us']:.1f}" if "us" in r else r.get("error", "")[:80].replace("|", "/")
            frac = f"{100 * r['frac_copy_bw']:.0f}%" if r.get("frac_copy_bw") else "-"
            lines.append(f"| {r['model']} | {r['M']} | {r['num_splits']}{' (default)' if r['default'] else ''} | "
                         f"{us} | {frac} |")
        lines.append("")
    return "\n".join(lines)


TABLE_COLUMNS = ("gpu", "pallas", "cudnn", "xla", "naive", "cache", "kernel", "cache_cudnn", "mgpu", "tree", "decode",
                 "decode_cudnn", "dpa")

TIMING_METHOD = ("each op run n times inside one jitted lax.fori_loop; every step perturbs its inputs by a scalar "
                 "of the previous output (x 1e-30) and rewrites the cache's last slot in place, so nothing is "
                 "folded or hoisted; R distinct K/V sets rotated (cycle >= 3x L2 where possible); n chosen so "
                 "one call lasts >= ~{target_ms:.0f} ms; warm-up, median of {calls} calls; the same loop with an "
                 "identity op is subtracted.")


def main(argv=None) -> dict:
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    from pallas import resolve_backend
    backend = resolve_backend(None)
    if args.smoke:
        backend = "interpret"
    sections = args.sections.split(",")
    t_start = time.perf_counter()
    timer = LoopTimer(args)
    report = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  device=str(jax.devices()[0].device_kind), platform=jax.default_backend(),
                  jax=jax.__version__, backend=backend, smoke=args.smoke, dtype=args.dtype,
                  argv=sys.argv[1:] if argv is None else argv,
                  timing=dict(method=TIMING_METHOD.format(target_ms=1e3 * timer.target_s, calls=timer.calls),
                              target_s=timer.target_s, calls=timer.calls, l2_bytes=L2_BYTES))
    log(f"bench_attention: device {report['device']} ({report['platform']}), jax {jax.__version__}, "
        f"kernel backend {backend}")

    def save():
        report["timing"].update(compile_s=round(timer.compile_s, 1), recompiles=timer.recompiles)
        (out_dir / "bench_attention.json").write_text(json.dumps(report, indent=1, default=str))
        (out_dir / "bench_attention.md").write_text(markdown(report))

    copy_bw = None
    if "checks" in sections:
        log("== checks")
        report["checks"] = []
        run_checks(args, backend, report["checks"])
        save()
    if "copy" in sections:
        log("== copy bandwidth")
        try:
            report["copy"] = run_copy(args)
            copy_bw = report["copy"]["bytes_per_s"]
        except Exception as exc:
            log(f"  copy FAILED {exc}")
            traceback.print_exc()
        save()
    if "sweep" in sections:
        log("== sweep")
        report["sweep"] = run_sweep(args, backend, copy_bw, t_start, timer)
        best = {}
        for M in sorted({r["M"] for r in report["sweep"]}):
            ok = [r for r in report["sweep"] if r["M"] == M and "us" in r]
            if ok:
                b = min(ok, key=lambda r: r["us"])
                best[str(M)] = {k: b[k] for k in ("default", "block_r", "block_k", "splits_used", "num_warps",
                                                  "num_stages", "combine", "us")}
        report["sweep_best"] = best
        save()
        log("== sweep (cuDNN cache half)")
        report["sweep_cudnn"] = run_sweep_cudnn(args, copy_bw, t_start, timer)
        save()
    if "table" in sections:
        log("== table")
        report["table"] = run_table(args, backend, copy_bw, t_start, timer)
        save()
    report["elapsed_s"] = time.perf_counter() - t_start
    save()
    log(f"done in {report['elapsed_s']:.0f} s (compiling {timer.compile_s:.0f} s, {timer.recompiles} recompiles); "
        f"wrote {out_dir / 'bench_attention.json'} and .md")
    return report


if __name__ == "__main__":
    main()

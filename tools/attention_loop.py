"""One attention op in the harness's in-loop timing, made un-hoistable and cache-cold.

Each step reads a scalar of the previous step's output (times 1e-30, a value XLA cannot know) and adds it to
the small inputs the op uses (queries, new keys / values; lengths get ``- (s > 1)``) and to the last slot of
each K/V cache (an in-place one-row write, like a decode step's), so nothing can be folded or hoisted out of
the loop and the steps run strictly one after another. Each iteration runs the op once per K/V buffer set,
rotating over R distinct sets (R = ceil(3 x 60 MB L2 / set bytes), at most 16), so the cache is read from HBM
even where one set would fit in L2. The loop count is chosen so that one call lasts about ``--target-s``; the
same loop with an identity op (the perturbation and the one-row cache writes only) gives the loop overhead per
step, which :func:`per_op` subtracts.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
from jax import lax

from infer.bench.harness import log, loop_count, net_of_overhead, time_loop

L2_BYTES = 60 * 2**20
EMPTY_EST_S = 3e-6  # first guess of the empty loop's seconds per step (only used to pick n)
_HLO_DTYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}


def num_rotations(bytes_per_set: int, smoke: bool, max_rotate: int) -> int:
    """K/V buffer sets to rotate over so that one cycle touches >= 3x the L2 (2 in smoke mode, to run that
    path on the CPU)."""
    if smoke:
        return 2
    return int(min(max_rotate, max(1, math.ceil(3 * L2_BYTES / max(bytes_per_set, 1)))))


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


def op_step(op, uses, steps: int, with_cache: bool):
    """step((out, kv_sets), small) -> (out, kv_sets) after ``steps`` chained op calls (one per K/V set when
    ``with_cache``)."""
    def step(carry, small):
        out, kvs = carry
        kvs = list(kvs)
        for r in range(steps):
            s = _step_scalar(out)
            inp = _perturb(small, uses, s)
            if with_cache:
                kvs[r] = (_touch(kvs[r][0], small["k_new"][:, :1], s), _touch(kvs[r][1], small["v_new"][:, :1], s))
                inp["k_cache"], inp["v_cache"] = kvs[r]
            out = op(inp)
        return out, tuple(kvs)
    return step


def cache_copies(hlo_text: str, cache) -> list[str]:
    """Names of copy / transpose instructions producing a cache-shaped array in a compiled module: such a copy
    inside the loop would add a full cache read + write per step (expected only in interpret mode, where the
    kernel is emulated with XLA ops)."""
    dtype = jnp.dtype(cache.dtype).name
    sig = f"{_HLO_DTYPES.get(dtype, dtype)}[{','.join(map(str, cache.shape))}]"
    pat = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = " + re.escape(sig))
    names = []
    for line in hlo_text.splitlines():
        m = pat.match(line)
        if m and ("copy" in m.group(1) or "transpose" in m.group(1)):
            names.append(m.group(1))
    return names


class OpTimer:
    """Times attention ops in the harness's in-loop timing; learns, per kind of op, measured / estimated time so
    that later shapes get a good loop count at the first compile."""

    def __init__(self, args):
        self.smoke = args.smoke
        self.target_s = 0.0 if args.smoke else args.target_s
        self.calls = 2 if args.smoke else max(1, args.calls)
        self.scale: dict = {}
        self.compile_s = 0.0
        self.recompiles = 0

    def time(self, kind: str, op, uses, small: dict, kv_box, *, est_s: float, steps: int = 1) -> dict:
        """Seconds per op call. ``kv_box``: None (op reads no cache) or a one-element list holding the tuple of
        K/V sets (replaced by the donated-and-returned sets)."""
        with_cache = kv_box is not None
        kvs = tuple(kv_box[0]) if with_cache else ()
        if with_cache:
            steps = len(kvs)
        sample = dict(small)
        if with_cache:
            sample["k_cache"], sample["v_cache"] = kvs[0]
        out0 = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(op, sample))
        reps = loop_count(self.target_s, est_s * self.scale.get(kind, 1.0) * steps)
        t, carry = time_loop(op_step(op, uses, steps, with_cache), (out0, kvs), (small,), reps, self.calls,
                             target_s=self.target_s)
        if with_cache:
            kv_box[0] = carry[1]
        del carry
        self.compile_s += t.compile_s
        self.recompiles += t.reps != reps
        copies = cache_copies(t.compiled.as_text(), kvs[0][0]) if with_cache else []
        if copies and not self.smoke:
            log(f"    WARNING {kind}: {len(copies)} cache-shaped copies/transposes in the timed module "
                f"({', '.join(copies[:4])}): each adds a full cache read + write (expected only in interpret mode)")
        per_step = t.call_s / (t.reps * steps)
        self.scale[kind] = per_step / est_s
        return dict(per_step_s=per_step, call_s=t.call_s, call_min_s=min(t.call_times_s), n=t.reps,
                    steps_per_iter=steps, calls=len(t.call_times_s), compile_s=t.compile_s, cache_copies=copies[:8],
                    num_cache_copies=len(copies))


def per_op(t: dict, empty: dict) -> dict:
    """Op time = (loop time - empty-loop time) per step, with the raw figures alongside."""
    return dict(**net_of_overhead(t["per_step_s"], empty["per_step_s"]),
                loop=dict(n=t["n"], steps_per_iter=t["steps_per_iter"], call_ms=t["call_s"] * 1e3,
                          compile_s=round(t["compile_s"], 2), num_cache_copies=t["num_cache_copies"],
                          empty_num_cache_copies=empty["num_cache_copies"], cache_copies=t["cache_copies"]))

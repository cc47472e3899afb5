"""Inputs of the speculative-decoding benchmarks: the 8B-cost padded pair (given drafts, or a random one), a pair
with other RoPE parameters, the dev-split prompt, and a prompt offset without near-ties."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from infer.bench.harness import log
from infer.bench.near_tie import greedy_top2_gaps
from longspec_jax.draft_vocab import VOCAB_NAME
from longspec_jax.speculation_profile import PROFILE_FILE

PAD_ARGS = ["--hidden-size", "4608", "--intermediate-size", "14336", "--num-layers", "32", "--num-heads", "72",
            "--num-kv-heads", "18"]
DEV_REPOS = ("pygments", "pyparsing", "mpmath")


def pad_pair(fixture: str, drafts: dict[str, str], pad_script: str, work: str) -> tuple[str, dict[str, str]]:
    """The target and each draft padded to 8B-like cost by ``pad_model.py`` (reused when already in ``work``), each
    padded draft with its small draft's speculation profile and draft vocabulary, where it has them."""
    big = os.path.join(work, "target")
    jobs = [([fixture, big, "--overwrite", *PAD_ARGS], big)]
    padded = {name: os.path.join(work, f"draft_{name}") for name in drafts}
    jobs += [(["--draft", path, big, padded[name], "--overwrite"], padded[name]) for name, path in drafts.items()]
    for args, out in jobs:
        if not os.path.isfile(os.path.join(out, "config.json")):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, pad_script, *args], check=True)
            log(f"padded {out} in {time.perf_counter() - t0:.0f} s")
    for name, path in drafts.items():  # a padded draft computes the same function over the same vocabulary
        for file in (PROFILE_FILE, VOCAB_NAME):
            if os.path.isfile(os.path.join(path, file)):
                shutil.copyfile(os.path.join(path, file), os.path.join(padded[name], file))
    return big, padded


def load_target_and_drafts(target: str, drafts: dict[str, str], pad_script: str | None, work: str,
                           dtype=jnp.bfloat16):
    """(target in ``dtype``, its drafts by name, the directory of the target that runs): padded by ``pad_script``
    to 8B-like cost first when it is given (:func:`pad_pair`)."""
    from longspec_jax import load_draft, load_target

    if pad_script:
        target, drafts = pad_pair(target, drafts, pad_script, work)
    loaded = load_target(target, dtype=dtype)
    return loaded, {name: load_draft(path, loaded) for name, path in drafts.items()}, target


def with_rope_parameters(target: str, drafts: dict[str, str], rope: dict, work: str) -> tuple[str, dict[str, str]]:
    """Copies of the target and each draft directory (in ``work``; files other than ``config.json`` linked) whose
    ``config.json`` has ``rope`` merged into its RoPE parameters: e.g. llama3-style scaling, to run a target past
    the context it was trained on. The drafts get the same edit, so they still describe their target. As in
    Hugging Face configs, a ``factor`` with ``original_max_position_embeddings`` sets ``max_position_embeddings``
    to their product where that is larger (factor 8 over 16,384 positions: a 131,072-position window)."""
    def edit(src: str, dst: str) -> str:
        os.makedirs(dst, exist_ok=True)
        for name in os.listdir(src):
            if name != "config.json" and not os.path.lexists(os.path.join(dst, name)):
                os.symlink(os.path.abspath(os.path.join(src, name)), os.path.join(dst, name))
        with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        params = {**(cfg.pop("rope_scaling", None) or {}), **(cfg.get("rope_parameters") or {}), **rope}
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        if "factor" in params and "original_max_position_embeddings" in params:
            window = int(params["factor"] * params["original_max_position_embeddings"])
            cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0), window)
        with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
            json.dump({**cfg, "rope_parameters": params}, f, indent=1)
        return dst

    return (edit(target, os.path.join(work, "target")),
            {name: edit(path, os.path.join(work, f"draft_{name}")) for name, path in drafts.items()})


def build_padded_pair(fixture: str, pad_script: str, work: str) -> tuple[str, str]:
    """Pads the fixture and a random small draft to 8B-like cost (reuses WORK if already built); returns the
    target and draft directories."""
    from longspec_jax import load_target, save_draft
    from longspec_jax.draft import DraftConfig, init_draft

    small_draft = os.path.join(work, "small_draft")
    if not os.path.isfile(os.path.join(small_draft, "config.json")):
        os.makedirs(work, exist_ok=True)
        small = load_target(fixture, dtype=jnp.float32, load_tokenizer=False)
        draft = init_draft(DraftConfig.from_target(small.config), jax.random.PRNGKey(0))
        save_draft(draft, small_draft, format="hf", target=small)
    big, padded = pad_pair(fixture, {"random": small_draft}, pad_script, work)
    return big, padded["random"]


def dev_prompt_tokens(tokenizer, count: int) -> list[int]:
    """The dev-split repos' source, concatenated in sorted path order with corpus-style header lines."""
    ids: list[int] = []
    for repo in DEV_REPOS:
        try:
            module = __import__(repo)
        except ImportError:
            continue
        root = os.path.dirname(module.__file__)
        for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f"# {repo}/{os.path.relpath(path, root)}\n{f.read()}\n"
            ids.extend(tokenizer(text)["input_ids"])
            if len(ids) >= count:
                return ids[:count]
    raise RuntimeError(f"only {len(ids)} tokens of dev-split source found")


def stable_prompt_offset(target32, stream, ctx: int, num_new: int, min_gap: float, search: int,
                         step: int = 2048) -> tuple[int, float]:
    """First offset (a multiple of ``step`` up to ``search``) of a ``ctx``-token prompt from ``stream`` whose
    float32 greedy continuation of ``num_new`` tokens has no top-2 logit gap below ``min_gap``: bf16 paths then
    cannot part (no near-tie), so an oracle replaying the plain output stays valid. Falls back to the offset
    with the largest smallest gap."""
    best = (0, -1.0)
    for offset in range(0, search + 1, step):
        prompt = stream[offset:offset + ctx]
        if len(prompt) < ctx:
            break
        smallest = float(greedy_top2_gaps(target32, prompt, num_new)[1].min())
        if smallest >= min_gap:
            return offset, smallest
        best = max(best, (offset, smallest), key=lambda x: x[1])
    return best


def stable_row_starts(target32, stream, ctx: int, num_new: int, min_gap: float, search: int, rows: int,
                      stride: int, step: int = 2048) -> list[tuple[int, float]]:
    """:func:`stable_prompt_offset` for each batch row on its own: row ``b`` searches from ``b * stride`` on.
    Returns ``[(start in stream, smallest gap)]`` per row (one near-tie in any row stalls the whole batch)."""
    found = []
    for b in range(rows):
        offset, gap = stable_prompt_offset(target32, stream[b * stride:], ctx, num_new, min_gap, search, step)
        found.append((b * stride + offset, gap))
    return found

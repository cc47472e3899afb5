"""Train a LongSpec draft for a target model.

    python -m train.main --config configs/code_lm_stage1.yaml [dotted.key=value ...]

Everything the run writes goes under ``checkpoint.dir``: Orbax checkpoints (one directory per saved step),
``metrics.jsonl``, ``tensorboard/``, ``config.yaml`` (the resolved config), the tokenised-data cache and, with
``draft.vocab_size``, ``draft_vocab.npy`` (:mod:`train.vocab`). Run the same command again after a kill and it
resumes from the newest complete checkpoint, reading the same data and drawing the same random numbers as the
uninterrupted run. ``python -m train.export --checkpoint DIR --out OUT``
writes the draft in a PyTorch LongSpec format.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from omegaconf import OmegaConf

from longspec_jax import load_draft, load_target
from longspec_jax.config import TargetConfig
from longspec_jax.draft import DraftConfig, init_draft
from longspec_jax.errors import ConfigError
from train.checkpointing import Checkpointer, checkpoint_metadata, latest_step, restore_checkpoint
from train.config import DTYPES, TrainConfig, config_to_dict, load_config
from train.data import BatchOrder, Batches, TokenRows, load_rows
from train.flops import device_peak_flops, train_flops_per_token
from train.metrics import MetricsLog
from train.sharding import init_distributed, jit_train_step, make_mesh, put_batch, replicated, tree_shardings
from train.step import StepSettings, TrainState, eval_counts, eval_summary, init_state, make_optimizer
from train.vocab import run_vocab

# Config sections that must match when a run resumes from a checkpoint (the rest may change between attempts).
RESUME_KEYS = ("target", "data.train", "data.format", "data.seq_len", "data.pack", "draft", "anchor", "noise",
               "loss", "train.steps", "train.batch_size", "train.grad_accum", "train.seed", "train.compute_dtype",
               "optim")
EVAL_DEPTH = 5  # chain length of the offline tau estimate (the default tree's depth)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.main", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML config file (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.steps=100")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        run(config)
    except ValueError as e:  # ConfigError, WeightsError, CheckpointError: bad input, said plainly
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def run(config: TrainConfig) -> list[dict]:
    """Trains (or resumes) as ``config`` says; returns the metrics logged by this call."""
    ckpt_dir = os.path.abspath(config.checkpoint.dir)
    # Data first: tokenising forks worker processes, which must happen before JAX starts its threads.
    target_config = TargetConfig.from_dir(config.target.path)
    draft_config = DraftConfig.from_target(target_config, config.draft.window)
    train_rows, eval_rows = load_rows(config, target_config)
    init_distributed()
    vocab_ids = None
    if config.draft.vocab_size:
        vocab_ids = run_vocab(train_rows, config.draft.vocab_size, target_config.vocab_size,
                              ckpt_dir if jax.process_index() == 0 else None)
    loss_vocab = tuple(vocab_ids.tolist()) if config.draft.vocab_loss == "subset" else None
    mesh = make_mesh(config.mesh)
    micro_rows = config.train.batch_size // config.train.grad_accum
    if micro_rows % mesh.size:
        raise ConfigError(f"train.batch_size / train.grad_accum = {micro_rows} rows per micro-batch do not "
                          f"divide over the {mesh.size} devices")
    target = load_target(config.target.path, dtype=DTYPES[config.target.dtype], load_tokenizer=False)

    settings = StepSettings(target=target.config, draft=draft_config, compute_dtype=DTYPES[config.train.compute_dtype],
                            anchor=config.anchor, max_shift=config.noise.max_shift, kl_weight=config.loss.kl_weight,
                            chunk_tokens=config.loss.chunk_tokens, seed=config.train.seed, vocab=loss_vocab)
    optimizer, schedule = make_optimizer(config.optim, config.train.steps)
    abstract = jax.eval_shape(lambda p: init_state(p, optimizer), _abstract_draft(draft_config))
    state_sharding = tree_shardings(mesh, abstract)
    target_sharding = tree_shardings(mesh, target.params)
    target_params = jax.device_put(target.params, target_sharding)
    state, start = _initial_state(config, target, draft_config, optimizer, abstract, state_sharding, ckpt_dir)

    step_fn = jit_train_step(settings, optimizer, schedule, mesh, state_sharding, target_sharding)
    flops = train_flops_per_token(target.config, draft_config, config.data.seq_len, kl=config.loss.kl_weight > 0,
                                  head_columns=len(loss_vocab) if loss_vocab else None)
    peak = config.train.peak_tflops * 1e12 or device_peak_flops(jax.devices()[0].device_kind)
    metadata = checkpoint_metadata(draft_config, target, extra={"config": config_to_dict(config)})
    checkpointer = Checkpointer(ckpt_dir, metadata, keep=config.checkpoint.keep,
                                async_save=config.checkpoint.async_save)
    OmegaConf.save(OmegaConf.structured(config), os.path.join(ckpt_dir, "config.yaml"))
    log = MetricsLog(ckpt_dir, config.train.steps, start, tensorboard=config.log.tensorboard,
                     progress=config.log.progress)
    batches = Batches(train_rows, BatchOrder(len(train_rows), config.train.batch_size, config.train.seed),
                      config.train.grad_accum, start)
    evaluate = None
    if eval_rows is not None:
        if len(eval_rows) < micro_rows:
            raise ConfigError(f"data.eval gives {len(eval_rows)} rows; an evaluation batch needs {micro_rows}")
        eval_fn = jax.jit(lambda p, t, b: eval_counts(settings, p, t, b, EVAL_DEPTH), out_shardings=replicated(mesh))
        evaluate = functools.partial(_evaluate, eval_fn, eval_rows, max(config.data.eval_rows, micro_rows),
                                     micro_rows, mesh)
    logged: list[dict] = []
    tokens_per_step = config.train.batch_size * config.data.seq_len
    try:
        t_last, steps_since = time.perf_counter(), 0
        for step in range(start, config.train.steps):
            state, metrics = step_fn(state, target_params, put_batch(mesh, batches.next(), row_axis=1))
            done, steps_since = step + 1, steps_since + 1
            record = {}
            eval_due = evaluate is not None and (done == config.train.steps or (
                config.train.eval_every and done % config.train.eval_every == 0))
            if done % config.train.log_every == 0 or done == config.train.steps or eval_due:
                record = {k: float(v) for k, v in jax.device_get(metrics).items()}
                elapsed = time.perf_counter() - t_last
                record["tokens_per_s"] = tokens_per_step * steps_since / elapsed
                if peak:
                    record["mfu"] = record["tokens_per_s"] * flops["total"] / (peak * mesh.size)
                t_last, steps_since = time.perf_counter(), 0
            if eval_due:
                record.update(evaluate(state.params, target_params))
                t_last = time.perf_counter()
            if record:
                log.write(done, record)
                logged.append({"step": done, **record})
            if done % config.checkpoint.every == 0 or done == config.train.steps:
                checkpointer.save(done, state.params, state.opt_state)
            log.advance()
    finally:
        batches.close()
        checkpointer.close()
        log.close()
    return logged


def _abstract_draft(draft_config: DraftConfig):
    return jax.eval_shape(lambda: init_draft(draft_config, jax.random.PRNGKey(0), jnp.float32).variables)


def _initial_state(config: TrainConfig, target, draft_config: DraftConfig, optimizer, abstract: TrainState,
                   sharding, ckpt_dir: str) -> tuple[TrainState, int]:
    """The newest complete checkpoint under ``ckpt_dir`` (after checking it belongs to this config), else a
    fresh state from ``draft.init`` or a random draft."""
    if latest_step(ckpt_dir) is not None:
        template = {"draft": _with_sharding(abstract.params, sharding.params),
                    "opt_state": _with_sharding(abstract.opt_state, sharding.opt_state)}
        ckpt = restore_checkpoint(ckpt_dir, template=template)
        _check_same_run(ckpt.metadata.get("extra", {}).get("config", {}), config_to_dict(config), ckpt_dir)
        state = TrainState(step=jnp.int32(ckpt.step), params=ckpt.draft_variables, opt_state=ckpt.opt_state)
        return state, ckpt.step
    if config.draft.init:
        init = config.draft.init
        if latest_step(init) is not None:
            variables = restore_checkpoint(init, restore_opt_state=False).draft_variables
        else:
            variables = load_draft(init, target, dtype=jnp.float32, window=config.draft.window).variables
    else:
        variables = init_draft(draft_config, jax.random.PRNGKey(config.train.seed), jnp.float32).variables
    state = jax.jit(lambda p: init_state(p, optimizer), out_shardings=sharding)(variables)
    return state, 0


def _with_sharding(abstract_tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_tree, shardings)


def _check_same_run(saved: dict, current: dict, ckpt_dir: str) -> None:
    def get(tree, dotted):
        for part in dotted.split("."):
            tree = tree.get(part, {}) if isinstance(tree, dict) else {}
        return tree
    changed = [k for k in RESUME_KEYS if get(saved, k) != get(current, k)]
    if changed:
        raise ConfigError(f"checkpoint.dir {ckpt_dir} holds a run with a different config ({', '.join(changed)} "
                          f"changed); resume with the same config or use a new checkpoint.dir")


def _evaluate(eval_fn, rows: TokenRows, limit: int, batch_rows: int, mesh, params, target_params) -> dict:
    """Offline measures over the first ``limit`` eval rows (``eval_fn``: :func:`train.step.eval_counts`
    jitted), in batches of ``batch_rows``."""
    totals: dict = {}
    for start in range(0, min(len(rows), limit) - batch_rows + 1, batch_rows):
        batch = put_batch(mesh, rows.rows(np.arange(start, start + batch_rows)))
        counts = jax.device_get(eval_fn(params, target_params, batch))
        totals = {k: totals.get(k, 0) + float(v) for k, v in counts.items()}
    return eval_summary(totals)


if __name__ == "__main__":
    sys.exit(main())

"""The training step: on 8 fake CPU devices (mesh data x fsdp = 4 x 2 and 8 x 1) it equals the single-device
step in float32, parameters really are sharded, and gradient accumulation does not change the result; the
learning-rate schedule; the offline evaluation on hand-made cases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import REPO_ROOT
from train.config import OptimSection
from train.step import chain_accepted, eval_summary, make_optimizer

SHARDED_SCRIPT = textwrap.dedent('''
    import json
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    from longspec_jax.config import TargetConfig
    from longspec_jax.draft import DraftConfig, init_draft
    from longspec_jax.target import init_target_params
    from train.config import AnchorSection, MeshSection, OptimSection
    from train.sharding import jit_train_step, make_mesh, put_batch, tree_shardings
    from train.step import StepSettings, init_state, make_optimizer

    assert len(jax.devices()) == 8
    cfg = TargetConfig(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=40000)
    dc = DraftConfig.from_target(cfg, window=8)
    settings = StepSettings(target=cfg, draft=dc, compute_dtype=jnp.float32, anchor=AnchorSection(), max_shift=4,
                            kl_weight=0.5, chunk_tokens=40, seed=3)
    optimizer, schedule = make_optimizer(OptimSection(lr=3e-3, warmup_ratio=0.0), 10)
    tparams = init_target_params(cfg, jax.random.PRNGKey(0), std=0.2)
    params = init_draft(dc, jax.random.PRNGKey(1)).variables
    rng = np.random.default_rng(0)
    T, rows = 24, 16
    steps = [dict(tokens=rng.integers(0, 128, (rows, T)).astype(np.int32),
                  targets=(rng.random((rows, T)) < 0.9).astype(np.int8),
                  lengths=np.full((rows,), T, np.int32)) for _ in range(2)]

    def run(data, fsdp, accum):
        mesh = make_mesh(MeshSection(data=data, fsdp=fsdp), devices=jax.devices()[:data * fsdp])
        abstract = jax.eval_shape(lambda p: init_state(p, optimizer), params)
        state_sh, target_sh = tree_shardings(mesh, abstract), tree_shardings(mesh, tparams)
        state = jax.jit(lambda p: init_state(p, optimizer), out_shardings=state_sh)(params)
        step = jit_train_step(settings, optimizer, schedule, mesh, state_sh, target_sh)
        tp = jax.device_put(tparams, target_sh)
        metrics = []
        for host in steps:
            batch = {k: v.reshape((accum, v.shape[0] // accum) + v.shape[1:]) for k, v in host.items()}
            state, m = step(state, tp, put_batch(mesh, batch, row_axis=1))
            metrics.append({k: float(v) for k, v in jax.device_get(m).items()})
        sharded = sum("fsdp" in str(x.sharding.spec) for x in jax.tree.leaves(state.params))
        target_sharded = sum("fsdp" in str(x.sharding.spec) for x in jax.tree.leaves(tp))
        return jax.device_get(state.params), metrics, sharded, target_sharded

    ref_params, ref_metrics, _, _ = run(1, 1, 1)
    out = {}
    for name, args in {"4x2": (4, 2, 1), "8x1": (8, 1, 1), "4x2-accum2": (4, 2, 2), "1x1-accum2": (1, 1, 2)}.items():
        p, m, sharded, target_sharded = run(*args)
        diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), p, ref_params))
        out[name] = dict(param_diff=max(diffs), loss=[x["loss"] for x in m], sharded=sharded,
                         target_sharded=target_sharded, grad_norm=[x["grad_norm"] for x in m])
    out["ref"] = dict(loss=[x["loss"] for x in ref_metrics], grad_norm=[x["grad_norm"] for x in ref_metrics],
                      moved=max(jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), ref_params,
                                                             jax.device_get(params)))))
    print("RESULT " + json.dumps(out))
''')


@pytest.mark.slow
def test_sharded_step_equals_single_device():
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    ref = out.pop("ref")
    assert ref["moved"] > 1e-3 and ref["loss"][1] != ref["loss"][0]  # the steps did something
    for name, r in out.items():
        np.testing.assert_allclose(r["loss"], ref["loss"], rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(r["grad_norm"], ref["grad_norm"], rtol=1e-4, err_msg=name)
        assert r["param_diff"] < 1e-5, (name, r["param_diff"])
        if name.startswith("4x2"):  # parameters of the draft, its optimizer state and the target over fsdp
            assert r["sharded"] > 5 and r["target_sharded"] > 5, r


def test_schedule_warms_up_then_decays_by_cosine():
    _, schedule = make_optimizer(OptimSection(lr=1e-3, warmup_ratio=0.1, min_lr_ratio=1e-4), 100)
    lrs = np.array([float(schedule(i)) for i in range(101)])
    np.testing.assert_allclose(lrs[[0, 5, 10]], [0.0, 5e-4, 1e-3], rtol=1e-6)
    assert (np.diff(lrs[:11]) > 0).all() and (np.diff(lrs[10:]) < 0).all()
    np.testing.assert_allclose(lrs[100], 1e-7, rtol=1e-4)
    np.testing.assert_allclose(lrs[55], 1e-7 + (1e-3 - 1e-7) * 0.5, rtol=1e-4)  # half way down the cosine


def test_weight_decay_skips_norms_and_biases():
    optimizer, _ = make_optimizer(OptimSection(lr=1.0, warmup_ratio=0.0, weight_decay=0.5, clip=1e9), 10)
    params = {"kernel": jnp.ones((2, 2)), "bias": jnp.ones((2,)), "weight": jnp.ones((2,))}
    state = optimizer.init(params)
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = optimizer.update(zero, state, params)
    assert float(jnp.abs(updates["kernel"]).max()) > 0  # decayed
    assert float(jnp.abs(updates["bias"]).max()) == 0 and float(jnp.abs(updates["weight"]).max()) == 0


def test_eval_summary_arithmetic():
    s = eval_summary({"nll": 30.0, "correct": 6.0, "count": 10.0, "agree": 4.0, "accepted": 9.0, "roots": 6.0})
    assert s == {"eval_loss": 3.0, "eval_accuracy": 0.6, "eval_target_agreement": 0.4, "eval_chain_tau": 2.5}


def test_chain_acceptance_on_a_hand_made_case():
    greedy = np.array([[5, 6, 7, 8, 9, 10, 11, 12]])
    tokens = np.array([[0, 5, 6, 7, 1, 9, 10, 11]])  # the data follows the target's argmax except at t = 4
    preds = np.stack([greedy, greedy, greedy])        # a perfect draft at every gap ...
    preds[1, 0, 2] = 99                                # ... except gap 2 at position 2
    acc, roots = chain_accepted(jnp.asarray(preds), jnp.asarray(greedy), jnp.asarray(tokens), jnp.asarray([8]))
    # root 0: steps 0 (pos 0), 1 (pos 1, data[1] = greedy[0]), 2 (pos 2, data[2] = greedy[1]) -> 3
    # root 1: step 1 at pos 2 is wrong -> 1; root 2: step 1 at pos 3 needs data[3] == greedy[2]: yes; step 2 at
    # pos 4 needs data[4] == greedy[3]: no -> 2; root 3: step 1 at pos 4 fails the context -> 1
    np.testing.assert_array_equal(np.asarray(acc)[0, :4], [3, 1, 2, 1])
    np.testing.assert_array_equal(np.asarray(roots)[0], [True] * 5 + [False] * 3)

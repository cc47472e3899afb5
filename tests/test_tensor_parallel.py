"""Tensor-parallel decoding (longspec_jax.mesh, tensor_parallel, sharded_io; generate on a target with a mesh).

Single-device tests here; the multi-device cases run in a fresh interpreter with 8 fake CPU devices
(``tests/sharded_cases.py``): the default suite runs one (mesh 4x2, plain decoding, loading, errors), the slow
ones the speculative loop on every mesh, prompt lookup, sampling and the Pallas kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from longspec_jax import load_target
from longspec_jax.mesh import make_mesh
from longspec_jax.target import Target
from longspec_jax.tensor_parallel import check_mesh, group_columns, group_params
from tests.conftest import REPO_ROOT
from tests.sharded_cases import TP_CONFIG, hf_config, prompt_logits, tp_target, write_checkpoint


def run_cases(*cases: str, timeout: int = 900) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-m", "tests.sharded_cases", *cases], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for case in cases:
        assert f"OK {case.partition('=')[0]}" in proc.stdout, proc.stdout
    return proc.stdout


def test_group_columns_puts_each_parts_slice_in_its_group():
    fused = np.arange(12)[None]  # parts of widths 4 (a0..a3), 4 (b0..b3), 4 (c0..c3)
    grouped = np.asarray(group_columns(jnp.asarray(fused), (4, 4, 4), 2))
    np.testing.assert_array_equal(grouped, [[[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]])


def test_grouped_layout_gives_the_same_logits():
    """target.fused_linear on the per-shard grouped layout, here on one device (biases included)."""
    config = TP_CONFIG.__class__(**{**TP_CONFIG.__dict__, "qkv_bias": True, "o_bias": True, "mlp_bias": True})
    target = tp_target(config=config)
    grouped = Target(config, group_params(target.params, config, 4))
    assert grouped.params["layers"][0]["bqkv"].shape == (4, 64)
    np.testing.assert_allclose(prompt_logits(grouped), prompt_logits(target), rtol=1e-5, atol=1e-5)


def test_tp_count_must_divide_the_kv_heads(tmp_path):
    three = AbstractMesh((1, 3), ("data", "model"))
    with pytest.raises(ValueError, match="divisible by 3; this model has 8 KV heads"):
        check_mesh(TP_CONFIG, three)
    with pytest.raises(ValueError, match="8 KV heads"):
        load_target(write_checkpoint(tmp_path / "ck", hf_config()), mesh=three)
    with pytest.raises(ValueError, match="needs the axes"):
        check_mesh(TP_CONFIG, AbstractMesh((1,), ("model",)))
    with pytest.raises(ValueError, match="does not match the 1 devices"):
        make_mesh(2)


@pytest.mark.slow
def test_sharded_generate_and_loading_on_8_devices(tmp_path):
    """Mesh 4x2 (model x data): logits and plain greedy tokens equal one device's; load_target(mesh=) equals
    loading then sharding, with host memory near one tensor; a batch the data axis does not split and TP 3 with
    8 KV heads raise."""
    out = run_cases("fast", f"loading={tmp_path}")
    print(out)


@pytest.mark.slow
def test_sharded_speculative_generate_on_every_mesh():
    """Meshes 8x1, 4x2, 2x1 (model x data): speculative tokens equal plain greedy and the single-device
    acceptance counts, with multi-token rounds."""
    run_cases("speculative")


@pytest.mark.slow
def test_sharded_draft_vocab():
    run_cases("draft_vocab")


@pytest.mark.slow
def test_sharded_lookup_sampling_and_pallas():
    run_cases("lookup_and_sampling")


@pytest.mark.slow
def test_sharded_engine():
    """The continuous-batching engine on meshes 4x2 and 8x1: greedy requests equal single-device generate."""
    run_cases("engine")

"""A target of given shapes with random weights, made on the devices (sharded over a mesh or on one device), for
benchmarks at real model shapes without a checkpoint."""

from __future__ import annotations

import jax

from longspec_jax.config import RopeConfig, TargetConfig
from longspec_jax.target import Target, init_target_params
from longspec_jax.tensor_parallel import group_params, target_shardings

# The LM head's std: logits of std ~32 leave top-2 gaps far above bf16 rounding, so the speculative path's argmax
# equals the plain one's and an oracle replaying the plain output holds. With the layers' std 0.02 the gaps were
# within rounding: on the H200, tau 1.03 with the plain output parting at token 3.
LM_HEAD_STD = 0.5


def random_target(s: dict, mesh, dtype, std: float) -> Target:
    """Random weights of shapes ``s``, made on the devices: sharded over ``mesh``, or on one device."""
    config = TargetConfig(model_type="llama", vocab_size=s["vocab_size"], hidden_size=s["hidden_size"],
                          intermediate_size=s["intermediate_size"], num_layers=s["num_layers"],
                          num_heads=s["num_heads"], num_kv_heads=s["num_kv_heads"], head_dim=s["head_dim"],
                          rms_norm_eps=s["rms_norm_eps"], rope=RopeConfig(theta=s["rope_theta"]),
                          max_position_embeddings=2**30)
    key = jax.random.PRNGKey(0)

    def init(k):
        params = init_target_params(config, k, dtype, std=std)
        return {**params, "lm_head": params["lm_head"] * (LM_HEAD_STD / std)} if "lm_head" in params else params

    if mesh is None:
        return Target(config, jax.jit(init)(key))
    grouped = lambda k: group_params(init(k), config, mesh.shape["model"])
    shardings = target_shardings(jax.eval_shape(grouped, key), config, mesh)
    return Target(config, jax.jit(grouped, out_shardings=shardings)(key), mesh=mesh)

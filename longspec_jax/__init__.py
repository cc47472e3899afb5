"""longspec-jax: LongSpec long-context lossless speculative decoding in JAX/Flax."""

from longspec_jax.checkpoint import load_target
from longspec_jax.config import RopeConfig, TargetConfig
from longspec_jax.draft import Draft, DraftConfig
from longspec_jax.draft_io import load_draft, save_draft
from longspec_jax.errors import ConfigError, LongSpecError, WeightsError
from longspec_jax.mesh import make_mesh
from longspec_jax.target import Target
from longspec_jax.tensor_parallel import shard_target

__all__ = ["load_target", "load_draft", "save_draft", "make_mesh", "shard_target", "Target", "Draft", "DraftConfig",
           "TargetConfig", "RopeConfig", "LongSpecError", "ConfigError", "WeightsError"]

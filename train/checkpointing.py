"""Orbax training checkpoints of the draft.

Layout under a checkpoint directory ``DIR`` (an Orbax ``CheckpointManager`` root)::

    DIR/
      <step>/                 one directory per saved step, written under a temporary name and renamed
                              when complete, so a crash mid-save never leaves a half-written <step>/
        draft/                the draft's Flax variables {"params": {...}} (Orbax StandardSave, sharding-aware)
        opt_state/            the optimizer state (optional; StandardSave)
        metadata/             JSON: {"format", "step", "draft_config", "target_config", "extra"}

``metadata.draft_config`` is :class:`longspec_jax.draft.DraftConfig` as a dict; ``metadata.target_config`` is the
target's HF ``config.json`` dict. Together they rebuild the draft and its PyTorch ``config.json`` without the
target's weights (``python -m train.export``). ``extra`` is free-form JSON for the training loop (data position,
config file, ...).

Usage (``Checkpointer`` is the training loop's periodic, asynchronous saver)::

    meta = checkpoint_metadata(draft.config, target, extra={"config": cfg_dict})
    save_checkpoint(DIR, step, draft_variables, opt_state, meta, max_to_keep=3)   # one blocking save
    ckpt = restore_checkpoint(DIR, template={"draft": abstract_vars, "opt_state": abstract_opt})  # or None
    ckpt.step, ckpt.draft_variables, ckpt.opt_state, ckpt.to_draft()

Pass ``template`` (arrays or ``jax.ShapeDtypeStruct`` with shardings) to restore into the original pytree
types (optax states are NamedTuples) and placements; without it, items come back as saved, as nested dicts.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Mapping

import jax
import orbax.checkpoint as ocp

from longspec_jax.config import TargetConfig
from longspec_jax.draft import Draft, DraftConfig
from longspec_jax.draft_io import draft_config_from_dict, draft_config_to_dict, target_hf_config

FORMAT = "longspec-jax-draft-train/1"
DRAFT_ITEM, OPT_ITEM, METADATA_ITEM = "draft", "opt_state", "metadata"
ITEMS = (DRAFT_ITEM, OPT_ITEM, METADATA_ITEM)


class CheckpointError(ValueError):
    """A training checkpoint is missing, incomplete or malformed."""


def checkpoint_metadata(draft_config: DraftConfig, target, extra: Mapping[str, Any] | None = None) -> dict:
    """Metadata for :func:`save_checkpoint`. ``target`` is a Target, TargetConfig or HF config dict."""
    hf = target_hf_config(target)
    TargetConfig.from_hf_dict(hf)  # validate now rather than at export time
    return {"format": FORMAT, "draft_config": draft_config_to_dict(draft_config), "target_config": hf,
            "extra": dict(extra or {})}


def _manager(directory, *, max_to_keep=None, create=True, async_save=False) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create,
                                           enable_async_checkpointing=async_save)
    return ocp.CheckpointManager(os.path.abspath(os.fspath(directory)), options=options, item_names=ITEMS)


def _check_metadata(metadata: Mapping[str, Any]) -> None:
    missing = [k for k in ("draft_config", "target_config") if k not in metadata]
    if missing:
        raise CheckpointError(f"checkpoint metadata lacks {', '.join(missing)}; build it with checkpoint_metadata()")


def save_checkpoint(directory, step: int, draft_variables, opt_state=None, metadata: Mapping[str, Any] | None = None,
                    *, max_to_keep: int | None = None) -> str:
    """Saves step ``step`` (blocking; every process must call it in multi-host runs). Returns the step dir.

    ``max_to_keep`` deletes the oldest steps beyond that many. Saving a step that exists raises."""
    if metadata is None:
        raise CheckpointError("save_checkpoint needs metadata (checkpoint_metadata(draft.config, target)) so that "
                              "the checkpoint can be exported without the target weights")
    _check_metadata(metadata)
    step = int(step)
    with _manager(directory, max_to_keep=max_to_keep) as manager:
        if step in manager.all_steps():
            raise CheckpointError(f"{directory}: step {step} already exists")
        manager.save(step, args=_save_args(step, draft_variables, opt_state, metadata), force=True)
        manager.wait_until_finished()
        return os.fspath(manager.directory / str(step))


def _save_args(step: int, draft_variables, opt_state, metadata: Mapping[str, Any]) -> ocp.args.Composite:
    meta = {**dict(metadata), "format": FORMAT, "step": step}
    items = {DRAFT_ITEM: ocp.args.StandardSave(draft_variables), METADATA_ITEM: ocp.args.JsonSave(meta)}
    if opt_state is not None:
        items[OPT_ITEM] = ocp.args.StandardSave(opt_state)
    return ocp.args.Composite(**items)


class Checkpointer:
    """The training loop's saver: one Orbax manager for the run, saves in the background (``async_save``),
    keeps the newest ``keep`` steps. A save interrupted by a kill leaves only a temporary directory, which
    :func:`restore_checkpoint` ignores."""

    def __init__(self, directory, metadata: Mapping[str, Any], *, keep: int, async_save: bool = True):
        _check_metadata(metadata)
        self.metadata = dict(metadata)
        self.manager = _manager(directory, max_to_keep=keep, async_save=async_save)

    def save(self, step: int, draft_variables, opt_state) -> None:
        step = int(step)
        if step not in self.manager.all_steps():
            self.manager.save(step, args=_save_args(step, draft_variables, opt_state, self.metadata), force=True)

    def close(self) -> None:
        """Waits for a save in flight and releases the manager."""
        self.manager.wait_until_finished()
        self.manager.close()


def all_steps(directory) -> list[int]:
    """The complete (finalized) steps saved under ``directory``, ascending; [] if there are none."""
    if not os.path.isdir(os.fspath(directory)):
        return []
    with _manager(directory, create=False) as manager:
        return sorted(manager.all_steps())


def latest_step(directory) -> int | None:
    """The newest complete step, or ``None``. Interrupted saves (temporary directories) are ignored."""
    steps = all_steps(directory)
    return steps[-1] if steps else None


@dataclasses.dataclass
class TrainCheckpoint:
    step: int
    draft_variables: dict
    opt_state: Any
    metadata: dict

    @property
    def draft_config(self) -> DraftConfig:
        return draft_config_from_dict(self.metadata["draft_config"])

    @property
    def target_config(self) -> dict:
        """The target's HF config.json dict."""
        return self.metadata["target_config"]

    def to_draft(self) -> Draft:
        return Draft(config=self.draft_config, variables=self.draft_variables, target_hf_config=self.target_config)


def restore_checkpoint(directory, step: int | None = None, *, template: Mapping[str, Any] | None = None,
                       restore_opt_state: bool = True) -> TrainCheckpoint:
    """Restores ``step``, or the newest step that restores cleanly when ``step`` is None (an unreadable newest
    step is skipped with a warning, so training resumes from the last complete checkpoint).

    ``template`` may hold ``"draft"`` and/or ``"opt_state"`` pytrees (arrays or ShapeDtypeStructs) giving the
    structure, dtypes and shardings to restore into. ``restore_opt_state=False`` skips the optimizer state
    (export needs only the draft)."""
    directory = os.fspath(directory)
    steps = all_steps(directory)
    if not steps:
        raise CheckpointError(f"no complete training checkpoint under {directory}")
    if step is not None:
        if int(step) not in steps:
            raise CheckpointError(f"{directory}: no complete checkpoint for step {step}; available: {steps}")
        return _restore(directory, int(step), template, restore_opt_state)
    failures = []
    for candidate in reversed(steps):
        try:
            ckpt = _restore(directory, candidate, template, restore_opt_state)
        except Exception as e:  # a damaged step: fall back to the previous one
            reason = f"{type(e).__name__}: {str(e)[:300]}"
            failures.append(f"step {candidate}: {reason}")
            warnings.warn(f"{directory}: cannot restore step {candidate} ({reason}); trying an older step")
            continue
        return ckpt
    raise CheckpointError(f"{directory}: no step could be restored: " + "; ".join(failures))


def _restore(directory: str, step: int, template, restore_opt_state: bool) -> TrainCheckpoint:
    template = dict(template or {})
    step_dir = os.path.join(directory, str(step))
    has_opt = os.path.isdir(os.path.join(step_dir, OPT_ITEM))
    items = {METADATA_ITEM: ocp.args.JsonRestore(),
             DRAFT_ITEM: ocp.args.StandardRestore(_abstract(template.get(DRAFT_ITEM)))}
    if restore_opt_state and has_opt:
        items[OPT_ITEM] = ocp.args.StandardRestore(_abstract(template.get(OPT_ITEM)))
    with _manager(directory, create=False) as manager:
        restored = manager.restore(step, args=ocp.args.Composite(**items))
    metadata = restored[METADATA_ITEM]
    if not isinstance(metadata, Mapping) or metadata.get("format") != FORMAT:
        raise CheckpointError(f"{step_dir}: not a longspec-jax draft checkpoint (metadata format "
                              f"{metadata.get('format') if isinstance(metadata, Mapping) else None!r})")
    _check_metadata(metadata)
    opt_state = restored[OPT_ITEM] if OPT_ITEM in items else None
    return TrainCheckpoint(step=step, draft_variables=restored[DRAFT_ITEM], opt_state=opt_state,
                           metadata=dict(metadata))


def _abstract(tree):
    if tree is None:
        return None
    return jax.tree_util.tree_map(
        lambda a: a if isinstance(a, jax.ShapeDtypeStruct)
        else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)), tree)

"""T > 0 through the engine's compiled programs: rows of a slot batch whose neighbours sample at other temperatures
(greedy ones included) still follow the target's exact output distribution, and greedy rows beside them stay
exact. The test rows and the tiny exact target are those of tests/test_speculative_sampling.py; the negative
control is a batch whose rows read their neighbour's temperature."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from infer.engine import Engine, EngineConfig, RequestParams
from infer.generate import generate
from infer.schedule import Step
from infer.slot_programs import Programs, padded_prompt, prefill_pieces
from infer.slots import SlotState
from longspec_jax.sampling import RowSampling
from tests.test_speculative_sampling import (ALPHA, EOS, MAX_NEW, PROMPTS, SAMPLED_BINARY, TREE, Case, _exact,
                                             _models, _pvalues)

SLOTS = 4096
SAMPLES = 4096   # test rows, alternating between the prompts
# Slot s runs (prompt, temperature, top_p) = ROLES[s % 4]: two test rows at the case's sampling, then a greedy row
# and a row at T = 0.5 as neighbours.
NEIGHBOURS = ((0, 0.0, 1.0), (1, 0.5, 1.0))


def _roles(case: Case):
    return ((0, case.temperature, case.top_p), (1, case.temperature, case.top_p)) + NEIGHBOURS


def _batch(programs: Programs, plan, case: Case, seed: int) -> list[list[int]]:
    """One batch of ``SLOTS`` requests decoded to the end; each slot's tokens."""
    roles = _roles(case)
    chunk = plan.shapes.base.prefill_chunk
    for p, prompt in enumerate(PROMPTS):
        tokens = padded_prompt(prompt, sum(prefill_pieces(len(prompt), chunk)))
        assert len(tokens) <= chunk  # one piece
        programs.prefill(tokens, 0, len(prompt))
        for slot in range(SLOTS):
            prompt_index, temperature, top_p = roles[slot % len(roles)]
            if prompt_index == p:
                params = RequestParams(max_tokens=MAX_NEW, temperature=temperature, top_p=top_p)
                programs.insert(slot, prompt, params, seed * SLOTS + slot, [EOS])
    step = Step(greedy=False, use_top_p=case.top_p < 1, settings=plan.settings[SLOTS, False],
                rounds=plan.rounds_per_step)  # every round of a step's device loop
    tokens = [[] for _ in range(SLOTS)]
    firsts = np.asarray(programs.state.pending[:, 0])
    for slot in range(SLOTS):
        tokens[slot].append(int(firsts[slot]))
    while bool(np.any(np.asarray(programs.state.active))):
        out = programs.decode(step)
        emitted, new = np.asarray(out.emitted), np.asarray(out.tokens)
        for slot in np.flatnonzero(emitted):
            tokens[slot] += new[slot, :emitted[slot]].tolist()
    return tokens


def _run(case: Case, row_sampling=None):
    """The test rows' outputs by prompt, and the greedy neighbours' outputs."""
    target, draft = _models()
    config = EngineConfig(max_batch=SLOTS, max_context=32, prefill_chunk=8, tree_shape=case.tree,
                          draft_sampling=case.draft_sampling)
    plan = Engine(target, draft, config).plan
    programs = Programs(plan, target, plan.draft)
    programs.resize(SLOTS)
    samples, greedy = [[], []], []
    original = SlotState.row_sampling
    if row_sampling is not None:
        SlotState.row_sampling = row_sampling
    try:
        for seed in range(SAMPLES // (SLOTS // 2)):
            tokens = _batch(programs, plan, case, seed)
            for slot, out in enumerate(tokens):
                role = slot % 4
                if role < 2:
                    samples[role].append(tuple(out))
                elif role == 2:
                    greedy.append(out)
    finally:
        SlotState.row_sampling = original
    return samples, greedy


def _neighbour_temperature(state, use_top_p):
    """Mutant: every row samples at the previous slot's temperature."""
    return RowSampling(temperature=jnp.roll(state.temperature, 1), top_p=state.top_p, use_top_p=use_top_p)


CASES = {"sampled-binary": SAMPLED_BINARY, "beam-tree": dataclasses.replace(TREE, draft_sampling=False)}


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_rows_beside_other_temperatures_follow_the_target_distribution(name):
    case = CASES[name]
    samples, greedy = _run(case)
    pvalues = _pvalues(samples, _exact(case))
    assert min(pvalues.values()) > ALPHA, pvalues
    target, _ = _models()
    solo = generate(target, [PROMPTS[0]], max_new_tokens=MAX_NEW, eos_token_id=[EOS])
    assert all(out == solo.tokens[0, :solo.num_generated[0]].tolist() for out in greedy)


@pytest.mark.slow
def test_rows_reading_their_neighbours_temperature_fail():
    samples, _ = _run(SAMPLED_BINARY, _neighbour_temperature)
    pvalues = _pvalues(samples, _exact(SAMPLED_BINARY))
    assert min(pvalues.values()) < ALPHA, pvalues

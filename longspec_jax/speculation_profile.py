"""A draft's measured acceptance, and what it predicts: tokens per round of any tree, the best tree for a node
budget, and how a sampled tree's level widths are shared among parents.

The model is positional (as in Sequoia, arXiv 2402.12374): at a tree node of depth d, the child of sibling rank r
is accepted with a conditional probability ``a[d, r]`` given that the lower-ranked children were rejected,
whatever the tokens. So the rank-r child is reached with probability ``reach(parent) * m[d, r]``, ``m[d, r] =
a[d, r] * prod_{j < r} (1 - a[d, j])``, and a round emits ``1 + sum of reach over the tree's nodes`` tokens on
average. The rates are measured by running speculation (``python -m infer.calibrate``, from the counts of
:func:`longspec_jax.tree.rank_outcomes`) and stored beside a draft as ``speculation_profile.json``, one table per
kind of tree and temperature: ``beams`` (the draft's top-k children; greedy decoding) and the sampled kinds of
:data:`longspec_jax.tree.SAMPLING_KINDS`.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import os

import numpy as np

from longspec_jax.tree import RANK_SLOTS, SAMPLING_KINDS

PROFILE_FILE = "speculation_profile.json"
TREE_KINDS = ("beams",) + SAMPLING_KINDS
MAX_CHILDREN = RANK_SLOTS       # most children a sampled tree gives one node
PRIOR_WEIGHT = 4.0              # pseudo-trials of the default rates behind every measured rate

# Conditional acceptance by sibling rank, the same at every depth, where no measurement is stored: the code-LM
# fixture's trained draft on held-out code at 12k tokens of context (python -m infer.calibrate), averaged over depth
# and rounded: beams at T = 0, sampled children at T = 1.
DEFAULT_RATES = {
    ("beams", 0.0): (0.87, 0.50, 0.30, 0.20, 0.10, 0.08, 0.06, 0.05),
    ("without_replacement", 1.0): (0.63, 0.28, 0.16, 0.14, 0.08, 0.07, 0.06, 0.05),
    ("top_plus_one", 1.0): (0.55, 0.16, 0.20, 0.13, 0.10, 0.06, 0.05, 0.05),
}


@dataclasses.dataclass(frozen=True)
class RateTable:
    """Conditional acceptance ``rates[d][r]`` (depth d + 1 nodes' parents at depth d, sibling rank r) of one tree
    kind at one temperature; depths past the table use its last row."""

    kind: str
    temperature: float
    rates: tuple[tuple[float, ...], ...]

    def row(self, depth: int) -> np.ndarray:
        return np.asarray(self.rates[min(depth, len(self.rates) - 1)], np.float64)

    def marginals(self, depth: int, ranks: int = MAX_CHILDREN) -> np.ndarray:
        """``m[r]`` for ranks ``0 .. ranks - 1``: probability that a node at ``depth`` passes on to its rank-r
        child, made non-increasing in r (a lower rank is never worth less than a higher one); ranks past the
        table repeat its last rate."""
        a = self.row(depth)
        a = np.clip(np.concatenate([a, np.full(max(0, ranks - len(a)), a[-1])])[:ranks], 0.0, 1.0)
        m = a * np.concatenate([[1.0], np.cumprod(1.0 - a)[:-1]])
        return np.minimum.accumulate(np.maximum(m, 1e-9))


@dataclasses.dataclass(frozen=True)
class SpeculationProfile:
    """A draft's rate tables, with where they came from (``source``: a few words) and, from a calibration, the
    tokens per target pass its probe tree gave (``probe_tau``: ``("beams T=0", 5.8), ...``)."""

    tables: tuple[RateTable, ...]
    source: str
    probe_tau: tuple[tuple[str, float], ...] = ()

    def table(self, kind: str, temperature: float) -> RateTable:
        """The rates of ``kind`` at ``temperature``: linear between the two nearest stored temperatures of that
        kind (the nearest where outside them); a sampled kind below its lowest stored temperature is interpolated
        towards the greedy ``beams`` table, which sampling approaches as T -> 0. A kind this profile has no table
        of comes from :data:`DEFAULT_PROFILE`."""
        if kind not in TREE_KINDS:
            raise ValueError(f"unknown tree kind {kind!r}; expected one of {', '.join(TREE_KINDS)}")
        own = sorted((t for t in self.tables if t.kind == kind), key=lambda t: t.temperature)
        if not own:
            return DEFAULT_PROFILE.table(kind, temperature)
        if kind != "beams":
            own = [t for t in self.tables if t.kind == "beams" and t.temperature == 0.0][:1] + own
        below = [t for t in own if t.temperature <= temperature]
        above = [t for t in own if t.temperature >= temperature]
        lo, hi = (below or above)[-1 if below else 0], (above or below)[0 if above else -1]
        if hi.temperature == lo.temperature:
            return dataclasses.replace(lo, kind=kind, temperature=temperature)
        w = (temperature - lo.temperature) / (hi.temperature - lo.temperature)
        depth = max(len(lo.rates), len(hi.rates))
        rates = tuple(tuple(float(x) for x in (1 - w) * lo.row(d) + w * hi.row(d)) for d in range(depth))
        return RateTable(kind, temperature, rates)

    def to_json(self) -> dict:
        return {"source": self.source, "probe_tau": dict(self.probe_tau),
                "tables": [dataclasses.asdict(t) for t in self.tables]}

    @classmethod
    def from_json(cls, data: dict, where: str = "speculation profile") -> "SpeculationProfile":
        try:
            tables = tuple(RateTable(str(t["kind"]), float(t["temperature"]),
                                     tuple(tuple(float(x) for x in row) for row in t["rates"]))
                           for t in data["tables"])
            source = str(data.get("source", where))
            probe_tau = tuple((str(k), float(v)) for k, v in data.get("probe_tau", {}).items())
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: malformed ({type(e).__name__}: {e})") from None
        for t in tables:
            if t.kind not in TREE_KINDS:
                raise ValueError(f"{where}: unknown tree kind {t.kind!r}; expected one of {', '.join(TREE_KINDS)}")
            if not t.rates or any(not row or not all(0.0 <= x <= 1.0 for x in row) for row in t.rates):
                raise ValueError(f"{where}: {t.kind} rates at T={t.temperature} must be non-empty rows in [0, 1]")
        return cls(tables, source, probe_tau)


DEFAULT_PROFILE = SpeculationProfile(
    tables=tuple(RateTable(kind, t, (rates,)) for (kind, t), rates in DEFAULT_RATES.items()),
    source="default rates (no calibration stored with the draft)")


def load_profile(directory: str) -> SpeculationProfile | None:
    """The profile stored in a draft directory, or None where it has none."""
    path = os.path.join(directory, PROFILE_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read the speculation profile ({e})") from None
    return SpeculationProfile.from_json(data, path)


def save_profile(profile: SpeculationProfile, directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, PROFILE_FILE)
    with open(path, "w") as f:
        json.dump(profile.to_json(), f, indent=1)
    return path


def profile_from_counts(counts: dict, source: str, prior: SpeculationProfile = DEFAULT_PROFILE
                        ) -> SpeculationProfile:
    """Rate tables from measured counts: ``counts[(kind, temperature)] = (tried_DxR, accepted_DxR)``; each
    rate is shrunk towards the prior's by :data:`PRIOR_WEIGHT` pseudo-trials (ranks seldom tried keep the
    prior's rate)."""
    tables = []
    for (kind, temperature), (tried, accepted) in sorted(counts.items()):
        tried, accepted = np.asarray(tried, np.float64), np.asarray(accepted, np.float64)
        base = prior.table(kind, temperature)
        rates = [(accepted[d] + PRIOR_WEIGHT * base.row(d)[:tried.shape[1]]) / (tried[d] + PRIOR_WEIGHT)
                 for d in range(tried.shape[0])]
        tables.append(RateTable(kind, float(temperature), tuple(tuple(round(float(x), 4) for x in r) for r in rates)))
    return SpeculationProfile(tuple(tables), source)


# ------------------------------------------------------------------------------------------ trees under the model


def allocate_branching(shape: tuple[int, ...], table: RateTable, max_children: int) -> tuple[tuple[int, ...], ...]:
    """A static topology with level widths ``shape`` that the rates favour: level k + 1's slots go, one by one,
    to the (node of level k, next rank) pair whose child would be reached most often. Ties go to the earlier
    node. Raises ``ValueError`` where a level is wider than its parents can hold at ``max_children`` each."""
    reach = np.ones(1)
    branching = []
    for k, width in enumerate(shape):
        if width > len(reach) * max_children:
            raise ValueError(f"tree_shape[{k}] = {width} exceeds the {len(reach)} x {max_children} children a sampled "
                             f"tree's level can hold")
        m = table.marginals(k, max_children)
        values = reach[:, None] * m[None, :]                       # [parents, ranks]
        order = np.lexsort((np.arange(values.size), -values.reshape(-1)))[:width]
        counts = np.bincount(order // max_children, minlength=len(reach))
        branching.append(tuple(int(c) for c in counts))
        reach = np.concatenate([reach[j] * m[:c] for j, c in enumerate(counts)])
    return tuple(branching)


def expected_tokens(branching: tuple[tuple[int, ...], ...], table: RateTable) -> float:
    """Tokens a round emits on average with this static topology: 1 + the summed reach of its nodes."""
    reach, total = np.ones(1), 1.0
    for k, counts in enumerate(branching):
        m = table.marginals(k, max(counts))
        reach = np.concatenate([reach[j] * m[:c] for j, c in enumerate(counts)])
        total += float(reach.sum())
    return total


def best_shape(table: RateTable, num_nodes: int, max_depth: int, max_children: int) -> tuple[int, ...]:
    """The level widths of the ``num_nodes - 1`` non-root nodes of highest reach within ``max_depth`` levels (at
    most ``max_children`` per node): the most tokens per round under the model for that many nodes, since a
    node's reach never exceeds its parent's."""
    heap = [(-float(table.marginals(0)[0]), 0, 0, 0, 1.0)]  # (-reach, order, level - 1, rank, parent's reach)
    widths = [0] * max_depth
    for order in range(1, 2 * num_nodes):
        if not heap or sum(widths) == num_nodes - 1:
            break
        neg_reach, _, d, rank, parent_reach = heapq.heappop(heap)
        widths[d] += 1
        if rank + 1 < max_children:
            sibling = parent_reach * float(table.marginals(d, max_children)[rank + 1])
            heapq.heappush(heap, (-sibling, 2 * order, d, rank + 1, parent_reach))
        if d + 1 < max_depth:
            heapq.heappush(heap, (neg_reach * float(table.marginals(d + 1)[0]), 2 * order + 1, d + 1, 0, -neg_reach))
    return tuple(w for w in widths if w)

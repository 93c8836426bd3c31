"""What one rank's kernels cost: `KernelClock`, and the clock fitted to measurements.

A clock answers, for one layer of one TP rank (`shapes.RankShape`), in seconds, forward and backward:

- `rest(tokens)`: the layer without its core attention at `tokens` local rows;
- `attention(cp_size, cp_rank, real, padded)`: the rank's share of its CP group's core attention,
  every ring step of Transformer Engine's THD ring, with no time for the transfers (`links.py`
  prices those, `simulate.py` overlaps them);
- `head(tokens)`: the embedding, the output layer and the loss at `tokens` rows (once a pass).

`FittedKernelClock` reads `measure.py`'s measurements: `rest` and `head` interpolate the measured
grid of token counts piecewise-linearly (beyond its ends, the nearest segment's line); `attention`
is a non-negative linear model of the ring's calls (`attention_features`), fitted to the measured
random passes of role "fit", forward and backward apart, on relative residuals. `check()` compares
it with the passes of role "check" and the CP1 layer checks (docs/gpu-replay.md, "Faithful").
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
from scipy.optimize import nnls

TILE = 128  # cuDNN's fused attention tiles queries and keys by 128 rows at head_dim 128
ATTENTION_FEATURES = ("passes", "cp_passes", "steps", "sequence_steps", "query_rows", "tile_pairs")


@dataclass(frozen=True)
class Timing:
    forward: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward

    def scaled(self, factor: float) -> Timing:
        return Timing(self.forward * factor, self.backward * factor)


class KernelClock(Protocol):
    def rest(self, tokens: int) -> Timing: ...

    def attention(self, cp_size: int, cp_rank: int, real: Sequence[int], padded: Sequence[int]) -> Timing: ...

    def head(self, tokens: int) -> Timing: ...


def _tiles(q: int, kv: int, causal: bool) -> float:
    nq, nk = math.ceil(q / TILE), math.ceil(kv / TILE)
    return nq * (nq + 1) / 2 if causal and nq == nk else float(nq * nk)


def ring_steps(cp_size: int, cp_rank: int, padded: Sequence[int]) -> list[list[tuple[int, int, bool]]]:
    """Per ring step, per sequence: (query rows, key rows, causal) of the rank's attention call, as
    Transformer Engine's THD ring runs it on rank `cp_rank` (each padded sequence in 2 x CP chunks,
    the rank holding two): step 0 its own chunks, causal; steps 1..rank all its query rows against
    the first half of the peer's keys; later steps the second half of its queries against all the
    peer's keys. CP1: each whole sequence, causal."""
    if cp_size == 1:
        return [[(p, p, True) for p in padded]]
    steps = [[(p // cp_size, p // cp_size, True) for p in padded]]
    for step in range(1, cp_size):
        if step <= cp_rank:
            steps.append([(p // cp_size, p // (2 * cp_size), False) for p in padded])
        else:
            steps.append([(p // (2 * cp_size), p // cp_size, False) for p in padded])
    return steps


def attention_features(cp_size: int, cp_rank: int, padded: Sequence[int]) -> list[float]:
    """The attention model's features of one pass (ATTENTION_FEATURES): the pass, whether it runs
    the CP path, its ring steps, its sequences over all steps, its query rows over all steps, and
    its 128 x 128 tiles of attention over all steps (`ring_steps`, summed in closed form: every
    step after the first pairs p / c rows with p / 2c rows, whichever side holds which)."""
    c, n = cp_size, len(padded)
    if c == 1:
        return [1.0, 0.0, 1.0, float(n), float(sum(padded)), float(sum(_tiles(p, p, True) for p in padded))]
    local = sum(padded) // c
    query_rows = local * (1 + cp_rank) + (local // 2) * (c - 1 - cp_rank)
    tiles = sum(_tiles(p // c, p // c, True) + (c - 1) * _tiles(p // c, p // (2 * c), False) for p in padded)
    return [1.0, 1.0, float(c), float(c * n), float(query_rows), float(tiles)]


def _interpolate(grid: list[tuple[int, float]], tokens: float) -> float:
    xs = [x for x, _ in grid]
    i = min(max(bisect.bisect_left(xs, tokens), 1), len(grid) - 1)
    (x0, y0), (x1, y1) = grid[i - 1], grid[i]
    return max(0.0, y0 + (y1 - y0) * (tokens - x0) / (x1 - x0))


def _fit(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative residuals: each pass weighs by 1 / its time."""
    weighted = features / seconds[:, None]
    scale = np.abs(weighted).max(axis=0)
    scale[scale == 0] = 1.0
    solution, _ = nnls(weighted / scale, np.ones(len(seconds)))
    return solution / scale


class FittedKernelClock:
    """The clock of one model's measurements (`measure.py`'s entry for one RankShape key)."""

    def __init__(self, entry: dict) -> None:
        self.entry = entry
        self._rest = {d: sorted((int(t), v[d]) for t, v in entry["rest"].items()) for d in ("forward", "backward")}
        self._head = {d: sorted((int(t), v[d]) for t, v in entry["head"].items()) for d in ("forward", "backward")}
        fit = [a for a in entry["attention"] if a["role"] == "fit"]
        x = np.array([attention_features(a["cp_size"], a["cp_rank"], a["padded"]) for a in fit])
        self.coefficients = {d: _fit(x, np.array([a[d] for a in fit])) for d in ("forward", "backward")}

    def rest(self, tokens: int) -> Timing:
        return Timing(_interpolate(self._rest["forward"], tokens), _interpolate(self._rest["backward"], tokens))

    def head(self, tokens: int) -> Timing:
        return Timing(_interpolate(self._head["forward"], tokens), _interpolate(self._head["backward"], tokens))

    def attention(self, cp_size: int, cp_rank: int, real: Sequence[int], padded: Sequence[int]) -> Timing:
        x = np.array(attention_features(cp_size, cp_rank, padded))
        return Timing(float(x @ self.coefficients["forward"]), float(x @ self.coefficients["backward"]))

    def check(self) -> dict:
        """Relative errors (predicted / measured - 1) of the fitted clock on what it was not fitted
        to: the "check" attention passes (attention alone, and the rank's whole layer pass: the
        measured rest at its token count plus the attention), and the CP1 layer checks (the
        replay's rest + attention against the whole layer, run as one)."""
        attention, layer_pass, layer = [], [], []
        for a in self.entry["attention"]:
            if a["role"] != "check":
                continue
            tokens = sum(a["padded"]) // a["cp_size"]
            predicted = self.attention(a["cp_size"], a["cp_rank"], a["real"], a["padded"]).total
            measured = a["forward"] + a["backward"]
            attention.append(predicted / measured - 1)
            rest = self.rest(tokens).total
            layer_pass.append((predicted + rest) / (measured + rest) - 1)
        for c in self.entry["layer_check"]:
            tokens = sum(c["padded"])
            predicted = self.rest(tokens).total + self.attention(1, 0, c["real"], c["padded"]).total
            layer.append(predicted / (c["layer"]["forward"] + c["layer"]["backward"]) - 1)
        return {"attention_check_passes": attention, "pass_check_passes": layer_pass, "cp1_layer_checks": layer}


class FakeKernelClock:
    """A clock of simple arithmetic, for the CPU tests: rest and head linear in tokens, attention
    linear in the tiles of its ring steps plus a fixed cost per step; backward twice forward."""

    def __init__(self, per_token: float = 1e-6, per_tile: float = 1e-6, per_step: float = 1e-4, head_per_token: float = 1e-7) -> None:
        self.per_token, self.per_tile, self.per_step, self.head_per_token = per_token, per_tile, per_step, head_per_token

    def rest(self, tokens: int) -> Timing:
        return Timing(self.per_token * tokens, 2 * self.per_token * tokens)

    def head(self, tokens: int) -> Timing:
        return Timing(self.head_per_token * tokens, 2 * self.head_per_token * tokens)

    def attention(self, cp_size: int, cp_rank: int, real: Sequence[int], padded: Sequence[int]) -> Timing:
        features = dict(zip(ATTENTION_FEATURES, attention_features(cp_size, cp_rank, padded)))
        forward = self.per_step * features["steps"] + self.per_tile * features["tile_pairs"]
        return Timing(forward, 2 * forward)

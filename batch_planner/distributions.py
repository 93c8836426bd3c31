"""Seeded sequence-length distributions shared by tests, the demo and the benchmarks.

- `megatron_dcp`: Megatron-Core's DCP example: lognormal, mean 1024, sigma 1.5, clipped 128..8192.
- `long_tail_16k`: the reference PR's 1K-16K long tail (lognormal median 2048, sigma 0.7, 1K..16K).
- `lognormal_32k`: lognormal median 2048, sigma 1, clipped 256..32768.
- `bimodal`: 99.9% around 1K, 0.1% around 37K.
- `rl_rollout_16k`: RL rollouts, a prompt and a sampled response: prompt lognormal median 512,
  sigma 0.5, 64..2048; response lognormal median 3000, sigma 1.1, cut at 14336 tokens (the
  generation limit), so about 8% of the samples end at the limit: a spike at the long end.
"""

from __future__ import annotations

import math
import random
from typing import Callable

Generator = Callable[[random.Random], int]


def _clipped_lognormal(mu: float, sigma: float, low: int, high: int) -> Generator:
    return lambda rng: int(min(high, max(low, round(rng.lognormvariate(mu, sigma)))))


def _bimodal(rng: random.Random) -> int:
    if rng.random() < 0.001:
        return int(min(40960, max(32768, round(rng.gauss(37 * 1024, 1024)))))
    return int(min(2048, max(256, round(rng.gauss(1024, 128)))))


RL_MAX_RESPONSE = 14336


def _rl_rollout(rng: random.Random) -> int:
    prompt = int(min(2048, max(64, round(rng.lognormvariate(math.log(512), 0.5)))))
    response = int(min(RL_MAX_RESPONSE, max(16, round(rng.lognormvariate(math.log(3000), 1.1)))))
    return prompt + response


# Mean of a lognormal is exp(mu + sigma^2 / 2); Megatron's example fixes the mean at 1024.
DISTRIBUTIONS: dict[str, Generator] = {
    "megatron_dcp": _clipped_lognormal(math.log(1024) - 1.5**2 / 2, 1.5, 128, 8192),
    "long_tail_16k": _clipped_lognormal(math.log(2048), 0.7, 1024, 16384),
    "lognormal_32k": _clipped_lognormal(math.log(2048), 1.0, 256, 32768),
    "bimodal": _bimodal,
    "rl_rollout_16k": _rl_rollout,
}


def sample_lengths(distribution: str, count: int, seed: int = 0) -> list[int]:
    """`count` sequence lengths from a named distribution; the same seed gives the same list."""
    try:
        draw = DISTRIBUTIONS[distribution]
    except KeyError:
        raise ValueError(f"unknown distribution {distribution!r}; known: {', '.join(DISTRIBUTIONS)}") from None
    rng = random.Random(f"{distribution}:{seed}")
    return [draw(rng) for _ in range(count)]

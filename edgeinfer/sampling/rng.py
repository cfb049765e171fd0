"""The sampler's random number generator: xoshiro256** seeded by splitmix64.

Both back ends implement exactly this generator, so a seed gives the same token sequence with
the C extension and with the numpy twin. `uniform()` = (next() >> 11) * 2**-53, in [0, 1).
A seed of None draws one from os.urandom.
"""

from __future__ import annotations

import os

from edgeinfer.errors import InvalidArgumentError

MASK = (1 << 64) - 1


def splitmix64(state: int) -> tuple[int, int]:
    state = (state + 0x9E3779B97F4A7C15) & MASK
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return state, z ^ (z >> 31)


def resolve_seed(seed: int | None) -> int:
    """The 64-bit seed both back ends start from: `seed` masked to 64 bits (so -1 is 2**64 - 1, and any
    Python int is accepted), or one from os.urandom for None. Anything else: InvalidArgumentError."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidArgumentError(f"seed must be an integer or None, got {seed!r}")
    return seed & MASK


def seed_state(seed: int | None) -> list[int]:
    x, s = resolve_seed(seed), []
    for _ in range(4):
        x, z = splitmix64(x)
        s.append(z)
    return s


def _rotl(x: int, k: int) -> int:
    return ((x << k) | (x >> (64 - k))) & MASK


class Rng:
    def __init__(self, seed: int | None):
        self.s = seed_state(seed)

    def next_u64(self) -> int:
        s = self.s
        result = (_rotl((s[1] * 5) & MASK, 7) * 9) & MASK
        t = (s[1] << 17) & MASK
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = _rotl(s[3], 45)
        return result

    def uniform(self) -> float:
        return (self.next_u64() >> 11) * (1.0 / (1 << 53))

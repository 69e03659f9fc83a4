"""An exact sampler of the discrete Gaussian N_Z(0, σ²) over the integers.

The discrete Gaussian gives x ∈ ℤ the probability exp(−x²/2σ²) / Σ_{y∈ℤ} exp(−y²/2σ²). Added to an
integer query of sensitivity 1 it is ρ = 1/(2σ²)-zCDP (Canonne, Kamath & Steinke 2020, "The
Discrete Gaussian for Differential Privacy", Theorem 4), i.e. RDP of α/(2σ²) at every order α: the
same bound as the continuous Gaussian mechanism, and the one dptune already composes for the
selection score (``dptune.privacy.selection._trial_rdp`` adds ``orders / (2 * σ_s**2)``).

Invariant: no floating point on the path. σ² is the exact rational ``Fraction(sigma) ** 2`` of the
float σ given, every Bernoulli trial compares a uniform integer with an integer numerator, and
the uniform integers come from 64-bit words of a ``numpy.random.Generator`` (``integers(0, 2**64,
dtype=uint64)``, exactly uniform) by rejection. The output is therefore a function of the integer
words only, and its low bits leak nothing (unlike float noise: Mironov 2012).

Algorithm (CKS section 5): Algorithm 1 with t = ⌊σ⌋ + 1 proposes a discrete Laplace Z of scale t
(U uniform on {0..t−1} kept with probability exp(−U/t), V geometric with ratio exp(−1), X = U + tV,
a random sign, rejecting −0) and accepts it with probability exp(−(|Z| − σ²/t)² / 2σ²);
Bernoulli(exp(−γ)) for rational γ is Algorithm 2: for γ ∈ [0, 1] the least K with
A_K ~ Bernoulli(γ/K) = 0 is odd with probability exp(−γ); for γ > 1, ⌊γ⌋ Bernoulli(exp(−1)) trials
then one of exp(−(γ − ⌊γ⌋)).

Not cryptographic: the exactness guarantee is as good as the generator's uniformity (PCG64 in
dptune, a statistical generator).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

#: 64-bit words fetched from the generator per refill of the bit pool.
_REFILL_WORDS = 8


class UniformIntegers:
    """Exact uniform integers below any bound, from a ``numpy.random.Generator``'s 64-bit words.

    The words are pooled as the bits of one Python integer; ``below(m)`` takes ⌈log₂ m⌉ bits and
    rejects values ≥ m, so every value of {0, …, m − 1} has probability exactly 1/m.
    """

    def __init__(self, generator: np.random.Generator) -> None:
        self.generator = generator
        self._pool = 0
        self._bits = 0

    def bits(self, k: int) -> int:
        """A uniform integer on {0, …, 2ᵏ − 1}."""
        if self._bits < k:
            words = max(_REFILL_WORDS, -(-(k - self._bits) // 64))
            fresh = self.generator.integers(0, 2**64, size=words, dtype=np.uint64)
            self._pool |= int.from_bytes(fresh.astype("<u8").tobytes(), "little") << self._bits
            self._bits += 64 * words
        value = self._pool & ((1 << k) - 1)
        self._pool >>= k
        self._bits -= k
        return value

    def below(self, m: int) -> int:
        """A uniform integer on {0, …, m − 1} (m ≥ 1)."""
        k = (m - 1).bit_length()
        while True:
            value = self.bits(k)
            if value < m:
                return value

    def bernoulli_exp(self, numerator: int, denominator: int) -> bool:
        """Bernoulli(exp(−γ)) for γ = numerator / denominator ≥ 0 (CKS Algorithm 2)."""
        whole, numerator = divmod(numerator, denominator)
        for _ in range(whole):
            if not self.bernoulli_exp_within_one(1, 1):
                return False
        return self.bernoulli_exp_within_one(numerator, denominator)

    def bernoulli_exp_within_one(self, numerator: int, denominator: int) -> bool:
        """Bernoulli(exp(−γ)) for γ = numerator / denominator ∈ [0, 1]: the least K with
        A_K ~ Bernoulli(γ/K) equal to 0 is odd with probability Σ_k (−γ)ᵏ/k! = exp(−γ)."""
        k = 1
        while self.below(denominator * k) < numerator:  # A_K = 1 with probability γ/K
            k += 1
        return k % 2 == 1


def sample_discrete_gaussian(sigma: float, generator: np.random.Generator) -> int:
    """One exact draw of N_Z(0, σ²) (σ > 0, in the units of the integer it is added to)."""
    return discrete_gaussian_samples(Fraction(sigma) ** 2, UniformIntegers(generator), 1)[0]


def discrete_gaussian_samples(sigma_squared: Fraction, uniform: UniformIntegers, count: int) -> list[int]:
    """``count`` independent exact draws of N_Z(0, σ²) for a rational σ² > 0 (CKS Algorithm 1)."""
    if not sigma_squared > 0:
        raise ValueError(f"the discrete Gaussian needs σ² > 0, got {sigma_squared}")
    n, d = sigma_squared.numerator, sigma_squared.denominator
    t = math.isqrt(n // d) + 1  # ⌊σ⌋ + 1 (⌊√x⌋ = isqrt(⌊x⌋))
    # acceptance exponent (|Z| − σ²/t)² / 2σ² = (|Z|·d·t − n)² / (2·n·d·t²)
    accept_denominator = 2 * n * d * t * t
    samples: list[int] = []
    while len(samples) < count:
        u = uniform.below(t)
        if not uniform.bernoulli_exp_within_one(u, t):
            continue
        v = 0
        while uniform.bernoulli_exp_within_one(1, 1):
            v += 1
        x = u + t * v
        negative = uniform.bits(1) == 1
        if negative and x == 0:
            continue
        if uniform.bernoulli_exp((x * d * t - n) ** 2, accept_denominator):
            samples.append(-x if negative else x)
    return samples

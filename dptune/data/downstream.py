"""What each encoding precision does to the result trained on its features: the evidence the
precision chooser (:func:`dptune.data.precision_choice.measure_precision`) goes by.

A precision other than torch fp32 changes the features a little; what matters is whether that
changes what is trained on them. ``bench/bench_encoding_precision.py --replicates R`` trains the
DP probe at ε = 1 and ε = 8 (E = 10; C ∈ {0.1, 1}, B ∈ {64, 256}) with R seeds per configuration
on fp32 features and on the candidate's, the same seeds on both (the same coins: a pair differs
only by its features), and sets the mean paired difference of test accuracy, with its 95 % t
interval, beside the runs' own noise: the standard deviation of fp32's test accuracy from seed to
seed. A precision whose intervals lie within ± that deviation at both ε is *inside the noise*:
its effect on the downstream result is smaller than a reseed's, and the chooser may pick it.

Evidence is kept per backbone and per arithmetic, not per CPU model: the fp32 precisions (torch,
OpenVINO) multiply in IEEE fp32 on every x86 CPU, the order of their sums aside; the bf16 ones
round the operands to bf16 and accumulate in fp32, with AMX tiles or AVX-512 BF16 dot products
(OpenVINO's bf16 is left out on a CPU that has neither: ``openvino_runtime.openvino_left_out``).
``measured_on`` names the CPUs of the measurement; ``bench/RESULTS.md`` holds the tables. A
(backbone, precision) with no evidence here falls back to the cosine of its features to fp32's
(``precision_choice.MIN_COSINE``), and the chooser says so.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DownstreamAgreement:
    """One precision's DP probes against fp32's, for one backbone (accuracy in points, %).

    ``intervals_points`` holds, per ε, the 95 % t interval of the mean paired test-accuracy
    difference (candidate − fp32); ``noise_points`` per ε the runs' seed-to-seed standard deviation
    of fp32's test accuracy (pooled over the configurations); ``replicates`` the seeds per
    configuration; ``min_cosine`` the least cosine of a document's features to its fp32 ones in
    the measurement; ``measured_on`` the CPUs it was measured on.
    """

    intervals_points: dict[float, tuple[float, float]]
    noise_points: dict[float, float]
    replicates: int
    min_cosine: float
    measured_on: tuple[str, ...]

    @property
    def inside_noise(self) -> bool:
        """Whether every ε's interval lies within ± that ε's seed-to-seed deviation."""
        return all(
            -self.noise_points[epsilon] <= low and high <= self.noise_points[epsilon]
            for epsilon, (low, high) in self.intervals_points.items()
        )

    @property
    def sane_cosine(self) -> float:
        """The least cosine to fp32 a probe row may show for this evidence to speak for the runtime at
        hand: 1 minus twice the measurement's largest departure from 1, or minus ``MIN_DEPARTURE``
        where that is more. Farther means another runtime than the one measured (a broken install,
        another version)."""
        return 1 - max(2 * (1 - self.min_cosine), MIN_DEPARTURE)

    @property
    def _verdict(self) -> str:
        return f"DP probes {'inside' if self.inside_noise else 'outside'} the runs' noise"

    def summary(self) -> str:
        """A few words for a progress bar: the verdict, the ε and the seeds."""
        epsilons = ", ".join(f"{epsilon:g}" for epsilon in sorted(self.intervals_points))
        return f"{self._verdict} at ε = {epsilons}, {self.replicates} seeds"

    def describe(self) -> str:
        """One line: the intervals against the noise, per ε."""
        cells = ", ".join(
            f"ε = {epsilon:g}: [{low:+.2f}, {high:+.2f}] vs ±{self.noise_points[epsilon]:.2f}"
            for epsilon, (low, high) in sorted(self.intervals_points.items())
        )
        return f"{self._verdict} ({cells} test points, {self.replicates} seeds)"


#: A departure from cosine 1 that a probe row may always show under evidence (``sane_cosine``).
MIN_DEPARTURE = 1e-4

AMX_XEON = "Intel Xeon (family 6, model 207: AMX, AVX-512 BF16), 2 cores"

#: The measured evidence, by (backbone, precision). MiniLM: 2026-12-06 on the AMX Xeon,
#: ``bench_encoding_precision.py --skip-accuracy --replicates 8`` (3,000 training and 1,500
#: validation and test documents of 128 tokens, 4 configurations × 8 seeds per ε; bench/RESULTS.md).
AGREEMENT: dict[tuple[str, str], DownstreamAgreement] = {
    ("minilm", "bf16"): DownstreamAgreement(
        {1.0: (-0.14, -0.07), 8.0: (-0.05, 0.02)}, {1.0: 1.10, 8.0: 0.47}, 8, 0.999899, (AMX_XEON,)
    ),
    ("minilm", "openvino-fp32"): DownstreamAgreement(
        {1.0: (0.0, 0.0), 8.0: (0.0, 0.0)}, {1.0: 1.10, 8.0: 0.47}, 8, 1.0, (AMX_XEON,)
    ),
    ("minilm", "openvino-bf16"): DownstreamAgreement(
        {1.0: (-0.07, -0.01), 8.0: (-0.02, 0.02)}, {1.0: 1.10, 8.0: 0.47}, 8, 0.999962, (AMX_XEON,)
    ),
}


def downstream_agreement(backbone: str) -> dict[str, DownstreamAgreement]:
    """The evidence for ``backbone``, by precision (empty: none measured)."""
    return {precision: found for (name, precision), found in AGREEMENT.items() if name == backbone}

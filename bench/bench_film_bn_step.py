"""Time one DP step of FiLM on EfficientNet-Lite0 (BatchNorm with frozen running statistics)
against the plain non-private step of the same model: FiLM engine and Opacus hooks engine.

The machinery, timing and outputs are those of ``bench/bench_dp_step.py`` (see its docstring:
interleaved rounds, best round, CPU time on the CPU, synchronised wall clock on CUDA, the
FiLM-vs-Opacus gradient agreement column); only the cases differ. FiLM here trains the scale and
shift of the 49 BatchNormAct2d layers (held in evaluation mode: running statistics used, never
updated; ``dptune.models.batch_norm``) and the head: d = 170,116 (42,016 BatchNorm scales and
shifts, a 1280 x 100 head). Random weights (the speed does not depend on them), 100 classes.

Cases. ``--device cpu``: 64 px (the embedded MNIST-5k space's size), B = 64, float32.
``--device cuda``: 224 px, B = 128 and 256, bf16 autocast and float32 (TF32 on).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_film_bn_step.py --device cpu --threads 1 \
        --out build/bench/film_bn_step_cpu
    # GPU machine (Opacus copied to build/device/ as for bench_dp_step.py):
    PYTHONPATH=.:bench:build/device python3 bench/bench_film_bn_step.py --device cuda --out "$OUT/film_bn_step_h200"
"""

from __future__ import annotations

from bench_dp_step import Case, main

BACKBONE = "efficientnet_lite0"


def efficientnet_cases(device: str) -> list[Case]:
    """The cases of ``device`` (module docstring)."""
    if device == "cpu":
        return [Case("EfficientNet-Lite0 FiLM 64px", BACKBONE, 64, "fp32", image_size=64)]
    return [
        Case("EfficientNet-Lite0 FiLM 224px", BACKBONE, batch_size, precision, image_size=224)
        for precision in ("bf16", "fp32")
        for batch_size in (128, 256)
    ]


if __name__ == "__main__":
    raise SystemExit(main(cases=efficientnet_cases))

"""OpenVINO's CPU runtime for a frozen text encoder: one of the ways ``dptune.data.features`` may
encode (``openvino-fp32``, ``openvino-bf16``), chosen only where it measures faster.

OpenVINO is installed by ``make venv`` without ``openvino-telemetry`` and imported here only, with that
package's import blocked (:func:`openvino_text_runner`).
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

#: Per text encoder, its OpenVINO model (converted once) and the compilations of it, by
#: (inference precision, threads, bulk): the measurement's rounds and the encoding reuse them.
_OPENVINO: weakref.WeakKeyDictionary[nn.Module, dict[object, Any]] = weakref.WeakKeyDictionary()
#: The process's one ``openvino.Core``, created on first use and never released (see :func:`_core`).
_CORE: list[Any] = []


def _core() -> Any:
    """The process's one OpenVINO ``Core``, kept for the process's life.

    Each ``Core`` loads its own CPU plugin, and the plugin's constructor installs an alternate signal
    stack of its own on the calling thread (OpenVINO 2026.4), which its destructor unmaps and replaces
    with the one it found. Plugins released out of order (a second ``Core`` outliving the first, as
    compiled models freed by the garbage collector are) leave the thread's signal stack pointing at
    unmapped memory: the next signal the process handles (SIGCHLD of a child, SIGINT, Ray Tune's
    SIGUSR1) kills it with SIGSEGV, or, if the pages were mapped again, writes its frame over
    whatever lives there. One plugin that is never released keeps the stack valid.
    ``tests/test_data.py::test_openvino_encodes_without_telemetry_and_leaves_the_signal_stack_valid``
    checks it."""
    if not _CORE:
        if "openvino_telemetry" not in sys.modules:
            sys.modules["openvino_telemetry"] = None  # type: ignore[assignment]  # None: its import raises ImportError
        import openvino as ov

        _CORE.append(ov.Core())
    return _CORE[0]


def native_bf16() -> bool:
    """Whether OpenVINO's CPU plugin reports bf16 among its ``OPTIMIZATION_CAPABILITIES`` on this CPU
    (AVX-512 BF16, AMX). Elsewhere (an AVX2-only CPU such as a first-generation AMD EPYC) it ignores a
    bf16 inference precision and computes in fp32, so ``openvino-bf16`` would be ``openvino-fp32`` under
    another name. (By OpenVINO's source, an AVX-512 CPU without BF16 computes a bf16 request by
    conversion but reports no BF16: ``openvino-bf16`` is left out there too, to be safe.)"""
    return "BF16" in _core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


def openvino_left_out() -> dict[str, str]:
    """dptune's OpenVINO precisions that this CPU would not compute as named, each with why in a few
    words: ``openvino-bf16`` where :func:`native_bf16` is False. (torch's bf16 is never left out: on a
    CPU without bf16 instructions it is computed by conversion, slower but in bf16: its features change.)"""
    return {} if native_bf16() else {"openvino-bf16": "OpenVINO reports no BF16 on this CPU (it would compute in fp32)"}


def check_inference_precision(compiled: Any, precision: str) -> None:
    """Raise ``RuntimeError`` unless ``compiled`` (a compiled model) computes in ``precision``
    (``"fp32"`` or ``"bf16"``): OpenVINO's CPU plugin replaces a bf16 inference precision the CPU cannot
    compute with its default without a word, and its compiled model's ``INFERENCE_PRECISION_HINT`` says
    what it chose; a label must name what ran."""
    ran = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
    if ran != _HINTS[precision]:
        capabilities = _core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
        raise RuntimeError(
            f"OpenVINO computes in {ran} on this CPU where openvino-{precision} was asked: this CPU cannot "
            f"compute in {precision} (OpenVINO's CPU capabilities: {', '.join(capabilities)})"
        )


#: OpenVINO's inference precision of each of ours.
_HINTS = {"fp32": "f32", "bf16": "bf16"}


#: A padded batch of token ids: (rows of the output it fills, input_ids, attention_mask), both (rows, longest).
TextBatch = tuple[np.ndarray, torch.Tensor, torch.Tensor]
#: Fills the features' rows of every batch, calling its second argument with each batch's row count.
TextRunner = Callable[[Iterator[TextBatch], Callable[[int], object]], None]


def openvino_text_runner(extractor: nn.Module, precision: str, features: np.ndarray, bulk: bool) -> TextRunner:
    """Runs ``extractor`` (a text encoder of ``(input_ids, attention_mask)``, any batch and length) on
    OpenVINO's CPU runtime at ``precision`` (``"fp32"`` or ``"bf16"`` inference precision) with
    torch's thread count, writing each batch's features into ``features``; ``RuntimeError`` where
    OpenVINO would compute in another precision (:func:`check_inference_precision`).

    The model is traced by OpenVINO's PyTorch frontend once per extractor. ``bulk`` compiles it for
    throughput (several inference streams, their requests kept busy by an ``AsyncInferQueue``): on 2
    cores, 2 streams of one thread encoded 8–11 % more documents per second than one request on 2
    threads. Several streams need several batches, so the measurement's one or two batches run one
    request at a time on every thread (``bulk=False``, ``"LATENCY"``): the measurement understates the
    bulk encoding's speed, never overstates it.
    Threads are not pinned, so nothing changes the process's CPU affinity. OpenVINO's usage
    telemetry is kept out: where the ``openvino_telemetry`` package is installed and not yet imported,
    its import is blocked first (with it, ``import openvino`` sends usage events and writes a client id
    under the home folder; without it OpenVINO uses its own no-op stub). ``make venv`` does not
    install it.
    """
    _core()  # blocks the telemetry import first
    import openvino as ov
    from openvino.frontend import FrontEndManager
    from openvino.frontend.pytorch.ts_decoder import TorchScriptPythonDecoder
    from transformers.utils import logging as transformers_logging

    compiled = _OPENVINO.setdefault(extractor, {})
    if "model" not in compiled:
        example = torch.ones(2, 8, dtype=torch.long)
        verbosity = transformers_logging.get_verbosity()
        transformers_logging.set_verbosity_error()  # tracing reads config fields it warns about
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the tracer's warnings on Python branches of shapes
                decoder = TorchScriptPythonDecoder(extractor.cpu().eval(), example_input=(example, example))
        finally:
            transformers_logging.set_verbosity(verbosity)
        frontend = FrontEndManager().load_by_framework("pytorch")
        compiled["model"] = frontend.convert(frontend.load(decoder))
    key = (precision, torch.get_num_threads(), bulk)
    if key not in compiled:
        model = _core().compile_model(
            compiled["model"],
            "CPU",
            {
                "INFERENCE_PRECISION_HINT": _HINTS[precision],
                "PERFORMANCE_HINT": "THROUGHPUT" if bulk else "LATENCY",
                "INFERENCE_NUM_THREADS": key[1],
                "ENABLE_CPU_PINNING": False,
            },
        )
        check_inference_precision(model, precision)
        compiled[key] = model
    model = compiled[key]

    def run(batches: Iterator[TextBatch], done: Callable[[int], object]) -> None:
        queue = ov.AsyncInferQueue(model, model.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS"))

        def fill(request: Any, rows: np.ndarray) -> None:  # on an OpenVINO thread, one per finished batch
            features[rows] = request.get_output_tensor(0).data
            done(len(rows))

        queue.set_callback(fill)
        for rows, input_ids, attention_mask in batches:
            queue.start_async({0: input_ids.numpy(), 1: attention_mask.numpy()}, rows)
        queue.wait_all()

    return run

"""`convert --target cuda`: the fused graph with fp16 activations and an fp16 KV cache, as ONNX
Runtime's CUDA kernels for MatMulNBits, GroupQueryAttention and SkipSimplifiedLayerNormalization
want them. The graph is built as for the CPU, then converted by ONNX Runtime's own float16 pass
(`onnxruntime.transformers.float16.convert_float_to_float16`): every float tensor and initializer
becomes float16 (MatMulNBits' scales too; its packed weights are not floats), except:

- the logits, kept float32 (the sampler's input);
- the attention mask (`/model/attn_mask` nodes), computed in float32 and cast at its consumers.
  RoPE's cos/sin table is a graph input (interface version 2) of the KV's float16: the runtime
  computes the angles in float32 (a position times a frequency in float16 loses whole radians past
  position ~2,000; the version 1 graph did, despite keeping its RoPE nodes float32, because the
  float16 pass put casts between them) and stores only their cosines and sines, which float16 holds.

The KV inputs and outputs are float16 (`interface.kv_dtype`), half the ring's memory. ONNX
Runtime's CPU EP runs this graph too (slowly), which is how its numbers are checked without a GPU.

float16's largest finite value is 65504: an activation past it is infinity, and the logits NaN on
every prompt. `check_range` refuses a model whose activations on the calibration text
(`calibration.Calibration.peak`) reach it, and notes one within a factor `MARGIN` of it (other text,
and float16's own rounding on the way, may go further than the calibration rows did).
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx
from onnx.external_data_helper import load_external_data_for_model

KEEP_FP32_NODES = ("/model/attn_mask",)
FP16_MAX = 65504.0
MARGIN = 2.0  # SmolLM2-135M's residual stream reaches 22,550 on the text (a third of the range) and runs


def check_range(peak, log) -> None:
    """ConvertError when `peak` (a `calibration.Peak`) reaches FP16_MAX; a note past FP16_MAX / MARGIN."""
    from edgeinfer.errors import ConvertError

    if peak.abs_value >= FP16_MAX:
        raise ConvertError(f"--target cuda computes in float16, whose largest value is {FP16_MAX:g}: on the shipped "
                           f"calibration text this model's activations reach {peak.abs_value:.4g} ({peak.where}), "
                           "which float16 holds as infinity, so every prompt would give NaN logits; convert for "
                           "--target cpu (float32 activations) instead")
    if peak.abs_value >= FP16_MAX / MARGIN:
        log(f"note: on the shipped calibration text this model's activations reach {peak.abs_value:.4g} "
            f"({peak.where}), within {MARGIN:g}x of float16's largest value ({FP16_MAX:g}): other text may "
            "overflow --target cuda's float16 and give NaN logits; --target cpu computes in float32")


def to_fp16(model: onnx.ModelProto, folder: Path, data_file: str) -> onnx.ModelProto:
    """`model` (its weights in `folder/data_file`) converted as the module doc says; the weights file
    is rewritten in float16 (the old one removed first)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    load_external_data_for_model(model, str(folder))
    os.remove(Path(folder) / data_file)
    blocked = [n.name for n in model.graph.node if n.name.startswith(KEEP_FP32_NODES)]
    return convert_float_to_float16(model, keep_io_types=["logits"], disable_shape_infer=False,
                                    node_block_list=blocked)


def save(model: onnx.ModelProto, path: Path, data_file: str) -> None:
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data_file, size_threshold=1024)

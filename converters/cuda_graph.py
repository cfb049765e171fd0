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
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx
from onnx.external_data_helper import load_external_data_for_model

KEEP_FP32_NODES = ("/model/attn_mask",)


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

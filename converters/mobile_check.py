"""ONNX Runtime's own judge of a graph for the mobile execution providers
(`onnxruntime.tools.mobile_helpers.usability_checker`, what `python -m
onnxruntime.tools.check_onnx_model_mobile_usability` runs), as data instead of log lines.

`mobile_usability(path)` optimizes the graph to ONNX Runtime's basic level first, as the checker
(and ORT Mobile's ORT-format conversion) does, then returns per EP the partitions, the supported
and total node counts and the checker's verdict ("YES": "should perform well ... as is").
"""

from __future__ import annotations

import pathlib
import tempfile

from onnxruntime.tools.mobile_helpers import usability_checker as uc
from edgeinfer.errors import ConvertError
from onnxruntime.tools.onnx_model_utils import optimize_model

EPS = {"NNAPI": lambda m: uc.check_nnapi_partitions(m, True),
       "CoreML MLProgram": lambda m: uc.check_coreml_partitions(m, True, "coreml_supported_mlprogram_ops.md")}


def mobile_usability(path: str | pathlib.Path) -> dict:
    """{ep: {"partitions", "supported_nodes", "nodes", "verdict"}} for the graph at `path`; ConvertError
    for a graph the checker cannot judge."""
    path = pathlib.Path(path)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        optimized = pathlib.Path(tmp) / path.name
        optimize_model(path, optimized, use_external_initializers=True)
        try:
            model = uc.ModelProtoWithShapeInfo(optimized).model_with_shape_info
            infos = {ep: check(model) for ep, check in EPS.items()}
        except ValueError as e:  # its shape inference stops at contrib ops: a fused (--target cpu) graph
            raise ConvertError(f"{path}: ONNX Runtime's mobile checker cannot judge this graph (it judges the "
                               f"portable graphs, --target coreml|nnapi): {str(e).splitlines()[0][:200]}") from None
        for ep, info in infos.items():
            out[ep] = {"partitions": info.num_partitions, "supported_nodes": info.num_supported_nodes,
                       "nodes": info.num_nodes, "verdict": info.suitability().name}
    return out

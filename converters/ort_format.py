"""`convert --ort-format`: the portable graphs also as ORT-format files, the format ONNX Runtime
Mobile (the Android and iOS packages) prefers, saved by ONNX Runtime itself as its
`convert_onnx_models_to_ort` tool does (fixed optimization style), with one difference below.

The level is "basic" (ONNX Runtime's advice for models that NNAPI or CoreML run): higher levels
fuse nodes into CPU-only contrib ops, which would take them off the mobile EPs. Constant folding is
off: it turned each fp16 weight and its Cast into an fp32 weight, so the coreml folder's .ort files
held fp32 weights (twice the size of the fp16 .onnx set; past about 0.5B parameters over the format's
2 GiB, a failed conversion), and it folds nothing else in these graphs (their shapes are static).
Each .ort file holds its weights inline, so the two graphs' weights are on disk twice (the .onnx
files share model.onnx.data); an app ships either the .onnx set or the .ort set.
"""

from __future__ import annotations

from pathlib import Path

from edgeinfer.errors import ConvertError

DISABLED_OPTIMIZERS = ["ConstantFolding"]


def write_ort_format(folder: Path, graphs: list[str]) -> list[str]:
    """Save each of `graphs` (file names in `folder`) as `<stem>.ort` beside it; the new names."""
    import onnxruntime as ort

    out = []
    for name in graphs:
        target = Path(folder) / f"{Path(name).stem}.ort"
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        so.optimized_model_filepath = str(target)
        so.add_session_config_entry("session.save_model_format", "ORT")
        try:
            ort.InferenceSession(str(Path(folder) / name), so, providers=["CPUExecutionProvider"],
                                 disabled_optimizers=DISABLED_OPTIMIZERS)
        except OSError:
            raise  # convert() words these (a full disk, a read-only folder)
        except Exception as e:  # ONNX Runtime's own Fail, e.g. when it cannot write the file
            raise ConvertError(f"ONNX Runtime could not write {target.name}: {str(e).splitlines()[0][:200]}") from None
        if not target.is_file():
            raise ConvertError(f"ONNX Runtime did not write {target.name}")
        out.append(target.name)
    return out

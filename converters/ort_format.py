"""`convert --ort-format`: the portable graphs also as ORT-format files, the format ONNX Runtime
Mobile (the Android and iOS packages) prefers, written by ONNX Runtime's own converter
(`onnxruntime.tools.convert_onnx_models_to_ort`, fixed optimization style).

The level is "basic" (ONNX Runtime's advice for models that NNAPI or CoreML run): higher levels
fuse nodes into CPU-only contrib ops, which would take them off the mobile EPs. Each .ort file
holds its weights inline, so the two graphs' weights are on disk twice (the .onnx files share
model.onnx.data); an app ships either the .onnx set or the .ort set.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from pathlib import Path

from edgeinfer.errors import ConvertError


def write_ort_format(folder: Path, graphs: list[str]) -> list[str]:
    """Convert each of `graphs` (file names in `folder`) to `<stem>.ort` beside it; the new names."""
    from onnxruntime.tools.convert_onnx_models_to_ort import OptimizationStyle, convert_onnx_models_to_ort

    logging.getLogger("ort_format_model.utils").setLevel(logging.WARNING)  # its "created config" lines
    out, old = [], os.environ.get("ORT_CONVERT_ONNX_MODELS_TO_ORT_OPTIMIZATION_LEVEL")
    os.environ["ORT_CONVERT_ONNX_MODELS_TO_ORT_OPTIMIZATION_LEVEL"] = "basic"
    try:
        for name in graphs:
            stem = Path(name).stem
            with contextlib.redirect_stdout(io.StringIO()) as log:
                try:
                    convert_onnx_models_to_ort(Path(folder) / name, output_dir=Path(folder),
                                               optimization_styles=[OptimizationStyle.Fixed])
                except OSError:
                    raise  # convert() words these (a full disk, a read-only folder)
                except Exception as e:  # ONNX Runtime's own Fail, e.g. when it cannot write the file
                    raise ConvertError(f"ONNX Runtime could not write {stem}.ort (is the disk full?): "
                                       f"{str(e).splitlines()[0][:200]}") from None
            made, target = Path(folder) / f"{stem}.basic.ort", Path(folder) / f"{stem}.ort"
            if not made.is_file():
                raise ConvertError(f"ONNX Runtime could not write {name} in ORT format: {log.getvalue()[-300:]}")
            os.replace(made, target)
            for extra in Path(folder).glob(f"{stem}.required_operators*.config"):
                extra.unlink()  # a reduced-build helper, not part of the model
            out.append(target.name)
    finally:
        if old is None:
            os.environ.pop("ORT_CONVERT_ONNX_MODELS_TO_ORT_OPTIMIZATION_LEVEL", None)
        else:
            os.environ["ORT_CONVERT_ONNX_MODELS_TO_ORT_OPTIMIZATION_LEVEL"] = old
    return out

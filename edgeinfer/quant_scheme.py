"""`QuantScheme`: how the converter stored the weights; the manifest's `quantization` section.

Here, in the runtime package, so that reading a manifest (`load`, `inspect`) needs no converter:
`converters/quantize.py`, which wraps ONNX Runtime's quantization kernels, re-exports it.
"""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, fields

from edgeinfer.fields import FieldError, json_fields
from edgeinfer.errors import ConvertError

QUANTS = ("fp32", "fp16", "int8", "int4")
BLOCK_SIZES = (16, 32, 64, 128, 256)
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
RECIPES = ("rtn", "mse", "asym", "q4_1", "gptq")  # int4 rounding (converters/quantize.py says what each does)


@dataclass(frozen=True)
class QuantScheme:
    """How the converter stores weights; written to the manifest's `quantization` section."""

    weights: str = "fp32"  # one of QUANTS: transformer-block linear layers
    block_size: int = 32  # int4/int8 only
    symmetric: bool = True  # int4/int8: no zero points when True
    accuracy_level: int = 0  # MatMulNBits: 0 = fp32 math, 4 = int8 activations (faster on CPU)
    embedding: str = "fp32"  # fp32 | fp16 | int8 | int4: the token embedding (and tied lm_head)
    lm_head: str = "fp32"  # same choices; equals `embedding` when tied (one shared matrix)
    int8_tensors: tuple[str, ...] = ()  # with weights=int4: projections kept at int8 (mixed precision)
    recipe: str = "rtn"  # how int4 blocks are rounded (RECIPES; converters/quantize.py)
    scale_dtype: str = "float32"  # int4/int8 block scales as stored: float32, or float16 (cast at load)

    def kind_for(self, projection: str) -> str:
        """Storage of one projection ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")."""
        if self.weights == "int4" and projection in self.int8_tensors:
            return "int8"
        return self.weights

    def __post_init__(self) -> None:
        for name in ("block_size", "accuracy_level"):  # numpy's integers as ints (they failed at the manifest's
            v = getattr(self, name)  # write, after the work; a review)
            if isinstance(v, numbers.Integral) and not isinstance(v, bool) and type(v) is not int:
                object.__setattr__(self, name, int(v))
        bad = _problem(self.__dict__)
        if bad:
            raise ConvertError(bad[1])

    def to_json(self) -> dict:
        d = asdict(self)
        d["int8_tensors"] = list(self.int8_tensors)
        for key, default in (("recipe", "rtn"), ("scale_dtype", "float32")):
            if d[key] == default:  # as manifests before these fields wrote it (absent): unchanged bytes
                del d[key]
        return d

    @classmethod
    def from_json(cls, d: dict, where: str = "quantization") -> "QuantScheme":
        """Checked: a bad field raises FieldError naming it."""
        kw = json_fields(cls, d, where)
        bad = _problem({**{f.name: f.default for f in fields(cls)}, **kw})
        if bad:
            raise FieldError(f"{where}.{bad[0]}", bad[1])
        return cls(**kw)


def _problem(v: dict) -> tuple[str, str] | None:
    """(field, what is wrong) for the first bad field of a scheme's values, or None."""
    for name in ("weights", "embedding", "lm_head"):
        if v[name] not in QUANTS:
            return name, f"unknown quantization {v[name]!r} (choose from {', '.join(QUANTS)})"
    if type(v["block_size"]) is not int or v["block_size"] not in BLOCK_SIZES:  # (32.0 was taken, to fail in onnx)
        return "block_size", f"block size {v['block_size']!r:.40} not supported (choose from {BLOCK_SIZES})"
    unknown = set(v["int8_tensors"]) - set(PROJECTIONS)
    if unknown:
        return "int8_tensors", (f"unknown projection(s) {', '.join(sorted(unknown))} "
                                f"(choose from {', '.join(PROJECTIONS)})")
    if v["scale_dtype"] not in ("float32", "float16"):
        return "scale_dtype", f"unknown scale dtype {v['scale_dtype']!r} (float32 or float16)"
    if v["recipe"] not in RECIPES:
        return "recipe", f"unknown recipe {v['recipe']!r} (choose from {', '.join(RECIPES)})"
    if v["recipe"] != "rtn" and v["weights"] != "int4":
        return "recipe", f"recipe {v['recipe']} rounds int4 blocks: weights {v['weights']} take rtn"
    if v["weights"] == "int4" and (v["recipe"], v["symmetric"]) in (("asym", True), ("gptq", True), ("mse", False)):
        # the converter rounds by the storage (quantize_blockwise): the label would not be what was done
        asym = v["recipe"] in ("asym", "gptq")
        return "symmetric", (f"recipe {v['recipe']} stores {'asymmetric' if asym else 'symmetric'} "
                             f"blocks: symmetric must be {not asym}")
    if type(v["accuracy_level"]) is not int or v["accuracy_level"] not in (0, 1, 2, 3, 4):  # (4.0 was taken)
        return "accuracy_level", f"accuracy_level must be an integer 0..4, got {v['accuracy_level']!r:.40}"
    return None

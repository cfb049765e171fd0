"""A thin ONNX Runtime session over a model folder's decoder graph (interface version 1).

`DecoderSession.forward` runs one call of the graph: new tokens in, logits for the requested
positions and the new K/V rows out. It owns no cache; the caller (the ring-buffer KV cache of
the runtime, or `evaluate` with an empty past) decides what `past` holds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from edgeinfer.errors import InvalidArgumentError, ModelFormatError
from edgeinfer.integrity import verify
from edgeinfer.manifest import MODEL_FILE, Manifest, io_names, read_manifest

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def resolve_provider(provider: str) -> str:
    """"auto" -> "cuda" when this onnxruntime build has the CUDA provider, else "cpu"; "cpu" and
    "cuda" as given. An unknown or unavailable provider raises InvalidArgumentError."""
    if provider == "auto":
        return "cuda" if PROVIDERS["cuda"] in ort.get_available_providers() else "cpu"
    if not isinstance(provider, str) or provider not in PROVIDERS:
        raise InvalidArgumentError(f"unknown provider {provider!r} (choose from auto, {', '.join(PROVIDERS)})")
    if PROVIDERS[provider] not in ort.get_available_providers():
        raise InvalidArgumentError(f"provider {provider!r} is not available in this onnxruntime build")
    return provider


def check_threads(threads: int | None) -> None:
    """threads is None (onnxruntime's default: one per physical core) or a positive int; anything
    else (0, -1, a bool, a float, a string) raises InvalidArgumentError."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise InvalidArgumentError(f"threads must be a positive integer or None (the default), got {threads!r}")


def session_options(threads: int | None) -> ort.SessionOptions:
    """Options for one decoder session: full graph optimization, `threads` intra-op threads (None:
    onnxruntime's default; else a positive int, see `check_threads`), one inter-op thread."""
    check_threads(threads)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads is not None:
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return so


class DecoderSession:
    def __init__(self, folder: Path | str, *, threads: int | None = None, provider: str = "auto",
                 manifest: Manifest | None = None):
        self.folder = Path(folder)
        self.manifest = manifest or read_manifest(self.folder)
        verify(self.folder, self.manifest.files)  # every loader (Model, eval) runs checked weights
        spec = self.manifest.arch
        self.names = io_names(spec.num_layers)
        self.provider = resolve_provider(provider)
        try:
            self.session = ort.InferenceSession(str(self.folder / MODEL_FILE), session_options(threads),
                                                providers=[PROVIDERS[self.provider]])
        except Exception as e:  # onnxruntime raises its own exception types for bad files
            raise ModelFormatError(f"cannot load {self.folder / MODEL_FILE}: {str(e).splitlines()[0][:300]}") from None
        self.kv_shape = (spec.num_kv_heads, spec.head_dim)
        self._output_names = [o.name for o in self.session.get_outputs()]

    def empty_past(self) -> list[tuple[np.ndarray, np.ndarray]]:
        z = np.zeros((1, 0, *self.kv_shape), np.float32)
        return [(z, z)] * self.manifest.arch.num_layers

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, past: list[tuple[np.ndarray, np.ndarray]],
                logits_index: np.ndarray) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
        """input_ids, position_ids [1, S] int64; past[i] = (K, V) [1, T, Hkv, Dh]; logits_index [N] int64.

        Returns logits [1, N, V] and, per layer, the new (K, V) rows [1, S, Hkv, Dh]. Mutates nothing.
        """
        feeds = {"input_ids": input_ids, "position_ids": position_ids, "logits_index": logits_index}
        shared = self.manifest.interface.get("kv_io") == "shared_buffer"
        s = input_ids.shape[1]
        for i, (k, v) in enumerate(past):
            if shared:  # the BNSH past of exactly T rows; GQA returns past + new as present
                k, v = np.ascontiguousarray(k.transpose(0, 2, 1, 3)), np.ascontiguousarray(v.transpose(0, 2, 1, 3))
            feeds[self.names.past_key(i)] = k
            feeds[self.names.past_value(i)] = v
        if shared:
            t = past[0][0].shape[1] if past else 0
            feeds["seqlens_k"] = np.array([t + s - 1], np.int32)
            feeds["total_sequence_length"] = np.array(t + s, np.int32)
        outs = self.session.run(self._output_names, feeds)
        new = [(outs[1 + 2 * i], outs[2 + 2 * i]) for i in range(len(past))]
        if shared:  # back to this method's contract: the S new rows, BSNH
            new = [(k[:, :, -s:].transpose(0, 2, 1, 3), v[:, :, -s:].transpose(0, 2, 1, 3)) for k, v in new]
        return outs[0], new

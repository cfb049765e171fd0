"""The `edgeinfer.json` manifest: what `convert` writes and `load` reads.

Versioned: `FORMAT_VERSION` changes when a reader of the old version would misread the folder.
A manifest from a newer version is refused with a clear error rather than half understood.

Checked: the manifest carries the sha256 of its own fields (`manifest_sha256`), as it carries each
file's: a changed field is refused at read, after the typed checks (older folders carry none).

Typed: each section is a frozen dataclass with `to_json`/`from_json`, checked once, by
`read_manifest` (a bad field raises ModelFormatError naming it, e.g. "bad field
tokenizer.add_bos: expected bool, got 'yes'"): `architecture` is an ArchSpec (arch.py),
`quantization` a QuantScheme (quant_scheme.py), `interface` an Interface (interface.py; its KV mode a
`kv_mode.KVMode`), `tokenizer` a TokenizerInfo. Nothing else reads these sections by key.

Format version 1 stays readable as it was written:
- The interface names its KV mode by `kv_mode` (a `KVMode` name, as `convert --attention` takes).
  Folders converted before it carry the older `kv_io` and `kv_layout` keys instead;
  `kv_mode.from_interface` maps them, so those folders load as they are (their graphs are the
  same). An edgeinfer from before the rename, reading a new folder, finds no `kv_io` and binds the
  standard-op way: right for a standard folder; for a GroupQueryAttention folder ONNX Runtime
  refuses the first graph call (the KV inputs have the wrong dims), so nothing is misread.
- A tokenizer section lacking a field reads it as older readers did (kind sentencepiece, no BOS,
  no EOS ids, no chat template).
- Renaming or adding a field in a way this reader maps, as above, keeps version 1; a change an
  older reader would misread silently raises FORMAT_VERSION.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from edgeinfer import small_files
from edgeinfer.arch import ArchSpec
from edgeinfer.fields import FieldError, json_fields
from edgeinfer.errors import ModelFormatError
from edgeinfer.interface import Interface
from edgeinfer.ngram_table import NgramInfo
from edgeinfer.portable import PortableInfo
from edgeinfer.quant_scheme import QuantScheme

FORMAT_VERSION = 1
TOKENIZER_KINDS = ("sentencepiece", "hf_tokenizers")
MANIFEST_FILE = "edgeinfer.json"
CHECKSUM_KEY = "manifest_sha256"  # the manifest's own checksum (`manifest_checksum`), beside its fields
MODEL_FILE = "model.onnx"


@dataclass(frozen=True)
class TokenizerInfo:
    """The manifest's `tokenizer` section: which back end reads the folder's tokenizer files, whether
    `encode` prepends BOS, the special ids, and the model's chat template (Jinja) if it has one."""

    kind: str = "sentencepiece"  # one of TOKENIZER_KINDS: tokenizer.model or tokenizer.json
    add_bos: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None

    def to_json(self) -> dict:
        return {"kind": self.kind, "add_bos": self.add_bos, "bos_token_id": self.bos_token_id,
                "eos_token_ids": list(self.eos_token_ids), "chat_template": self.chat_template}

    @classmethod
    def from_json(cls, d: dict, where: str = "tokenizer") -> "TokenizerInfo":
        info = cls(**json_fields(cls, d, where))
        if info.kind not in TOKENIZER_KINDS:
            raise FieldError(f"{where}.kind", f"unknown {info.kind!r} (choose from {', '.join(TOKENIZER_KINDS)})")
        return info


SOURCE_FORMATS = ("huggingface", "gguf", "optimum")


@dataclass(frozen=True)
class Origin:
    """The manifest's `origin` section: where the weights came from and what became of them.

    format        "huggingface" (a safetensors folder), "gguf" (llama.cpp's file) or "optimum"
                  (Hugging Face Optimum's ONNX export)
    file          the source's name
    tensor_types  GGUF: how many tensors of each type the file holds ({"Q4_1": 210, "F32": 61})
    quant         GGUF: the conversion's --quant ("keep", or the width everything was re-quantized to)
    kept_exact    GGUF types taken over without re-quantization
    requantized   with keep, tensors whose type we could not keep and what they became
                  ("model.layers.0.mlp.down_proj.weight: Q6_K -> int8")
    """

    format: str = "huggingface"
    file: str = ""
    tensor_types: dict = field(default_factory=dict)
    quant: str = ""
    kept_exact: tuple[str, ...] = ()
    requantized: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"format": self.format, "file": self.file, "tensor_types": dict(self.tensor_types),
                "quant": self.quant, "kept_exact": list(self.kept_exact), "requantized": list(self.requantized)}

    @classmethod
    def from_json(cls, d: dict, where: str = "origin") -> "Origin":
        o = cls(**json_fields(cls, d, where))
        if o.format not in SOURCE_FORMATS:
            raise FieldError(f"{where}.format", f"unknown {o.format!r} (one of {', '.join(SOURCE_FORMATS)})")
        for name, n in o.tensor_types.items():
            if type(n) is not int or n < 0:  # a count (NaN here was printed as invalid JSON by inspect --json)
                raise FieldError(f"{where}.tensor_types.{name}", f"expected a count, got {n!r:.40}")
        return o


@dataclass(frozen=True)
class Manifest:
    arch: ArchSpec
    quantization: QuantScheme
    target: str
    flavour: str
    interface: Interface
    tokenizer: TokenizerInfo
    default_capacity_tokens: int
    files: dict = field(default_factory=dict)  # outputs: name -> {"bytes", "sha256"} (checked by integrity.py)
    source: dict = field(default_factory=dict)  # inputs: name -> sha256
    converter_version: str = ""
    format_version: int = FORMAT_VERSION
    portable: PortableInfo | None = None  # the portable flavour's geometry and files
    origin: Origin | None = None  # where the weights came from (folders converted before it have none)
    ngrams: NgramInfo | None = None  # the model's n-gram table for speculative drafts (`convert --ngram-tokens`)
    checksum: str = field(default="", compare=False)  # its own sha256 as read ("" when it has none, or not read)

    @property
    def named_files(self) -> tuple[str, ...]:
        """The files this manifest itself names (the graph; a portable folder's prefill graph and
        embedding table): each must be among `files`, or it would be read unchecked."""
        p = self.portable
        return (MODEL_FILE,) + ((p.prefill_file, p.embeddings_file) if p is not None else ()) + \
            ((self.ngrams.file,) if self.ngrams is not None else ())

    def to_json(self) -> dict:
        return {**({"portable": self.portable.to_json()} if self.portable is not None else {}),
            **({"origin": self.origin.to_json()} if self.origin is not None else {}),
            **({"ngrams": self.ngrams.to_json()} if self.ngrams is not None else {}),
            "format_version": self.format_version,
            "converter_version": self.converter_version,
            "target": self.target,
            "flavour": self.flavour,
            "architecture": self.arch.to_json(),
            "quantization": self.quantization.to_json(),
            "interface": self.interface.to_json(),
            "tokenizer": self.tokenizer.to_json(),
            "default_capacity_tokens": self.default_capacity_tokens,
            "files": self.files,
            "source": self.source,
        }

    @classmethod
    def from_json(cls, d: dict) -> "Manifest":
        """Every section checked; FieldError names the first bad field. Unknown top-level keys are ignored."""
        def section(key: str):
            if key not in d:
                raise FieldError(key, "missing")
            return d[key]

        arch = ArchSpec.from_json(section("architecture"))
        top = {}
        for key, kind in (("target", str), ("flavour", str), ("default_capacity_tokens", int),
                          ("converter_version", str), ("format_version", int), (CHECKSUM_KEY, str)):
            v = d.get(key, "") if key in ("converter_version", CHECKSUM_KEY) else section(key)
            if not isinstance(v, kind) or isinstance(v, bool):
                raise FieldError(key, f"expected {kind.__name__}, got {v!r}")
            top[key] = v
        if top["default_capacity_tokens"] < 2:
            raise FieldError("default_capacity_tokens", f"must be at least 2, got {top['default_capacity_tokens']}")
        flavours = {"cpu": "fused", "cuda": "fused", "coreml": "portable", "nnapi": "portable"}
        if top["target"] not in flavours:
            raise FieldError("target", f"unknown {top['target']!r} (one of {', '.join(flavours)})")
        if top["flavour"] != flavours[top["target"]]:
            raise FieldError("flavour", f"{top['flavour']!r} does not go with target {top['target']!r} "
                             f"({flavours[top['target']]})")
        portable = PortableInfo.from_json(section("portable")) if top["flavour"] == "portable" else None
        tokenizer = TokenizerInfo.from_json(section("tokenizer"))
        bos = tokenizer.bos_token_id  # fed to the graph: out of range it wrapped round or crashed the Gather
        if bos is not None and not 0 <= bos < arch.vocab_size:
            raise FieldError("tokenizer.bos_token_id", f"{bos} is outside the vocabulary [0, {arch.vocab_size})")
        return cls(arch=arch, quantization=QuantScheme.from_json(section("quantization")),
                   interface=Interface.from_json(section("interface"), arch, portable=portable), portable=portable,
                   tokenizer=tokenizer,
                   origin=Origin.from_json(d["origin"]) if "origin" in d else None,
                   ngrams=NgramInfo.from_json(d["ngrams"]) if "ngrams" in d else None,
                   files=_files(d), source=d.get("source", {}), checksum=top.pop(CHECKSUM_KEY), **top)

    def write(self, folder: Path) -> None:
        d = self.to_json()
        d[CHECKSUM_KEY] = manifest_checksum(d)
        (Path(folder) / MANIFEST_FILE).write_text(json.dumps(d, indent=1) + "\n")


def manifest_checksum(d: dict) -> str:
    """sha256 of a manifest's fields (all but its checksum), as canonical JSON: sorted keys, no spaces, ASCII."""
    fields_only = {k: v for k, v in d.items() if k != CHECKSUM_KEY}
    return hashlib.sha256(json.dumps(fields_only, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _check_checksum(d: dict, path: Path) -> None:  # after `Manifest.from_json`: the field is a str
    """A manifest that carries a checksum must match it: the files' hashes cover the graph, weights and
    tokenizer, this covers the manifest (a flipped bit in rope_theta moved perplexity 6.08 -> 7.13, with
    every file "ok"). Folders converted before it carry none and are read as before."""
    if CHECKSUM_KEY not in d:
        return
    if d[CHECKSUM_KEY] != manifest_checksum(d):
        raise ModelFormatError(f"{path} was changed after conversion: its fields do not match its {CHECKSUM_KEY} (a "
                               f"corrupted file; or an edit by hand, which is kept by deleting that field); "
                               f"convert again")


def _files(d: dict) -> dict:
    """The "files" section: {} when absent (a folder made by hand: every converter of ours writes
    it; nothing to check);
    present, it must list files, so that an edit to it cannot switch the integrity check off."""
    if "files" not in d:
        return {}
    if not isinstance(d["files"], dict) or not d["files"]:
        raise FieldError("files", f"expected an object listing the folder's files, got {d['files']!r:.40}")
    return d["files"]


MAX_MANIFEST_BYTES = 16 * 1024 * 1024  # a manifest with a long chat template is tens of KB


def read_manifest(folder: Path) -> Manifest:
    folder = Path(folder)
    try:
        return _read_manifest(folder)
    except OSError as e:  # a path the system refuses (too long, a folder we may not enter)
        raise ModelFormatError(f"cannot read {folder}: {e.strerror or e}") from None


def _not_a_folder(folder: Path) -> str:
    """Why `folder`, which is no folder and no regular file, cannot be read as a model folder."""
    if not os.path.lexists(folder):
        return f"model folder not found: {folder}"
    if folder.is_symlink() and not os.path.exists(folder):
        return f"{folder} is a symbolic link that leads nowhere (a missing target or a loop)"
    mode = folder.stat().st_mode
    kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a folder")
    return f"{folder} is {kind}, not an edgeinfer model folder"


def _read_manifest(folder: Path) -> Manifest:
    if folder.is_file():
        try:
            with open(folder, "rb") as f:
                gguf = f.read(4) == b"GGUF"
        except OSError:
            gguf = False
        raise ModelFormatError(f"{folder} is {'a GGUF file' if gguf else 'a file'}, not an edgeinfer model folder"
                               + (f": convert it first (edgeinfer convert {folder} -o FOLDER)" if gguf else ""))
    if not folder.is_dir():
        raise ModelFormatError(_not_a_folder(folder))
    path = folder / MANIFEST_FILE
    if not path.exists() and path.is_symlink():  # (a loop was reported as no edgeinfer.json)
        raise ModelFormatError(f"{path} is a symbolic link that leads nowhere (a missing target or a loop)")
    if not path.exists():
        raise ModelFormatError(f"{folder} is not an edgeinfer model folder (no {MANIFEST_FILE}); "
                               "convert a Hugging Face folder with `edgeinfer convert`")
    if not path.is_file():  # a folder, or a FIFO that would block the read for ever
        raise ModelFormatError(f"{path} is not a file")
    raw = small_files.read_bytes(path, MAX_MANIFEST_BYTES, ModelFormatError)  # bounded: a link to /dev/zero
    try:  # JSON nested past the recursion limit is corrupted too
        d = small_files.parse_json(raw, path, ModelFormatError)
    except ModelFormatError:
        raise ModelFormatError(f"{path} is corrupted (not a valid manifest)") from None
    version = d.get("format_version") if isinstance(d, dict) else None
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ModelFormatError(f"{path} is corrupted (not a valid manifest: format_version {version!r:.40} is not "
                               f"a positive integer)")
    if version > FORMAT_VERSION:
        raise ModelFormatError(f"{path} has format version {version}; this edgeinfer reads up to "
                               f"{FORMAT_VERSION}: upgrade edgeinfer")
    try:
        m = Manifest.from_json(d)
    except FieldError as e:
        raise ModelFormatError(f"{path} is corrupted (bad field {e})") from None
    _check_checksum(d, path)
    if not (folder / MODEL_FILE).exists():
        if (folder / MODEL_FILE).is_symlink():
            raise ModelFormatError(f"{folder / MODEL_FILE} is a symbolic link that leads nowhere (a missing target "
                                   "or a loop)")
        raise ModelFormatError(f"{folder} lacks {MODEL_FILE}")
    return m

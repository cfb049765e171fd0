"""A thin ONNX Runtime session over a model folder's decoder graph.

`DecoderSession` opens the graph (checked against the manifest's sha256 first) and owns nothing
else: every run of the graph goes through `engine.Engine.forward`, for generation, evaluation and
the tests alike.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import onnxruntime as ort

from edgeinfer.errors import EdgeInferError, InvalidArgumentError, ModelFormatError, warn_user
from edgeinfer.integrity import folder_identity, replaced_while_loading, verify
from edgeinfer.interface import io_names
from edgeinfer.manifest import MODEL_FILE, Manifest, read_manifest
from edgeinfer.ort_lifecycle import new_session
from edgeinfer.versions import older_than

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
# the oldest ONNX Runtime that runs every graph the converter writes: 1.22 refuses the int8 embedding's
# GatherBlockQuantized (the bundled model's); pyproject.toml asks for it, but a Jetson's own CUDA build,
# or a pinned environment, can be older
MIN_ONNXRUNTIME = (1, 23)


def old_runtime_hint(version: str | None = None) -> str:
    """"" when ONNX Runtime (`version`, default the installed one) is at least MIN_ONNXRUNTIME, else a
    sentence to add to a load error: the graph may be fine and the runtime too old to read it."""
    version = ort.__version__ if version is None else version
    if not older_than(version, MIN_ONNXRUNTIME):
        return ""
    return (f" (ONNX Runtime {version} is installed; edgeinfer's graphs need "
            f"{'.'.join(map(str, MIN_ONNXRUNTIME))} or newer: pip install -U onnxruntime)")


def resolve_provider(provider: str, target: str = "cpu") -> str:
    """"auto" -> the detected device profile's first provider that this onnxruntime build has and that
    suits a folder converted for `target` (`platforms.auto_provider`; a cuda folder on a Jetson with
    the CUDA build: "cuda"; else "cpu"); "cpu" and "cuda" as given. An unknown or unavailable
    provider raises InvalidArgumentError."""
    if isinstance(provider, str) and provider == "auto":
        from edgeinfer.platforms import auto_provider, available_providers, detect

        return auto_provider(target, detect().profile, available_providers(), tuple(PROVIDERS))
    if not isinstance(provider, str) or provider not in PROVIDERS:
        raise InvalidArgumentError(f"unknown provider {provider!r} (choose from auto, {', '.join(PROVIDERS)})")
    if PROVIDERS[provider] not in ort.get_available_providers():
        raise InvalidArgumentError(f"provider {provider!r} is not available in this onnxruntime build")
    return provider


MAX_THREADS = 256  # (platforms.MAX_THREADS, a profile's cap, is this: tests/test_platforms.py)


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def on_cores(fn, items) -> None:
    """fn(item) for every item, on the cores this process may use (numpy work that releases the GIL);
    in this thread alone when one core or one item. An exception from any call is raised here."""
    items = list(items)
    workers = min(usable_cores(), len(items))
    if workers <= 1:
        for item in items:
            fn(item)
        return
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(fn, items))


def check_threads(threads: int | None, warn: bool = True) -> None:
    """threads is None (onnxruntime's default: one per physical core) or an int in 1..MAX_THREADS;
    anything else (0, -1, a bool, a float, a string, 10000) raises InvalidArgumentError. More than
    the cores this process may run on is allowed, with a warning (`warn`): the pool's threads then
    wait for each other (64 threads on 2 cores decoded about 25x slower; 10,000 held the machine
    for minutes)."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise InvalidArgumentError(f"threads must be a positive integer, got {threads!r:.40}")
    if threads is not None and threads > MAX_THREADS:
        raise InvalidArgumentError(f"threads must be at most {MAX_THREADS}, got {threads}")
    cores = usable_cores()
    if warn and threads is not None and threads > cores:
        warn_user(f"threads={threads} is more than the {cores} cores this process may use: the threads wait "
                  "for each other and decoding slows down many times over")


def session_options(threads: int | None, spin_duration_us: int | None = None, portable: bool = False
                    ) -> ort.SessionOptions:
    """Options for one decoder session: full graph optimization, `threads` intra-op threads (None:
    onnxruntime's default; else a positive int, see `check_threads`), one inter-op thread; with
    `spin_duration_us`, the pool's workers spin that long for work before sleeping (power control
    sets it short, see `power.threads`). `portable` (a CoreML/NNAPI graph, int8 as QDQ): ONNX
    Runtime's QDQ handling is off, so the weights' DequantizeLinear is folded into float32 weights
    and the CPU computes what the shipped graph does (its .ort form is optimized at the basic level,
    which fuses nothing). With it on, DequantizeLinear + MatMul became MatMulNBits at accuracy level
    4, int8 activations: logits up to 0.5 apart, greedy text apart within 40-140 tokens. (At
    accuracy level 0 that kernel is exact but 8x slower than the folded weights on the
    SmolLM2-135M shape: 124 against 16 ms a step; level 4 is 8.5 ms, inexact.)"""
    check_threads(threads)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if portable:
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    if threads is not None:
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    if spin_duration_us is not None:
        so.add_session_config_entry("session.intra_op.spin_duration_us", str(int(spin_duration_us)))
    so.log_severity_level = 4  # fatal only: a file it cannot load raises, and that is said in one line (at 3 its
    # coloured C++ log of the same failure came first)
    return so


class DecoderSession:
    def __init__(self, folder: Path | str, *, threads: int | None = None, provider: str = "auto",
                 manifest: Manifest | None = None, spin_duration_us: int | None = None, hashed: bool = False):
        """hashed: the caller has just hashed every listed file (`inspect --verify`), so they are not
        checked again (a folder that cannot be written, so keeps no stamp, paid it twice)."""
        check_threads(threads, warn=False)  # a bad count is the caller's error, said before any hashing
        self.folder = Path(folder)
        seen = folder_identity(self.folder) if manifest is None else None  # (given one: the caller compares)
        try:
            self._open(manifest, threads, provider, spin_duration_us, hashed)
        except (EdgeInferError, OSError):
            if manifest is None and folder_identity(self.folder) != seen:
                raise ModelFormatError(replaced_while_loading(self.folder)) from None
            raise
        self.identity = seen
        self.check_not_replaced()

    def close(self) -> None:
        """Let go of the ONNX Runtime session (its weights), keeping what describes it (`ChunkedSteps.close`)."""
        self.session = None

    def check_not_replaced(self) -> None:
        """A session that read its own manifest: ModelFormatError if its folder was replaced since (a
        caller that reads more of the folder afterwards, its tokenizer, calls this once it has)."""
        if self.identity is not None and folder_identity(self.folder) != self.identity:
            raise ModelFormatError(replaced_while_loading(self.folder))

    def _open(self, manifest: Manifest | None, threads: int | None, provider: str, spin_duration_us: int | None,
              hashed: bool) -> None:
        self.manifest = manifest or read_manifest(self.folder)
        if not hashed:
            verify(self.folder, self.manifest.files, self.manifest.named_files)  # every loader runs checked weights
        spec = self.manifest.arch
        self.names = io_names(spec.num_layers)
        self.provider = resolve_provider(provider, self.manifest.target)
        self.portable_on_cpu = self.manifest.portable is not None and self.provider == "cpu"  # the device's stand-in
        try:
            str(self.folder).encode("utf-8")
        except UnicodeEncodeError:  # ONNX Runtime's binding refused it as "incompatible constructor arguments"
            raise ModelFormatError(f"cannot load {str(self.folder)!r}: ONNX Runtime opens only paths that are valid "
                                   "UTF-8; rename the folder") from None
        try:
            self.session = new_session(lambda: ort.InferenceSession(
                str(self.folder / MODEL_FILE), session_options(threads, spin_duration_us, portable=self.portable_on_cpu),
                providers=[PROVIDERS[self.provider]]))
        except Exception as e:  # onnxruntime raises its own exception types for bad files
            raise ModelFormatError(f"cannot load {self.folder / MODEL_FILE}: {str(e).splitlines()[0][:300]}"
                                   f"{old_runtime_hint()}") from None
        self.provider = _provider_in_use(self.session, self.provider, asked=provider)
        self._check_io()
        if self.manifest.target == "cuda" and self.manifest.interface.version == 1:
            warn_user(f"{self.folder}: a cuda-target folder of graph interface version 1 rounds RoPE's angles "
                      "to float16 (wrong rotations past about 1,000 positions); re-convert it with this edgeinfer")

    def _check_io(self) -> None:
        """The graph takes exactly the inputs its manifest's interface names, and gives every output it
        names (a manifest edited to another interface version, or a graph swapped for another or with
        an output cut, is refused here, not by ONNX Runtime at the first call: a traceback)."""
        want_in, want_out = self.io_names("inputs"), self.io_names("outputs")
        got = {i.name for i in self.session.get_inputs()}
        if got != want_in:
            raise ModelFormatError(f"{self.folder / MODEL_FILE} does not take the inputs its edgeinfer.json names "
                                   f"(interface version {self.manifest.interface.version}): missing "
                                   f"{some_names(want_in - got)}, unexpected {some_names(got - want_in)}")
        missing = want_out - {o.name for o in self.session.get_outputs()}
        if missing:
            raise ModelFormatError(f"{self.folder / MODEL_FILE} does not give the outputs its edgeinfer.json names "
                                   f"(interface version {self.manifest.interface.version}): missing {some_names(missing)}")

    def io_names(self, part: str) -> set[str]:
        """The graph's input (part "inputs") or output ("outputs") names, as the manifest's interface gives them."""
        names = set()
        for key, desc in getattr(self.manifest.interface, part).items():
            names |= {desc.name.format(i=i) for i in range(self.manifest.arch.num_layers)} if desc.name else {key}
        return names


def _provider_in_use(session, chosen: str, asked) -> str:
    """The provider `session` really runs on. ONNX Runtime falls back to the CPU, with no error, when a
    provider it lists cannot start (onnxruntime-gpu without its CUDA or cuDNN libraries: a broken
    JetPack looked healthy). Asked for by name: InvalidArgumentError; chosen by "auto": a warning, and
    the CPU is what `DecoderSession.provider` says."""
    running = session.get_providers()
    if PROVIDERS[chosen] in running:
        return chosen
    why = (f"the {chosen} provider did not start (ONNX Runtime runs this session on {', '.join(running)}): are "
           "its libraries installed (CUDA and cuDNN for onnxruntime-gpu)? ONNX Runtime's log says more")
    if asked != "auto":
        raise InvalidArgumentError(why)
    warn_user(f"{why}; running on the CPU")
    return "cpu"


def some_names(names: set[str], most: int = 8) -> str:
    """A few of `names` for a message (a manifest edited to 4,096 layers misses 8,000 of them)."""
    if not names:
        return "none"
    shown = sorted(names)[:most]
    return str(shown) + (f" and {len(names) - most:,} more" if len(names) > most else "")

"""`edgeinfer convert`: its flags and its handler (the converter itself is `edgeinfer.converters`)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from edgeinfer.cli_args import OUTPUT_FULL, path_arg

TARGET_HELP = ("cpu (default): the fused graph; cuda: the fused graph with fp16 activations and KV; coreml / "
               "nnapi: the portable decode and prefill graphs with static shapes (docs/platforms.md)")


def add_convert_parser(sub) -> None:
    from edgeinfer.kv_mode import MODES as KV_MODES

    c = sub.add_parser("convert", help="convert a Hugging Face model folder or a GGUF file to an edgeinfer model folder")
    c.add_argument("src", type=path_arg, help="Hugging Face folder (config.json, *.safetensors, tokenizer files) or a "
                   "llama.cpp GGUF file (llama, qwen2, qwen3)")
    c.add_argument("-o", "--output", type=path_arg, required=True,
                   help="destination folder (must not exist, or with --force be an edgeinfer model folder)")
    c.add_argument("--target", choices=("cpu", "cuda", "coreml", "nnapi"), default="cpu", help=TARGET_HELP)
    c.add_argument("--quant", choices=("keep", "fp32", "fp16", "int8", "int4"), default=None,
                   help="weights (default: int4; coreml fp16; nnapi int8; a GGUF file: keep, its Q8_0/Q4_0/Q4_1 "
                   "blocks taken over exactly and other types stored at the nearest width)")
    c.add_argument("--block-size", type=int, choices=(16, 32, 64, 128), default=None,
                   help="int4/int8 blocks (32; the native graphs' int4 of a model of hidden size under 128: 16, "
                   "unless from a GGUF of mostly Q4_0/Q4_1 layers)")
    c.add_argument("--embedding", choices=("fp32", "fp16", "int8", "int4"), default=None,
                   help="precision of the token embedding and lm_head (default: measured per --quant)")
    c.add_argument("--accuracy-level", type=int, choices=(0, 1, 2, 3, 4), default=None,
                   help="MatMulNBits accuracy_level (0: fp32 math; 4: int8 activations)")
    c.add_argument("--asymmetric", action="store_true",
                   help="int4/int8 with zero points (int4's default recipe, gptq, and asym always have them)")
    c.add_argument("--recipe", choices=("gptq", "asym", "rtn", "mse", "q4_1"), default=None,
                   help="int4 rounding: gptq (default; asym's blocks fitted to the inputs the weights meet on a "
                   "shipped calibration text, rounding errors fed forward: the most accurate at asym's speed, "
                   "slower to convert), asym (integer zero points, scale and zero point searched per block), "
                   "rtn (symmetric, round to nearest, scale from the block's extreme, as llama.cpp's Q4_0; "
                   "~3 %% smaller, less accurate), mse (symmetric, per-block scale search "
                   "for the least squared error) or q4_1 (asymmetric blocks with an fp16 minimum, as llama.cpp's "
                   "Q4_1: 8-17 %% larger than asym, ~0.7x decode speed)")
    c.add_argument("--int8-tensors", nargs="*", metavar="NAME",
                   help="with --quant int4, keep these projections at int8 (e.g. qkv_proj down_proj)")
    c.add_argument("--attention", choices=("auto", *(m.name for m in KV_MODES)), default="auto",
                   help="the KV mode: " + "; ".join(
                       f"{m.name}: {m.description}" + (f" (head size a multiple of {m.head_multiple}, or heads "
                                                        "widened to one: the same function)"
                                                       if m.head_multiple > 1 else "") for m in KV_MODES)
                   + "; auto: gqa when the head size allows it or widening at most doubles it, else standard")
    c.add_argument("--capacity", type=int, default=None,
                   help="coreml/nnapi: the KV ring the graphs are built for (default 512, or the model's trained length "
                        "if shorter; more is refused; a smaller one loads)")
    c.add_argument("--prefill-tokens", type=int, default=None, help="coreml/nnapi: the prefill graph's chunk (64)")
    c.add_argument("--ort-format", action="store_true", help="coreml/nnapi: also write .ort files for ORT Mobile")
    c.add_argument("--via", choices=("auto", "native", "optimum"), default="auto",
                   help="the graph builder: native, or Hugging Face Optimum's ONNX export for families the native "
                   "builder lacks (pip install 'edgeinfer[optimum]'); auto: native, Optimum for an unknown "
                   "architecture when installed")
    c.add_argument("--ngram-tokens", type=_ngram_tokens, default=0, metavar="N",
                   help="the converted model writes N tokens of its own text (temperature 1, seeded) and its n-gram "
                   "table joins the folder: speculative decoding (speculative=\"ngram\"; serve --speculative "
                   "ngram) then drafts its habitual phrases too, not only what the prompt repeats (cpu target; "
                   "stories260K: 100000 tokens in ~12 s on two cores; at most 2000000; default 0, none)")
    c.add_argument("--force", action="store_true",
                   help="replace an existing edgeinfer model folder (never one holding SRC or the current folder)")
    c.add_argument("-q", "--quiet", action="store_true", help="print no progress and no summary of the result (errors still go to stderr)")
    c.set_defaults(func=run, imports=("edgeinfer.converters",), writes_stdout=lambda a: not a.quiet)


def _ngram_tokens(text: str) -> int:
    from edgeinfer.converters.ngrams import MAX_TOKENS

    n = int(text) if text.isascii() and text.isdigit() else -1
    if not 0 <= n <= MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"expected a number of tokens 0..{MAX_TOKENS}, got {text!r:.40}")
    return n


def _on_signal(signum, frame):
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C: the conversion's temporary folder is removed


def run(args: argparse.Namespace) -> int:
    """`edgeinfer convert`. SIGTERM and SIGHUP (`timeout`, a closed terminal, systemd) end it as Ctrl-C
    does, removing its temporary folder, with the exit status 128 + the signal's number; a signal
    the process was told to ignore (`nohup`, `trap '' TERM`) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        return _run(args)
    sigs = [s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None))
            if s is not None and signal.getsignal(s) is signal.SIG_DFL]
    before = {sig: signal.signal(sig, _on_signal) for sig in sigs}
    try:
        return _run(args)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _run(args: argparse.Namespace) -> int:
    from edgeinfer.converters import convert, default_scheme
    from edgeinfer.converters.convert import default_block_size
    from edgeinfer.converters.gguf_import import is_gguf
    from edgeinfer.errors import EdgeInferError
    from edgeinfer.inspect import describe
    from edgeinfer.portable import PORTABLE_TARGETS

    scheme = None
    scheme_flags = [flag for flag, v in (("--block-size", args.block_size), ("--embedding", args.embedding),
                                         ("--asymmetric", args.asymmetric), ("--int8-tensors", args.int8_tensors),
                                         ("--recipe", args.recipe))
                    if v is not None and v is not False]
    if args.via == "optimum" and is_gguf(args.src):  # first: no flag helps a GGUF
        # there (keep, the default for a GGUF, was blamed, then --recipe)
        raise EdgeInferError(f"--via optimum exports Hugging Face model folders only; {args.src} is a GGUF file")
    if args.via == "optimum" and ((args.recipe or "rtn") != "rtn" or args.asymmetric):
        raise EdgeInferError("--via optimum quantizes with ONNX Runtime's symmetric round to nearest (--recipe rtn): "
                             "--recipe and --asymmetric choose the native builder's rounding")
    keep = args.quant == "keep" or (args.quant is None and args.target == "cpu" and is_gguf(args.src))
    if keep:
        if scheme_flags:
            raise EdgeInferError(f"{', '.join(scheme_flags)}: --quant keep stores the GGUF file's own blocks (only "
                                 "--accuracy-level applies); choose --quant int4 or int8 to re-quantize")
    elif args.target in PORTABLE_TARGETS:  # the portable graphs take only --quant (fp32, fp16, int8)
        given = [flag for flag, v in (("--block-size", args.block_size), ("--embedding", args.embedding),
                                      ("--accuracy-level", args.accuracy_level), ("--asymmetric", args.asymmetric),
                                      ("--int8-tensors", args.int8_tensors), ("--recipe", args.recipe))
                 if v is not None and v is not False]
        if given:
            raise EdgeInferError(f"{', '.join(given)}: --target {args.target} stores weights per output channel "
                                 "(--quant only); these flags are for the cpu and cuda graphs")
    elif args.quant in ("fp16", "fp32") and scheme_flags + (["--accuracy-level"] if args.accuracy_level is not None else []):
        given = scheme_flags + (["--accuracy-level"] if args.accuracy_level is not None else [])
        raise EdgeInferError(f"{', '.join(given)}: --quant {args.quant} stores plain weights; these flags are for "
                             "--quant int4 and int8")
    elif scheme_flags:
        block = args.block_size or default_block_size(args.src, args.quant or "int4", args.target, args.recipe,
                                                      args.via)
        scheme = default_scheme(args.quant or "int4", block, accuracy_level=args.accuracy_level,
                                embedding=args.embedding, symmetric=not args.asymmetric,
                                int8_tensors=tuple(args.int8_tensors or ()), recipe=args.recipe)
    log = (lambda msg: print(msg, file=sys.stderr)) if not args.quiet else (lambda msg: None)
    convert(args.src, args.output, quant="keep" if keep else args.quant, block_size=args.block_size,
            target=args.target, force=args.force, scheme=scheme, attention=args.attention, capacity_tokens=args.capacity,
            prefill_tokens=args.prefill_tokens, ort_format=args.ort_format,
            accuracy_level=args.accuracy_level if scheme is None else None, via=args.via,
            ngram_tokens=args.ngram_tokens, log=log)
    if not args.quiet:
        try:
            print(describe(args.output))
            sys.stdout.flush()
        except OSError as e:  # > /dev/full: main's one line, saying the model is whole (it read as a failed conversion)
            if e.errno not in OUTPUT_FULL:
                raise
            raise OSError(e.errno, f"{e.strerror} (the model in {args.output} is converted and complete; only "
                                   "this summary was not written)") from None
    return 0

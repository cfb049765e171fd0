"""`--via optimum`: graphs exported by Hugging Face Optimum run on the KV ring (the `optimum` KV mode).

The folders under tests/fixtures/optimum were converted once by scripts/make_optimum_fixtures.py
(torch 2.13, transformers 4.57.6, optimum-onnx 0.1.0) from tiny random Phi-3 and Gemma models, with
transformers' references beside them, so these tests need neither torch nor Optimum. The ones that
convert (the extra installed) skip without it.

References:
- within the ring's capacity: transformers' own logits and greedy ids (2 layers);
- across a ring wrap: with one layer a token's K/V depend only on the token and its position, so a
  ring step equals one forward over exactly what the ring holds. Transformers' greedy ids with each
  step recomputed over the sinks and the newest tokens at positions 0..n are what the ring computes
  when it re-bases every token; with the default re-base interval, the reference is the same
  runtime's from-scratch forward over the held tokens at the ring's positions (conftest.ring_reference).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

import edgeinfer
from conftest import FIXTURES, ROOT, STORIES_FIX, ring_reference, run_ring
from edgeinfer.engine import Engine
from edgeinfer.errors import ConvertError, ModelFormatError
from edgeinfer.kv_cache import RingKVCache
from edgeinfer.kv_mode import OPTIMUM
from edgeinfer.manifest import MANIFEST_FILE, read_manifest
from edgeinfer.session import DecoderSession

OPT = FIXTURES / "optimum"
FAMILIES = ("phi3", "gemma")
TOL = 1e-4


def _ref(family: str) -> tuple[dict, dict]:
    return json.loads((OPT / family / "reference.json").read_text()), dict(np.load(OPT / family / "reference.npz"))


def _engine(folder, chunk: int = 64) -> Engine:
    return Engine(DecoderSession(folder), max_chunk=chunk)


def _cache(eng: Engine, capacity: int = 256):
    """An empty ring without sinks, below Phi-3's window of 64 (it holds W - 1 at most)."""
    return eng.new_cache(min(capacity, (eng.spec.sliding_window or capacity + 1) - 1), 0)


def _windowless(eng: Engine):
    """The spec with no sliding window: for the tests of the ring's mechanics with sinks, whose
    references are transformers over what the ring holds (StreamingLLM's), not over a window."""
    return dataclasses.replace(eng.spec, sliding_window=None)


@pytest.mark.parametrize("family", FAMILIES)
def test_manifest_names_the_optimum_mode_and_origin(family):
    m = read_manifest(OPT / family / "fp32")
    assert m.interface.kv_mode is OPTIMUM and m.arch.family == family
    assert m.origin is not None and m.origin.format == "optimum"
    assert set(m.interface.inputs) == {"input_ids", "position_ids", "logits_index", "attention_mask", "past_key",
                                       "past_value"}
    assert m.interface.inputs["past_key"].shape == ("batch", "past_sequence", m.arch.num_kv_heads, m.arch.head_dim)
    assert m.interface.outputs["present_key"].shape == ("batch", "sequence", m.arch.num_kv_heads, m.arch.head_dim)


@pytest.mark.parametrize("family", FAMILIES)
def test_full_pass_and_chunks_match_transformers(family):
    _, ref = _ref(family)
    ids = ref["input_ids"][0].tolist()
    eng = _engine(OPT / family / "fp32")
    assert np.abs(eng.forward(_cache(eng), ids, all_logits=True) - ref["logits"]).max() < TOL
    cache = _cache(eng)
    rows = [eng.forward(cache, ids[:10], all_logits=True)]
    for t in range(10, len(ids), 3):  # the past bound from the ring, the new rows written into it
        rows.append(eng.forward(cache, ids[t:t + 3], all_logits=True).copy())
    assert np.abs(np.concatenate(rows) - ref["logits"]).max() < TOL
    last = eng.forward(_cache(eng), ids)  # logits_index: the last position only
    assert last.shape == (1, ref["logits"].shape[1]) and np.abs(last[0] - ref["logits"][-1]).max() < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers(family):
    r, _ = _ref(family)
    m = edgeinfer.load(OPT / family / "fp32")
    c = m.generate(r["prompt_ids"], max_new_tokens=32, temperature=0, ignore_eos=True)
    assert list(c.token_ids) == r["greedy_ids"]
    assert c.usage.dropped_tokens == 0


def test_sliding_window_caps_the_ring():
    """Phi-3's config window (64) is recorded, not exported: the ring keeps it (W - 1 tokens, no sinks)."""
    m = edgeinfer.load(OPT / "phi3" / "fp32")
    assert m.manifest.arch.sliding_window == 64 and (m.capacity_tokens, m.n_sink) == (63, 0)
    gemma = edgeinfer.load(OPT / "gemma" / "fp32")  # no window: its trained length (256) less a sixteenth
    assert gemma.manifest.default_capacity_tokens == 256 and gemma.capacity_tokens == 240


@pytest.mark.parametrize("family", FAMILIES)
def test_ring_wrap_matches_transformers_window(family):
    """One layer, a 16-slot ring with 4 sinks re-based every token: 64 greedy tokens (the ring wraps
    after 8) equal transformers recomputing each step over the sinks and the newest tokens."""
    r, _ = _ref(family)
    w = r["window"]
    eng = _engine(OPT / family / "one_layer_fp32", chunk=8)
    cache = RingKVCache(_windowless(eng), w["capacity"], w["n_sink"], eng.max_chunk, eng.mode, rebase_every_tokens=1)
    out = [int(eng.prefill(cache, r["prompt_ids"]).argmax())]
    while len(out) < len(w["greedy_ids"]):
        out.append(int(eng.decode_one(cache, out[-1]).argmax()))
    assert out == w["greedy_ids"]
    assert cache.dropped > 40 and cache.next_position <= w["capacity"] + 1


@pytest.mark.parametrize("family", FAMILIES)
def test_ring_wrap_with_rebasing_equals_a_fresh_forward(family):
    """The default re-base interval: every token's logits equal one forward from an empty cache over
    exactly the tokens the ring held, at the ring's positions (keys rotated back by re-basing equal
    keys computed at the lower positions: the family's RoPE is the rotate-half the ring assumes)."""
    eng = _engine(OPT / family / "one_layer_fp32", chunk=8)
    capacity, n_sink = 20, 3
    cache = RingKVCache(_windowless(eng), capacity, n_sink, eng.max_chunk, eng.mode)
    ids = np.random.default_rng(3).integers(3, 512, 90).tolist()
    rows = run_ring(eng, cache, ids, chunk=8, shrink_when_full=True)
    assert cache.rebased_tokens > 0 and cache.dropped > 0
    for t in range(capacity - 4, len(ids), 7):
        lg, start, p0 = rows[t]
        assert np.abs(lg - ring_reference(eng, ids, t, start, p0, capacity, n_sink)).max() < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_long_generation_keeps_memory_and_positions_bounded(family):
    sinks = 0 if family == "phi3" else 4  # a model whose window binds has none
    m = edgeinfer.load(OPT / family / "int4", capacity_tokens=16, n_sink=sinks, prefill_chunk=4)
    c = m.generate([1, 5, 6, 7, 8, 9], max_new_tokens=300, temperature=0.8, seed=1, ignore_eos=True)
    assert len(c.token_ids) == 300 and c.usage.dropped_tokens == 6 + 299 - 16  # the last token is not fed
    assert m.cache.next_position <= m.cache.position_limit
    assert m.cache.positions[:sinks].tolist() == list(range(sinks))


@pytest.mark.parametrize("family", FAMILIES)
def test_int4_runs_close_to_fp32(family):
    _, ref = _ref(family)
    ids = ref["input_ids"][0].tolist()
    q = read_manifest(OPT / family / "int4").quantization
    assert (q.weights, q.block_size, q.symmetric, q.accuracy_level) == ("int4", 32, True, 4)
    eng = _engine(OPT / family / "int4")
    lg = eng.forward(_cache(eng, 64), ids, all_logits=True)
    assert np.isfinite(lg).all()
    # as close as the native int4 graphs of the 64-wide parity models are to theirs (llama2_gqa_tied: relative
    # RMS error 0.29, correlation 0.96, top-1 agreement 0.71; these: 0.27 / 0.96 / 0.79 and 0.39 / 0.93 / 0.71)
    d, r = lg - ref["logits"], ref["logits"]
    assert np.sqrt((d ** 2).mean() / (r ** 2).mean()) < 0.45
    assert np.corrcoef(lg.ravel(), r.ravel())[0, 1] > 0.9 and np.mean(lg.argmax(1) == r.argmax(1)) >= 0.65
    cache = _cache(eng, 64)  # the ring's binding computes the same as one pass at int4 too
    rows = [eng.forward(cache, ids[t:t + 4], all_logits=True).copy() for t in range(0, len(ids), 4)]
    assert np.abs(np.concatenate(rows) - lg).max() < 1e-3
    assert (OPT / family / "int4" / "model.onnx.data").stat().st_size < \
        (OPT / family / "fp32" / "model.onnx.data").stat().st_size / 4


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_perplexity_runs_both_ways(family, capsys):
    from edgeinfer.cli import main

    text = STORIES_FIX / "eval.txt"
    assert main(["eval", "-m", str(OPT / family / "fp32"), "--text", str(text), "--window", "64", "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main(["eval", "-m", str(OPT / family / "fp32"), "--text", str(text), "--stream", "--capacity", "32",
                 "--json"]) == 0
    stream = json.loads(capsys.readouterr().out)
    assert np.isfinite(whole["perplexity"]) and np.isfinite(stream["perplexity"]) and whole["scored_tokens"] > 1000


def test_a_graph_that_disagrees_with_its_manifest_is_refused(tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(OPT / "gemma" / "int4", folder)
    d = json.loads((folder / MANIFEST_FILE).read_text())
    del d["interface"]["inputs"]["attention_mask"]
    (folder / MANIFEST_FILE).write_text(json.dumps(d))
    with pytest.raises(ModelFormatError, match="interface.inputs.attention_mask: missing"):
        read_manifest(folder)


# --- converting (Optimum itself where installed) ---

def _hf_folder(tmp_path, model_type: str):
    """A source folder with a config and a tokenizer, no weights: enough for every refusal before the export."""
    import shutil

    src = tmp_path / f"{model_type}-src"
    src.mkdir()
    cfg = {"model_type": model_type, "architectures": ["X"], "hidden_size": 64, "num_attention_heads": 4,
           "num_hidden_layers": 2, "vocab_size": 512, "intermediate_size": 96}
    (src / "config.json").write_text(json.dumps(cfg))
    shutil.copyfile(ROOT / "models" / "stories260K" / "tokenizer.model", src / "tokenizer.model")
    return src


def _no_partial_output(dst):
    return not dst.exists() and not [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")]


def test_without_the_extra_the_error_says_the_pip_command(tmp_path, monkeypatch):
    from edgeinfer.converters.optimum_export import convert_via_optimum

    for name in ("torch", "optimum", "optimum.exporters", "optimum.exporters.onnx", "optimum.exporters.tasks"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError
    dst = tmp_path / "out"
    with pytest.raises(ConvertError, match=r"--via optimum needs Hugging Face Optimum and torch: "
                                           r"pip install 'edgeinfer\[optimum\]'"):
        convert_via_optimum(_hf_folder(tmp_path, "phi3"), dst, log=lambda m: None)
    assert _no_partial_output(dst)


@pytest.mark.parametrize("kw,match", [
    (dict(quant="fp16"), "unknown quantization 'fp16'"),
    (dict(block_size=24), "block size 24 not supported"),
])
def test_bad_options_are_refused_before_any_work(tmp_path, kw, match):
    from edgeinfer.converters.optimum_export import convert_via_optimum

    dst = tmp_path / "out"
    with pytest.raises(ConvertError, match=match):
        convert_via_optimum(_hf_folder(tmp_path, "phi3"), dst, log=lambda m: None, **kw)
    assert _no_partial_output(dst)


def test_the_optimum_module_imports_no_torch():
    """The base install stays torch-free: the converter module and a load of an Optimum folder import
    neither torch nor Optimum."""
    code = ("import sys, edgeinfer; import edgeinfer.converters.optimum_export; "
            f"m = edgeinfer.load({str(OPT / 'gemma' / 'int4')!r}); m.generate([1, 5], max_new_tokens=3); "
            "bad = [n for n in ('torch', 'optimum', 'transformers') if n in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _exporter_or_skip():
    pytest.importorskip("torch")
    pytest.importorskip("optimum.exporters.onnx")


@pytest.mark.parametrize("model_type,match", [
    ("mamba", "Optimum cannot export model type 'mamba'"),
    ("gpt2", "model type 'gpt2' is not one it has checked"),  # Optimum exports it; learned positions: no ring
])
def test_a_family_that_cannot_be_exported_is_refused(tmp_path, model_type, match):
    _exporter_or_skip()
    from edgeinfer.converters.optimum_export import convert_via_optimum

    dst = tmp_path / "out"
    with pytest.raises(ConvertError, match=match):
        convert_via_optimum(_hf_folder(tmp_path, model_type), dst, log=lambda m: None)
    assert _no_partial_output(dst)


@pytest.mark.parametrize("family", FAMILIES)
def test_converting_again_reproduces_the_committed_fixture(tmp_path, family):
    """With the extra installed: the fixture script's model converts to the same logits, and --force
    replaces an existing model folder atomically."""
    _exporter_or_skip()
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_optimum_fixtures import make_source

    from edgeinfer.converters.optimum_export import convert_via_optimum

    _, ref = _ref(family)
    src = make_source(family, tmp_path / "src")
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / MANIFEST_FILE).write_text("{}")  # an (old) model folder: replaced only with force
    with pytest.raises(ConvertError, match="destination exists"):
        convert_via_optimum(src, dst, quant="fp32", log=lambda m: None)
    m = convert_via_optimum(src, dst, quant="fp32", force=True, log=lambda m: None)
    assert m.interface.kv_mode is OPTIMUM
    eng = _engine(dst)  # (a ring of 64 was refused once Phi-3's window of 64 capped it at 63: this test runs only
    lg = eng.forward(_cache(eng), ref["input_ids"][0].tolist(), all_logits=True)  # with the extra installed)
    assert np.abs(lg - ref["logits"]).max() < TOL
    assert _no_partial_output(tmp_path / "never") and not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_auto_without_the_extra_names_it_for_an_unknown_architecture(tmp_path, monkeypatch):
    """`edgeinfer convert` of a family the native builder lacks, Optimum not installed: one error naming
    the architecture, the native families and the pip command; nothing written."""
    import importlib.util

    from edgeinfer.converters import convert

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("optimum", "torch") else real(name, *a))
    src, dst = _hf_folder(tmp_path, "phi3"), tmp_path / "out"
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "architectures": ["Phi3ForCausalLM"]}))
    with pytest.raises(ConvertError) as e:
        convert(src, dst)
    assert "'Phi3ForCausalLM'" in str(e.value) and "LlamaForCausalLM" in str(e.value)
    assert "pip install 'edgeinfer[optimum]'" in str(e.value)
    assert _no_partial_output(dst)


def test_via_optimum_refuses_the_native_graphs_options(tmp_path):
    from edgeinfer.converters import convert

    src = _hf_folder(tmp_path, "phi3")
    for kw in (dict(target="cuda"), dict(quant="fp16"), dict(accuracy_level=0), dict(attention="gqa")):
        dst = tmp_path / "out"
        with pytest.raises(ConvertError, match="--via optimum builds a cpu graph"):
            convert(src, dst, via="optimum", **kw)
        assert _no_partial_output(dst)


def test_auto_routes_an_unknown_architecture_through_optimum_with_a_note(tmp_path):
    """With the extra installed, the CLI converts a Phi-3 folder with no --via, saying so."""
    _exporter_or_skip()
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_optimum_fixtures import make_source

    src = make_source("phi3", tmp_path / "src")
    r = subprocess.run([sys.executable, "-m", "edgeinfer", "convert", str(src), "-o", str(tmp_path / "out"),
                        "--quant", "fp32"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "note: 'Phi3ForCausalLM' is not a native family: converting through Optimum" in r.stderr
    assert "source        Optimum ONNX export" in r.stdout


def test_via_optimum_takes_the_rounding_it_does_and_refuses_others(tmp_path, monkeypatch, capsys):
    """Optimum's int4 is ONNX Runtime's symmetric round to nearest: `--recipe rtn` is what it does and
    is taken (it was refused once asym became the native default), `--recipe asym` and
    `--asymmetric` are refused (they were taken and ignored: hostile round)."""
    import edgeinfer.converters.optimum_export as ox
    from edgeinfer.cli import main
    from edgeinfer.converters import convert, default_scheme

    got = []
    monkeypatch.setattr(ox, "convert_via_optimum", lambda src, dst, **kw: got.append(kw))
    src = _hf_folder(tmp_path, "phi3")
    for scheme in (default_scheme("int4", 64), default_scheme("int4", 64, recipe="rtn")):
        convert(src, tmp_path / "out", via="optimum", scheme=scheme)
    assert [(k["quant"], k["block_size"]) for k in got] == [("int4", 64)] * 2
    for flags in (["--recipe", "asym"], ["--asymmetric"], ["--recipe", "mse"]):
        assert main(["convert", str(src), "-o", str(tmp_path / "o2"), "--via", "optimum", *flags]) == 1
        assert "--via optimum quantizes with ONNX Runtime's symmetric round to nearest" in capsys.readouterr().err
    assert main(["convert", str(src), "-o", str(tmp_path / "o3"), "--via", "optimum", "--recipe", "rtn", "-q"]) == 0
    assert got[-1]["quant"] == "int4"

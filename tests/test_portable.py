"""The portable flavour (`convert --target coreml|nnapi`): ONNX Runtime's mobile checker takes every
node of both graphs in one partition; on the CPU EP the graphs reproduce stories260K's golden greedy
ids and the fused graph's perplexity; the ring contract holds; bad targets and capacities are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

import edgeinfer
from conftest import STORIES_FIX, STORIES_SRC, TINY, write_manifest
from edgeinfer.converters import convert, default_scheme
from edgeinfer.converters.mobile_check import mobile_usability
from edgeinfer.errors import ConvertError, InvalidArgumentError
from edgeinfer.evaluate import perplexity, stream_perplexity
from edgeinfer.manifest import read_manifest
from edgeinfer.portable import MAX_DIM, attention_mask, logit_chunks
from edgeinfer.portable_engine import PortableEngine, open_engine
from edgeinfer.session import DecoderSession

GOLDEN = json.loads((STORIES_FIX / "golden.json").read_text())
EVAL_TXT = STORIES_FIX / "eval.txt"


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """portable(src, target, quant=None, **kw) -> folder, each converted once per module."""
    made: dict = {}

    def get(src, target, quant=None, **kw):
        key = (str(src), target, quant, tuple(sorted(kw.items())))
        if key not in made:
            dst = tmp_path_factory.mktemp("portable") / f"{src.name}-{target}-{quant}"
            convert(src, dst, target=target, quant=quant, **kw)
            made[key] = dst
        return made[key]

    return get


# --- ONNX Runtime's checker ---

@pytest.mark.parametrize("target", ["coreml", "nnapi"])
@pytest.mark.parametrize("graph", ["model.onnx", "prefill.onnx"])
def test_checker_takes_every_node_in_one_partition(portable, target, graph):
    report = mobile_usability(portable(STORIES_SRC, target) / graph)
    eps = ["NNAPI", "CoreML MLProgram"] if target == "coreml" else ["NNAPI"]  # int8 DQ is NNAPI's
    for ep in eps:
        r = report[ep]
        assert (r["partitions"], r["supported_nodes"], r["verdict"]) == (1, r["nodes"], "YES"), (ep, r)


def test_checker_on_a_gqa_model_with_biases(portable):
    folder = portable(TINY / "qwen2_bias_tied", "coreml")
    for graph in ("model.onnx", "prefill.onnx"):
        for ep, r in mobile_usability(folder / graph).items():
            assert (r["partitions"], r["supported_nodes"], r["verdict"]) == (1, r["nodes"], "YES"), (ep, r)


# --- numbers on the CPU EP ---

def _greedy(folder, prompt: list[int], n: int) -> list[int]:
    eng = open_engine(DecoderSession(folder), 64)
    cache = eng.new_cache(512, 0)
    out = [int(eng.prefill(cache, prompt).argmax())]
    while len(out) < n:
        out.append(int(eng.decode_one(cache, out[-1]).argmax()))
    return out


def test_fp32_portable_reproduces_all_golden_sequences(portable):
    folder = portable(STORIES_SRC, "coreml", "fp32")
    assert isinstance(open_engine(DecoderSession(folder), 64), PortableEngine)
    for case in GOLDEN["cases"]:
        assert _greedy(folder, case["prompt_ids"], 64) == case["greedy_ids"], case["prompt"]


@pytest.mark.parametrize("target,quant", [("coreml", "fp16"), ("nnapi", "int8")])
def test_perplexity_within_1pct_of_the_fused_graph(portable, converted, target, quant, tmp_path):
    text = tmp_path / "eval.txt"  # four of the 16 stories (the portable graph scores one token per call)
    text.write_text("".join(EVAL_TXT.read_text().splitlines(keepends=True)[:8]))
    mine = perplexity(portable(STORIES_SRC, target, quant), text).perplexity
    fused = perplexity(converted(STORIES_SRC, quant), text).perplexity
    assert abs(mine / fused - 1) < 0.01, (mine, fused)


def test_a_portable_model_is_scored_on_its_decode_path_and_prefill_is_refused(portable, tmp_path):
    """A hostile round: `edgeinfer eval --path prefill` on a portable folder ran the decode path, the
    flag overridden with no word but the result line's "decode path"."""
    from edgeinfer.cli import main
    from edgeinfer.errors import EdgeInferError

    folder = portable(STORIES_SRC, "coreml", "fp32")
    text = tmp_path / "eval.txt"  # one story: the path is the point, not the figure
    text.write_text("".join(EVAL_TXT.read_text().splitlines(keepends=True)[:1]))
    r = perplexity(folder, text, window=64)
    assert r.path == "decode" and r.perplexity == perplexity(folder, text, window=64, path="decode").perplexity
    with pytest.raises(EdgeInferError, match="one position's logits per call.*--path decode"):
        perplexity(folder, text, path="prefill")
    assert main(["eval", "-m", str(folder), "--text", str(text), "--path", "prefill"]) == 1


def test_verify_opens_a_portable_folder_s_graphs_as_load_does(portable, tmp_path):
    """A hostile round: `inspect --verify` opened only a fused folder's graph, so a portable folder
    whose prefill graph is its decode graph (hashes and manifest made to match) was "ok" there and
    refused by load. Now verify runs the portable engine's checks too, and agrees with load."""
    import hashlib
    import shutil

    from edgeinfer.errors import ModelFormatError
    from edgeinfer.inspect import verify

    good = portable(STORIES_SRC, "coreml", "fp32")
    assert verify(good, out=lambda line: None)
    bad = tmp_path / "swapped"
    shutil.copytree(good, bad)
    shutil.copy(bad / "model.onnx", bad / "prefill.onnx")  # both graphs read model.onnx.data
    m = json.loads((bad / "edgeinfer.json").read_text())
    data = (bad / "prefill.onnx").read_bytes()
    m["files"]["prefill.onnx"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    write_manifest(bad, m)
    lines = []
    assert not verify(bad, out=lines.append)
    assert "prefill.onnx: input inputs_embeds is [1, 1, " in lines[-1], lines[-1]
    with pytest.raises(ModelFormatError, match="prefill.onnx: input inputs_embeds"):
        edgeinfer.load(bad)


def test_a_portable_prefill_graph_that_lacks_an_output_is_refused(portable, tmp_path):
    """The decode graph's outputs are checked as it loads; the prefill graph's were not, so one cut
    from it (hashes and manifest made to match) loaded and failed at the first prefill (a traceback)."""
    import hashlib
    import shutil

    import onnx

    from edgeinfer.errors import ModelFormatError

    bad = tmp_path / "cut"
    shutil.copytree(portable(STORIES_SRC, "coreml", "fp32"), bad)
    g = onnx.load(str(bad / "prefill.onnx"), load_external_data=False)
    g.graph.output.remove([o for o in g.graph.output if o.name == "present.2.key"][0])
    onnx.save(g, str(bad / "prefill.onnx"))
    m = json.loads((bad / "edgeinfer.json").read_text())
    data = (bad / "prefill.onnx").read_bytes()
    m["files"]["prefill.onnx"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    write_manifest(bad, m)
    with pytest.raises(ModelFormatError, match=r"prefill.onnx: the graph does not give the outputs .*present.2.key"):
        edgeinfer.load(bad)


def test_streamed_perplexity_through_the_ring(portable, converted, tmp_path):
    """Through a ring of 128 + 4 sinks that wraps on every story here, within 0.1 % of the fused graph
    (whose streamed figure on the whole text is transformers' exact sliding window's: test_runtime)."""
    text = tmp_path / "eval.txt"  # three stories of ~500 tokens (the portable graph scores a token per call)
    text.write_text("".join(EVAL_TXT.read_text().splitlines(keepends=True)[:6]))
    r = stream_perplexity(portable(STORIES_SRC, "coreml", "fp32"), text, capacity=128, sinks=4)
    fused = stream_perplexity(converted(STORIES_SRC, "fp32"), text, capacity=128, sinks=4)
    assert r.n_stories == 3 and r.scored_tokens == fused.scored_tokens > 3 * 3 * 132  # each wraps the ring
    assert abs(r.perplexity / fused.perplexity - 1) < 1e-3, (r.perplexity, fused.perplexity)


def test_ring_wraps_like_the_fused_graph(portable, converted):
    """A built capacity of 64 with 16-token prefill chunks; 200 greedy tokens shift the ring ~4 times."""
    a = edgeinfer.load(portable(STORIES_SRC, "coreml", "fp32", capacity_tokens=64, prefill_tokens=16))
    b = edgeinfer.load(converted(STORIES_SRC, "fp32"), capacity_tokens=64, prefill_chunk=16)
    prompt = "Once upon a time, there was a little girl named Lily. She loved to play outside."
    x = a.generate(prompt, max_new_tokens=200, temperature=0, ignore_eos=True)
    y = b.generate(prompt, max_new_tokens=200, temperature=0, ignore_eos=True)
    assert x.token_ids == y.token_ids and x.usage.dropped_tokens == y.usage.dropped_tokens > 0


@pytest.mark.parametrize("family", ["llama2_gqa_tied", "mistral_gqa_untied_fp16", "qwen2_bias_tied"])
def test_logits_match_the_fused_graph(portable, converted, family):
    src = TINY / family
    pe = open_engine(DecoderSession(portable(src, "coreml", "fp32")), 64)
    fe = open_engine(DecoderSession(converted(src, "fp32")), 64)
    ids = [1, 5, 9, 2, 7, 3, 8, 4, 6, 11, 13]
    pc, fc = pe.new_cache(64, 2), fe.new_cache(64, 2)
    np.testing.assert_allclose(pe.prefill(pc, ids), fe.prefill(fc, ids), atol=2e-4)
    for t in (3, 5, 7):
        np.testing.assert_allclose(pe.decode_one(pc, t), fe.decode_one(fc, t), atol=2e-4)


# --- host-side inputs ---

def test_logit_chunks_cover_the_vocabulary_in_chunks_under_the_limit():
    for v in (512, 16384, 16385, 32000, 49152, 151936):
        chunks = logit_chunks(v)
        assert chunks[0][0] == 0 and chunks[-1][1] == v and all(hi - lo <= MAX_DIM for lo, hi in chunks)
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))


def test_attention_mask_by_hand():
    m = attention_mask(n_valid=2, s=2, s_graph=3, ring_rows=4, groups=2)[0, 0]
    see = (m == 0).astype(int)
    #            ring 0..3  new 0..2
    want_row = [[1, 1, 0, 0, 1, 0, 0],   # query 0: valid slots and itself
                [1, 1, 0, 0, 1, 1, 0],   # query 1: and query 0
                [0, 0, 0, 0, 0, 0, 1]]   # padding: only itself
    assert see.tolist() == want_row * 2  # the same rows for each query head of a KV head


# --- refusals ---

@pytest.mark.parametrize("kwargs,words", [
    ({"target": "tpu"}, "unknown target"),
    ({"target": "nnapi", "quant": "int4"}, "4-bit"),
    ({"target": "coreml", "quant": "int8"}, "DequantizeLinear"),
    ({"target": "cpu", "capacity_tokens": 128}, "--target coreml or nnapi"),
    ({"target": "coreml", "capacity_tokens": 1}, "--capacity"),
    ({"target": "coreml", "capacity_tokens": 16300}, "portable graphs' limit"),
    ({"target": "nnapi", "capacity_tokens": 16300}, "portable graphs' limit"),  # it named CoreML for nnapi
    ({"target": "coreml", "scheme": default_scheme("int4")}, "quantization schemes"),
    ({"target": "nnapi", "attention": "gqa"}, "--attention"),
    ({"target": "cpu", "ort_format": True}, "--ort-format"),
])
def test_bad_targets_are_refused_before_any_work(tmp_path, kwargs, words):
    with pytest.raises(ConvertError, match=words):
        convert(STORIES_SRC, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_a_family_the_portable_graph_cannot_express_is_refused(tmp_path):
    with pytest.raises(ConvertError, match="Qwen3"):
        convert(TINY / "qwen3_qknorm_tied", tmp_path / "out", target="coreml")
    assert not (tmp_path / "out").exists()


def test_a_sliding_window_model_s_default_ring_is_the_window_less_one(tmp_path, converted):
    """load's ring of a model whose window W is under its trained length holds at most W - 1, so the
    default portable ring is cut to that (it was the trained length: 320 rows built for a 15-token
    ring, prefill 6x slower; a hostile round); a --prefill-tokens over that is refused, as over a ring
    given. The tokens are the cpu folder's."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(TINY / "mistral_gqa_untied_fp16", src, ignore=shutil.ignore_patterns("reference.npz"))
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "sliding_window": 16}))
    convert(src, tmp_path / "default", target="coreml", quant="fp32")
    assert (read_manifest(tmp_path / "default").portable.capacity_tokens,
            read_manifest(tmp_path / "default").portable.prefill_tokens) == (15, 15)
    convert(src, tmp_path / "chunk", target="coreml", quant="fp32", prefill_tokens=8)
    assert (read_manifest(tmp_path / "chunk").portable.capacity_tokens,
            read_manifest(tmp_path / "chunk").portable.prefill_tokens) == (15, 8)
    with pytest.raises(ConvertError, match="--prefill-tokens 32 is over the ring this model can use .* window of 16 "
                                           "less one: 15 tokens"):  # (a review: it grew the ring to 32)
        convert(src, tmp_path / "big-chunk", target="coreml", quant="fp32", prefill_tokens=32)
    assert not (tmp_path / "big-chunk").exists()
    convert(src, tmp_path / "given", target="coreml", quant="fp32", capacity_tokens=100)
    assert read_manifest(tmp_path / "given").portable.capacity_tokens == 100
    a, b = edgeinfer.load(tmp_path / "default"), edgeinfer.load(converted(src, "fp32"))
    assert a.capacity_tokens == b.capacity_tokens == 15
    rng = np.random.default_rng(0)
    for n in (1, 9, 40):  # within the ring, and a prompt that shifts through it
        ids = rng.integers(3, 500, n).tolist()
        assert (a.generate(ids, max_new_tokens=60, temperature=0, ignore_eos=True).token_ids ==
                b.generate(ids, max_new_tokens=60, temperature=0, ignore_eos=True).token_ids)


def test_capacity_above_the_built_one_is_refused_at_load(portable):
    folder = portable(STORIES_SRC, "coreml", "fp32", capacity_tokens=64, prefill_tokens=16)
    assert read_manifest(folder).portable.capacity_tokens == 64
    with pytest.raises(InvalidArgumentError, match="built for"):
        edgeinfer.load(folder, capacity_tokens=65)
    m = edgeinfer.load(folder, capacity_tokens=32)  # smaller is fine: the same fixed rows, fewer in the ring
    assert m.generate("Once", max_new_tokens=40, ignore_eos=True).usage.completion_tokens == 40


def test_manifest_records_the_flavour_and_both_graphs(portable, tmp_path):
    import shutil
    folder = tmp_path / "copy"
    shutil.copytree(portable(STORIES_SRC, "nnapi"), folder)
    m = read_manifest(folder)
    assert (m.flavour, m.target, m.interface.kv_mode.name, m.portable.weights) == ("portable", "nnapi", "portable",
                                                                                    "int8")
    assert {"model.onnx", "prefill.onnx", "embeddings.npy", "model.onnx.data"} <= set(m.files)
    raw = json.loads((folder / "edgeinfer.json").read_text())
    raw["interface"]["inputs"]["attention_mask"]["shape"][3] += 1  # a graph of another ring
    write_manifest(folder, raw)
    with pytest.raises(Exception, match="attention_mask"):
        read_manifest(folder)


def test_ort_format_files_load_and_match_the_onnx_graphs(portable):
    import onnxruntime as ort
    folder = portable(STORIES_SRC, "coreml", "fp32", ort_format=True)
    assert {"model.ort", "prefill.ort"} <= set(read_manifest(folder).files)
    onnx_s = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    ort_s = ort.InferenceSession(str(folder / "model.ort"), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal(i.shape).astype(np.float32) * 0.1 for i in onnx_s.get_inputs()}
    for a, b in zip(onnx_s.run(None, feeds), ort_s.run(None, feeds)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_coreml_ort_files_keep_the_fp16_weights(portable):
    """A hostile round: ONNX Runtime's constant folding turned each fp16 weight and its Cast into an
    fp32 weight, so the coreml .ort files were 2.3x the fp16 data (and a 0.73B model failed to
    convert, past the format's 2 GiB). With folding off they hold the fp16 weights (plus the graph)."""
    folder = portable(STORIES_SRC, "coreml", "fp16", ort_format=True)
    data = (folder / "model.onnx.data").stat().st_size
    for name in ("model.ort", "prefill.ort"):
        assert (folder / name).stat().st_size < 1.5 * data, name


@pytest.mark.parametrize("target, quant", [("coreml", "fp32"), ("coreml", "fp16"), ("nnapi", "int8")])
def test_edgeinfer_computes_what_the_shipped_ort_graphs_compute(portable, target, quant):
    """A hostile round: edgeinfer ran an nnapi int8 folder's .onnx graphs at ONNX Runtime's full
    optimization, which fuses DequantizeLinear + MatMul into MatMulNBits at accuracy level 4 (int8
    activations); the .ort files that ship are optimized at the basic level and keep float ones.
    Logits were up to 0.5 apart, greedy text within 40-140 tokens. Now both graphs that edgeinfer
    opens compute what the shipped ones do."""
    import onnxruntime as ort
    folder = portable(STORIES_SRC, target, quant, ort_format=True)
    engine = edgeinfer.load(folder).engine
    for mine, name in ((engine.session.session, "model"), (engine.prefill_session, "prefill")):
        shipped = ort.InferenceSession(str(folder / f"{name}.ort"), providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        feeds = {i.name: rng.standard_normal(i.shape).astype(np.float32) * 0.1 for i in mine.get_inputs()}
        feeds["attention_mask"][:] = 0  # every slot visible
        np.testing.assert_allclose(mine.run(None, feeds)[0], shipped.run(None, feeds)[0], atol=1e-4)


@pytest.mark.parametrize("target, quant", [("nnapi", "int8"), ("coreml", "fp32"), ("coreml", "fp16")])
def test_inspect_json_describes_the_portable_weights_as_they_are(portable, target, quant, capsys):
    """A hostile round: `inspect --json` gave a portable int8 folder the fused graph's default scheme
    (blocks of 32, accuracy level 4, an int8 embedding); its weights are per output channel and its
    embedding an fp16 table on the host. It now says what the files hold (the text form did already)."""
    from edgeinfer.cli import main

    folder = portable(STORIES_SRC, target, quant)
    assert main(["inspect", str(folder), "--json"]) == 0
    q = json.loads(capsys.readouterr().out)["quantization"]
    table = np.load(folder / "embeddings.npy", mmap_mode="r")
    assert q == {"weights": quant, "per": "output channel" if quant == "int8" else None,
                 "embedding": {np.float16: "fp16", np.float32: "fp32"}[table.dtype.type], "embedding_on_host": True}


def test_a_file_the_manifest_names_must_be_listed_for_its_check(portable, tmp_path):
    """A hostile round: a portable manifest may name its embedding table or prefill graph under any
    file name; one that its "files" did not list (a name no listing rule covered, e.g. emb.dat) was
    read unchecked: a zeroed table loaded and gave "⁇ ⁇ ⁇". Every file the manifest names must be
    listed, as every graph, weights and tokenizer file in the folder must."""
    import shutil

    folder = tmp_path / "f"
    shutil.copytree(portable(STORIES_SRC, "coreml", "fp32"), folder)
    raw = json.loads((folder / "edgeinfer.json").read_text())
    (folder / "emb.dat").write_bytes((folder / "embeddings.npy").read_bytes())
    (folder / "embeddings.npy").unlink()
    del raw["files"]["embeddings.npy"]
    raw["portable"]["embeddings_file"] = "emb.dat"
    write_manifest(folder, raw)
    with pytest.raises(edgeinfer.ModelFormatError, match="names emb.dat but does not list it"):
        edgeinfer.load(folder)


def test_the_service_unit_of_a_portable_folder_counts_its_float32_weights(portable, monkeypatch):
    """The final review: portable sessions on the CPU fold their weights to float32, once per graph,
    but the unit's MemoryMax counted the folder's size on disk (int8: an eighth of it), so the kernel
    would have killed the service in a loop."""
    import edgeinfer.server.systemd as systemd
    from edgeinfer.cli import main
    from edgeinfer.inspect import parameter_count
    from edgeinfer.manifest import read_manifest

    folder = portable(STORIES_SRC, "nnapi", "int8")
    sized = []
    monkeypatch.setattr(systemd, "systemd_unit", lambda **kw: sized.append(kw["memory_max_bytes"]) or "")
    assert main(["serve", "-m", str(folder), "--port", "8080", "--slots", "1", "--print-systemd-unit"]) == 0
    spec = read_manifest(folder).arch
    on_disk = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    assert 2 * 4 * parameter_count(spec) > on_disk  # (int8 weights: about an eighth)
    assert sized[0] >= 2 * 4 * parameter_count(spec) + spec.kv_bytes_per_token  # weights, then a ring


def test_the_mobile_checker_refuses_a_fused_graph_with_a_convert_error():
    """A mobile review: `mobile_usability` on a fused graph raised a bare ValueError from ONNX Runtime's
    checker ("Run onnx.shape_inference..."); it is edgeinfer's ConvertError, saying what it judges."""
    from edgeinfer.converters.mobile_check import mobile_usability
    from edgeinfer.errors import ConvertError
    from edgeinfer.model import default_model_path

    with pytest.raises(ConvertError, match="judges the portable graphs"):
        mobile_usability(default_model_path() / "model.onnx")


@pytest.mark.parametrize("kind,says", [("bytes", "no array header"), ("npz", "a zip archive")])
def test_an_embeddings_file_that_is_not_an_array_is_refused_without_numpys_pickle_advice(portable, tmp_path, kind,
                                                                                          says):
    """A hostile round: random bytes as embeddings.npy (hashes made to match) were refused with numpy's
    "contains pickled (object) data ... load it unsafely using allow_pickle=": advice not to take. A
    review: an .npz under the name was an AttributeError (a traceback)."""
    import hashlib
    import io
    import shutil

    from edgeinfer.errors import ModelFormatError

    bad = tmp_path / "bad"
    shutil.copytree(portable(STORIES_SRC, "coreml", "fp32"), bad)
    if kind == "bytes":
        data = bytes(range(256)) * 64
    else:
        buf = io.BytesIO()
        np.savez(buf, e=np.load(bad / "embeddings.npy"))
        data = buf.getvalue()
    (bad / "embeddings.npy").write_bytes(data)
    m = json.loads((bad / "edgeinfer.json").read_text())
    m["files"]["embeddings.npy"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    write_manifest(bad, m)
    with pytest.raises(ModelFormatError, match=rf"embeddings.npy is not a .npy array \({says}\)") as e:
        edgeinfer.load(bad)
    assert "pickle" not in str(e.value)

"""Hostile tests for issue 12: the portable flavour (`convert --target coreml|nnapi`, PortableEngine),
the cuda target's fp16 KV ring on the CPU EP, device profiles and detection, `inspect --platform`,
`load(provider="auto")` and serve's profile defaults.

The first section holds what a user would expect and does not get today (each test names the
defect); the rest pins down what held up under attack and is not covered elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import edgeinfer
from conftest import STORIES_FIX, STORIES_SRC, TINY
from edgeinfer.cli import main
from edgeinfer.converters import convert
from edgeinfer.errors import ConvertError, EdgeInferError, InvalidArgumentError, ModelFormatError
from edgeinfer.integrity import sha256_file
from edgeinfer.overflow import ContextOverflowError
from edgeinfer.platforms import GENERIC, Detection, detect, detect_from_fixture, load_profiles
from edgeinfer.portable_engine import open_engine
from edgeinfer.session import DecoderSession

ROOT = Path(__file__).resolve().parents[1]
PLATFORM_FIX = ROOT / "tests" / "fixtures" / "platforms"
P = 16  # the prefill chunk the small portable folders are built with
C = 64  # and their capacity
PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """folders(name) -> a converted folder, each made once per module:
    p32 / p16: stories260K portable (coreml) fp32 / fp16 weights, capacity 64, prefill 16; p512: fp32, capacity
    512 (the trained length);
    f32 / f16 / cpu4: the fused cpu graph at fp32 / fp16 / int4; cuda: the cuda target (int4, fp16 KV);
    gqa-cuda / gqa-p: the tiny GQA llama as cuda (GroupQueryAttention, in place) and nnapi portable."""
    base = tmp_path_factory.mktemp("hostile")
    recipes = {
        "p32": (STORIES_SRC, dict(target="coreml", quant="fp32", capacity_tokens=C, prefill_tokens=P)),
        "p16": (STORIES_SRC, dict(target="coreml", capacity_tokens=C, prefill_tokens=P)),
        "p512": (STORIES_SRC, dict(target="coreml", quant="fp32", capacity_tokens=512, prefill_tokens=P)),
        "f32": (STORIES_SRC, dict(quant="fp32")),
        "f16": (STORIES_SRC, dict(quant="fp16")),
        "cpu4": (STORIES_SRC, dict()),
        "cuda": (STORIES_SRC, dict(target="cuda")),
        "gqa-cuda": (TINY / "llama2_gqa_tied", dict(target="cuda")),
        "gqa-p": (TINY / "llama2_gqa_tied", dict(target="nnapi", capacity_tokens=48, prefill_tokens=8)),
    }
    made: dict = {}

    def get(name):
        if name not in made:
            src, kw = recipes[name]
            convert(src, base / name, **kw)
            made[name] = base / name
        return made[name]

    return get


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_manifest(folder: Path, fn) -> None:
    m = json.loads((folder / "edgeinfer.json").read_text())
    fn(m)
    (folder / "edgeinfer.json").write_text(json.dumps(m))


def rehash(folder: Path) -> None:
    """Make the manifest's sizes and hashes agree with the files again (what a careless re-packer does)."""
    def fix(m):
        for name in list(m["files"]):
            if (folder / name).exists():
                m["files"][name] = {"bytes": (folder / name).stat().st_size, "sha256": sha256_file(folder / name)}
    edit_manifest(folder, fix)


def greedy(model, prompt, n, **kw):
    return model.generate(prompt, max_new_tokens=n, temperature=0, ignore_eos=True, **kw)


# =====================================================================================================
# Defects: these fail today
# =====================================================================================================

def test_portable_ring_below_the_chunk_matches_the_fused_graph(folders):
    """DEFECT: PortableEngine ignores load()'s prefill_chunk and its cap at the capacity (Engine uses
    min(prefill_chunk, capacity)); a ring smaller than P gets P-token prefill calls whose last rows see
    up to C + P - 1 tokens, so the same load() arguments give other tokens than the fused graph."""
    a = edgeinfer.load(folders("p32"), capacity_tokens=4, n_sink=1)
    b = edgeinfer.load(folders("f32"), capacity_tokens=4, n_sink=1, prefill_chunk=P)
    assert greedy(a, PROMPT, 30).token_ids == greedy(b, PROMPT, 30).token_ids


def test_portable_prefill_chunk_is_honoured(folders):
    """DEFECT (same cause): load(prefill_chunk=4) on a portable folder still prefills in one P-token call."""
    m = edgeinfer.load(folders("p32"), prefill_chunk=4)
    before = m.engine.calls
    m.generate(list(range(1, 17)), max_new_tokens=1)
    assert m.engine.calls - before == 4  # 16 prompt tokens in calls of 4, as the fused Engine does


def _tampered(folders, tmp_path, name, fn) -> Path:
    d = copy_folder(folders("p16"), tmp_path / name)
    fn(d)
    return d


def _swap_graphs(d: Path) -> None:
    a, b = (d / "model.onnx").read_bytes(), (d / "prefill.onnx").read_bytes()
    (d / "model.onnx").write_bytes(b)
    (d / "prefill.onnx").write_bytes(a)
    rehash(d)


def _prefill_is_decode(d: Path) -> None:
    edit_manifest(d, lambda m: m["portable"].update(prefill_file="model.onnx"))


def _same_ring_other_split(d: Path) -> None:  # R = C + P unchanged, so the interface check passes
    edit_manifest(d, lambda m: m["portable"].update(capacity_tokens=C + P // 2, prefill_tokens=P // 2))


@pytest.mark.parametrize("tamper", [_swap_graphs, _prefill_is_decode, _same_ring_other_split],
                         ids=["model-and-prefill-swapped", "prefill_file-names-the-decode-graph",
                              "capacity-and-prefill-resplit"])
def test_portable_graphs_that_do_not_match_the_manifest_are_refused_at_load(folders, tmp_path, tamper):
    """DEFECT: nothing compares the graphs' static shapes with the manifest's geometry; load succeeds
    and the first generate dies with onnxruntime's raw INVALID_ARGUMENT ("Got invalid dimensions")."""
    d = _tampered(folders, tmp_path, "t", tamper)
    with pytest.raises(ModelFormatError):
        m = edgeinfer.load(d)
        m.generate(PROMPT, max_new_tokens=2)  # (today: onnxruntime's InvalidArgument from here)


@pytest.mark.parametrize("dtype", ["int8", "<U1"])
def test_embeddings_of_a_non_float_dtype_are_refused_at_load(folders, tmp_path, dtype):
    """DEFECT: only the shape of embeddings.npy is checked; int8 rows load and generate garbage, text
    rows load and fail at the first prompt with numpy's "could not convert string to float"."""
    def tamper(d):
        e = np.load(d / "embeddings.npy")
        np.save(d / "embeddings.npy", (e * 100).astype(np.int8) if dtype == "int8" else np.full(e.shape, "a"))
        rehash(d)
    d = _tampered(folders, tmp_path, "t", tamper)
    with pytest.raises(ModelFormatError, match="embeddings"):
        edgeinfer.load(d)


@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_portable_file_names_stay_inside_the_folder(folders, tmp_path, where):
    """DEFECT: portable.embeddings_file / prefill_file are any strings, joined to the folder and never
    hashed unless listed: a manifest can make load() read a file outside the model folder."""
    outside = tmp_path / "outside.npy"
    np.save(outside, np.load(folders("p16") / "embeddings.npy"))
    name = str(outside) if where == "absolute" else "../outside.npy"
    d = _tampered(folders, tmp_path, "t", lambda d: edit_manifest(d, lambda m: m["portable"].update(
        embeddings_file=name)))
    with pytest.raises(ModelFormatError):
        edgeinfer.load(d)


def test_grouped_query_rows_over_coreml_limit_are_refused(tmp_path):
    """DEFECT: the portable graph groups queries as [1, Hkv, G*S, Dh] and the mask is [1, 1, G*P, R+P],
    but only C + 2P (and D, I) are checked against CoreML's 16,384: with G = 4 and P = 5000 the
    prefill graph has a dimension of 20,000 (converters/portable.py computes Gq and never uses it)."""
    out = tmp_path / "out"
    src = _trained_for(TINY / "llama3_mqa_untied_bf16", 8192, tmp_path)  # a ring of 5,000 within its length
    with pytest.raises(ConvertError, match="16384"):
        convert(src, out, target="coreml", capacity_tokens=5000, prefill_tokens=5000)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def _trained_for(src: Path, positions: int, tmp_path: Path) -> Path:
    """A copy of the Hugging Face folder `src` whose config says it was trained on `positions`."""
    dst = tmp_path / f"{src.name}-{positions}"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": positions}))
    return dst


@pytest.mark.parametrize("cap", [2, 4])
def test_a_capacity_convert_accepts_loads_with_the_defaults(tmp_path, cap):
    """DEFECT: --capacity 2..4 converts, but load(folder) with no arguments then fails ("n_sink must be
    in [0, capacity_tokens), got 4 for capacity 2"): the user never chose n_sink or a capacity."""
    out = tmp_path / "out"
    try:
        convert(STORIES_SRC, out, target="coreml", capacity_tokens=cap, prefill_tokens=4)
    except ConvertError:
        return  # refusing at convert time is fine too
    m = edgeinfer.load(out)
    assert greedy(m, "Once", 10).usage.completion_tokens == 10


@pytest.mark.parametrize("flag", [["--asymmetric"], ["--embedding", "int4"], ["--accuracy-level", "0"],
                                  ["--int8-tensors", "down_proj"], ["--block-size", "128"]])
def test_cli_quantization_flags_the_portable_graph_ignores_are_refused(tmp_path, capsys, flag):
    """DEFECT: cli_convert.run builds no scheme for coreml/nnapi, so these flags are silently dropped
    (the API refuses a scheme with "quantization schemes ... apply to the cpu/cuda graph")."""
    out = tmp_path / "out"
    rc = main(["convert", str(STORIES_SRC), "-o", str(out), "--target", "nnapi", "-q", *flag])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.startswith("edgeinfer: error: ") and len(err.splitlines()) == 1, (rc, err)
    assert not out.exists()


@pytest.mark.skipif(os.name != "posix", reason="RLIMIT_FSIZE")
def test_ort_format_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    """DEFECT: when ONNX Runtime cannot write the .ort file (disk full, quota, file-size limit) its
    converter raises onnxruntime's own Fail, which convert does not turn into a ConvertError: the CLI
    prints a traceback. (Simulated with RLIMIT_FSIZE: the .onnx files fit, the .ort files do not.)"""
    import resource
    import signal

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))

    r = subprocess.run([sys.executable, "-m", "edgeinfer", "convert", str(STORIES_SRC), "-o", str(tmp_path / "out"),
                        "--target", "nnapi", "--capacity", "64", "--prefill-tokens", "16", "--ort-format", "-q"],
                       preexec_fn=limit, capture_output=True, text=True, timeout=300, cwd=ROOT)
    err = r.stderr.strip()
    assert r.returncode == 1 and "Traceback" not in err, err[-600:]
    assert err.startswith("edgeinfer: error: ") and len(err.splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


def test_eval_with_its_default_window_on_a_small_portable_folder(folders, tmp_path, capsys):
    """DEFECT: `edgeinfer eval -m PORTABLE` uses a 512-token window; on a folder built with a smaller
    capacity it fails with "capacity_tokens=512 is over the 64 ...: convert again with --capacity",
    naming a setting eval does not have. Then it named --window, a setting the user never gave. Now it
    runs, its default window capped at the built ring."""
    text = tmp_path / "t.txt"
    text.write_text(PROMPT + "\n")
    rc = main(["eval", "-m", str(folders("p16")), "--text", str(text)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err


def test_inspect_platform_root_must_be_a_recorded_device(tmp_path, capsys):
    """DEFECT: --root accepts any folder: pointing it one level too deep (at a fixture's root/) or at an
    unrelated folder silently reports "generic-cpu: unknown device"; `edgeinfer power --root` refuses
    such a folder ("not a recorded device (a folder with root/ and platform.txt)")."""
    for wrong in (PLATFORM_FIX / "raspberry-pi-4" / "root", tmp_path):
        assert main(["inspect", "--platform", "--root", str(wrong)]) == 1, wrong
        err = capsys.readouterr().err.strip()
        assert err.startswith("edgeinfer: error: ") and "recorded device" in err and len(err.splitlines()) == 1
        with pytest.raises(InvalidArgumentError):
            detect_from_fixture(wrong)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs")
def test_a_fifo_in_the_profiles_folder_does_not_hang(tmp_path):
    """DEFECT: load_profile reads each *.toml with read_text, which blocks for ever on a FIFO
    (detect() guards its device files against exactly this; the profiles loader does not)."""
    for f in (ROOT / "platforms").glob("*.toml"):
        shutil.copy(f, tmp_path / f.name)
    os.mkfifo(tmp_path / "zz-fifo.toml")
    code = ("import sys\nfrom edgeinfer.platforms import load_profiles, ProfileError\n"
            "try:\n    load_profiles(sys.argv[1])\nexcept ProfileError as e:\n    print('refused', e)\n")
    try:
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("load_profiles hung on a FIFO named *.toml")
    assert r.stdout.startswith("refused") and "zz-fifo.toml" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("name,kw", [("p16", {"capacity_tokens": 8}), ("cuda", {"provider": "cpu"})])
def test_verbose_kv_breakdown_adds_up(folders, capsys, name, kw):
    """DEFECT (cosmetic): load(verbose=True) prints "(capacity + chunk) slots x ... x 4 bytes" always;
    a portable ring has the built R = C + P rows and the cuda ring 2-byte elements, so the breakdown
    does not multiply to the MiB printed beside it."""
    m = edgeinfer.load(folders(name), verbose=True, **kw)
    line = capsys.readouterr().err
    g = re.search(r"\((\d+) layers x 2 x (\d+) kv heads x (\d+) rows x (\d+) x (\d+) bytes;", line)
    assert g, line
    layers, heads, rows, dh, size = map(int, g.groups())
    assert layers * 2 * heads * rows * dh * size == m.cache.bytes, line


def test_serve_help_states_the_profile_defaults(capsys):
    """DEFECT (docs): serve's --slots and --power help still say "(default 2)" / "(default balanced)",
    but when neither the config nor a flag sets them they now come from the detected device profile."""
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--slots SLOTS", "--power {performance,balanced,battery,thermal-guard,off}"):
        text = out[out.rindex(flag) + len(flag):]  # the option's own help, not the usage line
        text = text[:text.index(" --")]
        assert "profile" in text, text


# =====================================================================================================
# What held up
# =====================================================================================================

@pytest.mark.parametrize("n", [1, 2, P - 1, P, P + 1, 2 * P - 1, 2 * P, 2 * P + 1, C - 1, C, C + 1, 3 * C + 5])
def test_portable_prompt_lengths_around_the_chunk_and_the_ring(folders, n):
    a = edgeinfer.load(folders("p32"), capacity_tokens=C)
    b = edgeinfer.load(folders("f32"), capacity_tokens=C, prefill_chunk=P)
    ids = [1] + np.random.default_rng(n).integers(3, 500, n - 1).tolist()
    x, y = greedy(a, ids, 24), greedy(b, ids, 24)
    assert x.token_ids == y.token_ids and x.usage == y.usage


@pytest.mark.parametrize("kw", [dict(overflow="truncate"), dict(overflow="error"), dict(n_sink=0),
                                dict(n_sink=C - 1), dict(capacity_tokens=20, overflow="truncate"),
                                dict(capacity_tokens=P, n_sink=2)])
def test_portable_overflow_policies_and_sinks_match_the_fused_graph(folders, kw):
    kw = {"capacity_tokens": C, **kw}
    a = edgeinfer.load(folders("p32"), **kw)
    b = edgeinfer.load(folders("f32"), prefill_chunk=P, **kw)
    for n in (5, 40):
        ids = [1] + np.random.default_rng(n).integers(3, 500, n - 1).tolist()
        x, y = greedy(a, ids, 30), greedy(b, ids, 30)
        assert (x.token_ids, x.finish_reason, x.usage) == (y.token_ids, y.finish_reason, y.usage)
    if kw.get("overflow") == "error":
        with pytest.raises(ContextOverflowError):
            greedy(a, list(range(1, C + 10)), 5)


def test_portable_capacity_bounds(folders):
    with pytest.raises(InvalidArgumentError, match="built for"):
        edgeinfer.load(folders("p32"), capacity_tokens=C + 1)
    m = edgeinfer.load(folders("p32"), capacity_tokens=C)
    with pytest.raises(InvalidArgumentError, match="built for"):
        m.engine.new_cache(C + 1, 0)
    for bad in (0, 1, -1, 2.5, "64", True):
        with pytest.raises(InvalidArgumentError):
            edgeinfer.load(folders("p32"), capacity_tokens=bad)


def _conversation_log(model):
    c, log = model.conversation(), []
    for i, text in enumerate(["Lily had a ball.", "Tom ran home.", "The sun was hot.", "They ate cake."]):
        s = c.stream_say(text, max_new_tokens=25, temperature=0, stop=["."] if i % 2 else None)
        try:
            if i == 2:  # abandoned half-way: rolled back
                for j, _ in enumerate(s):
                    if j == 5:
                        break
                s.close()
                log.append(("abandoned", len(c.messages), c.cache.n_valid))
                continue
            r = s.run_to_end()
        except ContextOverflowError as e:  # overflow="error": refused, rolled back
            log.append(("refused", str(e), len(c.messages), c.cache.n_valid))
            continue
        log.append((r.text, r.finish_reason, r.usage.dropped_tokens, c.cache.n_valid))
    return log


@pytest.mark.parametrize("overflow", ["shift", "truncate", "error"])
def test_portable_conversation_with_rollback_and_stops_matches_the_fused_graph(folders, overflow):
    a = edgeinfer.load(folders("p32"), capacity_tokens=C, overflow=overflow)
    b = edgeinfer.load(folders("f32"), capacity_tokens=C, overflow=overflow, prefill_chunk=P)
    assert _conversation_log(a) == _conversation_log(b)


def test_two_threads_on_one_portable_model(folders):
    m = edgeinfer.load(folders("p16"))
    prompts = ["Once upon a time", "Lily had a red ball and", "The dog ran to the park because it was"]
    want = [m.conversation().say(p, max_new_tokens=120, temperature=0, ignore_eos=True).text for p in prompts]
    want.append(greedy(m, prompts[0], 120).text)
    got = [None] * 4

    def run(i):
        got[i] = greedy(m, prompts[0], 120).text if i == 3 else \
            m.conversation().say(prompts[i], max_new_tokens=120, temperature=0, ignore_eos=True).text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == want


@pytest.mark.parametrize("portable,fused", [("p32", "f32"), ("p16", "f16")])
def test_long_portable_generation_stays_on_the_fused_graph(folders, portable, fused):
    """2,000 greedy tokens through a ring of 64: ~30 wraps and ~2,000 tokens of re-basing."""
    a = edgeinfer.load(folders(portable), capacity_tokens=C)
    b = edgeinfer.load(folders(fused), capacity_tokens=C, prefill_chunk=P)
    x, y = greedy(a, PROMPT, 2000), greedy(b, PROMPT, 2000)
    assert x.token_ids == y.token_ids and x.usage.dropped_tokens == y.usage.dropped_tokens > 1900
    assert a.cache.rebased_tokens > 1000


def test_fp16_ring_rebasing_does_not_drift(folders):
    """The cuda folder (fp16 KV) beside the int4 CPU graph, teacher-forced over 2,000 tokens through a
    ring of 64 (re-based ~every 16 tokens): the gap stays where it starts."""
    ea = open_engine(DecoderSession(folders("cuda"), provider="cpu"), 16)
    eb = open_engine(DecoderSession(folders("cpu4")), 16)
    ca, cb = ea.new_cache(C, 4), eb.new_cache(C, 4)
    assert ca.k[0].dtype == np.float16
    ids = np.random.default_rng(1).integers(3, 500, 2000).tolist()
    gap, agree = [], []
    for t in ids:
        a, b = ea.decode_one(ca, t), eb.decode_one(cb, t)
        gap.append(float(np.abs(a - b).max()))
        agree.append(a.argmax() == b.argmax())
    assert ca.rebased_tokens > 1500
    first, last = np.mean(gap[:400]), np.mean(gap[-400:])
    assert last <= 1.5 * first and np.mean(agree[-400:]) >= 0.9, (first, last)


def test_fp16_ring_without_sinks_rebases_like_no_rebase(folders):
    """Re-basing is a rotation: with no sinks, a ring that re-bases and one that never does give the
    same logits up to fp16 noise (measured 0.43 max; the int4 CPU graph's own int8-activation noise 0.21)."""
    from edgeinfer.kv_cache import RingKVCache

    e = open_engine(DecoderSession(folders("cuda"), provider="cpu"), 16)
    ids = np.random.default_rng(2).integers(3, 500, 300).tolist()
    outs = []
    for every in (None, 10_000):
        c = RingKVCache(e.spec, C, 0, 16, e.mode, rebase_every_tokens=every, dtype=e.kv_dtype)
        outs.append(np.array([e.decode_one(c, t).copy() for t in ids]))
    assert np.abs(outs[0] - outs[1]).max() < 1.0
    assert (outs[0].argmax(-1) == outs[1].argmax(-1)).mean() >= 0.95


@pytest.mark.parametrize("family", ["llama_linear_rope_bias", "llama3_mqa_untied_bf16"])
def test_portable_rope_scaling_matches_the_fused_graph_through_rebasing(tmp_path, family):
    convert(TINY / family, tmp_path / "p", target="coreml", quant="fp32", capacity_tokens=C, prefill_tokens=8)
    convert(TINY / family, tmp_path / "f", quant="fp32")
    pe, fe = open_engine(DecoderSession(tmp_path / "p"), 8), open_engine(DecoderSession(tmp_path / "f"), 8)
    pc, fc = pe.new_cache(C, 2), fe.new_cache(C, 2)
    np.testing.assert_allclose(pe.prefill(pc, list(range(1, 40))), fe.prefill(fc, list(range(1, 40))), atol=2e-4)
    for t in range(150):
        np.testing.assert_allclose(pe.decode_one(pc, t + 3), fe.decode_one(fc, t + 3), atol=2e-4)
    assert pc.rebased_tokens == fc.rebased_tokens > 0


@pytest.mark.parametrize("name", ["p16", "gqa-p", "gqa-cuda", "cuda"])
def test_daemon_serves_portable_and_cuda_folders_like_in_process(folders, name):
    import concurrent.futures as cf

    from edgeinfer.server.config import ServeConfig
    from test_server import KEY, Running

    folder = folders(name)
    r = Running(ServeConfig(model=str(folder), api_key=KEY, slots=3, queue=4, max_tokens_limit=200))
    try:
        if name == "gqa-cuda":
            assert type(r.server.scheduler.stepper).__name__ == "DecodeBatcher"  # fp16 rows batched
        ref = edgeinfer.load(folder, provider="cpu")
        cl = r.client()
        prompts = [[1, 5, 9, 2], list(range(1, 12)), [1] + list(range(20, 80))]

        def ask(p):
            c = cl.completions.create(model=r.server.model_id, prompt=p, max_tokens=60, temperature=0,
                                      extra_body={"ignore_eos": True})
            return c.choices[0].text

        with cf.ThreadPoolExecutor(3) as ex:
            got = list(ex.map(ask, prompts))
        assert got == [greedy(ref, p, 60).text for p in prompts]
        assert [ask(p) for p in prompts] == got  # again, reusing the slots' prefixes
        c = cl.completions.create(model=r.server.model_id, prompt="Once upon a time", max_tokens=80, temperature=0,
                                  stop=["."])
        w = ref.generate("Once upon a time", max_new_tokens=80, temperature=0, stop=["."])
        assert (c.choices[0].text, c.choices[0].finish_reason) == (w.text, w.finish_reason)
    finally:
        r.stop()


# --- tampered folders that are refused as they should be ---

@pytest.mark.parametrize("what", ["shape", "garbage", "object", "prefill-missing", "portable-garbage",
                                  "portable-cap-str", "fused-claims-portable", "kv-fp16"])
def test_tampered_portable_folder_is_a_clear_load_error(folders, tmp_path, what):
    def tamper(d):
        if what == "shape":
            np.save(d / "embeddings.npy", np.load(d / "embeddings.npy")[:, :-1])
            rehash(d)
        elif what == "garbage":
            (d / "embeddings.npy").write_bytes(b"garbage")
            rehash(d)
        elif what == "object":
            np.save(d / "embeddings.npy", np.load(d / "embeddings.npy").astype(object))
            rehash(d)
        elif what == "prefill-missing":
            (d / "prefill.onnx").unlink()
        elif what == "portable-garbage":
            edit_manifest(d, lambda m: m.update(portable="garbage"))
        elif what == "portable-cap-str":
            edit_manifest(d, lambda m: m["portable"].update(capacity_tokens="64"))
        elif what == "fused-claims-portable":
            edit_manifest(d, lambda m: m.update(flavour="fused"))
        elif what == "kv-fp16":
            edit_manifest(d, lambda m: m["interface"].update(kv_dtype="float16"))
    d = _tampered(folders, tmp_path, "t", tamper)
    with pytest.raises(ModelFormatError) as e:
        edgeinfer.load(d)
    assert len(str(e.value).splitlines()) == 1


# --- convert's portable options ---

@pytest.mark.parametrize("kw", [dict(capacity_tokens=0), dict(capacity_tokens=1), dict(capacity_tokens=-5),
                                dict(capacity_tokens=10**20), dict(capacity_tokens="64"), dict(capacity_tokens=64.0),
                                dict(capacity_tokens=True), dict(capacity_tokens=np.int64(64)),
                                dict(prefill_tokens=0), dict(prefill_tokens=1), dict(prefill_tokens=None, capacity_tokens=16330),
                                dict(capacity_tokens=2, prefill_tokens=8192),
                                dict(capacity_tokens=8, prefill_tokens=64)])  # a chunk past the ring: 10 GB for 8188
def test_bad_portable_geometry_is_refused_before_any_work(tmp_path, kw):
    with pytest.raises(ConvertError, match="--capacity|--prefill-tokens"):
        convert(STORIES_SRC, tmp_path / "out", target="nnapi", **kw)
    assert list(tmp_path.iterdir()) == []


def test_geometry_at_the_coreml_limit_converts(tmp_path):
    src = _trained_for(STORIES_SRC, 16384, tmp_path)
    m = convert(src, tmp_path / "out", target="coreml", capacity_tokens=16380, prefill_tokens=2)
    assert m.portable.ring_rows + m.portable.prefill_tokens == 16384
    assert m.default_capacity_tokens == 4096  # capped at the largest default


def test_ort_format_folder_is_clean_and_loads(tmp_path):
    m = convert(STORIES_SRC, tmp_path / "out", target="nnapi", capacity_tokens=C, prefill_tokens=P, ort_format=True)
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"model.ort", "prefill.ort"} <= names and not [n for n in names if "required_operators" in n
                                                          or n.endswith(".basic.ort")]
    assert set(m.files) <= names and os.environ.get("ORT_CONVERT_ONNX_MODELS_TO_ORT_OPTIMIZATION_LEVEL") is None
    assert greedy(edgeinfer.load(tmp_path / "out"), "Once", 5).usage.completion_tokens == 5
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


# --- detection and profiles ---

def test_detection_on_hostile_device_files(tmp_path):
    root = tmp_path / "root"
    (root / "proc/device-tree").mkdir(parents=True)
    os.mkfifo(root / "proc/cpuinfo")  # a FIFO as /proc/cpuinfo would block a plain read
    (root / "proc/device-tree/model").symlink_to("/dev/zero")  # a device that never ends
    (root / "etc").mkdir()
    (root / "etc/nv_tegra_release").symlink_to(root / "etc/nv_tegra_release")  # a loop
    (root / "system").mkdir()
    (root / "system/build.prop").write_bytes(b"\x00" * 10 + b"ro.product.model=\xff\xfe\n" * 10000)
    d = detect(root, {"ANDROID_ROOT": "\x00" * 5}, "linux", "aarch64")
    assert d.profile.name == "android-arm64" and len(d.warnings) >= 2
    assert all(len(e) < 400 for e in d.evidence)
    looped = tmp_path / "loop"
    looped.symlink_to(looped)
    for odd in (looped, tmp_path / "nothing"):
        assert detect(odd, {}, "linux", "aarch64").profile.name == GENERIC
    for machine in (None, 123, "", "x" * 10_000, "AMD64"):
        assert isinstance(detect(tmp_path / "nothing", {}, "linux", machine), Detection)


def test_pi_string_past_the_read_limit_is_not_read(tmp_path):
    root = tmp_path / "root"
    (root / "proc").mkdir(parents=True)
    (root / "proc/cpuinfo").write_text("processor : 0\n" * 10_000 + "Model : Raspberry Pi 5 Model B\n")
    d = detect(root, {}, "linux", "aarch64")
    assert d.profile.name == GENERIC and d.warnings == ()


@pytest.mark.parametrize("content", [b"\x00\x01\x02binary", b"name = 'x'\n" * 2, "name = \"généric\"".encode("latin-1"),
                                     b"[[[", b"\xef\xbb\xbfname = 'generic-cpu'"])
def test_malformed_profile_bytes_are_a_profile_error(tmp_path, content):
    from edgeinfer.platforms import ProfileError

    for f in (ROOT / "platforms").glob("*.toml"):
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "bad.toml").write_bytes(content)
    with pytest.raises(ProfileError, match="bad.toml"):
        load_profiles(tmp_path)


@pytest.mark.parametrize("argv,rc", [
    (["inspect", "--platform", "--json"], 0),
    (["inspect", "--platform", "--root", str(PLATFORM_FIX / "jetson-agx-orin"), "--json"], 0),
    (["inspect", "--platform", "--root", "/etc/passwd"], 1),
    (["inspect", "--platform", "--root", str(PLATFORM_FIX / "android-arm64"), "--verify"], 1),
])
def test_inspect_platform_flag_combinations(capsys, argv, rc):
    assert main(argv) == rc
    out, err = capsys.readouterr()
    if rc == 0 and "--json" in argv:
        data = json.loads(out)
        assert data["profile"]["name"] in load_profiles()
        assert ("provider" in data) == ("--root" not in argv)
    else:
        assert err.startswith("edgeinfer: error: ") and len(err.strip().splitlines()) == 1


def test_auto_provider_on_portable_and_cuda_folders_runs_on_this_cpu(folders):
    for name in ("p16", "cuda"):
        assert edgeinfer.load(folders(name)).session.provider == "cpu"
    with pytest.raises(InvalidArgumentError):
        edgeinfer.load(folders("p16"), provider="coreml")


def test_serve_profile_defaults_follow_detection_and_yield_to_the_config(tmp_path, monkeypatch):
    import edgeinfer.platforms as P
    from edgeinfer.server.config import load_config

    android = P.load_profiles()["android-arm64"]
    monkeypatch.setattr(P, "detect", lambda *a, **k: P.Detection(profile=android, evidence=("t",), note=None))
    c = load_config(None, {"slots": None, "power": None})
    assert (c.slots, c.power) == (android.daemon_slots, android.power_policy)
    f = tmp_path / "s.toml"
    f.write_text('power = "balanced"\nmax-temp-c = 70\n')
    c = load_config(str(f), {})
    assert (c.slots, c.power, c.max_temp_c) == (android.daemon_slots, "balanced", 70)
    f.write_text("slots = 0\n")
    with pytest.raises(InvalidArgumentError, match="slots"):
        load_config(str(f), {})


def test_a_small_ring_gets_a_prefill_chunk_no_larger_than_itself(tmp_path):
    m = convert(STORIES_SRC, tmp_path / "out", target="nnapi", capacity_tokens=8)
    assert (m.portable.capacity_tokens, m.portable.prefill_tokens) == (8, 8)


def test_speculation_on_a_portable_graph_is_refused_not_run_plain(folders):
    """A portable graph verifies no drafts: speculative="ngram" ran plain decoding without a word."""
    m = edgeinfer.load(folders("p32"))
    with pytest.raises(InvalidArgumentError, match="portable graph"):
        greedy(m, PROMPT, 4, speculative="ngram")
    assert greedy(m, PROMPT, 4).finish_reason == "length"  # the refusal left the model usable


def test_serve_with_speculation_on_a_portable_folder_is_refused_at_start(folders):
    from edgeinfer.server.config import ServeConfig
    from edgeinfer.server.run import build

    with pytest.raises(InvalidArgumentError, match="portable graph"):
        build(ServeConfig(model=str(folders("p32")), speculative="ngram"))


def test_a_service_unit_is_refused_for_settings_its_start_would_refuse(folders, capsys):
    """`--print-systemd-unit` printed a unit (exit 0) for settings the service then refused as it
    started, so systemd would restart it in a loop (a docs round): speculation on a portable folder,
    a ring past the trained length. It now loads the model as the service does, and says why not."""
    from edgeinfer.cli import main

    for flags, needle in ((["-m", str(folders("p32")), "--speculative", "ngram"], "portable graph"),
                          (["--capacity", "100000"], "more than this model's trained length")):
        assert main(["serve", "--port", "8080", *flags, "--print-systemd-unit"]) == 1
        captured = capsys.readouterr()
        assert captured.out == "" and needle in captured.err and len(captured.err.strip().splitlines()) == 1


def test_eval_of_a_portable_folder_says_it_scored_the_decode_graph(folders, tmp_path):
    """Its forward gives one position's logits per call, so every window runs token by token: the
    result said "prefill"."""
    from edgeinfer.evaluate import perplexity

    text = tmp_path / "t.txt"
    text.write_text(PROMPT + "\n")
    r = perplexity(folders("p32"), text, window=C)
    fused = perplexity(folders("f32"), text, window=C, path="decode")
    assert r.path == "decode" and r.scored_tokens == fused.scored_tokens
    assert r.perplexity == pytest.approx(fused.perplexity, rel=1e-3)


@pytest.mark.parametrize("name,ring,fit,prompt,gen", [("p32", 64, 56, 40, 16), ("p512", 480, 472, 400, 72)])
def test_bench_advice_on_a_small_portable_ring_is_advice_that_works(folders, capsys, name, ring, fit, prompt, gen):
    """The defaults (512 + 128 tokens) do not fit a portable ring: the error named capacity_tokens=648,
    a number the user never gave. On a ring built at the trained length (512), the advice was
    --capacity 512 (a ring that re-bases every token, 4x slower) or 504 tokens in all (which still
    shifted through the 480-token default ring); now it names the 480 a ring holds without re-basing
    often. Following the advice keeps the job whole."""
    rc = main(["bench", "-m", str(folders(name)), "--runs", "1"])
    err = capsys.readouterr().err
    assert rc != 0 and f"--capacity {ring} " in err and f"--prompt-tokens + --gen-tokens up to {fit}" in err, err
    assert main(["bench", "-m", str(folders(name)), "--runs", "1", "--prompt-tokens", str(prompt), "--gen-tokens",
                 str(gen), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["capacity_tokens"] == ring


def test_bench_note_on_a_job_past_the_rebase_room_does_not_blame_training(folders, capsys):
    """A 500-token job on a 512-token model was said to be longer than the model was trained on."""
    assert main(["bench", "-m", str(folders("f32")), "--runs", "1", "--prompt-tokens", "400", "--gen-tokens",
                 "100"]) == 0
    out = capsys.readouterr().out
    assert "the KV ring holds 480 tokens, fewer than the job's 500" in out
    assert "the most this model holds without re-basing often" in out
    assert "trained" not in out, out


def test_a_portable_ring_past_the_trained_length_is_refused_at_convert(tmp_path):
    """--capacity over the model's trained length (stories260K: 512) is refused before any work, and
    nothing is left behind; without --capacity the default ring is cut to that length."""
    with pytest.raises(ConvertError, match=r"--capacity 1024 is over the model's trained length of 512 positions"):
        convert(STORIES_SRC, tmp_path / "big", target="nnapi", capacity_tokens=1024)
    assert not (tmp_path / "big").exists() and os.listdir(tmp_path) == []
    tiny = TINY / "llama2_gqa_tied"  # trained on 256: the default portable ring (512) is cut to it
    m = convert(tiny, tmp_path / "tiny", target="nnapi")
    assert m.portable.capacity_tokens == 256
    assert edgeinfer.load(tmp_path / "tiny").capacity_tokens == 240
    with pytest.raises(ConvertError, match=r"--prefill-tokens 300 is over the model's trained length of 256"):
        convert(tiny, tmp_path / "tiny300", target="nnapi", prefill_tokens=300)  # was cut to 256 without a word


def test_the_profiles_capacity_leaves_portable_and_draft_rings_alone(folders, monkeypatch):
    """A portable model's ring rows are fixed by its graphs: the profile's smaller capacity saved no
    memory, only context (a review). A draft model's ring is its own default, not the device's."""
    import dataclasses
    import edgeinfer.platforms as P

    profile = dataclasses.replace(load_profiles()["raspberry-pi-4"], capacity_tokens=16, threads=1)
    monkeypatch.setattr(P, "detect", lambda *a, **k: Detection(profile=profile, evidence=("t",), note=None))
    assert edgeinfer.load(folders("p32")).capacity_tokens == 64
    target = edgeinfer.load(folders("f32"))
    assert target.capacity_tokens == 16
    target.set_draft(folders("f32"))
    assert target.engine.draft.capacity_tokens == 480


def test_bench_past_the_rebase_room_runs_in_the_models_largest_ring_not_the_devices(folders, monkeypatch, capsys):
    """A job past what the model holds without re-basing often runs in that ring (480 of 512), which
    bench now gives: left to load's default, a device profile's smaller ring would have run it."""
    import dataclasses
    import edgeinfer.platforms as P

    profile = dataclasses.replace(load_profiles()["raspberry-pi-4"], capacity_tokens=64, threads=1)
    monkeypatch.setattr(P, "detect", lambda *a, **k: Detection(profile=profile, evidence=("t",), note=None))
    assert main(["bench", "-m", str(folders("f32")), "--runs", "1", "--prompt-tokens", "400", "--gen-tokens", "100",
                 "--threads", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["capacity_tokens"] == 480

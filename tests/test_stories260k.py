"""The real model: stories260K (Karpathy's TinyStories 260K Llama) against its golden files.

golden.json: 64 greedy ids per prompt from transformers FP32; eval_ppl.json: perplexity 5.6836 on
eval.txt by the method `edgeinfer eval` implements. Quantized folders must stay within the
issue's bounds (int8 +1 %; int4 +5 %, which the default int4 meets in blocks of 16, as `convert` takes
them for a model this narrow).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import edgeinfer
from conftest import STORIES_FIX, STORIES_SRC
from edgeinfer.cli import main
from edgeinfer.evaluate import perplexity
from edgeinfer.engine import Engine
from edgeinfer.session import DecoderSession

GOLDEN = json.loads((STORIES_FIX / "golden.json").read_text())
REF_PPL = json.loads((STORIES_FIX / "eval_ppl.json").read_text())["perplexity"]
EVAL_TXT = STORIES_FIX / "eval.txt"


def greedy_with_cache(folder, prompt: list[int], n: int) -> list[int]:
    eng = Engine(DecoderSession(folder))
    cache = eng.new_cache(512, 0)
    out = [int(eng.prefill(cache, prompt).argmax())]
    while len(out) < n:
        out.append(int(eng.decode_one(cache, out[-1]).argmax()))
    return out


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["prompt"][:16] or "<bos>")
def test_fp32_greedy_reproduces_golden(case, converted):
    assert greedy_with_cache(converted(STORIES_SRC, "fp32"), case["prompt_ids"], 64) == case["greedy_ids"]


def test_fp32_top5_logits_at_prompt_end(converted):
    eng = Engine(DecoderSession(converted(STORIES_SRC, "fp32")))
    for case in GOLDEN["cases"]:
        cache = eng.new_cache(512, 0)
        last = eng.prefill(cache, case["prompt_ids"])
        ref_ids, ref_logits = case["top5_last_prompt_pos"]["ids"], case["top5_last_prompt_pos"]["logits"]
        assert np.argsort(-last)[:5].tolist() == ref_ids
        assert np.abs(last[ref_ids] - np.asarray(ref_logits)).max() < 1e-4


@pytest.mark.parametrize("quant,bound", [("fp32", 0.001), ("int8", 0.01)])
def test_perplexity_within_bound(quant, bound, converted):
    r = perplexity(converted(STORIES_SRC, quant), EVAL_TXT)
    assert r.scored_tokens == 7898 and r.n_windows == 21
    if quant == "fp32":
        assert abs(r.perplexity / REF_PPL - 1) < bound
    else:
        assert r.perplexity / REF_PPL - 1 < bound


@pytest.mark.parametrize("kw,bound", [
    ({}, 0.13),  # gptq, embedding int4 too, blocks of 32 (a wider model's default): +7.0 % (asym's +12.2 % passes too)
    ({"recipe": "rtn"}, 0.16),  # symmetric round to nearest (the default until 2026-12-01): +15.2 %
    ({"embedding": "int8", "int8_tensors": ("qkv_proj", "down_proj")}, 0.05),  # mixed recipe: +2.1 %
])
def test_int4_block32_perplexity(kw, bound, converted):
    r = perplexity(converted(STORIES_SRC, "int4", **kw), EVAL_TXT)
    assert r.perplexity / REF_PPL - 1 < bound


def test_the_default_int4_of_a_model_this_narrow_is_within_5_percent(tmp_path):
    """Issue 14's bar for stories260K: the default int4 within +5 % of fp32. In blocks of 32 its rows
    of 64 inputs had two scales each: +7.0 % at best (gptq). `convert` now takes blocks of 16 for int4
    of a model of hidden size under 128 (`default_block_size`): measured 5.9549 (+4.77 %) on the
    prefill path and 5.9573 (+4.82 %) on the decode path; in three other paragraph orders of the
    calibration text 5.9317, 5.9015, 5.9286."""
    from edgeinfer.converters import convert
    from edgeinfer.manifest import read_manifest

    folder = tmp_path / "default"
    convert(STORIES_SRC, folder)
    q = read_manifest(folder).quantization
    assert (q.weights, q.block_size, q.recipe, q.embedding) == ("int4", 16, "gptq", "int4")
    for path in ("prefill", "decode"):
        r = perplexity(folder, EVAL_TXT, path=path)
        assert r.scored_tokens == 7898 and r.perplexity / REF_PPL - 1 < 0.05, (path, r.perplexity)


def test_eval_cli_json(capsys, converted):
    folder = converted(STORIES_SRC, "fp32")
    assert main(["eval", "-m", str(folder), "--text", str(EVAL_TXT), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["scored_tokens"] == 7898
    assert abs(out["perplexity"] - REF_PPL) < 1e-3


def test_eval_cli_window_changes_count(capsys, converted):
    folder = converted(STORIES_SRC, "fp32")
    assert main(["eval", "-m", str(folder), "--text", str(EVAL_TXT), "--window", "128", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # 16 stories, 7919 ids with BOS: every 128-token window loses its first token to scoring
    assert out["scored_tokens"] == 7919 - out["n_windows"]
    assert out["model"] == str(folder) and out["text"] == str(EVAL_TXT)  # a saved result says what it measured
    assert out["versions"]["edgeinfer"] == edgeinfer.__version__


def test_eval_json_names_relative_paths_absolutely(capsys, converted, monkeypatch):
    folder = converted(STORIES_SRC, "fp32")
    monkeypatch.chdir(folder.parent)
    assert main(["eval", "-m", folder.name, "--text", os.path.relpath(EVAL_TXT), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == os.path.join(os.getcwd(), folder.name)
    assert out["text"] == os.path.abspath(os.path.relpath(EVAL_TXT))  # absolute, links kept as given


def test_inspect_describes_the_folder(capsys, converted):
    folder = converted(STORIES_SRC, "int8")
    assert main(["inspect", str(folder)]) == 0
    text = capsys.readouterr().out
    assert "llama: 0.26 M parameters, 5 layers" in text and "weights int8" in text
    assert "2560 bytes per token" in text  # 5 layers * 2 * 4 kv heads * 16 dims (widened from 8) * 4 bytes
    assert main(["inspect", str(folder), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    from edgeinfer.converters.safetensors_io import Checkpoint

    n_source = sum(int(np.prod(t.shape)) for t in Checkpoint(STORIES_SRC).tensors.values())
    assert s["kv_bytes_per_token"] == 2560 and s["source_head_dim"] == 8 and s["parameters"] == n_source


def test_inspect_sizes_the_model_by_its_manifest_and_warns_of_damaged_files(capsys, converted, tmp_path):
    """Hostile round: a backup of the weights and 50 MB of notes in the folder made inspect print
    23.31 bits per weight and 50.79 MB for an int8 model; a deleted or truncated model.onnx.data
    0.98 and 4.06 bits per weight, exit 0 and no warning. Sizes now come from the files the manifest lists; a
    listed file that is missing or of another size is named (inspect --verify checks every byte)."""
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(converted(STORIES_SRC, "int8"), folder)
    assert main(["inspect", str(folder), "--json"]) == 0
    clean = json.loads(capsys.readouterr().out)
    assert clean["file_problems"] == [] and clean["bits_per_weight"] > 8
    shutil.copy(folder / "model.onnx.data", folder / "model.onnx.data.bak")
    (folder / "notes.bin").write_bytes(b"\0" * 5_000_000)
    assert main(["inspect", str(folder), "--json"]) == 0
    cluttered = json.loads(capsys.readouterr().out)
    assert cluttered["size_on_disk_bytes"] == clean["size_on_disk_bytes"]
    assert cluttered["bits_per_weight"] == clean["bits_per_weight"] and cluttered["file_problems"] == []
    with open(folder / "model.onnx.data", "r+b") as f:
        f.truncate(1000)
    assert main(["inspect", str(folder)]) == 0
    text = capsys.readouterr().out
    assert "WARNING: model.onnx.data is 1000 bytes, the manifest says" in text
    (folder / "model.onnx.data").unlink()
    assert main(["inspect", str(folder)]) == 0
    assert "WARNING: model.onnx.data is missing" in capsys.readouterr().out

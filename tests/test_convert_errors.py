"""Bad input to `edgeinfer convert`: a one-line error naming the problem, exit 1, no traceback,
no partial destination left behind, and an existing destination untouched."""

from __future__ import annotations

import errno
import json
import shutil
import time
from pathlib import Path

import pytest

import edgeinfer
from conftest import TINY, write_manifest
from edgeinfer.cli import main

SRC = TINY / "llama2_gqa_tied"


@pytest.fixture
def src(tmp_path) -> Path:
    d = tmp_path / "src"
    shutil.copytree(SRC, d)
    (d / "reference.npz").unlink()
    return d


def run_convert(capsys, src: Path, dst: Path, *extra: str) -> tuple[int, str]:
    rc = main(["convert", str(src), "-o", str(dst), "-q", *extra])
    err = capsys.readouterr().err
    return rc, err


def assert_user_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgeinfer: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def assert_no_partial(parent: Path) -> None:
    assert not [p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def edit_config(src: Path, **changes) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (src / "config.json").write_text(json.dumps(cfg))


def rewrite_tensor(src: Path, name: str, shape=None, dtype=None, drop=False, add=None) -> None:
    """Rewrite model.safetensors with one entry changed (shape, dtype tag), dropped, or one extra."""
    raw = (src / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    blobs = {k: data[v["data_offsets"][0]:v["data_offsets"][1]] for k, v in header.items() if k != "__metadata__"}
    metas = {k: dict(v) for k, v in header.items() if k != "__metadata__"}
    if drop:
        del blobs[name], metas[name]
    if shape is not None:
        metas[name]["shape"] = shape
        blobs[name] = bytes(4 * int(__import__("numpy").prod(shape)))
    if dtype is not None:
        metas[name]["dtype"] = dtype
    if add:
        metas[add] = {"dtype": "F32", "shape": [4]}
        blobs[add] = bytes(16)
    off, out = 0, b""
    for k in metas:
        metas[k]["data_offsets"] = [off, off + len(blobs[k])]
        off += len(blobs[k])
        out += blobs[k]
    h = json.dumps(metas).encode()
    (src / "model.safetensors").write_bytes(len(h).to_bytes(8, "little") + h + out)


def test_missing_source(capsys, tmp_path):
    rc, err = run_convert(capsys, tmp_path / "nope", tmp_path / "out")
    assert_user_error(rc, err, "source not found")
    assert not (tmp_path / "out").exists()


def test_source_is_a_file(capsys, tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"x")
    rc, err = run_convert(capsys, f, tmp_path / "out")
    assert_user_error(rc, err, "a Hugging Face model folder or a GGUF file")


def test_missing_config(capsys, src, tmp_path):
    (src / "config.json").unlink()
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err, "missing config.json")
    assert_no_partial(tmp_path)


def test_config_not_json(capsys, src, tmp_path):
    (src / "config.json").write_text("{not json")
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err, "config.json is not valid JSON")


def test_missing_tokenizer(capsys, src, tmp_path):
    (src / "tokenizer.model").unlink()
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err, "no tokenizer")


def test_unsupported_architecture_lists_supported(capsys, src, tmp_path):
    edit_config(src, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err, "unsupported architecture 'GPT2LMHeadModel'", "LlamaForCausalLM", "Qwen3ForCausalLM")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("changes,needle", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_size": -64}, "'hidden_size' must be a positive integer"),
    ({"rope_scaling": "linear"}, "'rope_scaling' must be an object"),
    ({"architectures": "LlamaForCausalLM"}, "architectures must be a list of names"),
    ({"max_position_embeddings": 2}, "must be at least 16"),
    # past the bounds load checks: refused before writing a folder that `load` calls corrupted (review)
    ({"max_position_embeddings": 2 ** 28}, "config.json: field 'max_position_embeddings' must be in 1.."),
    ({"num_hidden_layers": 5000}, "config.json: field 'num_hidden_layers' must be in 1..4,096"),
    # before RoPE's table is made from them (a hostile round: 2**29 took 3 GB and 30 s, 2**63 a traceback)
    ({"head_dim": 2 ** 29}, "config.json: field 'head_dim' must be in 1..4,096, got 536,870,912"),
    ({"head_dim": 2 ** 63}, "config.json: field 'head_dim' must be in 1..4,096"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 10 ** 400}},
     "field 'rope_scaling.original_max_position_embeddings' must be in 1..134,217,728, got a number of 401 digits"),
    ({"rope_parameters": "x"}, "'rope_parameters' must be an object"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": "abc"}, "sliding_window"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 3}, "integer >= 16"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": [4096]}, "sliding_window"),
    # two rope blocks that disagree: transformers 5.24 takes rope_scaling, our reading took rope_parameters
    ({"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
      "rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "disagree on 'rope_type'"),
    ({"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
      "rope_scaling": {"type": "linear", "factor": 4.0}}, "disagree on 'rope_type'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
     "disagree on 'factor'"),
    ({"rope_theta": 10000.0, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}},
     "rope_theta is 10000.0 at the top level but 1000000.0"),
    # transformers 5.24 lets the top-level value win; it was read from the block
    ({"original_max_position_embeddings": 16, "rope_theta": 500000.0, "rope_parameters": {
        "rope_theta": 500000.0, "rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256}}, "original_max_position_embeddings is 16 at the top level"),
    ({"rope_scaling": {"type": "linear", "rope_type": "default", "factor": 2.0}}, "both type 'linear' and rope_type"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}}, "high_freq_factor above low_freq_factor"),
    # positive, but 0 or infinity in float32, where the graph holds them: NaN logits at every prompt (a hostile round)
    ({"rope_theta": 1e-300}, "'rope_theta' is 1e-300, which float32 (the graph's) holds as 0"),
    ({"rms_norm_eps": 1e-50}, "'rms_norm_eps' is 1e-50, which float32 (the graph's) holds as 0"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 1e-300}}, "'rope_scaling.factor' is 1e-300"),
    ({"rope_theta": 1e308}, "holds as infinity"),
    # held in float32, but RoPE's angles are not finite there by the last position: NaN logits from it on
    ({"rope_scaling": {"rope_type": "linear", "factor": 1e-37}}, "RoPE's angles (theta 10000, type linear) are not"),
    ({"rope_theta": 1e-45, "max_position_embeddings": 131072}, "not finite in float32 by position 131071"),
    # NaN in both places (Python's json writes it): refused as a value, not as copies that disagree (a hostile round)
    ({"rope_theta": float("nan"), "rope_parameters": {"rope_theta": float("nan"), "rope_type": "default"}},
     "'rope_theta' must be a finite positive number, got nan"),
    ({"rope_parameters": {"rope_type": "linear", "factor": float("nan")},
      "rope_scaling": {"rope_type": "linear", "factor": float("nan")}}, "'rope_scaling.factor' must be a finite"),
])
def test_unsupported_config_field(capsys, src, tmp_path, changes, needle):
    edit_config(src, **changes)
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err, needle)
    assert_no_partial(tmp_path)


def test_no_safetensors(capsys, src, tmp_path):
    (src / "model.safetensors").unlink()
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err, "no *.safetensors")


def test_truncated_safetensors(capsys, src, tmp_path):
    p = src / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-1000])
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err, "truncated safetensors file")
    assert not (tmp_path / "out").exists()
    assert_no_partial(tmp_path)


def test_corrupted_safetensors_header(capsys, src, tmp_path):
    p = src / "model.safetensors"
    raw = bytearray(p.read_bytes())
    raw[8:20] = b"\xff" * 12
    p.write_bytes(bytes(raw))
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err, "corrupted safetensors header")


def test_wrong_tensor_shape(capsys, src, tmp_path):
    rewrite_tensor(src, "model.layers.1.mlp.down_proj.weight", shape=[64, 95])
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err, "model.layers.1.mlp.down_proj.weight", "[64, 95]")
    assert_no_partial(tmp_path)


def test_wrong_tensor_dtype(capsys, src, tmp_path):
    rewrite_tensor(src, "model.layers.0.self_attn.q_proj.weight", dtype="I32")
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err, "q_proj.weight", "I32")


def test_missing_tensor(capsys, src, tmp_path):
    rewrite_tensor(src, "model.layers.1.post_attention_layernorm.weight", drop=True)
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err, "'model.layers.1.post_attention_layernorm.weight' is missing")


def test_unexpected_tensor(capsys, src, tmp_path):
    rewrite_tensor(src, "", add="model.layers.0.mlp.gate_proj.bias")
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err, "does not use", "gate_proj.bias")


def test_sharded_index_with_missing_shard(capsys, src, tmp_path):
    (src / "model.safetensors").rename(src / "model-00001-of-00002.safetensors")
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err, "missing shard", "model-00002-of-00002.safetensors")


def test_a_tensor_in_two_shards_is_refused(capsys, src, tmp_path):
    """Two copies of one tensor (a stale shard left beside new ones, no model.safetensors and no index):
    which is the model's? The later file silently won before."""
    import shutil as sh

    (src / "model.safetensors").rename(src / "model-a.safetensors")
    sh.copyfile(src / "model-a.safetensors", src / "model-extra.safetensors")
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err, "is in both model-a.safetensors and model-extra.safetensors")


@pytest.mark.parametrize("beside", ["index", "stray"])
def test_model_safetensors_is_read_as_transformers_reads_it(capsys, src, tmp_path, beside):
    """transformers loads model.safetensors where there is one, whatever else the folder holds; with an
    index beside it, the index's shards were converted instead (another model, silently: a hostile round)."""
    import shutil as sh

    sh.copyfile(src / "model.safetensors", src / "model-00001-of-00001.safetensors")
    if beside == "index":
        (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "model.layers.0.self_attn.q_proj.weight": "model-00001-of-00001.safetensors"}}))
    rc, _ = run_convert(capsys, src, tmp_path / "out")
    assert rc == 0
    source = json.loads((tmp_path / "out" / "edgeinfer.json").read_text())["source"]
    assert "model.safetensors" in source and "model-00001-of-00001.safetensors" not in source


def _existing_dst(tmp_path: Path) -> Path:
    """An earlier edgeinfer model folder (the only kind --force may replace), with a file to recognise it by
    (one a conversion writes: its manifest lists no files, so any other would be the user's, kept)."""
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "edgeinfer.json").write_text("{}")
    (dst / "chat_template.jinja").write_text("mine")
    return dst


def test_existing_destination_refused_without_force(capsys, src, tmp_path):
    dst = _existing_dst(tmp_path)
    rc, err = run_convert(capsys, src, dst)
    assert_user_error(rc, err, "destination exists", "--force")
    assert sorted(p.name for p in dst.iterdir()) == ["chat_template.jinja", "edgeinfer.json"]


def test_force_replaces_destination_only_when_complete(capsys, src, tmp_path):
    dst = _existing_dst(tmp_path)
    rc, _ = run_convert(capsys, src, dst, "--force")
    assert rc == 0
    assert (dst / "model.onnx").exists() and (dst / "edgeinfer.json").exists() and not (dst / "chat_template.jinja").exists()
    assert_no_partial(tmp_path)


def test_failure_with_force_keeps_existing_destination(capsys, src, tmp_path):
    dst = _existing_dst(tmp_path)
    rewrite_tensor(src, "model.norm.weight", shape=[63])
    rc, err = run_convert(capsys, src, dst, "--force")
    assert_user_error(rc, err, "model.norm.weight")
    assert sorted(p.name for p in dst.iterdir()) == ["chat_template.jinja", "edgeinfer.json"]
    assert_no_partial(tmp_path)


def _fail_after(monkeypatch, n_tensors: int, exc: BaseException) -> None:
    """Make the weight writer raise `exc` after writing `n_tensors` tensors (half-way through)."""
    from edgeinfer.converters import onnx_writer

    real_add = onnx_writer.WeightWriter.add
    count = {"n": 0}

    def add(self, name, array):
        count["n"] += 1
        if count["n"] > n_tensors:
            raise exc
        return real_add(self, name, array)

    monkeypatch.setattr(onnx_writer.WeightWriter, "add", add)


def test_disk_full(capsys, monkeypatch, src, tmp_path):
    dst = _existing_dst(tmp_path)
    _fail_after(monkeypatch, 5, OSError(errno.ENOSPC, "No space left on device"))
    rc, err = run_convert(capsys, src, dst, "--force")
    assert_user_error(rc, err, "disk full")
    assert sorted(p.name for p in dst.iterdir()) == ["chat_template.jinja", "edgeinfer.json"]
    assert_no_partial(tmp_path)


def test_ctrl_c_half_way(capsys, monkeypatch, src, tmp_path):
    _fail_after(monkeypatch, 5, KeyboardInterrupt())
    rc = main(["convert", str(src), "-o", str(tmp_path / "out"), "-q"])
    err = capsys.readouterr().err
    assert rc == 130 and err.strip() == "edgeinfer: interrupted"
    assert not (tmp_path / "out").exists()
    assert_no_partial(tmp_path)


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_sigterm_half_way_cleans_up_as_ctrl_c_does(capsys, monkeypatch, src, tmp_path, signame):
    """`timeout`, a closed terminal or systemd stopping a conversion: its temporary folder (a whole
    model's size) is removed, as with Ctrl-C, and it exits 128 + the signal (hostile review: a hidden
    .out.partial-PID folder stayed for ever)."""
    import os
    import signal

    from edgeinfer.converters import onnx_writer

    real_add, count = onnx_writer.WeightWriter.add, {"n": 0}

    def add(self, name, array):
        count["n"] += 1
        if count["n"] == 5:
            os.kill(os.getpid(), getattr(signal, signame))
        return real_add(self, name, array)

    monkeypatch.setattr(onnx_writer.WeightWriter, "add", add)
    launched = signal.signal(getattr(signal, signame), signal.SIG_DFL)  # as a terminal would (pytest may run
    try:  # under nohup, which ignores SIGHUP: a conversion rightly leaves that alone, the next test's case)
        handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)
        with pytest.raises(SystemExit) as e:
            main(["convert", str(src), "-o", str(tmp_path / "out"), "-q"])
        assert e.value.code == 128 + getattr(signal, signame)
        assert not (tmp_path / "out").exists()
        assert_no_partial(tmp_path)
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)) == handlers  # put back
    finally:
        signal.signal(getattr(signal, signame), launched)


def test_a_signal_the_process_ignores_stays_ignored(capsys, monkeypatch, src, tmp_path):
    """Under `nohup` SIGHUP is ignored: closing the terminal must not stop the conversion."""
    import os
    import signal

    from edgeinfer.converters import onnx_writer

    real_add, count = onnx_writer.WeightWriter.add, {"n": 0}

    def add(self, name, array):
        count["n"] += 1
        if count["n"] == 5:
            os.kill(os.getpid(), signal.SIGHUP)
        return real_add(self, name, array)

    monkeypatch.setattr(onnx_writer.WeightWriter, "add", add)
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert main(["convert", str(src), "-o", str(tmp_path / "out"), "-q"]) == 0
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


def test_the_folder_takes_the_umask_and_orphans_of_killed_conversions_go(capsys, src, tmp_path):
    """A converted folder is readable as the umask says (mkdtemp's 0700 kept a daemon's own user
    out); a temporary folder whose conversion was killed outright (its process gone, nothing written
    for an hour) is removed by the next conversion there; one whose process lives, or that changed
    lately (a conversion on another host sharing the folder), is not."""
    import os
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    hour_ago = time.time() - 3700
    for name in (f".out.partial-{dead}-0000abcd", f".out.partial-{dead}-0000beef",
                 f".out.partial-{os.getppid()}-0000abcd"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.onnx.data").write_bytes(b"x")
        if not name.endswith("beef"):  # its process gone here, but written to a minute ago (another host's?)
            for q in (tmp_path / name / "model.onnx.data", tmp_path / name):
                os.utime(q, (hour_ago, hour_ago))
    old = os.umask(0o022)
    try:
        assert main(["convert", str(src), "-o", str(tmp_path / "out"), "-q"]) == 0
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755
    assert sorted(p.name for p in tmp_path.iterdir() if ".partial-" in p.name) == sorted(
        [f".out.partial-{dead}-0000beef", f".out.partial-{os.getppid()}-0000abcd"])


def test_bad_option_values(capsys, src, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["convert", str(src), "-o", str(tmp_path / "out"), "--quant", "int3"])
    assert e.value.code == 2
    assert "invalid choice: 'int3'" in capsys.readouterr().err
    rc, err = run_convert(capsys, src, tmp_path / "out", "--quant", "int4", "--int8-tensors", "attn")
    assert_user_error(rc, err, "unknown projection(s) attn")


@pytest.mark.parametrize("name,content,needle", [
    ("tokenizer_config.json", "[[[", "tokenizer_config.json is not valid JSON"),
    ("generation_config.json", "not json", "generation_config.json is not valid JSON"),
    ("generation_config.json", json.dumps({"eos_token_id": "x"}), "must be token ids"),
    ("generation_config.json", json.dumps({"bos_token_id": 10 ** 6}), "must be token ids"),
    ("tokenizer.model", "\x00\x01garbage" * 10, "tokenizer cannot be used"),
    ("tokenizer_config.json", json.dumps({"add_eos_token": "yes"}), "add_eos_token must be true or false"),
])
def test_settings_and_tokenizer_files_the_folder_could_not_use_are_refused(capsys, src, tmp_path, name, content,
                                                                           needle):
    """Refused at convert, not accepted and then failing at every load (hostile review)."""
    (src / name).write_text(content)
    assert_user_error(*run_convert(capsys, src, tmp_path / "out"), needle)
    assert_no_partial(tmp_path)


def test_add_eos_token_converts_with_a_note_and_prompts_end_without_eos(capsys, src, tmp_path):
    """add_eos_token true (a fine-tuning recipe's setting that save_pretrained keeps) was ignored
    silently (a hostile round): it converts, with a note saying prompts are not ended with EOS, as
    transformers' chat templates (add_special_tokens=False) do not end them."""
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_eos_token": True}))
    assert main(["convert", str(src), "-o", str(tmp_path / "out"), "--quant", "int8"]) == 0
    err = capsys.readouterr().err
    assert "note: tokenizer_config.json sets add_eos_token" in err and "error" not in err, err
    model, bundled = edgeinfer.load(tmp_path / "out"), edgeinfer.load()
    ids = model.tokenizer.encode("Once upon a time")
    assert ids == bundled.tokenizer.encode("Once upon a time") and ids[-1] not in model.manifest.tokenizer.eos_token_ids


def test_chat_templates_in_hugging_face_s_forms_convert_and_load(capsys, src, tmp_path):
    """A list of named templates (the one named "default" is used), transformers' {% generation %}
    tag, and a template that does not parse: each folder loads and completes; chat renders the first
    two and refuses the third by name."""
    import edgeinfer

    cfg = json.loads((src / "tokenizer_config.json").read_text())
    templates = {
        "list": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ messages[0].content }}!"}],
        "generation": "{% for m in messages %}{% generation %}{{ m.content }}!{% endgeneration %}{% endfor %}",
        "broken": "{% for m in messages %}{{ m.content }",
    }
    for kind, template in templates.items():
        (src / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
        out = tmp_path / kind
        assert main(["convert", str(src), "-o", str(out), "--quant", "fp32"]) == 0, kind
        assert "does not parse" in capsys.readouterr().err or kind != "broken"
        if kind == "broken":
            with pytest.warns(UserWarning, match="chat template does not parse"):
                m = edgeinfer.load(out)
        else:
            m = edgeinfer.load(out)
        assert m.generate("hello", max_new_tokens=3, ignore_eos=True).usage.completion_tokens == 3
        if kind == "broken":
            with pytest.raises(edgeinfer.ModelFormatError, match="does not parse"):
                m.chat([{"role": "user", "content": "hi"}])
        else:
            assert m.template.render([{"role": "user", "content": "hi"}]) == "hi!"


@pytest.mark.parametrize("flags,needle", [
    (["--quant", "int4", "--recipe", "mse", "--asymmetric"], "choose --recipe asym"),
    (["--quant", "int8", "--recipe", "q4_1"], "goes with --quant int4, not int8"),
    (["--quant", "int8", "--int8-tensors", "qkv_proj"], "goes with --quant int4, not int8"),
    (["--quant", "int4", "--recipe", "q4_1", "--block-size", "64"], "blocks of 32, not 64"),
    (["--quant", "fp32", "--int8-tensors", "qkv_proj", "--accuracy-level", "4"], "--quant fp32 stores plain weights"),
    (["--quant", "fp16", "--block-size", "16"], "--block-size: --quant fp16 stores plain weights"),
    (["--quant", "fp16", "--accuracy-level", "0"], "--accuracy-level: --quant fp16 stores plain weights"),
])
def test_flags_the_conversion_would_ignore_are_refused(capsys, src, tmp_path, flags, needle):
    """Each was accepted, changed nothing in the weights, and was recorded in the manifest (and shown
    by inspect) as if applied (hostile review)."""
    assert_user_error(*run_convert(capsys, src, tmp_path / "out", *flags), needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_embedding_blocks_that_do_not_divide_the_hidden_size_are_refused_before_any_work(capsys, src, tmp_path,
                                                                                        quant):
    """Hidden size 64, block 128: refused before the tokenizer or the calibration text was read (it
    was refused once the graph's embedding was built, after the calibration line); an fp32 embedding
    converts (the projections' last block is zero-padded)."""
    rc = main(["convert", str(src), "-o", str(tmp_path / "out"), "--quant", quant, "--block-size", "128"])
    assert_user_error(rc, capsys.readouterr().err, "hidden size 64 is not a multiple of block 128")
    assert not (tmp_path / "out").exists()
    assert_no_partial(tmp_path)
    assert main(["convert", str(src), "-o", str(tmp_path / "out"), "--quant", quant, "--block-size", "128",
                 "--embedding", "fp32", "-q"]) == 0


def test_a_projection_named_twice_is_one_choice():
    from edgeinfer.converters import default_scheme

    assert default_scheme("int4", int8_tensors=("qkv_proj", "qkv_proj")).int8_tensors == ("qkv_proj",)


def test_the_root_folder_is_never_a_destination(capsys, src):
    for extra in ((), ("--force",)):
        assert_user_error(*run_convert(capsys, src, Path("/"), *extra), "cannot be the root folder")


def test_weights_holding_nan_are_refused_at_convert(capsys, src, tmp_path):
    import numpy as np

    raw = (src / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    start, end = header["model.layers.0.self_attn.q_proj.weight"]["data_offsets"]
    assert header["model.layers.0.self_attn.q_proj.weight"]["dtype"] == "F32"
    data = bytearray(raw)
    data[8 + n + start:8 + n + start + 4] = np.array([np.nan], np.float32).tobytes()
    (src / "model.safetensors").write_bytes(bytes(data))
    for quant in ("fp32", "int4"):
        assert_user_error(*run_convert(capsys, src, tmp_path / quant, "--quant", quant), "NaN or infinity")
    assert_no_partial(tmp_path)


def test_a_folder_whose_weights_compute_nan_is_a_clear_error(capsys, src, tmp_path):
    """Weights broken after conversion (and re-stamped, so that load's checks pass): generate and eval
    say the logits are not finite and exit 1, instead of a ValueError traceback or "perplexity nan"."""
    import hashlib

    import numpy as np

    out = tmp_path / "out"
    assert main(["convert", str(src), "-o", str(out), "--quant", "fp32", "-q"]) == 0
    data = out / "model.onnx.data"
    data.write_bytes(np.full(data.stat().st_size // 4, np.nan, np.float32).tobytes())
    m = json.loads((out / "edgeinfer.json").read_text())
    m["files"]["model.onnx.data"]["sha256"] = hashlib.sha256(data.read_bytes()).hexdigest()
    write_manifest(out, m)
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time there was a dog.\n")
    capsys.readouterr()
    assert main(["generate", "-m", str(out), "Once", "--max-tokens", "3"]) == 1
    assert "logits the sampler cannot use" in capsys.readouterr().err
    assert main(["eval", "-m", str(out), "--text", str(text)]) == 1
    assert "not finite" in capsys.readouterr().err


def test_eval_refuses_what_it_would_score_wrongly(capsys, src, tmp_path):
    """A window past the model's context (positions it never saw: a number that means nothing), ring
    settings without --stream (they were ignored), and a folder given as the text."""
    out = tmp_path / "out"
    assert main(["convert", str(src), "-o", str(out), "--quant", "fp32", "-q"]) == 0
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time there was a dog.\n")
    context = json.loads((out / "edgeinfer.json").read_text())["architecture"]["max_position_embeddings"]
    capsys.readouterr()
    for args, needle in ((["--window", str(context + 1)], "over the model's context"),
                         (["--capacity", "64"], "add --stream"), (["--sinks", "2"], "add --stream")):
        assert main(["eval", "-m", str(out), "--text", str(text), *args]) == 1
        assert needle in capsys.readouterr().err
    assert main(["eval", "-m", str(out), "--text", str(tmp_path)]) == 1
    assert "is not a regular file" in capsys.readouterr().err



def test_rope_blocks_that_agree_are_read_and_a_top_level_original_length_fills_the_block():
    from edgeinfer.converters.hf_config import parse_rope

    agree = parse_rope({"rope_theta": 10000.0, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "linear",
                                                                  "factor": 2.0},
                        "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (agree.type, agree.factor, agree.theta) == ("linear", 2.0, 10000.0)
    top = parse_rope({"original_max_position_embeddings": 64, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}})
    assert top.original_max_position_embeddings == 64


def test_a_converted_folder_given_as_the_source_is_named_so(tmp_path):
    """`convert OUT -o X` on an edgeinfer folder said "missing config.json in OUT" (a fresh user's review)."""
    from conftest import STORIES_SRC
    from edgeinfer.errors import ConvertError
    from edgeinfer.converters import convert

    out = tmp_path / "out"
    convert(STORIES_SRC, out, quant="fp32")
    with pytest.raises(ConvertError, match="is an edgeinfer model folder \\(converted already\\), not a source"):
        convert(out, tmp_path / "again", quant="int8")
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("tokenizer_file,in_map", [("tokenizer.model", False), ("tokenizer.json", False),
                                                   ("tokenizer.json", True)])
def test_a_config_without_bos_and_eos_ids_takes_the_tokenizer_s(capsys, tmp_path, tokenizer_file, in_map):
    """A hostile round: a config.json without bos_token_id and eos_token_id (and no
    generation_config.json) converted with no BOS before prompts and no EOS to stop at, though
    tokenizer_config.json names `<s>` and `</s>` and transformers' tokenizer adds `<s>`. They are
    taken from the tokenizer now, with a note (SentencePiece's pieces, or tokenizer.json's)."""
    from conftest import STORIES_SRC

    src = tmp_path / "src"
    shutil.copytree(STORIES_SRC, src)
    (src / "generation_config.json").unlink(missing_ok=True)
    (src / ("tokenizer.json" if tokenizer_file == "tokenizer.model" else "tokenizer.model")).unlink()
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("bos_token_id"), cfg.pop("eos_token_id")
    (src / "config.json").write_text(json.dumps(cfg))
    if in_map:  # an older checkpoint: the names only in special_tokens_map.json (as transformers reads them)
        tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
        (src / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in tok_cfg.items()
                                                               if k not in ("bos_token", "eos_token")}))
        (src / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    assert main(["convert", str(src), "-o", str(tmp_path / "out"), "--quant", "fp32"]) == 0
    err = capsys.readouterr().err
    assert "took '<s>' (id 1), the tokenizer's bos_token" in err and "took '</s>' (id 2)" in err, err
    tok = json.loads((tmp_path / "out" / "edgeinfer.json").read_text())["tokenizer"]
    assert (tok["add_bos"], tok["bos_token_id"], tok["eos_token_ids"]) == (True, 1, [2])
    assert edgeinfer.load(tmp_path / "out").tokenizer.encode("Once")[0] == 1


def test_a_working_folder_removed_since_is_a_one_line_error_or_no_matter(capsys, monkeypatch, src, tmp_path):
    """A hostile round: from a working folder that was removed (a build folder deleted under an open
    terminal), a relative -o gave a traceback, and --force onto a model named by its absolute path was
    refused with a bare "No such file or directory"."""
    model = tmp_path / "model"
    assert run_convert(capsys, src, model)[0] == 0
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    rc, err = run_convert(capsys, src, Path("rel"))
    assert_user_error(rc, err, "the current folder no longer exists: give the destination 'rel' as an absolute path")
    assert run_convert(capsys, src, model, "--force")[0] == 0


@pytest.mark.parametrize("kwargs,needle", [({"accuracy_level": 4.0}, "accuracy_level must be an integer 0..4, got 4.0"),
                                           ({"block_size": 32.0}, "block_size must be an integer, got 32.0"),
                                           ({"quant": "int8", "accuracy_level": 0.0}, "got 0.0")])
def test_a_float_for_an_integer_option_is_refused_before_any_work(src, tmp_path, kwargs, needle):
    """A hostile round of the Python API: accuracy_level=4.0 passed `in range(5)` and wrote a manifest
    that load refused; block_size=32.0 failed deep in building the graph. numpy's integers are integers."""
    from edgeinfer.converters import convert
    from edgeinfer.errors import ConvertError

    with pytest.raises(ConvertError, match=needle):
        convert(src, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()
    import numpy as np

    convert(src, tmp_path / "np", quant="int8", block_size=np.int64(32), accuracy_level=np.int32(4))
    manifest = json.loads((tmp_path / "np" / "edgeinfer.json").read_text())
    assert (manifest["quantization"]["block_size"], manifest["quantization"]["accuracy_level"]) == (32, 4)
    edgeinfer.load(tmp_path / "np").close()


@pytest.mark.parametrize("field,value,needle", [("block_size", 32.0, "block size 32.0 not supported"),
                                                ("accuracy_level", 4.0, "accuracy_level must be an integer 0..4")])
def test_a_scheme_s_float_sizes_are_refused_and_numpy_s_integers_taken(src, tmp_path, field, value, needle):
    """A review: the same values through `scheme=` (the public `default_scheme`) still converted into a
    folder load refused (4.0), failed in onnx (32.0) or at the manifest's write (numpy's ints)."""
    import dataclasses

    import numpy as np

    from edgeinfer.converters import convert, default_scheme
    from edgeinfer.errors import ConvertError

    with pytest.raises(ConvertError, match=needle):
        dataclasses.replace(default_scheme("int8", 32), **{field: value})
    scheme = default_scheme("int8", np.int64(32), accuracy_level=np.int32(4))
    assert type(scheme.block_size) is int and type(scheme.accuracy_level) is int
    convert(src, tmp_path / "out", scheme=scheme)
    edgeinfer.load(tmp_path / "out").close()


def test_a_null_in_generation_config_leaves_config_json_s_ids(capsys, src, tmp_path):
    """A review: generation_config.json's `"bos_token_id": null` beside config.json's 1 took the
    tokenizer's token instead, saying neither file gave one."""
    (src / "generation_config.json").write_text(json.dumps({"bos_token_id": None, "eos_token_id": None}))
    edit_config(src, bos_token_id=1, eos_token_id=2)
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert rc == 0 and "took" not in err, err
    tok = json.loads((tmp_path / "out" / "edgeinfer.json").read_text())["tokenizer"]
    assert (tok["bos_token_id"], tok["eos_token_ids"]) == (1, [2])

"""Draft-model speculative decoding (`speculative="draft"`, `Model.set_draft`, drafting.ModelDrafter).

The target is fp32 stories260K (where a several-row call computes one-row calls' logits up to float
rounding, so speculation is exact); the draft is the bundled int8 stories260K: the same tokenizer,
a slightly different function, so most drafts are accepted and some are not. References: plain
decoding's tokens, and the draft model's own greedy continuation for what the drafter proposes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import edgeinfer
from conftest import STORIES_FIX, STORIES_SRC, TINY, write_manifest
from edgeinfer import speculative
from edgeinfer.errors import InvalidArgumentError, InvalidArgumentTypeError
from edgeinfer.model import default_model_path
from edgeinfer.drafting import Draft, ModelDrafter
from edgeinfer.speculative import Tuning

GOLDEN = json.loads((STORIES_FIX / "golden.json").read_text())
SAMPLINGS = [dict(temperature=0), dict(temperature=0.8, seed=3),
             dict(temperature=1.0, top_p=0.9, top_k=40, seed=11, repetition_penalty=1.1)]


@pytest.fixture(scope="module")
def fp32(converted):
    return converted(STORIES_SRC, "fp32")


@pytest.fixture(autouse=True)
def always_draft(monkeypatch):
    """Draft 4 tokens whenever asked, whatever the timings (see test_speculative.py)."""
    monkeypatch.setattr(speculative, "TUNING", Tuning(fixed_k=4))


def greedy(model, ids, k):
    """The model's own greedy continuation of ids: k tokens (the reference for the drafter)."""
    c = model.engine.new_cache(512, 4)
    logits, out = model.engine.prefill(c, list(ids)), []
    for _ in range(k):
        out.append(int(np.argmax(logits)))
        logits = model.engine.decode_one(c, out[-1])
    return out


def test_drafter_proposes_the_draft_models_greedy_continuation_after_rejections(fp32):
    """The reference: the draft model's greedy continuation of the text its ring holds (the history
    from `base`: a 64-slot ring restarts from the last 32 tokens when a draft would not fit). fp32 as
    the draft here: the reference prefills what the drafter fed step by step, and only at fp32 do the
    two paths agree to rounding (at int8's accuracy level 4 a near-tie may flip)."""
    d = edgeinfer.load(fp32)
    ids = d.tokenizer.encode("Once upon a time, there was a little girl named Lily.")
    drafter = ModelDrafter(Draft(d.engine, 64, 4), ids)
    history = list(ids)
    rng = np.random.default_rng(0)
    for round_ in range(30):
        got = drafter.draft(4)
        assert got == greedy(d, history[drafter.base:], 4), round_
        assert drafter.base == 0 or len(history) - drafter.base <= 64  # what the ring holds
        keep = int(rng.integers(0, 5))  # the target accepted `keep` drafts, then its own token
        for t in got[:keep] + [int(rng.integers(3, 512))]:
            drafter.push(t)
            history.append(t)
    assert len(history) > 64 and drafter.base > 0  # the 64-slot ring restarted from the recent text
    assert drafter.cache.dropped == 0  # and never shifted


def test_a_long_history_is_cut_and_drafts_go_on_as_before(fp32):
    """The drafter kept every token a request had seen (~36 bytes a token, for as long as it ran). It
    keeps the last max(window, capacity) tokens to twice as many, and still drafts the draft model's
    greedy continuation of what its ring holds (a small window for the test)."""
    d = edgeinfer.load(fp32)
    ids = d.tokenizer.encode("Once upon a time, there was a little girl named Lily.")
    drafter = ModelDrafter(Draft(d.engine, 16, 2), ids)
    drafter.window = 24  # (the cut comes at 48 tokens; the ring restarts whenever a draft would not fit)
    history, cuts, longest = list(ids), 0, 0
    rng = np.random.default_rng(1)
    for round_ in range(80):
        got = drafter.draft(4)
        start = len(history) - len(drafter.history) + drafter.base  # the ring's first token in the whole history
        assert got == greedy(d, history[start:], 4), round_
        keep = int(rng.integers(0, 5))
        for t in got[:keep] + [int(rng.integers(3, 512))]:
            before = len(drafter.history)
            drafter.push(t)
            history.append(t)
            cuts += len(drafter.history) < before
            longest = max(longest, len(drafter.history))
            assert drafter.history == history[-len(drafter.history):] and 0 <= drafter.base <= len(drafter.history)
    assert cuts >= 3 and longest == 47 and drafter.cache.dropped == 0
    long_prompt = ModelDrafter(Draft(d.engine, 16, 2), list(range(3, 20003)))
    assert long_prompt.history == list(range(3, 20003))[-ModelDrafter.window:]


@pytest.mark.parametrize("capacity", [512, 64])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t0.8", "top_p+penalty"])
def test_identical_to_plain_decoding_on_the_golden_prompts(fp32, capacity, sampling):
    m = edgeinfer.load(fp32, capacity_tokens=capacity, threads=2)
    m.set_draft(default_model_path())
    drafted = accepted = 0
    for case in GOLDEN["cases"]:
        kw = dict(max_new_tokens=200, ignore_eos=True, **sampling)
        m.held = None
        a = m.generate(case["prompt_ids"], **kw)
        m.held = None
        g = m.stream(case["prompt_ids"], speculative="draft", **kw)
        b = g.run_to_end()
        assert a.token_ids == b.token_ids and a.text == b.text, case["prompt_ids"]
        assert (a.finish_reason, a.usage) == (b.finish_reason, b.usage)
        drafted, accepted = drafted + g.speculation.drafted_tokens, accepted + g.speculation.accepted_tokens
    assert accepted > 0.3 * drafted > 0  # it drafted, and the draft was right often but not always
    assert accepted < drafted


def test_stop_strings_and_a_draft_with_a_small_ring(fp32):
    m = edgeinfer.load(fp32, capacity_tokens=128)
    m.set_draft(edgeinfer.load(default_model_path(), capacity_tokens=24, n_sink=2))  # restarts often
    prompt = GOLDEN["cases"][0]["prompt_ids"]
    for stop in (["Lily"], [" the", "park"], ["."]):
        m.held = None
        a = m.generate(prompt, max_new_tokens=120, temperature=0, stop=stop)
        m.held = None
        b = m.generate(prompt, max_new_tokens=120, temperature=0, stop=stop, speculative="draft")
        assert (a.text, a.token_ids, a.finish_reason, a.usage) == (b.text, b.token_ids, b.finish_reason, b.usage)


def test_conversations_and_threads_share_one_draft(fp32):
    import threading

    m = edgeinfer.load(fp32)
    m.set_draft(default_model_path())
    want = {}
    for i, case in enumerate(GOLDEN["cases"][:4]):
        want[i] = m.conversation().say(case["prompt"] or "Once", max_new_tokens=60, temperature=0).token_ids
    got, errors = {}, []

    def run(i, prompt):
        try:
            got[i] = m.conversation().say(prompt, max_new_tokens=60, temperature=0, speculative="draft").token_ids
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, c["prompt"] or "Once")) for i, c in enumerate(GOLDEN["cases"][:4])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == want


def resized_vocabulary(src, dst, rows: int):
    """`src` (a tied model) with its embedding cut to `rows` ids or padded with random rows to them."""
    import shutil

    from conftest import write_safetensors
    from edgeinfer.converters.safetensors_io import Checkpoint

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("reference.npz", "*.safetensors"))
    ckpt = Checkpoint(src)
    tensors = {n: ckpt.read(n) for n in ckpt.tensors}
    e = tensors["model.embed_tokens.weight"]
    pad = np.random.default_rng(0).normal(size=(max(rows - len(e), 0), e.shape[1])).astype(np.float32)
    tensors["model.embed_tokens.weight"] = np.concatenate([e, pad])[:rows]
    write_safetensors(dst / "model.safetensors", tensors)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "vocab_size": rows}))
    return dst


def test_set_draft_refusals(fp32, converted, tmp_path, monkeypatch):
    m = edgeinfer.load(fp32)
    with pytest.raises(InvalidArgumentError, match="needs a draft model"):
        m.generate("Once", speculative="draft")
    import shutil

    other = tmp_path / "other-eos"  # the same vocabulary, another end-of-sequence id: not the same tokenizer
    shutil.copytree(fp32, other, ignore=shutil.ignore_patterns(".edgeinfer-verified*"))
    manifest = json.loads((other / "edgeinfer.json").read_text())
    manifest["tokenizer"]["eos_token_ids"] = [3]
    write_manifest(other, manifest)
    with pytest.raises(InvalidArgumentError, match="does not have this model's tokenizer"):
        m.set_draft(other)
    # The same EOS first and more ids that end a generation: the same tokenizer (a GGUF's conversion of SmolLM2
    # against its Hugging Face folder's, refused once the GGUF's stop set took <|endoftext|> too: a review)
    more = tmp_path / "more-stops"
    shutil.copytree(fp32, more, ignore=shutil.ignore_patterns(".edgeinfer-verified*"))
    manifest["tokenizer"]["eos_token_ids"] = [2, 0]
    write_manifest(more, manifest)
    m.set_draft(more)
    assert m.generate("Once", max_new_tokens=5, speculative="draft").usage.completion_tokens == 5
    m.set_draft(None)
    from edgeinfer.cli import main  # a service unit for that pair is refused as its start would be (a docs round)

    assert main(["serve", "-m", str(fp32), "--port", "8080", "--speculative", "draft", "--draft-model", str(other),
                 "--print-systemd-unit"]) == 1
    m.set_draft(converted(TINY / "llama2_gqa_tied", "fp32"))  # a random model over stories260K's tokenizer: fine
    closed = []
    close = edgeinfer.Model.close
    monkeypatch.setattr(edgeinfer.Model, "close", lambda self: closed.append(self.folder) or close(self))
    for rows in (640, 480):  # that model with its embedding padded or cut: the same tokenizer files (a hostile round)
        folder = converted(resized_vocabulary(TINY / "llama2_gqa_tied", tmp_path / f"src-{rows}", rows), "fp32")
        with pytest.raises(InvalidArgumentError, match=f"has a vocabulary of {rows} ids, this model 512"):
            m.set_draft(folder)
        assert closed == [folder]  # the folder it loaded to check is let go of (a review: it stayed loaded)
        closed.clear()
        d = edgeinfer.load(folder)  # a Model the caller gave stays the caller's, open
        with pytest.raises(InvalidArgumentError, match="has a vocabulary of"):
            m.set_draft(d)
        assert not d.closed and closed == []
        d.close()
        closed.clear()
    assert m.generate("Once", max_new_tokens=5, speculative="draft").usage.completion_tokens == 5  # the draft kept
    with pytest.raises(InvalidArgumentTypeError, match="draft must be a Model, a folder or None"):
        m.set_draft(42)
    d = m.set_draft(default_model_path())
    assert d.engine.draft is None and m.engine.draft.engine is d.engine
    assert m.generate("Once", max_new_tokens=5, speculative="draft").usage.completion_tokens == 5
    m.set_draft(None)
    with pytest.raises(InvalidArgumentError, match="needs a draft model"):
        m.generate("Once", speculative="draft")


def test_the_daemon_drafts_with_a_draft_model(fp32):
    """`edgeinfer serve --speculative draft --draft-model DIR`: answers as plain greedy decoding
    (`test_speculative.daemon_answers_like_plain`); the two settings go together."""
    from edgeinfer.server.config import ServeConfig
    from test_speculative import daemon_answers_like_plain

    with pytest.raises(InvalidArgumentError, match="needs draft-model"):
        ServeConfig(speculative="draft")
    with pytest.raises(InvalidArgumentError, match="only with speculative = draft"):
        ServeConfig(draft_model=str(default_model_path()))

    def attached(server):
        assert server.model.engine.draft is not None

    daemon_answers_like_plain(fp32, attached, speculative="draft", draft_model=str(default_model_path()))


# ---- what a hostile review found (each failed before its fix) ----

def test_a_draft_detached_during_prefill_does_not_break_the_request(fp32, monkeypatch):
    """set_draft(None) from another thread while a request prefills: the request keeps the draft it
    started with (it read Engine.draft once) and gives plain decoding's tokens."""
    m = edgeinfer.load(fp32)
    m.set_draft(default_model_path())
    prompt = GOLDEN["cases"][1]["prompt_ids"]
    want = m.generate(prompt, max_new_tokens=40, temperature=0).token_ids
    m.held = None
    prefill = m.engine.prefill

    def detaching(*a, **kw):
        m.set_draft(None)
        return prefill(*a, **kw)

    monkeypatch.setattr(m.engine, "prefill", detaching)
    assert m.generate(prompt, max_new_tokens=40, temperature=0, speculative="draft").token_ids == want


def test_a_draft_model_closed_during_a_request_leaves_it_decoding_plainly(fp32):
    """A hostile round: closing the draft model killed the target's open request at its next step
    (ModelClosedError after 13 chunks), though drafts decide no token. It now goes on without drafts,
    as after set_draft(None); a request that starts with the draft closed is refused before it touches
    the context (the prefix the ring held is still reused)."""
    m = edgeinfer.load(fp32)
    prompt = GOLDEN["cases"][1]["prompt_ids"]
    want = m.generate(prompt, max_new_tokens=60, temperature=0).token_ids
    draft = edgeinfer.load(default_model_path())
    m.set_draft(draft)
    m.held = None
    stream = m.stream(prompt, max_new_tokens=60, temperature=0, speculative="draft")
    for i, _ in enumerate(stream):
        if i == 5:
            draft.close()
    assert stream.completion.token_ids == want
    with pytest.raises(edgeinfer.InvalidArgumentError, match="the draft model was closed"):  # (not ModelClosedError:
        m.generate(prompt, max_new_tokens=4, temperature=0, speculative="draft")  # this model is open)
    again = m.generate(prompt, max_new_tokens=60, temperature=0)
    assert again.token_ids == want and again.usage.cached_tokens > 0


@pytest.mark.parametrize("capacity,history,k", [(16, 40, 2), (8, 48, 8), (2, 10, 4), (5, 3, 8)])
def test_the_draft_ring_never_shifts_however_small(capacity, history, k):
    d = edgeinfer.load()
    ids = d.tokenizer.encode("Once upon a time")
    dr = ModelDrafter(Draft(d.engine, capacity, 1), ids)
    assert len(dr.draft(k)) == min(k, capacity - 1)
    rng = np.random.default_rng(capacity)
    for _ in range(history):
        dr.push(int(rng.integers(3, 512)))
        if rng.random() < 0.3:
            dr.draft(k)
    dr.draft(k)
    assert dr.cache.dropped == 0 and dr.cache.n_valid <= capacity


def test_a_probe_prefills_a_bounded_tail(fp32, monkeypatch):
    """The first draft feeds at most half the draft ring of the prompt; a later probe after many
    plain steps at most 2 x resync_tokens."""
    d = edgeinfer.load(default_model_path(), capacity_tokens=256)
    fed = []
    prefill = d.engine.prefill
    monkeypatch.setattr(d.engine, "prefill", lambda c, ids, *a, **kw: (fed.append(len(ids)), prefill(c, ids))[1])
    dr = ModelDrafter(Draft(d.engine, 256, 4), list(range(3, 403)))  # a 400-token prompt
    dr.draft(3)
    for t in range(100):  # plain steps: nothing drafted
        dr.push(3 + t)
    dr.draft(3)
    assert fed[0] <= 128 and fed[-1] <= 2 * ModelDrafter.resync_tokens, fed


def test_a_gguf_conversion_drafts_for_its_hugging_face_twin(fp32, tmp_path):
    """Other tokenizer files, the same tokens: accepted (Tokenizer.same_as), and exact."""
    from edgeinfer.converters import convert

    convert(STORIES_FIX.parent / "gguf" / "stories260K-F32.gguf", tmp_path / "g", quant="fp32")
    m = edgeinfer.load(fp32)
    m.set_draft(tmp_path / "g")
    prompt = GOLDEN["cases"][2]["prompt_ids"]
    want = m.generate(prompt, max_new_tokens=50, temperature=0).token_ids
    m.held = None
    assert m.generate(prompt, max_new_tokens=50, temperature=0, speculative="draft").token_ids == want


def test_draft_settings_refused_with_their_names(fp32, tmp_path):
    from edgeinfer.server.config import ServeConfig

    m = edgeinfer.load(fp32, n_sink=400, capacity_tokens=480)
    assert m.set_draft(default_model_path()).n_sink == 4  # its own ring: not the target's 400 sinks
    with pytest.raises(InvalidArgumentError, match="folder is empty"):
        m.set_draft("")
    with pytest.raises(edgeinfer.ModelFormatError, match="^the draft model: model folder not found"):
        m.set_draft(tmp_path / "nowhere")
    with pytest.raises(InvalidArgumentError, match="needs draft-model"):
        ServeConfig(speculative="draft")
    with pytest.raises(InvalidArgumentError, match="draft-model is an empty path"):
        ServeConfig(speculative="draft", draft_model="")
    with pytest.raises(InvalidArgumentError, match="only with speculative = draft, not 'ngram'"):
        ServeConfig(speculative="ngram", draft_model="x")


def test_a_portable_model_refuses_draft_speculation(tmp_path):
    from edgeinfer.converters import convert

    convert(STORIES_SRC, tmp_path / "p", target="coreml")
    p = edgeinfer.load(tmp_path / "p")
    with pytest.raises(InvalidArgumentError, match="needs a fused graph"):  # no draft model could be set here
        p.generate("Once", max_new_tokens=3, speculative="draft")
    with pytest.raises(InvalidArgumentError, match="fused graphs"):
        p.set_draft(default_model_path())


def test_systemd_unit_carries_the_draft_model(tmp_path, capsys, monkeypatch):
    import shlex

    from edgeinfer.cli import main

    monkeypatch.chdir(default_model_path().parent)
    assert main(["serve", "--print-systemd-unit", "--slots", "2"]) == 0
    plain = capsys.readouterr().out
    assert main(["serve", "--print-systemd-unit", "--slots", "2", "--speculative", "draft",
                 "--draft-model", default_model_path().name]) == 0  # relative to the current folder
    unit = capsys.readouterr().out
    argv = shlex.split(next(x for x in unit.splitlines() if x.startswith("ExecStart="))[len("ExecStart="):])
    assert argv[argv.index("--draft-model") + 1] == str(default_model_path().resolve())
    rw = next(x for x in unit.splitlines() if x.startswith("ReadWritePaths="))
    assert rw.count(str(default_model_path().resolve())) == 2  # the model and its draft (the same folder here)

    def mem(u):
        return int(next(x for x in u.splitlines() if x.startswith("MemoryMax="))[len("MemoryMax="):-1])
    assert mem(unit) > mem(plain)


def test_a_model_that_drafts_for_itself_is_freed_when_dropped(fp32):
    """set_draft(model) with the model itself made a cycle (its engine held a Draft that held the
    engine), so a model dropped without close() kept its session and thread pool until the cycle
    collector ran (a hostile round: 20 such models kept 20 sessions with the collector off). It drafts
    for itself as before, its tokens plain decoding's."""
    import gc
    import weakref

    m = edgeinfer.load(fp32)
    want = m.generate("Once upon a time", max_new_tokens=40, temperature=0).text
    assert m.set_draft(m) is m
    assert m.generate("Once upon a time", max_new_tokens=40, temperature=0, speculative="draft").text == want
    engine = weakref.ref(m.engine)
    gc.disable()
    try:
        del m
        assert engine() is None
    finally:
        gc.enable()


def test_set_draft_s_cleanup_never_closes_what_it_attached_nor_hides_the_refusal(fp32, monkeypatch):
    """A folder set_draft loaded is closed when it is refused, but (a review of that fix) a Ctrl-C that
    comes once the attach is done leaves it attached and open, and a close that fails does not hide the
    refusal."""
    import edgeinfer.model as em
    from edgeinfer.engine import Engine

    m = edgeinfer.load(fp32)
    attach = Engine.attach_draft

    def attach_then_interrupt(self, draft):
        attach(self, draft)
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "attach_draft", attach_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        m.set_draft(default_model_path())
    monkeypatch.setattr(Engine, "attach_draft", attach)
    assert not m.engine.draft.engine.closed
    assert m.generate("Once", max_new_tokens=5, speculative="draft").usage.completion_tokens == 5

    def refuse(target, draft):
        raise InvalidArgumentError("refused")

    def failing_close(self):
        raise OSError("close failed")

    monkeypatch.setattr(em, "check_pair", refuse)
    monkeypatch.setattr(em.Model, "close", failing_close)
    with pytest.raises(InvalidArgumentError, match="refused"):
        m.set_draft(default_model_path())

"""The daemon's overhead and concurrency, measured against the same model in process (JSON out).

    python scripts/bench_server.py [-m MODEL] [--threads 2] [--rounds 5] [--out FILE]

Starts `edgeinfer serve` on a free loopback port (a separate process, as users run it) with 4 slots,
and in this process loads the same model. Alternating rounds, medians:
Both use a ring of 2048 tokens, or 15/16 of the model's trained length if shorter (room to re-base
in), and prompts of 512 tokens, or that ring less 160 if shorter (stories260K: 480 and 320).
1. TTFT, non-streaming, a 512-token prompt, max_tokens 1: client wall time per request vs
   `generate(max_new_tokens=1)` wall time in process.
2. Streamed decode tokens/s (128 tokens, EOS ignored, a 32-token prompt: its prefill is about a
   step): the tokens over the time from the request to the last chunk, at the client (the tokens
   its usage counts: a chunk may carry several, or none while a character's bytes are incomplete;
   counting chunks counted 114 of 128, and timing from the first chunk left out the tokens it
   carried) vs `stream()` in process (from the call to its last token).
3. Concurrency: aggregate tokens/s of 4 concurrent greedy streams vs 1 (rounds alternate one and
   four, the first round warms up; the clients only collect bytes and parse them after the stream,
   so they do not take the CPU from the server on a small machine), and whether each stream's text
   equals the same request served alone.
4. Prefix reuse: a chat with a 512-token system prompt (shorter where the ring is: both turns fit
   in half of it); the 2nd turn's TTFT (streamed, first content
   chunk) vs the 1st turn's, its cached_tokens, and whether its text equals a fresh server's.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import numpy as np

import edgeinfer
from edgeinfer.manifest import read_manifest
from edgeinfer.model import default_model_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, threads: int, slots: int, capacity: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "edgeinfer", "serve", "--port", str(port), "--slots", str(slots), "--queue", "8",
           "--threads", str(threads), "--max-tokens-limit", "4096", "--capacity", str(capacity)]
    if model:
        cmd[4:4] = ["-m", model]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not start")


def stream_completion(url: str, prompt, max_tokens: int, model_id: str, chat: bool = False,
                      stamps: bool = True) -> dict:
    """One streamed request: TTFT (first content), token arrival times, text, usage. With
    stamps=False the client only collects bytes and parses them after the stream ends, so that
    several concurrent clients on this machine do not take the CPU from the server they measure."""
    body = {"model": model_id, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    body.update({"messages": prompt} if chat else {"prompt": prompt})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    t0, times, raw = time.perf_counter(), [], []
    with httpx.stream("POST", url + path, json=body, timeout=600) as r:
        if stamps:
            for line in r.iter_lines():
                raw.append(line)
                times.append(time.perf_counter() - t0)
        else:
            raw = b"".join(r.iter_raw()).decode().split("\n")
            times = [time.perf_counter() - t0] * len(raw)
    text, arrivals, usage = [], [], None
    for line, at in zip(raw, times):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices", []):
            piece = ch["delta"].get("content") if chat else ch.get("text")
            if piece:
                arrivals.append(at)
                text.append(piece)
    return {"ttft_s": arrivals[0] if arrivals else None, "stamps": arrivals, "text": "".join(text), "usage": usage,
            "last_s": times[-1] if times else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    capacity = min(2048, read_manifest(args.model or default_model_path()).arch.max_position_embeddings * 15 // 16)
    m = edgeinfer.load(args.model, threads=args.threads, capacity_tokens=capacity)
    model_id = m.folder.name
    rng = np.random.default_rng(0)
    prompt512 = [m.tokenizer.bos_id] + rng.integers(3, m.manifest.arch.vocab_size, min(512, capacity - 160) - 1).tolist()
    proc, url = start_server(args.model, args.threads, slots=4, capacity=capacity)
    report: dict = {"model": str(m.folder), "threads": args.threads, "rounds": args.rounds}
    try:
        ttft_srv, ttft_in, tps_srv, tps_in = [], [], [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            r = httpx.post(url + "/v1/completions", timeout=600,
                           json={"model": model_id, "prompt": prompt512, "max_tokens": 1, "temperature": 0})
            ttft_srv.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
            t0 = time.perf_counter()
            m.generate(prompt512, max_new_tokens=1, temperature=0)
            ttft_in.append(time.perf_counter() - t0)
            got = stream_completion(url, prompt512[:32], 128, model_id)
            tps_srv.append(got["usage"]["completion_tokens"] / got["last_s"])
            tokens, t0 = 0, time.perf_counter()
            for c in m.stream(prompt512[:32], max_new_tokens=128, temperature=0, ignore_eos=True):
                tokens += c.token_id is not None
            tps_in.append(tokens / (time.perf_counter() - t0))
        report["ttft_512_ms"] = {"server": round(statistics.median(ttft_srv) * 1e3, 2),
                                 "in_process": round(statistics.median(ttft_in) * 1e3, 2),
                                 "ratio": round(statistics.median(ttft_srv) / statistics.median(ttft_in), 3)}
        report["stream_decode_tok_s"] = {"server": round(statistics.median(tps_srv), 1),
                                         "in_process": round(statistics.median(tps_in), 1),
                                         "ratio": round(statistics.median(tps_srv) / statistics.median(tps_in), 3)}

        prompts = [prompt512[:32 + 8 * i] for i in range(4)]
        alone = [stream_completion(url, p, 128, model_id, stamps=False) for p in prompts]  # texts, one at a time
        one, four, together = [], [], []
        for r in range(args.rounds + 1):  # the first round warms up and is not counted
            t0 = time.perf_counter()
            stream_completion(url, prompts[r % 4], 128, model_id, stamps=False)
            t1 = time.perf_counter()
            together = [None] * 4
            ts = [threading.Thread(target=lambda i=i: together.__setitem__(
                i, stream_completion(url, prompts[i], 128, model_id, stamps=False))) for i in range(4)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            if r:
                one.append(128 / (t1 - t0))
                four.append(4 * 128 / (time.perf_counter() - t1))
        report["concurrency_4_streams"] = {
            "one_stream_tok_s": round(statistics.median(one), 1), "aggregate_tok_s": round(statistics.median(four), 1),
            "ratio": round(statistics.median(f / o for f, o in zip(four, one)), 3),
            "identical_to_alone": [a["text"] == b["text"] for a, b in zip(alone, together)]}

        system = m.tokenizer.decode(prompt512[1:])
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Tell me a story."}]
        while len(m.encode_chat(msgs)) > capacity // 2:  # (a 352-id system prompt decoded came back as 542
            system = system[:len(system) * 9 // 10]  # tokens, past stories260K's 512-token ring: nothing reused)
            msgs[0]["content"] = system
        first = stream_completion(url, msgs, 16, model_id, chat=True)
        msgs2 = msgs + [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "And then?"}]
        second = stream_completion(url, msgs2, 16, model_id, chat=True)
        fresh_proc, fresh_url = start_server(args.model, args.threads, slots=1, capacity=capacity)
        try:
            fresh = stream_completion(fresh_url, msgs2, 16, model_id, chat=True)
        finally:
            fresh_proc.terminate()
            fresh_proc.wait()
        report["prefix_reuse"] = {
            "turn1_ttft_ms": round(first["ttft_s"] * 1e3, 2), "turn2_ttft_ms": round(second["ttft_s"] * 1e3, 2),
            "ratio": round(second["ttft_s"] / first["ttft_s"], 3),
            "turn1_prompt_tokens": first["usage"]["prompt_tokens"],
            "turn2_cached_tokens": second["usage"]["prompt_tokens_details"]["cached_tokens"],
            "same_text_as_without_reuse": second["text"] == fresh["text"]}
    finally:
        proc.terminate()
        proc.wait()
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

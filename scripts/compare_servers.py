"""Side by side: `edgeinfer serve` vs llama-cpp-python's OpenAI server, same client, same prompts.

    python scripts/compare_servers.py --edgeinfer-model DIR --gguf FILE.gguf \
        [--llama-python PY] [--threads 2] [--rounds 3] [--out FILE]

Each server runs alone on a free loopback port (one at a time, so they never share the 2 cores),
in alternating passes (edgeinfer, llama.cpp, edgeinfer, ...). Per pass, over /v1/completions with
streaming, temperature 0 and EOS banned by logit_bias (both servers take it):
  ttft_ms        time to the first streamed token, a ~512-token text prompt (prefill dominated)
  decode_tok_s   128 tokens over the time from the request to the last chunk, a short prompt (its
                 prefill is about a step): the tokens are the 128 asked for, EOS being banned, or the
                 usage's count where a server sends one. Counting chunks of text counted 102-114 of
                 our 128 tokens (a chunk may carry several tokens, or none while a character's bytes
                 are incomplete), and timing from the first chunk left out the tokens it carried
                 (a server merges the tokens a client has not read yet: 38 chunks for 128)
Medians over passes. llama-cpp-python runs from its own interpreter (--llama-python), since it
is not a dependency of edgeinfer.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

import edgeinfer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int) -> subprocess.Popen:
    log = tempfile.TemporaryFile()  # the server's output, shown if it does not start (a missing llama_cpp
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)  # said only "server exited")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {' '.join(cmd)}\n{_tail(log)}")
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"server did not start: {' '.join(cmd)}\n{_tail(log)}")


def _tail(log, n: int = 2000) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-n:]


def stream(url: str, model: str, prompt: str, max_tokens: int) -> tuple[list[float], int]:
    """Arrival times of the chunks with text, and the tokens generated (the usage's, else max_tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "logit_bias": {"2": -100}, "stream_options": {"include_usage": True}}
    t0, stamps, tokens = time.perf_counter(), [], max_tokens
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                if any(c.get("text") for c in ev.get("choices", [])):
                    stamps.append(time.perf_counter() - t0)
                if (ev.get("usage") or {}).get("completion_tokens"):
                    tokens = ev["usage"]["completion_tokens"]
    return stamps, tokens


def measure(url: str, model: str, long_prompt: str, short_prompt: str) -> dict:
    stream(url, model, short_prompt, 4)  # warm-up
    ttft = stream(url, model, long_prompt, 2)[0][0]
    s, tokens = stream(url, model, short_prompt, 128)
    return {"ttft_ms": ttft * 1e3, "decode_tok_s": tokens / s[-1], "tokens": tokens, "text_chunks": len(s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--edgeinfer-model", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--llama-python", default=sys.executable)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    tok = edgeinfer.load(a.edgeinfer_model).tokenizer
    words = "the little dog ran to the park and saw a big red ball under the tree near the house".split()
    long_prompt = " ".join(words[i % len(words)] for i in range(460))
    short_prompt = "Once upon a time, there was a little girl"
    servers = {
        "edgeinfer": lambda port: [sys.executable, "-m", "edgeinfer", "serve", "-m", a.edgeinfer_model, "--port",
                                   str(port), "--threads", str(a.threads), "--slots", "1", "--max-tokens-limit", "512"],
        "llamacpp": lambda port: [a.llama_python, "-m", "llama_cpp.server", "--model", a.gguf, "--port", str(port),
                                  "--host", "127.0.0.1", "--n_threads", str(a.threads), "--n_threads_batch",
                                  str(a.threads), "--n_ctx", "2048"],
    }
    runs: dict = {name: [] for name in servers}
    for _ in range(a.rounds):
        for name, cmd in servers.items():
            port = free_port()
            proc = start(cmd(port), port)
            try:
                model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
                runs[name].append(measure(f"http://127.0.0.1:{port}", model, long_prompt, short_prompt))
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            print(name, runs[name][-1], file=sys.stderr)
    summary = {name: {k: round(statistics.median(r[k] for r in rs), 2) for k in ("ttft_ms", "decode_tok_s")}
               for name, rs in runs.items()}
    report = {"edgeinfer_model": a.edgeinfer_model, "gguf": a.gguf, "threads": a.threads, "rounds": a.rounds,
              "long_prompt_tokens": len(tok.encode(long_prompt)), "summary": summary,
              "edgeinfer_over_llamacpp": {k: round(summary["edgeinfer"][k] / summary["llamacpp"][k], 3)
                                          for k in ("ttft_ms", "decode_tok_s")}, "runs": runs}
    text = json.dumps(report, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

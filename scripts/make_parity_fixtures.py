"""Reference outputs from transformers for the tiny models (run once; CI needs no torch).

    pip install torch==2.13.0 transformers
    python scripts/make_parity_fixtures.py [--dir tests/fixtures/tiny]

Writes <model>/reference.npz with:
  input_ids [1, 24]    fixed random ids
  logits    [24, V]    float32 logits of one teacher-forced forward pass
  prompt_ids [8]       greedy prompt
  greedy_ids [32]      32 argmax steps, full recompute each step, no EOS stop
  min_margin           smallest top1 - top2 logit gap over the greedy steps
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
try:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
except ModuleNotFoundError as e:  # (a traceback, even for --help: a scripts round)
    raise SystemExit(f"this script needs {e.name}: pip install torch==2.13.0 transformers") from None

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=ROOT / "tests" / "fixtures" / "tiny")
    args = ap.parse_args()
    torch.manual_seed(0)
    rng = np.random.default_rng(1234)
    report = {}
    for folder in sorted(p for p in args.dir.iterdir() if (p / "config.json").exists()):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
        vocab = model.config.vocab_size
        input_ids = rng.integers(3, vocab, size=(1, 24))
        prompt = rng.integers(3, vocab, size=(8,))
        with torch.no_grad():
            logits = model(torch.tensor(input_ids)).logits[0].float().numpy()
            ids, margins = list(prompt), []
            for _ in range(32):
                last = model(torch.tensor([ids])).logits[0, -1].float().numpy()
                top2 = np.sort(last)[-2:]
                margins.append(float(top2[1] - top2[0]))
                ids.append(int(last.argmax()))
        np.savez_compressed(folder / "reference.npz", input_ids=input_ids, logits=logits.astype(np.float32),
                            prompt_ids=prompt, greedy_ids=np.array(ids[8:]), min_margin=np.float32(min(margins)))
        report[folder.name] = {"min_margin": round(min(margins), 4), "logit_absmax": float(np.abs(logits).max())}
    report["_versions"] = {"transformers": transformers.__version__, "torch": torch.__version__}
    (args.dir / "REFERENCE.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

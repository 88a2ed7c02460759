"""Record an independent engine's greedy decoding of SmolLM2-135M-Instruct (the GGUF file that
`tree-attention-edu fetch-model` fetches) into tests/data/smollm2_reference.json.

The engine is transformers' own GGUF loader (`from_pretrained(dir, gguf_file=...)`): it reads
the file with its own code, dequantises every tensor to float32, undoes llama.cpp's Q/K row
permutation itself and runs its `LlamaForCausalLM` in float32. Nothing here imports
tree_attention_edu. It needs torch, transformers and accelerate, which the project does not
depend on: run it in a scratch environment, e.g.

    python3 -m venv /work/scratch/refvenv
    /work/scratch/refvenv/bin/pip install torch==2.13.0+cpu transformers==5.23.0 \
        accelerate==1.15.0 gguf==0.19.0
    tree-attention-edu fetch-model            # .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
    /work/scratch/refvenv/bin/python scripts/reference_smollm2.py

For each prompt it records the prompt's token ids (transformers' tokenizer built from the
file), the greedy new tokens (argmax of each step's float32 logits, no end-of-sequence stop,
so every prompt has the same count), and each step's top-k token ids and logits.
tests/test_smollm2.py checks the package against this file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = ROOT / "tests" / "data" / "smollm2_reference.json"

NEEDLE = "The secret code for the blue door is 7319."
FILLER = [
    "The grass in the valley grows tall every spring.",
    "A river runs past the old mill and into the lake.",
    "Farmers bring apples and bread to the market on Saturdays.",
    "The library opens at nine and closes at six.",
    "Children play football in the park after school.",
    "The train to the coast leaves from the second platform.",
    "Clouds gather over the hills before the evening rain.",
    "The baker wakes up early to light the ovens.",
]


def long_document(sentences: int = 300) -> str:
    """A document of `sentences` filler sentences with NEEDLE in the middle."""
    body = [FILLER[i % len(FILLER)] for i in range(sentences)]
    body.insert(sentences // 2, NEEDLE)
    return " ".join(body)


PROMPTS = [
    {"name": "plain", "chat": False, "text": "The capital of France is"},
    {
        "name": "chat",
        "chat": True,
        "text": "What is the capital of France? Answer in one sentence.",
    },
    {
        "name": "code",
        "chat": False,
        "text": "# Return the n-th Fibonacci number, with fib(0) = 0 and fib(1) = 1.\n"
        "def fib(n):\n",
    },
    {
        "name": "long",
        "chat": True,
        "text": "Read the document, then answer the question.\n\n"
        + long_document()
        + "\n\nQuestion: What is the secret code for the blue door?",
    },
]


def main() -> None:
    import gguf
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--new-tokens", type=int, default=20)
    parser.add_argument("--top-k", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(2)
    data = args.model.read_bytes()
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.model.parent, gguf_file=args.model.name)
    model = AutoModelForCausalLM.from_pretrained(
        args.model.parent, gguf_file=args.model.name, dtype=torch.float32
    )
    model.eval()
    print(f"loaded in {time.perf_counter() - t0:.1f} s")
    records = []
    for prompt in PROMPTS:
        text = prompt["text"]
        if prompt["chat"]:
            text = tok.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        ids = tok(text, add_special_tokens=True)["input_ids"]
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model(torch.tensor([ids]), use_cache=True)
            tokens, top_ids, top_logits = [], [], []
            for step in range(args.new_tokens):
                logits = out.logits[0, -1].to(torch.float32)
                top = torch.topk(logits, args.top_k)
                top_ids.append(top.indices.tolist())
                top_logits.append([round(float(x), 6) for x in top.values])
                tokens.append(int(torch.argmax(logits)))
                if step + 1 < args.new_tokens:
                    out = model(
                        torch.tensor([[tokens[-1]]]),
                        past_key_values=out.past_key_values,
                        use_cache=True,
                    )
        seconds = time.perf_counter() - t0
        print(
            f"{prompt['name']}: {len(ids)} prompt tokens, {seconds:.1f} s -> {tok.decode(tokens)!r}"
        )
        records.append(
            {
                **prompt,
                "rendered": text if prompt["chat"] else None,
                "ids": ids,
                "tokens": tokens,
                "top_ids": top_ids,
                "top_logits": top_logits,
                "decoded": tok.decode(tokens),
            }
        )
    result = {
        "command": "python scripts/reference_smollm2.py (in a scratch venv: see its docstring)",
        "engine": "transformers AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., "
        "dtype=torch.float32), greedy with its KV cache",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "gguf": getattr(gguf, "__version__", "0.19.0"),
            "python": platform.python_version(),
        },
        "model": {
            "file": args.model.name,
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        },
        "new_tokens": args.new_tokens,
        "top_k": args.top_k,
        "prompts": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()

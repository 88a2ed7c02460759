"""Compare llama.cpp itself (through llama-cpp-python) with the recorded reference of
tests/data/smollm2_reference.json, on the same prompt ids.

llama.cpp multiplies the Q4_1/Q8_0 weights without dequantising them to float32 (it rounds
the activations to 8-bit blocks first), so its logits are not expected to equal transformers'
or the package's; this reports how close they are. For each prompt it feeds the reference's
prompt ids, then the reference's greedy tokens one by one (teacher forcing, so the steps stay
aligned), and records at each step: whether llama.cpp's own argmax is the reference's token
(top-1 agreement), and the largest |logit difference| at the reference's top-5 ids. It also
checks llama.cpp's tokenizer on the prompt texts.

llama-cpp-python compiles llama.cpp from source; in a scratch environment (not the
project's):

    CMAKE_BUILD_PARALLEL_LEVEL=1 /work/scratch/refvenv/bin/pip install llama-cpp-python==0.3.36
    /work/scratch/refvenv/bin/python scripts/llamacpp_smollm2.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    import llama_cpp
    import llama_cpp.llama as high_level

    # Weights in llama.cpp's own CPU buffers: its "extra" buffer types (AMX, repacking) crashed
    # in ggml_backend_amx_mul_mat on this machine's AMX-capable CPU (llama-cpp-python 0.3.36).
    defaults = high_level.llama_cpp.llama_model_default_params

    def model_params():
        params = defaults()
        params.use_extra_bufts = False
        return params

    high_level.llama_cpp.llama_model_default_params = model_params

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", type=Path, default=ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    parser.add_argument(
        "--reference", type=Path, default=ROOT / "tests" / "data" / "smollm2_reference.json"
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    ref = json.loads(args.reference.read_text())
    llm = llama_cpp.Llama(
        model_path=str(args.model),
        n_ctx=4096,
        n_batch=512,
        logits_all=True,
        n_threads=args.threads,
        seed=0,
        verbose=False,
    )
    print(f"llama-cpp-python {llama_cpp.__version__}")
    rows = []
    for p in ref["prompts"]:
        text = p["rendered"] if p["chat"] else p["text"]
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(p["ids"])
        agree, errs, own = 0, [], []
        for step, token in enumerate(p["tokens"]):
            logits = np.asarray(llm.scores[llm.n_tokens - 1], np.float64)
            own.append(int(np.argmax(logits)))
            agree += own[-1] == token
            errs.append(
                float(np.abs(logits[p["top_ids"][step]] - np.array(p["top_logits"][step])).max())
            )
            if step + 1 < len(p["tokens"]):
                llm.eval([token])
        seconds = time.perf_counter() - t0
        row = {
            "prompt": p["name"],
            "prompt_tokens": len(p["ids"]),
            "tokenizer_ids_equal": ids == p["ids"],
            "steps": len(p["tokens"]),
            "top1_agreement": agree,
            "max_abs_logit_diff": max(errs),
            "median_abs_logit_diff": float(np.median(errs)),
            "seconds": round(seconds, 2),
            "llama_cpp_text": llm.detokenize(own).decode("utf-8", "replace"),
        }
        rows.append(row)
        print(json.dumps(row))


if __name__ == "__main__":
    main()

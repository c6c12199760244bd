"""The transformers reference for bench/generate.sh: tokens/s of `GPT2LMHeadModel.generate` on the
CPU, greedy, float32, with its KV cache, measured as `qatc generate` measures itself (the new tokens
over the seconds of the generation: the prompt's pass, every step and the choosing; not loading).

    $(bash ../shared/tools/peer-env.sh | tail -1) bench/generate_peer.py --model DIR --prompt-ids 33676,4720,25 --new 64

`--min-new-tokens` is set to the count, so EOS does not end a run early (qatc: `--ignore-eos`).
Prints one JSON line per attention implementation (`eager`, GPT-2's own; `sdpa`, transformers'
default, PyTorch's fused attention): the best and the median tokens/s over the repeats, after a
warm-up run, and the tokens (greedy, so every run gives the same).

`--write-124m DIR` writes a GPT-2 124M of random weights (`GPT2Config()`, torch.manual_seed(0),
float32 safetensors and config.json) for the speed figures: no 124M checkpoint ships with the
repository or ../shared, and the time of a step does not depend on the weights' values.
"""
import argparse
import json
import statistics
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--prompt-ids", default="33676,4720,25")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attn", default="eager,sdpa")
    ap.add_argument("--write-124m", metavar="DIR")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if a.write_124m:
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config()).save_pretrained(a.write_124m, safe_serialization=True)
        return
    ids = torch.tensor([[int(t) for t in a.prompt_ids.split(",")]])
    for attn in a.attn.split(","):
        m = GPT2LMHeadModel.from_pretrained(a.model, dtype=torch.float32, attn_implementation=attn).eval()
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False,
                  pad_token_id=m.config.eos_token_id)
        rates = []
        with torch.no_grad():
            m.generate(ids, **kw)  # warm-up
            for _ in range(a.repeats):
                t = time.perf_counter()
                out = m.generate(ids, **kw)
                rates.append(a.new / (time.perf_counter() - t))
        print(json.dumps({"engine": f"transformers {transformers.__version__} ({attn})", "threads": a.threads,
                          "tokens_per_s": max(rates), "median_tokens_per_s": statistics.median(rates),
                          "tokens": out[0, ids.shape[1]:].tolist()}), flush=True)


if __name__ == "__main__":
    main()

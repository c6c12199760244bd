"""A randomly initialised GPT-2 as Hugging Face's GPT2LMHeadModel initialises one, written as
model.safetensors (f32) and config.json into DIR: the start of the evaluation model that
`make quality-model` trains with qatc (issue 33, 3). Pure Python (no NumPy, no PyTorch), so the
same seed gives the same bytes on any machine.

  python3 bench/quality-model/init_gpt2.py DIR [--layers 6] [--embd 384] [--heads 6] [--seed 1]

Init (transformers' GPT2PreTrainedModel._init_weights): every linear weight and both embeddings
N(0, 0.02); the residual projections (attn.c_proj, mlp.c_proj) N(0, 0.02 / sqrt(2 L)); biases 0;
layer norms weight 1, bias 0. Normal draws are Python's random.gauss from random.Random(seed),
in the order the tensors are listed below.
"""
import argparse
import array
import json
import math
import os
import random
import struct


def tensors(layers, embd, vocab, positions):
    yield "transformer.wte.weight", [vocab, embd], 0.02
    yield "transformer.wpe.weight", [positions, embd], 0.02
    proj = 0.02 / math.sqrt(2 * layers)
    for i in range(layers):
        p = f"transformer.h.{i}."
        yield p + "ln_1.weight", [embd], "one"
        yield p + "ln_1.bias", [embd], "zero"
        yield p + "attn.c_attn.weight", [embd, 3 * embd], 0.02
        yield p + "attn.c_attn.bias", [3 * embd], "zero"
        yield p + "attn.c_proj.weight", [embd, embd], proj
        yield p + "attn.c_proj.bias", [embd], "zero"
        yield p + "ln_2.weight", [embd], "one"
        yield p + "ln_2.bias", [embd], "zero"
        yield p + "mlp.c_fc.weight", [embd, 4 * embd], 0.02
        yield p + "mlp.c_fc.bias", [4 * embd], "zero"
        yield p + "mlp.c_proj.weight", [4 * embd, embd], proj
        yield p + "mlp.c_proj.bias", [embd], "zero"
    yield "transformer.ln_f.weight", [embd], "one"
    yield "transformer.ln_f.bias", [embd], "zero"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--embd", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    header, blobs, offset = {}, [], 0
    for name, shape, init in tensors(a.layers, a.embd, a.vocab, a.positions):
        n = math.prod(shape)
        if init == "one":
            data = array.array("f", [1.0]) * n
        elif init == "zero":
            data = array.array("f", [0.0]) * n
        else:
            data = array.array("f", (rng.gauss(0.0, init) for _ in range(n)))
        raw = data.tobytes()  # little-endian on every machine qatc runs on
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    os.makedirs(a.dir, exist_ok=True)
    with open(os.path.join(a.dir, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)
    config = {
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.0,
        "bos_token_id": 50256,
        "embd_pdrop": 0.0,
        "eos_token_id": 50256,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05,
        "model_type": "gpt2",
        "n_embd": a.embd,
        "n_head": a.heads,
        "n_inner": None,
        "n_layer": a.layers,
        "n_positions": a.positions,
        "resid_pdrop": 0.0,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "vocab_size": a.vocab,
    }
    with open(os.path.join(a.dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Writes the safetensors seed corpus: tiny GPT-2 checkpoints in the layouts qatc accepts.

Small on purpose (a few KB): libFuzzer mutates faster and caps new inputs near the seeds' size.
Values are arbitrary but deterministic. Run from fuzz/: python3 make_seeds.py
"""
import json
import os
import struct

C, L, P, V = 8, 1, 4, 11
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seeds", "safetensors_load")


def gpt2_tensors():
    t = [("wte.weight", [V, C]), ("wpe.weight", [P, C])]
    for i in range(L):
        for n, s in [("ln_1.weight", [C]), ("ln_1.bias", [C]), ("attn.c_attn.weight", [C, 3 * C]),
                     ("attn.c_attn.bias", [3 * C]), ("attn.c_proj.weight", [C, C]), ("attn.c_proj.bias", [C]),
                     ("ln_2.weight", [C]), ("ln_2.bias", [C]), ("mlp.c_fc.weight", [C, 4 * C]),
                     ("mlp.c_fc.bias", [4 * C]), ("mlp.c_proj.weight", [4 * C, C]), ("mlp.c_proj.bias", [C])]:
            t.append((f"h.{i}.{n}", s))
    return t + [("ln_f.weight", [C]), ("ln_f.bias", [C])]


def numel(s):
    n = 1
    for d in s:
        n *= d
    return n


def encode(dtype, vals):
    if dtype == "F32":
        return struct.pack(f"<{len(vals)}f", *vals)
    if dtype == "F16":
        return struct.pack(f"<{len(vals)}e", *vals)
    if dtype == "BF16":
        return b"".join(struct.pack("<f", v)[2:] for v in vals)
    if dtype in ("BOOL", "U8"):
        return bytes(int(v != 0) for v in vals)
    raise ValueError(dtype)


def write(name, tensors, prefix=""):
    """tensors: list of (key, dtype, shape)."""
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for k, (key, dtype, shape) in enumerate(sorted(tensors)):
        n = numel(shape)
        vals = [((i * 7 + k * 3) % 13 - 6) * 0.01 + (1.0 if key.endswith("ln_1.weight") else 0.0) for i in range(n)]
        b = encode(dtype, vals)
        header[prefix + key] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(b)]}
        data += b
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


os.makedirs(OUT, exist_ok=True)
base = gpt2_tensors()
# Hub layout: F32, no prefix, no buffers.
write("gpt2_f32.safetensors", [(k, "F32", s) for k, s in base])
# Older transformers: F16, `transformer.` prefix, mask buffers (BOOL and F32 scalar).
write("gpt2_f16_prefix_buffers.safetensors",
      [(k, "F16", s) for k, s in base] + [("h.0.attn.bias", "BOOL", [1, 1, P, P]), ("h.0.attn.masked_bias", "F32", [])],
      prefix="transformer.")
# BF16 with an explicit lm_head.
write("gpt2_bf16_lm_head.safetensors", [(k, "BF16", s) for k, s in base] + [("lm_head.weight", "BF16", [V, C])])
# Not a GPT-2, but a valid file: one U8 buffer and one tensor.
write("two_tensors.safetensors", [("x", "F32", [2, 3]), ("h.3.attn.bias", "U8", [1, 1, 2, 2])])

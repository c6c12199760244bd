#!/usr/bin/env python3
"""Writes the seed corpora: tiny GPT-2 checkpoints in the layouts qatc accepts (safetensors_load),
PEFT adapters for them (adapter_read), resume states of the tiny LoRA step (resume_state) and bit
maps (bit_map_read).

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


def st_bytes(tensors, prefix=""):
    """A safetensors file of (key, dtype, shape) with deterministic values."""
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for k, (key, dtype, shape) in enumerate(sorted(tensors)):
        n = numel(shape)
        vals = [((i * 7 + k * 3) % 13 - 6) * 0.01 + (1.0 if key.endswith("ln_1.weight") else 0.0) for i in range(n)]
        b = encode(dtype, vals)
        header[prefix + key] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(b)]}
        data += b
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def write(name, tensors, prefix=""):
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(st_bytes(tensors, prefix))


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


def put(target, name, data):
    d = os.path.join(os.path.dirname(OUT), target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# adapter_read: u16 length of adapter_config.json, the config, then adapter_model.safetensors
def adapter(r, targets, alpha=16, extra=None):
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0,
           "target_modules": targets, "fan_in_fan_out": True, "bias": "none", "use_rslora": False}
    cfg.update(extra or {})
    c = json.dumps(cfg).encode()
    dims = {"attn.c_attn": (C, 3 * C), "attn.c_proj": (C, C), "mlp.c_fc": (C, 4 * C), "mlp.c_proj": (4 * C, C)}
    ts = []
    for m, (i, o) in dims.items():
        if any(m == t or m.endswith("." + t) for t in targets):
            for l in range(L):
                key = f"base_model.model.transformer.h.{l}.{m}"
                ts += [(key + ".lora_A.weight", "F32", [r, i]), (key + ".lora_B.weight", "F32", [o, r])]
    return struct.pack("<H", len(c)) + c + st_bytes(ts)


put("adapter_read", "c_attn_r2.bin", adapter(2, ["c_attn"]))
put("adapter_read", "all_r4_rslora.bin", adapter(4, ["c_attn", "c_proj", "c_fc"], extra={"use_rslora": True}))
put("adapter_read", "mlp_r1_patterns.bin", adapter(1, ["mlp.c_fc", "mlp.c_proj"], alpha=2, extra={"rank_pattern": {}, "alpha_pattern": {}}))

# resume_state: the tiny LoRA step's persistent inputs (fuzz_targets/resume_state.rs)
state = [("step", "F32", [])]
for l in range(2):
    for t, shape in [("lora_A", [2, 8]), ("lora_B", [24, 2])]:
        n = f"h.{l}.attn.c_attn.{t}.weight"
        state += [(n, "F32", shape), ("adam.m:" + n, "F32", shape), ("adam.v:" + n, "F32", shape)]
put("resume_state", "tiny_lora.safetensors", st_bytes(state))
put("resume_state", "tiny_lora_extra.safetensors", st_bytes(state + [("lr", "F32", [])]))
put("resume_state", "tiny_lora_f16.safetensors", st_bytes([(k, "F16", s) for k, _, s in state]))

# bit_map_read: what qatc prt writes
def bit_map(modules):
    return (json.dumps({"version": 1, "modules": modules}, indent=2) + "\n").encode()


put("bit_map_read", "prt.json", bit_map({"h.0.attn.c_attn": {"bits": 4, "group": 8, "scheme": "sym"},
                                         "h.0.attn.c_proj": None, "h.0.mlp.c_fc": {"bits": 3, "group": 0, "scheme": "asym"},
                                         "h.0.mlp.c_proj": {"bits": 4, "group": 32, "scheme": "q4_0"}}))
put("bit_map_read", "nf4.json", bit_map({"h.0.mlp.c_proj": {"bits": 4, "group": 16, "scheme": "nf4"}}))
put("bit_map_read", "empty.json", bit_map({}))

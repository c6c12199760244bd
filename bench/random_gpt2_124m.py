# A GPT-2 124M checkpoint with the hub's tensor names and shapes and pseudo-random float16 values
# (for timing builds only: no trained weights here). Usage: python3 bench/random_gpt2_124m.py [OUT_DIR]
import json, os, random, struct, sys
out = sys.argv[1] if len(sys.argv) > 1 else "gpt2-124m"
os.makedirs(out, exist_ok=True)
random.seed(0)
C, L, V, P = 768, 12, 50257, 1024
shapes = {"wte.weight": [V, C], "wpe.weight": [P, C], "ln_f.weight": [C], "ln_f.bias": [C]}
for i in range(L):
    h = f"h.{i}."
    shapes.update({h+"ln_1.weight": [C], h+"ln_1.bias": [C], h+"attn.c_attn.weight": [C, 3*C], h+"attn.c_attn.bias": [3*C],
                   h+"attn.c_proj.weight": [C, C], h+"attn.c_proj.bias": [C], h+"ln_2.weight": [C], h+"ln_2.bias": [C],
                   h+"mlp.c_fc.weight": [C, 4*C], h+"mlp.c_fc.bias": [4*C], h+"mlp.c_proj.weight": [4*C, C], h+"mlp.c_proj.bias": [C]})
block = b"".join(struct.pack("<e", random.uniform(-0.05, 0.05)) for _ in range(65537))
ones = struct.pack("<e", 1.0)
header, off, datas = {}, 0, []
for name, shape in shapes.items():
    n = 1
    for d in shape: n *= d
    if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
        data = ones * n
    else:
        data = (block * (2 * n // len(block) + 1))[: 2 * n]
    header[name] = {"dtype": "F16", "shape": shape, "data_offsets": [off, off + len(data)]}
    off += len(data); datas.append(data)
h = json.dumps(header).encode(); h += b" " * ((8 - len(h) % 8) % 8)
with open(os.path.join(out, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(h))); f.write(h)
    for d in datas: f.write(d)
cfg = json.load(open(os.path.join(os.path.dirname(__file__), "..", "examples", "gpt2-shakespeare-small", "config.json")))
cfg.update({"n_embd": C, "n_head": 12, "n_layer": L, "n_positions": P})
json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=2)

"""The one home of issue 20's model FLOPs and of the GPU peaks MFU is taken against; bench/gpu.sh and
bench/torch_cuda_peer.py both use it, so qatc's and PyTorch's MFU are the same arithmetic.

FLOPs per token of the QAT + LoRA training step (issue 20):

    4 * N_matmul + 6 * N_lora + 12 * L * C * T

- N_matmul: the weights of the frozen matmuls, 12 C^2 per layer (c_attn 3 C^2, attn.c_proj C^2,
  c_fc 4 C^2, mlp.c_proj 4 C^2) plus the tied LM head V C. Frozen: a forward (2 N) and the input
  gradient (2 N), no weight gradient, so 4 N.
- N_lora: the LoRA weights of the four linears at rank r, r (n_in + n_out) each: r (C + 3C),
  r (C + C), r (C + 4C), r (4C + C), that is 16 r C per layer; trained, so forward, input and weight
  gradients: 6 N.
- 12 L C T: causal attention's two matmuls (QK^T, PV) forward and backward, counted whole (as
  llm.c and nanoGPT count them, not halved for the mask).

Peaks: dense bf16 tensor-core TFLOP/s from NVIDIA's datasheets (the sparse figure halved), by the
device name CUDA reports. MFU is not given for a device not in the table.

  python3 bench/mfu.py --layers 12 --embd 768 --seq 1024 [--vocab 50257] [--r 16]
      [--tokens-per-s X --device "NVIDIA H100 80GB HBM3"]    # one JSON line
"""
import argparse
import json

# (substring of the device name, peak dense bf16 FLOP/s, what it is); first match wins
PEAKS = [
    ("H200 NVL", 835e12, "H200 NVL"),
    ("H200", 989e12, "H200 SXM"),
    ("H100 PCIe", 756e12, "H100 PCIe"),
    ("H100 NVL", 835e12, "H100 NVL"),
    ("H100", 989e12, "H100 SXM (80GB HBM3)"),
]


def matmul_params(layers, embd, vocab):
    return layers * 12 * embd * embd + vocab * embd


def lora_params(layers, embd, r):
    return layers * 16 * r * embd


def flops_per_token(layers, embd, vocab, seq, r):
    return 4 * matmul_params(layers, embd, vocab) + 6 * lora_params(layers, embd, r) + 12 * layers * embd * seq


def peak(device):
    """(FLOP/s, what) for a device name, or (None, why)."""
    for key, flops, what in PEAKS:
        if key in (device or ""):
            return flops, what
    return None, f"no peak known for '{device}'"


def report(layers, embd, vocab, seq, r, tokens_per_s=None, device=None):
    f = flops_per_token(layers, embd, vocab, seq, r)
    p, what = peak(device)
    d = {"flops_per_token": f, "peak_flops": p, "peak_of": what, "device": device}
    if tokens_per_s:
        d["model_flops_per_s"] = tokens_per_s * f
        d["mfu"] = tokens_per_s * f / p if p else None
    return d


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--embd", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--tokens-per-s", type=float)
    ap.add_argument("--device")
    a = ap.parse_args()
    print(json.dumps(report(a.layers, a.embd, a.vocab, a.seq, a.r, a.tokens_per_s, a.device)))


if __name__ == "__main__":
    main()

"""How long the two lm_head GEMMs of benchmark config A take in PyTorch on this machine: the
floor under any fp32 training step of that config (qatc's or PyTorch's), which shows what a 2x
target over PyTorch eager leaves for everything else.

    python bench/lm_head_floor.py   (the peer environment: ../shared/tools/peer-env.sh)
"""
import time

import torch

torch.set_num_threads(2)
n, c, v = 4 * 128, 256, 50257  # B*T, n_embd, vocab of config A
x, w, g = torch.randn(n, c), torch.randn(v, c), torch.randn(n, v)


def median_ms(f, reps=7):
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[reps // 2] * 1e3


fwd = median_ms(lambda: x @ w.T)  # logits = x W^T
bwd = median_ms(lambda: g @ w)  # dx = dlogits W (W is frozen: no dW)
flops = 2 * n * c * v
print(f"logits  x @ W^T  {fwd:6.1f} ms  {flops / fwd / 1e6:5.0f} GFLOP/s")
print(f"dx   dlogits @ W {bwd:6.1f} ms  {flops / bwd / 1e6:5.0f} GFLOP/s")
print(f"both             {fwd + bwd:6.1f} ms")

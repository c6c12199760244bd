"""PyTorch peer of a QAT+LoRA GPT-2 training step on CUDA: the GPU twin of
../shared/tools/torch_peer.py (same model, fake-quant and LoRA; copied here because the GPU machine
gets this repository only), timed with CUDA events.

A randomly initialised Hugging Face GPT-2 of a given size; every Conv1D (c_attn, attn.c_proj, c_fc,
mlp.c_proj) gets per-group symmetric fake-quant (STE) of its frozen base weight plus a PEFT-style
LoRA branch; forward + backward + AdamW. Prints one JSON line: the median step time, tokens/s, MFU
(bench/mfu.py: issue 20's FLOPs per token and the device's dense bf16 peak) and the peak device
memory PyTorch allocated. With --compile (torch.compile, Inductor) the warm-up steps, where it
compiles, are timed apart (compile_s) and excluded from the median.

--fit: no timing; the largest batch (1, 2, 4, ... up to --max-batch, the grid `qatc plan --fit`
tries) whose step runs without CUDA running out of memory, with --checkpoint (transformers'
per-block gradient checkpointing) or without; one JSON line with it and its peak memory.

  python3 bench/torch_cuda_peer.py --layers 12 --embd 768 --heads 12 --seq 1024 --batch 16 \\
      --dtype fp32|tf32|bf16 [--attn eager|sdpa] [--compile] [--precompute-quant] [--checkpoint]
  python3 bench/torch_cuda_peer.py --layers 48 --embd 1600 --heads 25 --dtype bf16 --attn sdpa --fit
"""
import argparse, json, math, os, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mfu  # noqa: E402  (bench/mfu.py: the FLOPs formula's one home)


def parse(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12); ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12); ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=1024); ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bits", type=int, default=4); ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--r", type=int, default=16); ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "tf32", "bf16"],
                    help="fp32: strict fp32 matmuls; tf32: TF32 tensor cores for fp32 matmuls; bf16: autocast to bf16")
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    ap.add_argument("--compile", action="store_true", help="torch.compile (compile time and warm-up excluded)")
    ap.add_argument("--precompute-quant", action="store_true", help="fake-quantize the frozen weights once")
    ap.add_argument("--checkpoint", action="store_true", help="gradient checkpointing (transformers', per block)")
    ap.add_argument("--fit", action="store_true", help="the largest batch that fits (no timing)")
    ap.add_argument("--max-batch", type=int, default=1024, help="the largest batch --fit tries")
    return ap.parse_args(argv)


def run(args):
    # torch is imported here, after the arguments: `--help` and bad arguments need no torch (the
    # dry run of bench/gpu.sh checks them on a machine without one)
    import torch, torch.nn as nn
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    class FakeQuantSTE(torch.autograd.Function):
        @staticmethod
        def forward(ctx, w, bits, group):
            qmax = 2 ** (bits - 1) - 1
            shape = w.shape
            g = w.reshape(-1, group)
            scale = g.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / qmax
            q = torch.clamp(torch.round(g / scale), -qmax - 1, qmax)
            return (q * scale).reshape(shape)

        @staticmethod
        def backward(ctx, g):
            return g, None, None

    class QLoraConv1D(nn.Module):
        def __init__(self, base: Conv1D, bits, group, r, alpha, precompute=False):
            super().__init__()
            self.base = base
            self.wq = None
            if precompute:
                with torch.no_grad():
                    self.wq = FakeQuantSTE.apply(base.weight.t().contiguous(), bits, group).t().contiguous()
            for p in base.parameters():
                p.requires_grad_(False)
            nin, nout = base.weight.shape  # Conv1D stores [in, out]
            self.bits, self.group, self.scaling = bits, group, alpha / r
            self.lora_A = nn.Parameter(torch.empty(r, nin))
            self.lora_B = nn.Parameter(torch.zeros(nout, r))
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

        def forward(self, x):
            wq = self.wq if self.wq is not None else FakeQuantSTE.apply(self.base.weight.t().contiguous(), self.bits, self.group).t()
            y = torch.addmm(self.base.bias, x.reshape(-1, x.shape[-1]), wq).reshape(*x.shape[:-1], -1)
            return y + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scaling

    def build(args, device):
        torch.manual_seed(0)
        cfg = GPT2Config(n_layer=args.layers, n_embd=args.embd, n_head=args.heads, vocab_size=args.vocab, n_positions=max(1024, args.seq))
        cfg._attn_implementation = args.attn
        m = GPT2LMHeadModel(cfg)
        for p in m.parameters():
            p.requires_grad_(False)
        for blk in m.transformer.h:
            for parent, name in [(blk.attn, "c_attn"), (blk.attn, "c_proj"), (blk.mlp, "c_fc"), (blk.mlp, "c_proj")]:
                setattr(parent, name, QLoraConv1D(getattr(parent, name), args.bits, args.group, args.r, 2 * args.r, args.precompute_quant))
        if args.checkpoint:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
        m.config.use_cache = False
        return m.to(device)

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    dev = torch.device("cuda")
    tf32 = args.dtype == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    if args.fit:
        fit(args, dev, build, torch)
        return
    m = build(args, dev)
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)
    fwd = torch.compile(m) if args.compile else m
    warm = 3 if args.compile else 2

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            loss = fwd(input_ids=x, labels=x).loss
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); loss = step(); b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    med = times[len(times) // 2]
    tps = args.batch * args.seq / med
    device = torch.cuda.get_device_name()
    print(json.dumps({"peer": "pytorch-cuda-" + ("compile" if args.compile else "eager") + "+lora+fakequant",
                      "torch": torch.__version__, "cuda": torch.version.cuda, "device": device, **vars(args),
                      "trainable": sum(p.numel() for p in params), "loss": float(loss),
                      "step_s_median": med, "step_s_min": times[0], "tokens_per_s": tps,
                      # the warm-up steps: with --compile, where torch.compile compiles
                      "warmup_steps": warm, "warmup_s": warm_s, "compile_s": warm_s - warm * med if args.compile else None,
                      "mfu": mfu.report(args.layers, args.embd, args.vocab, args.seq, args.r, tps, device),
                      "peak_allocated_bytes": torch.cuda.max_memory_allocated()}))


def fit(args, dev, build, torch):
    """Doubles the batch until a step runs out of memory: the largest that ran, and its peak."""
    m = build(args, dev)
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    tried, best = [], None
    b = 1
    while b <= args.max_batch:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            x = torch.randint(0, args.vocab, (b, args.seq), device=dev)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
                loss = m(input_ids=x, labels=x).loss
            loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            tried.append({"batch": b, "fits": True, "peak_allocated_bytes": peak})
            best = (b, peak)
        except torch.cuda.OutOfMemoryError:
            tried.append({"batch": b, "fits": False})
            break
        finally:
            x = loss = None
            opt.zero_grad(set_to_none=True)
        b *= 2
    _, total = torch.cuda.mem_get_info()
    print(json.dumps({"peer": "pytorch-cuda-eager+lora+fakequant fit", "torch": torch.__version__, "cuda": torch.version.cuda,
                      "device": torch.cuda.get_device_name(), "device_total_bytes": total, **vars(args),
                      "max_batch": best[0] if best else 0, "peak_allocated_bytes": best[1] if best else None, "tried": tried}))


def main():
    run(parse())


if __name__ == "__main__":
    main()

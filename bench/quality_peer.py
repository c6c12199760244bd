"""The PyTorch + PEFT reference for bench/quality.sh: QAT + LoRA on the Shakespeare GPT-2 with the
recipe qatc runs, measured the same way (validation loss on the same batches).

    $(bash ../shared/tools/peer-env.sh | tail -1) bench/quality_peer.py --bits 3 --group 64 --scheme sym

Per run it reports, as one JSON line: the validation loss at full precision (`fp`), after
post-training fake-quantization (`ptq`), after STEPS steps of QAT + LoRA (`qat_lora`) and, with
--lora-fp, after the same LoRA training on the unquantized model (`lora_fp`).

The recipe is qatc's: the four linears of every block fake-quantized with qatc's rules (ir/src/op.rs,
QuantScheme: sym, nf4) on the frozen base weight, straight-through gradient; PEFT LoRA r 16,
alpha 32 on c_attn, c_proj, c_fc (every Conv1D); AdamW (0.9, 0.999, 1e-8, no weight decay) at a
constant learning rate; B 8, T 128; the training batches visited in qatc's shuffled order
(`src/schedule.rs`: splitmix64 Fisher-Yates per epoch, the same permutation for the same seed).
Only LoRA's initial values differ (PEFT draws them from torch's generator). The validation batches
are batch s = tokens [s*B*T, s*B*T + B*T + 1) of the validation file, as `qatc eval`.

`--scales learned` trains the per-group scales with LSQ (Esser et al. 2020; the same rule as qatc's
`fake_quant_learned`, passes/src/autodiff/rules.rs) and `--qat merged` quantizes W + s (BA)^T: both
use a LoRA of this file's own (PEFT's math: y = x W + b + s (x A^T) B^T, A kaiming-uniform, B 0),
since PEFT has neither; they exist to compare qatc's learned scales with a PyTorch implementation.
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]
MASK = (1 << 64) - 1


# ---- data: llm.c token files and qatc's batch order ---------------------------------------------
def read_tokens(path):
    raw = open(path, "rb").read()
    header = np.frombuffer(raw[:1024], dtype="<i4")
    assert header[0] == 20240520, f"{path}: not an llm.c token file"
    n = int(header[2])
    return torch.from_numpy(np.frombuffer(raw[1024:1024 + 2 * n], dtype="<u2").astype(np.int64).copy())


def batch(toks, s, b, t):
    chunk = toks[s * b * t: s * b * t + b * t + 1]
    return chunk[:-1].reshape(b, t), chunk[1:].reshape(b, t)


def splitmix(state):
    state = (state + 0x9E3779B97F4A7C15) & MASK
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return state, z ^ (z >> 31)


def permutation(seed, epoch, n):
    """src/schedule.rs `permutation`, bit for bit."""
    p = list(range(n))
    st = (seed ^ ((epoch * 0xD1B54A32D192ED03) & MASK)) & MASK
    for i in range(n - 1, 0, -1):
        st, z = splitmix(st)
        j = z % (i + 1)
        p[i], p[j] = p[j], p[i]
    return p


def shuffled_batch(seed, j, n):
    return permutation(seed, j // n, n)[j % n]


# ---- quantization: qatc's rules, per group of G rows of each column of W [in, out] ---------------
def grouped(w, group):
    n_in, n_out = w.shape
    g = n_in if group == 0 else group
    return w.reshape(n_in // g, g, n_out)


def grid(scheme, bits):
    """(lo, hi, qp) of the grid in units of the scale; qp is LSQ's Q_P."""
    if scheme == "sym":
        q = float(2 ** (bits - 1) - 1)
        return -q, q, q
    if scheme == "nf4":
        return -1.0, 1.0, 1.0
    raise ValueError(scheme)


def minmax_scales(w, scheme, bits, group):
    """The min-max scale of every group, [in/G, 1, out] (absmax / qmax; nf4: absmax)."""
    _, hi, _ = grid(scheme, bits)
    return grouped(w, group).abs().amax(dim=1, keepdim=True) / hi


def nf4_round(x):
    codes = torch.tensor(NF4, dtype=x.dtype)
    return codes[(x.unsqueeze(-1) - codes).abs().argmin(dim=-1)]


def fake_quant_minmax(w, scheme, bits, group):
    """FakeQuant with the min-max scale (no gradient: the base weight is frozen)."""
    with torch.no_grad():
        lo, hi, _ = grid(scheme, bits)
        wg = grouped(w, group)
        s = minmax_scales(w, scheme, bits, group)
        safe = torch.where(s == 0, torch.ones_like(s), s)
        x = wg / safe
        q = torch.clamp(torch.round(x), lo, hi) if scheme == "sym" else nf4_round(x)
        return torch.where(s == 0, torch.zeros_like(wg), q * s).reshape(w.shape)


class StraightThrough(torch.autograd.Function):
    """FakeQuant's gradient: dy passes through unchanged."""

    @staticmethod
    def forward(ctx, w, scheme, bits, group):
        return fake_quant_minmax(w, scheme, bits, group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None, None, None


def fake_quant_lsq(w, s, scheme, bits, group):
    """LSQ (Esser et al. 2020), the paper's formulation: the scale's gradient scaled by
    1/sqrt(G * Q_P), x = w / s clamped to the grid, rounded with a straight-through gradient; the
    scale is rounded to fp16 (straight through), as qatc stores it."""
    lo, hi, qp = grid(scheme, bits)
    wg = grouped(w, group)
    g = 1.0 / math.sqrt(wg.shape[1] * qp)
    s = s * g + (s - s * g).detach()  # value s, gradient g * ds
    s = s + (s.detach().half().float() - s.detach())  # the fp16 value, gradient straight through
    x = torch.clamp(wg / s, lo, hi)
    r = torch.round(x) if scheme == "sym" else nf4_round(x)
    q = x + (r - x).detach()
    return (q * s).reshape(w.shape)


# ---- the model -----------------------------------------------------------------------------------
def load(model_dir):
    from transformers import GPT2LMHeadModel
    import transformers
    transformers.logging.set_verbosity_error()
    # qatc's step has no dropout (LoRA's own aside, 0 here), so neither has the peer's: a config.json
    # without the *_pdrop keys (qatc's own, the evaluation GPT-2's) would get transformers' 0.1
    m = GPT2LMHeadModel.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                        attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    return m.float()


def conv1d_modules(m):
    """(parent, attribute, module name) of the four linears of every block."""
    out = []
    for i, blk in enumerate(m.transformer.h):
        for parent, attr, name in [(blk.attn, "c_attn", "attn.c_attn"), (blk.attn, "c_proj", "attn.c_proj"),
                                   (blk.mlp, "c_fc", "mlp.c_fc"), (blk.mlp, "c_proj", "mlp.c_proj")]:
            out.append((parent, attr, f"h.{i}.{name}"))
    return out


def make_fq_conv1d(base, scheme, bits, group):
    """A Conv1D whose forward uses the fake-quantized weight: PEFT wraps it as any Conv1D."""
    from transformers.pytorch_utils import Conv1D

    class FQConv1D(Conv1D):
        def forward(self, x):
            wq = StraightThrough.apply(self.weight, scheme, bits, group)
            y = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), wq)
            return y.reshape(*x.shape[:-1], -1)

    m = FQConv1D(base.weight.shape[1], base.weight.shape[0])
    m.load_state_dict(base.state_dict())
    return m


class OwnLora(nn.Module):
    """LoRA with PEFT's math on a Conv1D, for what PEFT cannot do: learned scales, merged QAT."""

    def __init__(self, base, quant, r, alpha, merged, learned):
        super().__init__()
        self.base, self.quant, self.merged, self.learned = base, quant, merged, learned
        for p in base.parameters():
            p.requires_grad_(False)
        n_in, n_out = base.weight.shape
        self.scaling = alpha / r
        self.lora_A = nn.Parameter(torch.empty(r, n_in))
        self.lora_B = nn.Parameter(torch.zeros(n_out, r))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        if quant is not None and learned:
            scheme, bits, group = quant
            s = minmax_scales(base.weight.detach(), scheme, bits, group)
            # rounded up to fp16, so no weight is clipped at the start (qatc: quant::init_scales)
            s16 = s.half().float()
            s16 = torch.where(s16 < s, torch.nextafter(s.half(), torch.tensor(float("inf"), dtype=torch.half)).float(), s16)
            self.scales = nn.Parameter(s16)

    def weight(self):
        w = self.base.weight
        if self.merged:
            w = w + self.scaling * (self.lora_A.t() @ self.lora_B.t())
        if self.quant is None:
            return w
        scheme, bits, group = self.quant
        if self.learned:
            return fake_quant_lsq(w, self.scales, scheme, bits, group)
        return StraightThrough.apply(w, scheme, bits, group)

    def forward(self, x):
        y = torch.addmm(self.base.bias, x.reshape(-1, x.shape[-1]), self.weight()).reshape(*x.shape[:-1], -1)
        if not self.merged:
            y = y + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scaling
        return y


def quantize_weights_(m, quant):
    with torch.no_grad():
        for parent, attr, _ in conv1d_modules(m):
            c = getattr(parent, attr)
            c.weight.copy_(fake_quant_minmax(c.weight, *quant))


def autocast(a):
    """`--autocast bf16`: forward and loss under torch.autocast('cpu', bfloat16), as a PyTorch
    user's mixed-precision script runs them (qatc's `--precision bf16` is measured against it)."""
    import contextlib
    if getattr(a, "autocast", "none") == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lr_factor(a, s):
    """qatc's LrSchedule.at(s) / lr (src/schedule.rs): linear warmup from (s+1)/warmup, then
    constant or cosine to --min-lr at the end of the run. Every group is scaled by it (qatc scales
    the learned scales' rate with the same schedule)."""
    if s < a.warmup:
        return (s + 1) / a.warmup
    if a.schedule == "cosine":
        span = max(a.steps - a.warmup, 1)
        frac = min((s - a.warmup) / span, 1.0)
        return (a.min_lr + 0.5 * (a.lr - a.min_lr) * (1.0 + math.cos(math.pi * frac))) / a.lr
    return 1.0


@torch.no_grad()
def evaluate(m, toks, b, t, n, a=None):
    m.eval()
    total = 0.0
    for s in range(n):
        ids, tgt = batch(toks, s, b, t)
        with autocast(a):
            logits = m(input_ids=ids).logits
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1)).item()
    return total / n


def train(m, params, toks, a, log):
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(a, s))
    nb = (len(toks) - 1) // (a.batch * a.seq)
    m.train()
    losses = []
    for step in range(a.steps):
        s = shuffled_batch(a.seed, step, nb)
        ids, tgt = batch(toks, s, a.batch, a.seq)
        with autocast(a):
            logits = m(input_ids=ids).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log and (step + 1) % 50 == 0:
            print(f"  step {step + 1}: loss {np.mean(losses[-50:]):.4f}", file=sys.stderr)
    return losses


def peft_lora(m, quant, a):
    """PEFT LoRA over Conv1Ds that fake-quantize their frozen weight (the reference row)."""
    from peft import LoraConfig, get_peft_model
    if quant is not None:
        for parent, attr, _ in conv1d_modules(m):
            setattr(parent, attr, make_fq_conv1d(getattr(parent, attr), *quant))
    cfg = LoraConfig(r=a.r, lora_alpha=a.alpha, lora_dropout=0.0, target_modules=["c_attn", "c_proj", "c_fc"],
                     fan_in_fan_out=True, bias="none")
    pm = get_peft_model(m, cfg)
    return pm, [p for p in pm.parameters() if p.requires_grad]


def own_lora(m, quant, a):
    for p in m.parameters():
        p.requires_grad_(False)
    for parent, attr, _ in conv1d_modules(m):
        setattr(parent, attr, OwnLora(getattr(parent, attr), quant, a.r, a.alpha, a.qat == "merged", a.scales == "learned"))
    lora, scales = [], []
    for n, p in m.named_parameters():
        if n.endswith("lora_A") or n.endswith("lora_B"):
            lora.append(p)
        elif n.endswith("scales"):
            scales.append(p)
    groups = [{"params": lora}]
    if scales:
        groups.append({"params": scales, "lr": a.scale_lr})
    return m, groups


def save_init(m, a, out_dir):
    """The LoRA's initial A and B as a PEFT adapter (`qatc train --init-adapter DIR` starts from
    the same values)."""
    import safetensors.torch
    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for n, p in m.named_parameters():
        for side in ("lora_A", "lora_B"):
            if n.endswith(side):
                tensors[f"base_model.model.transformer.{n[len('transformer.'):-len(side)]}{side}.weight"] = p.detach().clone().contiguous()
    safetensors.torch.save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": a.r, "lora_alpha": a.alpha, "lora_dropout": 0.0,
           "target_modules": ["c_attn", "c_proj", "c_fc"], "fan_in_fan_out": True, "bias": "none"}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def main():
    # the embedded copies of ../shared/models/gpt2-shakespeare-small and ../shared/data/shakespeare
    examples = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.join(examples, "gpt2-shakespeare-small"))
    ap.add_argument("--train", default=os.path.join(examples, "shakespeare_train.bin"))
    ap.add_argument("--val", default=os.path.join(examples, "shakespeare_val.bin"))
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--scheme", default="sym", choices=["sym", "nf4"])
    ap.add_argument("--qat", default="base", choices=["base", "merged"])
    ap.add_argument("--scales", default="minmax", choices=["minmax", "learned"])
    ap.add_argument("--scale-lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--val-batches", type=int, default=60)
    ap.add_argument("--lora-fp", action="store_true", help="also train LoRA on the unquantized model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--schedule", default="constant", choices=["constant", "cosine"])
    ap.add_argument("--min-lr", type=float, default=0.0)
    ap.add_argument("--autocast", default="none", choices=["none", "bf16"])
    ap.add_argument("--save-init", help="write the LoRA's initial values here as a PEFT adapter (own LoRA only)")
    ap.add_argument("--skip-baselines", action="store_true", help="only the QAT + LoRA run (no fp / ptq evaluations)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    quant = (a.scheme, a.bits, a.group)
    tr, va = read_tokens(a.train), read_tokens(a.val)
    n = a.val_batches
    out = {"peer": "pytorch+peft" if (a.qat, a.scales) == ("base", "minmax") else "pytorch",
           "bits": a.bits, "group": a.group, "scheme": a.scheme, "qat": a.qat, "scales": a.scales,
           "steps": a.steps, "lr": a.lr, "val_batches": n, "torch": torch.__version__}
    out["autocast"] = a.autocast
    if not a.skip_baselines:
        out["fp"] = evaluate(load(a.model), va, a.batch, a.seq, n, a)
        m = load(a.model)
        quantize_weights_(m, quant)
        out["ptq"] = evaluate(m, va, a.batch, a.seq, n, a)
    t0 = time.time()
    m = load(a.model)
    if (a.qat, a.scales) == ("base", "minmax"):
        m, params = peft_lora(m, quant, a)
    else:
        m, params = own_lora(m, quant, a)
        if a.scales == "learned":
            out["scale_lr"] = a.scale_lr
        if a.save_init:
            save_init(m, a, a.save_init)
    losses = train(m, params, tr, a, True)
    out["train_loss_first10"] = float(np.mean(losses[:10]))
    out["train_loss_last10"] = float(np.mean(losses[-10:]))
    out["qat_lora"] = evaluate(m, va, a.batch, a.seq, n, a)
    out["train_s"] = time.time() - t0
    if a.lora_fp:
        torch.manual_seed(a.seed)
        m, params = peft_lora(load(a.model), None, a)
        train(m, params, tr, a, False)
        out["lora_fp"] = evaluate(m, va, a.batch, a.seq, n)
        out["recovered"] = 1.0 - (out["qat_lora"] - out["lora_fp"]) / (out["ptq"] - out["fp"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()

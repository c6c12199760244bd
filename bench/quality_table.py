"""The table of bench/quality.sh: reads its rows.jsonl, prints markdown (stdout).

recovered = 1 - (qat - lora_fp) / (ptq - fp), each peer with its own fp, ptq and LoRA baseline; ptq is
min-max post-training quantization. Learned scales start as the default picks ("learned, auto start":
per weight the least output error on calibration batches of min-max, weight search and
activation-aware), at the min-max grid ("learned, min-max start") or at each group's
least-squared-error fraction of it ("learned, searched start"); the post-training loss at the
searched scales alone (no training) is its own row, so that what the search gives and what
training gives are told apart.
"""
import json
import sys

SPECS = [("b4_sym", "4-bit sym g64"), ("b3_sym", "3-bit sym g64"), ("b2_sym", "2-bit sym g64"), ("nf4", "nf4 g64")]


def main(path):
    rows = {}  # row -> {seed: record}; post-training rows have no seed (None)
    for line in open(path):
        line = line.strip()
        if line:
            r = json.loads(line)
            seed = r.get("seed", 1 if is_trained(r["row"]) else None)
            rows.setdefault(r["row"], {})[seed] = r
    fp = one(rows, "fp", "loss")
    lora = {s: r["loss"] for s, r in rows.get("lora_fp", {}).items()}
    peer_lora = {s: r["lora_fp"] for r_by in [rows.get("peer_b3_sym", {})] for s, r in r_by.items() if "lora_fp" in r}
    seeds = sorted({s for by in rows.values() for s in by if s is not None})
    out = []
    out.append(f"full precision {fmt(fp)}; LoRA on the unquantized model {fmt(mean(lora.values()))} (qatc)"
               + (f", {fmt(mean(peer_lora.values()))} (PyTorch + PEFT)" if peer_lora else "")
               + (f"; trained rows: mean over seeds {', '.join(map(str, seeds))}, spread = largest - smallest"
                  if len(seeds) > 1 else ""))
    out.append("")
    out.append("| weights | scales | QAT | post-training | QAT + LoRA | penalty left | recovered | seeds | spread of recovered |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    for key, title in SPECS:
        ptq = one(rows, f"{key}_ptq", "loss")
        s = one(rows, f"{key}_ptq_search", "loss")
        if s is not None:
            out.append(f"| {title} | searched, not trained | post-training only | {fmt(ptq)} | {fmt(s)} (no training) "
                       f"| {left(s, fp)} vs fp | {fmt3(recovered(s, fp, ptq, fp))} | - | - |")
        for scales in ("minmax", "learned", "learned_minmax", "search"):
            for mode in ("base", "merged"):
                by = rows.get(f"{key}_{scales}_{mode}")
                if not by:
                    continue
                label = {"search": "learned, searched start", "learned": "learned, auto start",
                         "learned_minmax": "learned, min-max start"}.get(scales, scales)
                out.append(trained_row(title, label, mode, ptq, fp, {s: r["loss"] for s, r in by.items()}, lora))
        by = rows.get(f"peer_{key}")
        if by:
            p = next(iter(by.values()))
            out.append(trained_row(title, "minmax", "PyTorch + PEFT (base)", p["ptq"], p["fp"],
                                   {s: r["qat_lora"] for s, r in by.items()}, peer_lora))
    prts = sorted((float(k[4:]), next(iter(by.values()))) for k, by in rows.items()
                  if k.startswith("prt_") and any("average_bits" in r for r in by.values()))
    if prts:
        out.append("")
        out.append("| budget (nats) | average bits | penalty on the search batches | validation loss | penalty | after QAT + LoRA (learned, searched start, base) | penalty |")
        out.append("|---|---|---|---|---|---|---|")
        for b, r in prts:
            q = mean(x["loss"] for x in rows.get(f"prt_{b:g}_search_base", {}).values())
            out.append(f"| {b:g} | {r['average_bits']:.2f} | {r['search_penalty']:+.4f} | {fmt(r['loss'])} | {left(r['loss'], fp)} "
                       f"| {fmt(q)} | {left(q, fp)} |")
    print("\n".join(out))


def is_trained(name):
    """Rows whose result depends on the seed (batch order, LoRA's initialisation)."""
    return not (name == "fp" or name.endswith("_ptq") or name.endswith("_ptq_search")
                or (name.startswith("prt_") and not name.endswith("_search_base")))


def one(rows, name, key):
    by = rows.get(name)
    return None if not by else next(iter(by.values())).get(key)


def trained_row(title, label, mode, ptq, fp, loss_by_seed, lora_by_seed):
    """Mean QAT + LoRA loss and mean share recovered over the seeds; each seed's share against the
    LoRA-on-full-precision run of the same seed (its batch order), the spread over the seeds."""
    shares = [recovered(l, lora_by_seed.get(s), ptq, fp) for s, l in loss_by_seed.items()]
    shares = [x for x in shares if x is not None]
    loss = mean(loss_by_seed.values())
    lora = mean(lora_by_seed[s] for s in loss_by_seed if s in lora_by_seed)
    spread = f"{max(shares) - min(shares):.3f}" if len(shares) > 1 else "-"
    return (f"| {title} | {label} | {mode} | {fmt(ptq)} | {fmt(loss)} | {left(loss, lora)} | {fmt3(mean(shares))} "
            f"| {len(loss_by_seed)} | {spread} |")


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def fmt3(v):
    return "-" if v is None else f"{v:.3f}"


def fmt(v):
    return "-" if v is None else f"{v:.4f}"


def left(qat, lora_fp):
    return "-" if None in (qat, lora_fp) else f"{qat - lora_fp:+.4f}"


def recovered(qat, lora_fp, ptq, fp):
    if None in (qat, lora_fp, ptq, fp) or ptq == fp:
        return None
    return 1.0 - (qat - lora_fp) / (ptq - fp)


if __name__ == "__main__":
    main(sys.argv[1])

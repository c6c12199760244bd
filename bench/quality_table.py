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
    rows = {}
    for line in open(path):
        line = line.strip()
        if line:
            r = json.loads(line)
            rows[r["row"]] = r
    fp = rows.get("fp", {}).get("loss")
    lora_fp = rows.get("lora_fp", {}).get("loss")
    peer_lora_fp = next((r["lora_fp"] for r in rows.values() if "lora_fp" in r), None)
    out = []
    out.append(f"full precision {fmt(fp)}; LoRA on the unquantized model {fmt(lora_fp)} (qatc)"
               + (f", {fmt(peer_lora_fp)} (PyTorch + PEFT)" if peer_lora_fp is not None else ""))
    out.append("")
    out.append("| weights | scales | QAT | post-training | QAT + LoRA | penalty left | recovered |")
    out.append("|---|---|---|---|---|---|---|")
    for key, title in SPECS:
        ptq = rows.get(f"{key}_ptq", {}).get("loss")
        s = rows.get(f"{key}_ptq_search")
        if s is not None:
            out.append(f"| {title} | searched, not trained | post-training only | {fmt(ptq)} | {fmt(s['loss'])} (no training) "
                       f"| {left(s['loss'], fp)} vs fp | {recovered(s['loss'], fp, ptq, fp)} |")
        for scales in ("minmax", "learned", "learned_minmax", "search"):
            for mode in ("base", "merged"):
                r = rows.get(f"{key}_{scales}_{mode}")
                if r is None:
                    continue
                label = {"search": "learned, searched start", "learned": "learned, auto start",
                         "learned_minmax": "learned, min-max start"}.get(scales, scales)
                out.append(f"| {title} | {label} | {mode} | {fmt(ptq)} | {fmt(r['loss'])} | {left(r['loss'], lora_fp)} "
                           f"| {recovered(r['loss'], lora_fp, ptq, fp)} |")
        p = rows.get(f"peer_{key}")
        if p is not None:
            out.append(f"| {title} | minmax | PyTorch + PEFT (base) | {fmt(p['ptq'])} | {fmt(p['qat_lora'])} "
                       f"| {left(p['qat_lora'], peer_lora_fp)} | {recovered(p['qat_lora'], peer_lora_fp, p['ptq'], p['fp'])} |")
    prts = sorted((float(k[4:]), r) for k, r in rows.items() if k.startswith("prt_") and "average_bits" in r)
    if prts:
        out.append("")
        out.append("| budget (nats) | average bits | penalty on the search batches | validation loss | penalty | after QAT + LoRA (learned, searched start, base) | penalty |")
        out.append("|---|---|---|---|---|---|---|")
        for b, r in prts:
            q = rows.get(f"prt_{b:g}_search_base", {}).get("loss")
            out.append(f"| {b:g} | {r['average_bits']:.2f} | {r['search_penalty']:+.4f} | {fmt(r['loss'])} | {left(r['loss'], fp)} "
                       f"| {fmt(q)} | {left(q, fp)} |")
    print("\n".join(out))


def fmt(v):
    return "-" if v is None else f"{v:.4f}"


def left(qat, lora_fp):
    return "-" if None in (qat, lora_fp) else f"{qat - lora_fp:+.4f}"


def recovered(qat, lora_fp, ptq, fp):
    if None in (qat, lora_fp, ptq, fp) or ptq == fp:
        return "-"
    return f"{1.0 - (qat - lora_fp) / (ptq - fp):.3f}"


if __name__ == "__main__":
    main(sys.argv[1])

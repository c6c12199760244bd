//! `qatc train --profile`'s table: where a step's time goes, kind of step by kind of step.

/// Where a step's time goes, as a table: one line per kind of step (kernel family or GEMM shape),
/// largest first, at most `top` lines, with the rates it ran at where the executor counts what
/// it moves and computes (CUDA: GB/s of its compulsory bytes, TFLOP/s of a GEMM's; to set
/// against the device's peaks, e.g. an H100 SXM's 3.35 TB/s and 989 dense bf16 TFLOP/s). Its
/// head says what one `unit` (a step, a batch, a token) took in all and in each phase of the
/// step; each row says its phase.
pub fn profile_table(rows: &[crate::trainer::ProfileRow], unit: &str, top: usize) -> String {
    let phases = crate::trainer::phase_sums(rows);
    let total: f64 = rows.iter().map(|r| r.secs).sum();
    let counted = rows.iter().any(|r| r.bytes > 0.0);
    let mut s = format!("one {unit}, {:.1} ms:\n", total * 1e3);
    if !phases.is_empty() {
        let share = |x: f64| 100.0 * x / total.max(f64::MIN_POSITIVE);
        let parts: Vec<String> = phases.iter().map(|&(p, x)| format!("{p} {:.1} ms ({:.0}%)", x * 1e3, share(x))).collect();
        s += &format!("  by phase: {}\n", parts.join(", "));
    }
    if counted {
        s += &format!("  {:>11} {:>6}  {:<6} {:>8} {:>8}  {:<9} what\n", "time", "share", "count", "GB/s", "TFLOP/s", "phase");
    }
    let rate = |x: f64, secs: f64, unit: f64| if x > 0.0 && secs > 0.0 { format!("{:.1}", x / secs / unit) } else { "-".into() };
    for r in rows.iter().take(top) {
        let share = 100.0 * r.secs / total.max(f64::MIN_POSITIVE);
        let count = format!("x{:.0}", r.count);
        let rates = if counted { format!(" {:>8} {:>8} ", rate(r.bytes, r.secs, 1e9), rate(r.flops, r.secs, 1e12)) } else { String::new() };
        s += &format!("  {:>8.2} ms {share:>5.1}%  {count:<6}{rates} {:<9} {}\n", r.secs * 1e3, r.phase, r.what);
    }
    if rows.len() > top {
        s += &format!("  ({} more kinds of step, {:.1} ms)\n", rows.len() - top, rows[top..].iter().map(|r| r.secs).sum::<f64>() * 1e3);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trainer::ProfileRow;

    fn row(what: &str, secs: f64, bytes: f64, flops: f64) -> ProfileRow {
        ProfileRow { what: what.into(), phase: "forward", count: 2.0, secs, bytes, flops }
    }

    /// Where the executor counts what a step moves and computes (CUDA), the table shows the rates:
    /// 1 GB in 1 ms is 1000 GB/s, 2 TFLOP in 10 ms 200 TFLOP/s; a kernel has no FLOP rate.
    #[test]
    fn the_profile_shows_rates_where_costs_are_counted() {
        let t = profile_table(&[row("gemm 8x8x8", 0.010, 3e9, 2e12), row("layernorm", 0.001, 1e9, 0.0)], "step", 10);
        assert!(t.contains("GB/s") && t.contains("TFLOP/s"), "{t}");
        let gemm = t.lines().find(|l| l.ends_with("gemm 8x8x8")).expect("a gemm line");
        assert!(gemm.contains(" 300.0 ") && gemm.contains(" 200.0 "), "{gemm}");
        let ln = t.lines().find(|l| l.ends_with("layernorm")).expect("a kernel line");
        assert!(ln.contains(" 1000.0 ") && ln.contains(" - "), "{ln}");
        // the CPU counts nothing: no rate columns
        let cpu = profile_table(&[row("layernorm", 0.001, 0.0, 0.0)], "step", 10);
        assert!(!cpu.contains("GB/s"), "{cpu}");
    }

    /// The head says each phase's time and share of the whole (forward 3 ms of 12 is 25%).
    #[test]
    fn the_profile_head_splits_the_time_by_phase() {
        let backward = |what, secs| ProfileRow { phase: "backward", ..row(what, secs, 0.0, 0.0) };
        let rows = [backward("gemm 8x8x8", 0.006), row("gemm 8x8x8", 0.003, 0.0, 0.0), backward("layernorm_bwd", 0.003)];
        let t = profile_table(&rows, "batch", 10);
        let head: Vec<&str> = t.lines().take(2).collect();
        assert_eq!(head, ["one batch, 12.0 ms:", "  by phase: forward 3.0 ms (25%), backward 9.0 ms (75%)"]);
        // the same GEMM shape in each phase has a row of its own, which says which
        let gemms: Vec<&str> = t.lines().filter(|l| l.ends_with("gemm 8x8x8")).collect();
        assert!(gemms.len() == 2 && gemms[0].contains(" backward ") && gemms[1].contains(" forward "), "{t}");
    }
}

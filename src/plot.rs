//! A loss curve as SVG: train loss per step (a line) and validation loss (dots), with axes and
//! labels and optional labelled reference levels (full precision, post-training quantization),
//! readable at a glance without any plotting library.

use std::fmt::Write;

/// (step, loss) series; `val` may be empty; `levels` are (label, loss) drawn as dashed lines.
pub fn loss_svg(title: &str, train: &[(usize, f64)], val: &[(usize, f64)], levels: &[(String, f64)], best: Option<(usize, f64)>) -> String {
    let (w, h, l, r, t, b) = (720.0, 380.0, 60.0, 20.0, 56.0, 44.0);
    let all = train.iter().chain(val).map(|p| p.1).chain(levels.iter().map(|x| x.1)).filter(|v| v.is_finite());
    let (mut lo, mut hi) = all.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, c), v| (a.min(v), c.max(v)));
    if !lo.is_finite() {
        (lo, hi) = (0.0, 1.0);
    }
    if hi - lo < 1e-9 {
        hi = lo + 1.0;
    }
    let pad = 0.05 * (hi - lo);
    let (lo, hi) = (lo - pad, hi + pad);
    let smax = train.iter().chain(val).map(|p| p.0).max().unwrap_or(1).max(1) as f64;
    let x = |s: usize| l + (w - l - r) * s as f64 / smax;
    let y = |v: f64| t + (h - t - b) * (hi - v) / (hi - lo);
    let mut o = String::new();
    let _ = writeln!(o, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#);
    let _ = writeln!(o, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(o, r#"<text x="{l}" y="22" font-size="15">{}</text>"#, xml(title));
    // axes with 5 ticks each
    let _ = writeln!(o, r##"<path d="M{l} {t} V{} H{}" stroke="#444" fill="none"/>"##, h - b, w - r);
    for i in 0..=4 {
        let v = lo + (hi - lo) * i as f64 / 4.0;
        let _ = writeln!(o, r##"<text x="{}" y="{}" text-anchor="end" fill="#444">{v:.3}</text>"##, l - 6.0, y(v) + 4.0);
        let _ = writeln!(o, r##"<path d="M{l} {0} H{1}" stroke="#eee"/>"##, y(v), w - r);
        let s = (smax * i as f64 / 4.0).round() as usize;
        let _ = writeln!(o, r##"<text x="{}" y="{}" text-anchor="middle" fill="#444">{s}</text>"##, x(s), h - b + 16.0);
    }
    let _ = writeln!(o, r##"<text x="{}" y="{}" text-anchor="middle" fill="#444">step</text>"##, (l + w - r) / 2.0, h - 8.0);
    let _ =
        writeln!(o, r##"<text transform="translate(14 {}) rotate(-90)" text-anchor="middle" fill="#444">loss</text>"##, (t + h - b) / 2.0);
    // raw per-step loss, light, and its trailing mean over 10 steps, dark: batches are noisy
    let pts: Vec<String> = train.iter().filter(|p| p.1.is_finite()).map(|&(s, v)| format!("{:.1},{:.1}", x(s), y(v))).collect();
    let _ = writeln!(o, r##"<polyline points="{}" fill="none" stroke="#9ecae1" stroke-width="1"/>"##, pts.join(" "));
    let fin: Vec<(usize, f64)> = train.iter().copied().filter(|p| p.1.is_finite()).collect();
    let avg: Vec<String> = (0..fin.len())
        .map(|i| {
            let w = &fin[i.saturating_sub(9)..=i];
            let m = w.iter().map(|p| p.1).sum::<f64>() / w.len() as f64;
            format!("{:.1},{:.1}", x(fin[i].0), y(m))
        })
        .collect();
    let _ = writeln!(o, r##"<polyline points="{}" fill="none" stroke="#1f77b4" stroke-width="2"/>"##, avg.join(" "));
    for (label, v) in levels.iter().filter(|x| x.1.is_finite()) {
        let _ = writeln!(o, r##"<path d="M{l} {0:.1} H{1}" stroke="#555" stroke-dasharray="6 4"/>"##, y(*v), w - r);
        let _ =
            writeln!(o, r##"<text x="{}" y="{:.1}" text-anchor="end" fill="#555">{} {v:.3}</text>"##, w - r - 4.0, y(*v) - 5.0, xml(label));
    }
    for &(s, v) in val.iter().filter(|p| p.1.is_finite()) {
        let _ = writeln!(o, r##"<circle cx="{:.1}" cy="{:.1}" r="4" fill="#d62728"/>"##, x(s), y(v));
    }
    // `--keep-best`: the validation whose weights were kept, ringed, on a dotted line down to its step
    if let Some((s, v)) = best.filter(|b| b.1.is_finite()) {
        let _ = writeln!(o, r##"<path d="M{0:.1} {1:.1} V{2}" stroke="#d62728" stroke-dasharray="2 3"/>"##, x(s), y(v) + 8.0, h - b);
        let _ = writeln!(o, r##"<circle cx="{:.1}" cy="{:.1}" r="8" fill="none" stroke="#d62728" stroke-width="2"/>"##, x(s), y(v));
        let anchor = if x(s) > w / 2.0 { "end" } else { "start" };
        let dx = if anchor == "end" { -12.0 } else { 12.0 };
        let _ = writeln!(
            o,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="{anchor}" fill="#d62728">kept: step {s}, {v:.3}</text>"##,
            x(s) + dx,
            y(v) - 10.0
        );
    }
    // the legend sits on its own row under the title, clear of the data
    let _ = writeln!(o, r##"<text x="{}" y="42" text-anchor="end" fill="#1f77b4">train loss (10-step mean)</text>"##, w - r - 120.0);
    if !val.is_empty() {
        let _ = writeln!(o, r##"<text x="{}" y="42" text-anchor="end" fill="#d62728">validation loss</text>"##, w - r);
    }
    o.push_str("</svg>\n");
    o
}

fn xml(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    #[test]
    fn draws_both_series() {
        let s = super::loss_svg("a < b", &[(0, 5.0), (1, 4.5), (2, 4.0)], &[(2, 4.2)], &[("full precision".into(), 3.5)], None);
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert!(s.contains("polyline") && s.contains("<circle") && s.contains("a &lt; b"));
        // the level is inside the drawn range, labelled
        assert!(s.contains("stroke-dasharray") && s.contains("full precision 3.500"));
        assert!(!s.contains("kept:"));
    }

    #[test]
    fn rings_the_kept_validation() {
        let s = super::loss_svg("t", &[(0, 5.0), (1, 4.5), (2, 4.0), (3, 3.9)], &[(2, 4.2), (4, 4.3)], &[], Some((2, 4.2)));
        assert!(s.contains(r#"r="8" fill="none""#) && s.contains("kept: step 2, 4.200"), "{s}");
    }
}

//! The memory timeline as an SVG picture: bytes over the schedule, stacked by category, with
//! the inputs' storage at the bottom, the arena's live values above it, the planned peak and
//! the forward/backward boundary marked. Hand-written SVG (no dependency): a few polygons, lines
//! and text elements, every text escaped.

use std::fmt::Write;

use super::units::human;
use super::{Category, Plan};

const W: f64 = 1000.0;
const H: f64 = 540.0;
const X0: f64 = 90.0;
const X1: f64 = 760.0;
const Y0: f64 = 60.0;
const Y1: f64 = 470.0;

fn color(c: Category) -> &'static str {
    match c {
        Category::Weights => "#8c8c8c",
        Category::Trainable => "#f2c14e",
        Category::Optimizer => "#b07aa1",
        Category::Data => "#bab0ac",
        Category::Activations => "#4e79a7",
        Category::Gradients => "#e15759",
        Category::Temporaries => "#59a14f",
    }
}

/// Bottom-to-top drawing order: the inputs' storage first (flat bands), then the arena.
const STACK: [Category; 7] = [
    Category::Weights,
    Category::Trainable,
    Category::Optimizer,
    Category::Data,
    Category::Activations,
    Category::Gradients,
    Category::Temporaries,
];

pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;").replace('\'', "&apos;")
}

/// A round tick step for an axis spanning `max`.
fn nice_step(max: f64, ticks: f64) -> f64 {
    let raw = (max / ticks).max(1e-9);
    let mag = 10f64.powf(raw.log10().floor());
    let k = [1.0, 2.0, 2.5, 5.0, 10.0].into_iter().find(|k| k * mag >= raw).unwrap_or(10.0);
    k * mag
}

/// Byte ticks that read as round numbers: a round step in GiB, MiB or KiB.
fn byte_step(max: f64) -> f64 {
    let unit = [1024f64.powi(3), 1024f64.powi(2), 1024.0].into_iter().find(|u| max >= 2.0 * u).unwrap_or(1.0);
    nice_step(max / unit, 6.0).max(if unit > 1.0 { 0.1 } else { 1.0 }) * unit
}

/// Renders the plan's timeline. `limit` draws a device-memory line (`--memory`).
pub fn render(p: &Plan, title: &str, limit: Option<usize>) -> String {
    let steps = p.profile.len().max(1);
    let persistent: Vec<(Category, usize)> = p.persistent.clone();
    let base = |c: Category| persistent.iter().find(|(x, _)| *x == c).map(|(_, b)| *b).unwrap_or(0);
    let stack_at = |s: usize| -> [f64; 7] {
        let row = p.profile.get(s).copied().unwrap_or([0; 7]);
        let mut out = [0.0; 7];
        for (k, c) in STACK.iter().enumerate() {
            out[k] = if c.persistent() { base(*c) as f64 } else { row[super::breakdown::cat_index(*c)] as f64 };
        }
        out
    };
    // one column per pixel at most; each column shows its step with the most live bytes
    let cols = ((X1 - X0) as usize).min(steps);
    let mut columns: Vec<(usize, [f64; 7])> = Vec::with_capacity(cols);
    for c in 0..cols {
        let (lo, hi) = (c * steps / cols, ((c + 1) * steps / cols).max(c * steps / cols + 1));
        let mut best = (lo, -1.0);
        for s in lo..hi.min(steps) {
            let t: f64 = stack_at(s).iter().sum();
            if t > best.1 {
                best = (s, t);
            }
        }
        columns.push((best.0, stack_at(best.0)));
    }
    let peak_total = p.peak_bytes() as f64;
    let ymax = peak_total.max(limit.unwrap_or(0) as f64).max(1.0) * 1.1;
    let x = |s: f64| X0 + (X1 - X0) * s / steps as f64;
    let y = |b: f64| Y1 - (Y1 - Y0) * b / ymax;

    let mut o = String::new();
    let _ = writeln!(o, r#"<?xml version="1.0" encoding="UTF-8"?>"#);
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="Helvetica, Arial, sans-serif" font-size="12">"#
    );
    let _ = writeln!(o, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(o, r#"<text x="{X0}" y="24" font-size="16" font-weight="bold">{}</text>"#, escape(title));
    let _ = writeln!(
        o,
        r##"<text x="{X0}" y="44" fill="#444">peak {} = inputs {} + arena {} (lower bound {}, ratio {:.3})</text>"##,
        human(p.peak_bytes()),
        human(p.persistent_bytes()),
        human(p.arena_bytes),
        human(p.lower_bound),
        p.ratio()
    );
    // y grid and ticks
    let step = byte_step(ymax);
    let mut t = 0.0;
    while t <= ymax {
        let yy = y(t);
        let _ = writeln!(o, r##"<line x1="{X0}" y1="{yy:.1}" x2="{X1}" y2="{yy:.1}" stroke="#e6e6e6"/>"##);
        let _ = writeln!(o, r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#, X0 - 6.0, yy + 4.0, human(t as usize));
        t += step;
    }
    // stacked bands
    let ncol = columns.len();
    for k in 0..STACK.len() {
        let mut pts = String::new();
        for (c, (_, v)) in columns.iter().enumerate() {
            let top: f64 = v[..=k].iter().sum();
            let _ = write!(pts, "{:.1},{:.1} ", x(c as f64 * steps as f64 / ncol as f64), y(top));
            let _ = write!(pts, "{:.1},{:.1} ", x((c + 1) as f64 * steps as f64 / ncol as f64), y(top));
        }
        for (c, (_, v)) in columns.iter().enumerate().rev() {
            let bot: f64 = v[..k].iter().sum();
            let _ = write!(pts, "{:.1},{:.1} ", x((c + 1) as f64 * steps as f64 / ncol as f64), y(bot));
            let _ = write!(pts, "{:.1},{:.1} ", x(c as f64 * steps as f64 / ncol as f64), y(bot));
        }
        let _ = writeln!(
            o,
            r#"<polygon class="band {}" fill="{}" stroke="none" points="{}"/>"#,
            STACK[k].name(),
            color(STACK[k]),
            pts.trim_end()
        );
    }
    // the outline of the total, so that one-step spikes stay visible
    let mut outline = String::new();
    for (c, (_, v)) in columns.iter().enumerate() {
        let top: f64 = v.iter().sum();
        let _ = write!(outline, "{:.1},{:.1} ", x(c as f64 * steps as f64 / ncol as f64), y(top));
        let _ = write!(outline, "{:.1},{:.1} ", x((c + 1) as f64 * steps as f64 / ncol as f64), y(top));
    }
    let _ = writeln!(o, r##"<polyline class="total" fill="none" stroke="#333" stroke-width="0.8" points="{}"/>"##, outline.trim_end());
    // axes
    let _ = writeln!(o, r##"<line x1="{X0}" y1="{Y1}" x2="{X1}" y2="{Y1}" stroke="#333"/>"##);
    let _ = writeln!(o, r##"<line x1="{X0}" y1="{Y0}" x2="{X0}" y2="{Y1}" stroke="#333"/>"##);
    let xs = nice_step(steps as f64, 6.0).max(1.0) as usize;
    let mut s = 0;
    while s <= steps {
        let _ = writeln!(o, r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{s}</text>"#, x(s as f64), Y1 + 16.0);
        s += xs.max(1);
    }
    let _ = writeln!(o, r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#444">schedule step</text>"##, (X0 + X1) / 2.0, Y1 + 34.0);
    // the planned peak: the arena's size on top of the inputs
    let yp = y(peak_total);
    let _ =
        writeln!(o, r##"<line class="planned-peak" x1="{X0}" y1="{yp:.1}" x2="{X1}" y2="{yp:.1}" stroke="#222" stroke-dasharray="6,4"/>"##);
    let _ = writeln!(
        o,
        r##"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="#222">planned peak {}</text>"##,
        X1 - 4.0,
        yp - 5.0,
        human(p.peak_bytes())
    );
    // the peak step
    let xp = x(p.peak_step as f64 + 0.5);
    let live_peak = p.persistent_bytes() + p.lower_bound;
    let peak_name = p.steps.get(p.peak_step).map(|s| s.name.as_str()).unwrap_or("");
    let _ = writeln!(
        o,
        r##"<line id="peak" x1="{xp:.1}" y1="{Y0}" x2="{xp:.1}" y2="{Y1}" stroke="#d62728" stroke-width="1" stroke-dasharray="4,3" opacity="0.8"/>"##
    );
    let _ = writeln!(o, r##"<circle cx="{xp:.1}" cy="{:.1}" r="4" fill="#d62728"/>"##, y(live_peak as f64));
    let anchor = if xp > (X0 + X1) / 2.0 { "end" } else { "start" };
    let dx = if anchor == "end" { -6.0 } else { 6.0 };
    let _ = writeln!(
        o,
        r##"<text x="{:.1}" y="{:.1}" text-anchor="{anchor}" fill="#d62728" font-weight="bold">peak {} at step {} ({})</text>"##,
        xp + dx,
        y(live_peak as f64) - 8.0,
        human(live_peak),
        p.peak_step,
        escape(peak_name)
    );
    if let Some(b) = p.backward_starts {
        let xb = x(b as f64);
        let _ = writeln!(o, r##"<line x1="{xb:.1}" y1="{Y0}" x2="{xb:.1}" y2="{Y1}" stroke="#555" stroke-dasharray="2,3"/>"##);
        let _ = writeln!(o, r##"<text x="{:.1}" y="{:.1}" fill="#555">forward | backward</text>"##, xb - 50.0, Y0 - 4.0);
    }
    if let Some(l) = limit {
        let yl = y(l as f64);
        let _ = writeln!(o, r##"<line class="limit" x1="{X0}" y1="{yl:.1}" x2="{X1}" y2="{yl:.1}" stroke="#ff7f0e" stroke-width="2"/>"##);
        let _ = writeln!(o, r##"<text x="{:.1}" y="{:.1}" fill="#ff7f0e">--memory {}</text>"##, X0 + 4.0, yl - 5.0, human(l));
    }
    // legend, top category first (as stacked)
    let lx = X1 + 20.0;
    let _ = writeln!(o, r#"<text x="{lx}" y="{:.1}" font-weight="bold">at the peak</text>"#, Y0 + 4.0);
    for (r, c) in STACK.iter().rev().enumerate() {
        let ly = Y0 + 20.0 + r as f64 * 22.0;
        let bytes = if c.persistent() { base(*c) } else { p.at_peak.iter().find(|(x, _)| x == c).map(|(_, b)| *b).unwrap_or(0) };
        let _ = writeln!(o, r#"<rect x="{lx}" y="{:.1}" width="14" height="14" fill="{}"/>"#, ly - 11.0, color(*c));
        let _ = writeln!(o, r#"<text x="{:.1}" y="{ly:.1}">{} {}</text>"#, lx + 20.0, escape(c.label()), human(bytes));
    }
    let ly = Y0 + 20.0 + 7.0 * 22.0 + 6.0;
    let _ = writeln!(
        o,
        r##"<text x="{lx}" y="{ly:.1}" fill="#444">fragmentation {}</text>"##,
        human(p.arena_bytes.saturating_sub(p.lower_bound))
    );
    let _ = writeln!(
        o,
        r##"<text x="{lx}" y="{:.1}" fill="#444">recompute {}</text>"##,
        ly + 20.0,
        escape(&super::units::flops(p.recompute_flops))
    );
    o.push_str("</svg>\n");
    o
}

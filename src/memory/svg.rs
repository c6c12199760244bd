//! The executed plan's timeline as an SVG picture: bytes over the program's steps, stacked by
//! category, the inputs' storage at the bottom, the arena's live buffers above it; the planned
//! peak (what the executor allocates), the peak step, the forward/backward boundary and the
//! chunked cross-entropy's steps marked. Hand-written SVG (no dependency), every text escaped.
//!
//! Every text stays inside the frame and apart from the others whatever its length: the title
//! and subtitle are elided in the middle to the width they have (a long model path keeps its
//! start and its file name), labels sit in their own rows above the plot or in the legend, and
//! the plot's top leaves room for the planned-peak label above its line.

use std::fmt::Write;

use qatc_ir::Category;
use qatc_passes::plan::units::{flops, human};

use super::Executed;

const W: f64 = 1040.0;
const H: f64 = 580.0;
const MARGIN: f64 = 16.0;
const X0: f64 = 90.0;
const X1: f64 = 760.0;
/// The plot's top and bottom; the rows above it hold the title, the subtitle and the markers'
/// labels.
const Y0: f64 = 112.0;
const Y1: f64 = 500.0;
/// The width of a character at the given font size, generously (Helvetica's widest digits and
/// capitals are about 0.6 em): text is elided to fit by this measure.
fn char_width(font: f64) -> f64 {
    0.62 * font
}

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

/// `s` in at most `max` characters: its start and end kept, `...` between them.
pub fn elide(s: &str, max: usize) -> String {
    let chars: Vec<char> = s.chars().collect();
    if chars.len() <= max || max < 5 {
        return chars.into_iter().take(max.max(1)).collect();
    }
    let keep = max - 3;
    let head = keep.div_ceil(2);
    let tail = keep - head;
    let mut out: String = chars[..head].iter().collect();
    out.push_str("...");
    out.extend(&chars[chars.len() - tail..]);
    out
}

/// How many characters of text at `font` fit in `width` pixels.
fn fits(width: f64, font: f64) -> usize {
    (width / char_width(font)).floor().max(1.0) as usize
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

/// Renders the timeline. `title` names what was planned (it is elided to fit), `limit` draws a
/// device-memory line (`--memory`).
pub fn render(e: &Executed, title: &str, limit: Option<usize>) -> String {
    let p = &e.plan;
    let steps = p.profile.len().max(1);
    let stack_at = |s: usize| -> [f64; 7] {
        let row = p.profile.get(s).copied().unwrap_or([0; 7]);
        let mut out = [0.0; 7];
        for (k, c) in STACK.iter().enumerate() {
            out[k] = if c.persistent() { p.inputs[c.index()] as f64 } else { row[c.index()] as f64 };
        }
        out
    };
    // one column per pixel at most; each column shows its step with the most live bytes
    let cols = ((X1 - X0) as usize).min(steps);
    let mut columns: Vec<[f64; 7]> = Vec::with_capacity(cols);
    for c in 0..cols {
        let (lo, hi) = (c * steps / cols, ((c + 1) * steps / cols).max(c * steps / cols + 1));
        let mut best = (lo, -1.0);
        for s in lo..hi.min(steps) {
            let t: f64 = stack_at(s).iter().sum();
            if t > best.1 {
                best = (s, t);
            }
        }
        columns.push(stack_at(best.0));
    }
    let peak_total = p.peak_bytes() as f64;
    // headroom above the planned peak for its label
    let ymax = peak_total.max(limit.unwrap_or(0) as f64).max(1.0) * 1.12;
    let x = |s: f64| X0 + (X1 - X0) * s / steps as f64;
    let y = |b: f64| Y1 - (Y1 - Y0) * b / ymax;

    let mut o = String::new();
    let _ = writeln!(o, r#"<?xml version="1.0" encoding="UTF-8"?>"#);
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="Helvetica, Arial, sans-serif" font-size="12">"#
    );
    let _ = writeln!(o, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    // rows above the plot: title (16 px), subtitle, markers' labels; each elided to the frame
    let text_width = W - 2.0 * MARGIN;
    let _ = writeln!(
        o,
        r#"<text class="title" x="{MARGIN}" y="26" font-size="16" font-weight="bold">{}</text>"#,
        escape(&elide(title, fits(text_width, 16.0)))
    );
    let sub = format!(
        "{} executor: peak {} = inputs {} + arena {} (lower bound {}, ratio {:.3}); {} steps, {} buffers",
        e.target.kind.name(),
        human(p.peak_bytes()),
        human(p.input_bytes()),
        human(p.arena_bytes),
        human(p.lower_bound),
        p.ratio(),
        p.steps.len(),
        p.buffers.len()
    );
    let _ =
        writeln!(o, r##"<text class="subtitle" x="{MARGIN}" y="48" fill="#444">{}</text>"##, escape(&elide(&sub, fits(text_width, 12.0))));
    let live_peak = p.input_bytes() + p.lower_bound;
    let peak_what = p.steps.get(p.peak_step).map(|s| s.what.as_str()).unwrap_or("");
    let peak_line = format!("peak {} at step {} ({peak_what})", human(live_peak), p.peak_step);
    let _ = writeln!(
        o,
        r##"<text class="peak-label" x="{MARGIN}" y="70" fill="#d62728" font-weight="bold">{}</text>"##,
        escape(&elide(&peak_line, fits(text_width, 12.0)))
    );
    let ce_line = match (e.program.cross_entropy.first(), &e.chunk) {
        // shorter than the table's line, so the choice fits beside it
        (Some(c), Some(k)) if c.chunks() > 1 || c.tile_cols < c.vocab => format!(
            "cross-entropy over {} x {}: {} chunk(s) of {} rows x {} columns ({}, not {}); {}",
            c.rows,
            c.vocab,
            c.chunks(),
            c.chunk_rows,
            c.tile_cols,
            human(c.scratch_bytes()),
            human(c.whole_bytes()),
            k.short()
        ),
        (Some(c), Some(k)) => format!("{}; {}", super::chunking_line(c), k.short()),
        (Some(c), None) => super::chunking_line(c),
        (None, _) => "cross-entropy: not chunked".to_string(),
    };
    let _ = writeln!(
        o,
        r##"<text class="chunk-label" x="{MARGIN}" y="90" fill="#555">{}</text>"##,
        escape(&elide(&ce_line, fits(text_width, 12.0)))
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
    let ncol = columns.len().max(1);
    let cx = |c: usize| x(c as f64 * steps as f64 / ncol as f64);
    for k in 0..STACK.len() {
        let mut pts = String::new();
        for (c, v) in columns.iter().enumerate() {
            let top: f64 = v[..=k].iter().sum();
            let _ = write!(pts, "{:.1},{:.1} {:.1},{:.1} ", cx(c), y(top), cx(c + 1), y(top));
        }
        for (c, v) in columns.iter().enumerate().rev() {
            let bot: f64 = v[..k].iter().sum();
            let _ = write!(pts, "{:.1},{:.1} {:.1},{:.1} ", cx(c + 1), y(bot), cx(c), y(bot));
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
    for (c, v) in columns.iter().enumerate() {
        let top: f64 = v.iter().sum();
        let _ = write!(outline, "{:.1},{:.1} {:.1},{:.1} ", cx(c), y(top), cx(c + 1), y(top));
    }
    let _ = writeln!(o, r##"<polyline class="total" fill="none" stroke="#333" stroke-width="0.8" points="{}"/>"##, outline.trim_end());
    // the chunked cross-entropy's steps: a bracket under the axis, where its scratch lives
    for b in p.buffers.iter().filter(|b| b.name == qatc_kernels::lower::CE_CHUNK_SCRATCH) {
        let (xa, xb) = (x(b.first_step as f64), x(b.last_step as f64 + 1.0).max(x(b.first_step as f64) + 2.0));
        let _ = writeln!(
            o,
            r##"<rect class="chunks" x="{xa:.1}" y="{:.1}" width="{:.1}" height="5" fill="#59a14f" opacity="0.7"/>"##,
            Y1 + 2.0,
            xb - xa
        );
    }
    // axes
    let _ = writeln!(o, r##"<line x1="{X0}" y1="{Y1}" x2="{X1}" y2="{Y1}" stroke="#333"/>"##);
    let _ = writeln!(o, r##"<line x1="{X0}" y1="{Y0}" x2="{X0}" y2="{Y1}" stroke="#333"/>"##);
    let xs = nice_step(steps as f64, 6.0).max(1.0) as usize;
    let mut s = 0;
    while s <= steps {
        let _ = writeln!(o, r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{s}</text>"#, x(s as f64), Y1 + 20.0);
        s += xs.max(1);
    }
    let _ = writeln!(o, r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#444">program step</text>"##, (X0 + X1) / 2.0, Y1 + 40.0);
    // the planned peak: what the executor allocates; its label above the line, inside the plot
    let yp = y(peak_total);
    let _ =
        writeln!(o, r##"<line class="planned-peak" x1="{X0}" y1="{yp:.1}" x2="{X1}" y2="{yp:.1}" stroke="#222" stroke-dasharray="6,4"/>"##);
    let _ = writeln!(
        o,
        r##"<text class="planned-peak-label" x="{:.1}" y="{:.1}" text-anchor="end" fill="#222">planned peak {}</text>"##,
        X1 - 4.0,
        yp - 6.0,
        human(p.peak_bytes())
    );
    // the peak step: a marker only (its label is the row above the plot)
    let xp = x(p.peak_step as f64 + 0.5);
    let _ = writeln!(
        o,
        r##"<line id="peak" x1="{xp:.1}" y1="{Y0}" x2="{xp:.1}" y2="{Y1}" stroke="#d62728" stroke-width="1" stroke-dasharray="4,3" opacity="0.8"/>"##
    );
    let _ = writeln!(o, r##"<circle cx="{xp:.1}" cy="{:.1}" r="4" fill="#d62728"/>"##, y(live_peak as f64));
    if let Some(b) = p.backward_starts {
        let xb = x(b as f64);
        let _ =
            writeln!(o, r##"<line class="backward" x1="{xb:.1}" y1="{Y0}" x2="{xb:.1}" y2="{Y1}" stroke="#555" stroke-dasharray="2,3"/>"##);
        let _ = writeln!(o, r##"<text x="{:.1}" y="{:.1}" fill="#555" font-size="11">backward</text>"##, xb + 3.0, Y1 - 6.0);
    }
    if let Some(m) = limit {
        // the line is what the plan may use: on CUDA, the device less the context's reserve
        let l = e.target.step_budget(m);
        let yl = y(l as f64);
        let _ = writeln!(o, r##"<line class="limit" x1="{X0}" y1="{yl:.1}" x2="{X1}" y2="{yl:.1}" stroke="#ff7f0e" stroke-width="2"/>"##);
        let label = match e.target.reserved_bytes {
            0 => format!("--memory {}", human(m)),
            r => format!("--memory {} less {} reserved: {}", human(m), human(r), human(l)),
        };
        let _ = writeln!(o, r##"<text x="{:.1}" y="{:.1}" fill="#ff7f0e">{label}</text>"##, X0 + 4.0, yl - 5.0);
    }
    // legend, top category first (as stacked)
    let lx = X1 + 20.0;
    let legend_chars = fits(W - MARGIN - lx - 20.0, 12.0);
    let _ = writeln!(o, r#"<text x="{lx}" y="{:.1}" font-weight="bold">at the peak</text>"#, Y0 + 4.0);
    for (r, c) in STACK.iter().rev().enumerate() {
        let ly = Y0 + 24.0 + r as f64 * 22.0;
        let _ = writeln!(o, r#"<rect x="{lx}" y="{:.1}" width="14" height="14" fill="{}"/>"#, ly - 11.0, color(*c));
        let label = elide(&format!("{} {}", c.label(), human(p.at_peak(*c))), legend_chars);
        let _ = writeln!(o, r#"<text x="{:.1}" y="{ly:.1}">{}</text>"#, lx + 20.0, escape(&label));
    }
    let ly = Y0 + 24.0 + 7.0 * 22.0 + 6.0;
    let more = [format!("fragmentation {}", human(p.fragmentation())), format!("recompute {}", flops(e.recompute_flops))];
    for (i, m) in more.iter().enumerate() {
        let _ =
            writeln!(o, r##"<text x="{lx}" y="{:.1}" fill="#444">{}</text>"##, ly + 20.0 * i as f64, escape(&elide(m, legend_chars + 3)));
    }
    o.push_str("</svg>\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elision_keeps_both_ends() {
        assert_eq!(elide("abcdef", 10), "abcdef");
        assert_eq!(elide("/very/long/path/to/model.safetensors", 20), "/very/lon...etensors");
        assert_eq!(elide("/very/long/path/to/model.safetensors", 20).chars().count(), 20);
    }
}

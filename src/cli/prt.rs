//! `qatc prt MODEL --data FILE`: the precision range test. For each targeted module, quantize it
//! alone (the rest of the model at full precision) at increasing bit widths and keep the lowest
//! whose eval loss stays within `--threshold` (relative) of full precision. Writes a bit map that
//! `--bits-map` accepts in compile, eval and train.
//!
//! With `--budget NATS` the map is for the whole model instead: each module is measured at every
//! width from 8 bits down until its penalty alone exceeds the budget, `bitalloc::allocate` picks
//! the widths that spend the fewest bits while the penalties sum to the budget, and the map is
//! measured with every module quantized at once; when that exceeds the budget (penalties do not
//! add exactly) the allocation is redone on a tighter budget.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Context;
use qatc_ir::{QuantScheme, QuantSpec};
use qatc_passes::linears::{self, MODULES};
use qatc_passes::quant::QuantOptions;

use super::eval::EvalSetup;
use super::options::{BitMap, DEFAULT_GROUP};
use crate::artifacts::write_atomic;
use crate::batches::{Batches, Dataset};
use crate::bitalloc;
use crate::model::Model;

#[derive(clap::Args, Debug)]
pub struct Args {
    pub model: PathBuf,
    /// An llm.c token file, UTF-8 text, or instruction data (.jsonl: the loss over what
    /// --train-on counts).
    #[arg(long)]
    pub data: PathBuf,
    #[command(flatten)]
    pub examples: super::examples::ExampleArgs,
    /// Allowed relative loss increase over full precision.
    #[arg(long, default_value_t = 0.02)]
    pub threshold: f64,
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    #[arg(long, default_value_t = 128)]
    pub seq: usize,
    /// Batches per evaluation.
    #[arg(long, default_value_t = 4)]
    pub batches: usize,
    /// Group size along the input dimension (0: per output channel).
    #[arg(long, default_value_t = DEFAULT_GROUP)]
    pub group: usize,
    /// The quantization scheme tried (nf4 and q4_0: 4 bits only).
    #[arg(long, value_enum, default_value_t = QuantScheme::Sym)]
    pub scheme: QuantScheme,
    /// Modules to test (suffixes, as --quant-targets).
    #[arg(long, value_delimiter = ',')]
    pub targets: Option<Vec<String>>,
    /// Where to write the bit map.
    #[arg(long, default_value = "bits_map.json")]
    pub bits_map: PathBuf,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
    /// Whole-model budget in nats: the map whose modules, quantized together, raise the loss by
    /// at most this much with the fewest bits (instead of --threshold per module).
    #[arg(long)]
    pub budget: Option<f64>,
    /// With --budget: keep each module's measurements in FILE and reuse them when it exists (for
    /// the same model, data, batches and quantization), so several budgets cost one measurement.
    /// Measure with the largest budget first: a module's curve stops where it exceeds the budget.
    #[arg(long)]
    pub measurements: Option<PathBuf>,
    /// Where the evaluations run: auto (a CUDA GPU when qatc can use one, else the CPU), cpu,
    /// cuda; each compiled like the training step.
    #[arg(long, value_enum, default_value_t = crate::config::DeviceFlag::Auto)]
    pub device: crate::config::DeviceFlag,
    /// Run the evaluations on the reference interpreter (slower) instead of compiled.
    #[arg(long)]
    pub interpreter: bool,
    #[command(flatten)]
    pub cache: super::kernel_cache::KernelCacheArgs,
    #[command(flatten)]
    pub read: super::ReadArgs,
}

/// What `--measurements` keeps: every module's (bits, loss) curve, and what they were measured on.
#[derive(serde::Serialize, serde::Deserialize, Debug, Default)]
struct Measurements {
    version: u32,
    settings: String,
    full_precision_loss: f64,
    modules: BTreeMap<String, Vec<(u8, f64)>>,
}

#[derive(serde::Serialize, Debug)]
struct ModuleResult {
    module: String,
    bits: Option<u8>,
    loss: f64,
    tried: Vec<(u8, f64)>,
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let m = super::open_model(&a.model, &a.read)?;
    super::check_seq(&m, a.batch, a.seq)?;
    let reading = super::examples::options_of(a.examples.config(&a.data, None)?.as_ref())?;
    let data = Dataset::load(&a.data, a.seq, &reading)?;
    data.check_vocab(m.cfg.vocab_size)?;
    if let Some(s) = data.summary(a.batch) {
        eprintln!("qatc: {s}");
    }
    if !(a.threshold >= 0.0 && a.threshold.is_finite()) {
        anyhow::bail!("--threshold must be a number >= 0, got {}", a.threshold);
    }
    if a.batches == 0 {
        anyhow::bail!("--batches must be at least 1");
    }
    // explains how many tokens one batch needs and the file has
    let n = a.batches.min(data.require_batches(a.batch, a.seq)?);
    let modules = modules_tested(a, &m)?;
    if a.budget.is_some_and(|b| !(b >= 0.0 && b.is_finite())) {
        anyhow::bail!("--budget must be a number of nats >= 0");
    }
    if a.measurements.is_some() && a.budget.is_none() {
        anyhow::bail!("--measurements goes with --budget");
    }
    let settings = format!(
        "model={} data={} batch={} seq={} batches={n} group={} scheme={}",
        a.model.display(),
        a.data.display(),
        a.batch,
        a.seq,
        a.group,
        a.scheme
    );
    let mut cache = read_measurements(a, settings)?;
    let (target, interpreter) = super::eval::placement(a.device, a.interpreter)?;
    let kernel_cache = a.cache.dir();
    let first = std::cell::Cell::new(true);
    // each evaluation is its own compiled forward (another module quantized): the first says what runs them
    let evaluate = |mut setup: EvalSetup| -> anyhow::Result<f64> {
        // what the batches give: instruction data's loss weights and position ids
        setup.model.inputs = data.inputs();
        let mut e = super::eval::Evaluator::new(&m, a.batch, a.seq, &setup, None)?;
        if first.replace(false) {
            eprintln!("qatc: prt's evaluations run {}", e.description);
        }
        Ok(e.run(&data, n, false)?.loss)
    };
    let base = match cache.full_precision_loss {
        l if l != 0.0 => l,
        _ => evaluate(EvalSetup { target, interpreter, kernel_cache: kernel_cache.clone(), ..EvalSetup::default() })?,
    };
    cache.full_precision_loss = base;
    let limit = base * (1.0 + a.threshold);
    // the loss with `map` (module -> spec) quantized, the rest at full precision
    let eval_map = |map: BTreeMap<String, Option<QuantSpec>>| -> anyhow::Result<f64> {
        let spec = QuantSpec { bits: 8, group: a.group, scheme: a.scheme };
        let mut setup = EvalSetup { target, interpreter, kernel_cache: kernel_cache.clone(), ..EvalSetup::default() };
        setup.model.quant =
            Some(QuantOptions { spec, targets: vec![], per_module: map, act_bits: None, learned_scales: false, per_module_source: None });
        evaluate(setup)
    };
    let mut results = sweep(a, &modules, &mut cache, base, limit, &eval_map)?;
    if let Some(p) = &a.measurements {
        write_atomic(p, (serde_json::to_string_pretty(&cache)? + "\n").as_bytes()).with_context(|| format!("{}", p.display()))?;
    }
    let budgeted = match a.budget {
        Some(budget) => fit_budget(a, &m, &mut results, base, budget, &eval_map)?,
        None => None,
    };
    let map = BitMap {
        version: super::options::BIT_MAP_VERSION,
        modules: results.iter().map(|r| (r.module.clone(), r.bits.map(|bits| spec_of(a, bits)))).collect(),
    };
    write_atomic(&a.bits_map, (serde_json::to_string_pretty(&map)? + "\n").as_bytes())
        .with_context(|| format!("{}", a.bits_map.display()))?;
    report(a, &m, &results, base, limit, budgeted)
}

/// The loss of the model with the modules of a map (module -> spec) quantized, the rest at full
/// precision.
type EvalMap<'e> = dyn Fn(BTreeMap<String, Option<QuantSpec>>) -> anyhow::Result<f64> + 'e;

/// The quantization tried at `bits`.
fn spec_of(a: &Args, bits: u8) -> QuantSpec {
    QuantSpec { bits, group: a.group, scheme: a.scheme }
}

/// The modules `--targets` names in the model, layer by layer.
fn modules_tested(a: &Args, m: &Model) -> anyhow::Result<Vec<String>> {
    let targets = a.targets.clone().unwrap_or_else(QuantOptions::default_targets);
    let mut modules = Vec::new();
    for l in 0..m.cfg.n_layer {
        for mm in MODULES {
            let name = format!("h.{l}.{mm}");
            if targets.iter().any(|t| linears::matches(&name, t)) {
                modules.push(name);
            }
        }
    }
    if modules.is_empty() {
        anyhow::bail!("no module matches --targets {}", targets.join(","));
    }
    Ok(modules)
}

/// `--measurements`' file where it exists (refused when measured with other `settings`), else an
/// empty one.
fn read_measurements(a: &Args, settings: String) -> anyhow::Result<Measurements> {
    match &a.measurements {
        Some(p) if p.exists() => {
            let text = std::fs::read_to_string(p).with_context(|| format!("{}", p.display()))?;
            let c: Measurements = serde_json::from_str(&text).with_context(|| format!("{}: not qatc prt measurements", p.display()))?;
            if c.version != 1 || c.settings != settings {
                anyhow::bail!("{}: measured with other settings ({}); now {settings}", p.display(), c.settings);
            }
            Ok(c)
        }
        _ => Ok(Measurements { version: 1, settings, ..Default::default() }),
    }
}

/// Each module quantized alone at the scheme's widths: from the widest down to where it alone
/// exceeds `--budget`, or from the narrowest up to the first within `limit`. A module in `cache`
/// is not measured again; every module's curve is kept there.
fn sweep(
    a: &Args,
    modules: &[String],
    cache: &mut Measurements,
    base: f64,
    limit: f64,
    eval_map: &EvalMap,
) -> anyhow::Result<Vec<ModuleResult>> {
    let widths: Vec<u8> = a.scheme.widths().collect();
    let pb = super::progress(modules.len() as u64, "prt {bar:30} {pos}/{len} modules  {msg}  eta {eta}");
    let mut results = Vec::new();
    for module in modules {
        if let Some(tried) = cache.modules.get(module) {
            pb.inc(1);
            results.push(ModuleResult { module: module.clone(), bits: None, loss: base, tried: tried.clone() });
            continue;
        }
        let mut tried = Vec::new();
        let mut found = None;
        // a budget needs each module's whole curve, from the top until it alone is over budget
        let order: Vec<u8> = if a.budget.is_some() { widths.iter().rev().copied().collect() } else { widths.clone() };
        for bits in order {
            let loss = eval_map(BTreeMap::from([(module.clone(), Some(spec_of(a, bits)))])).with_context(|| module.clone())?;
            tried.push((bits, loss));
            pb.set_message(format!("{module} {bits}-bit loss {loss:.4}"));
            match a.budget {
                Some(b) if loss - base > b => break,
                Some(_) => {}
                None if loss <= limit => {
                    found = Some((bits, loss));
                    break;
                }
                None => {}
            }
        }
        pb.inc(1);
        cache.modules.insert(module.clone(), tried.clone());
        results.push(ModuleResult { module: module.clone(), bits: found.map(|f| f.0), loss: found.map(|f| f.1).unwrap_or(base), tried });
    }
    pb.finish_and_clear();
    Ok(results)
}

/// `--budget`: the widths `bitalloc::allocate` picks from the modules' curves, the whole map
/// measured and the allocation redone on a tighter budget while it exceeds the budget; the
/// results' bits set to it. Returns (the budget, the predicted penalty, the measured one).
fn fit_budget(
    a: &Args,
    m: &Model,
    results: &mut [ModuleResult],
    base: f64,
    budget: f64,
    eval_map: &EvalMap,
) -> anyhow::Result<Option<(f64, f64, f64)>> {
    let curves: Vec<bitalloc::Curve> = results
        .iter()
        .map(|r| {
            let info = m.ckpt.info(&format!("{}.weight", r.module));
            let elems = info.map_or(0, |i| i.shape.iter().product());
            let full_bits = info.map_or(16, |i| 8 * i.dtype.bytes_for(1) as u32);
            bitalloc::Curve { elems, full_bits, tried: r.tried.iter().map(|&(b, l)| (b, l - base)).collect() }
        })
        .collect();
    // penalties do not add exactly: tighten until the whole map is measured within budget
    let mut target = budget;
    let mut best: Option<(Vec<Option<u8>>, f64, f64)> = None;
    for _ in 0..6 {
        let (bits, predicted) = bitalloc::allocate(&curves, target);
        let map = results.iter().zip(&bits).map(|(r, b)| (r.module.clone(), b.map(|b| spec_of(a, b)))).collect();
        let measured = eval_map(map)? - base;
        let fits = measured <= budget;
        best = Some((bits, predicted, measured));
        if fits || target <= 0.0 {
            break;
        }
        target *= 0.9 * budget / measured.max(1e-12);
    }
    let Some((bits, predicted, measured)) = best else { return Ok(None) };
    for (r, b) in results.iter_mut().zip(&bits) {
        r.bits = *b;
        r.loss = b.and_then(|b| r.tried.iter().find(|t| t.0 == b).map(|t| t.1)).unwrap_or(base);
    }
    Ok(Some((budget, predicted, measured)))
}

/// The summary: each module's width and loss, the average bits over the tested weights'
/// elements and the bytes against the checkpoint's (as JSON with `--json`).
fn report(a: &Args, m: &Model, results: &[ModuleResult], base: f64, limit: f64, budgeted: Option<(f64, f64, f64)>) -> anyhow::Result<()> {
    let (mut elems, mut bit_elems, mut stored, mut quant_bytes) = (0usize, 0usize, 0usize, 0usize);
    for r in results {
        let Some(info) = m.ckpt.info(&format!("{}.weight", r.module)) else { continue };
        let (n_in, n_out) = (info.shape[0], info.shape[1]);
        let e = n_in * n_out;
        elems += e;
        stored += info.dtype.bytes_for(e);
        match r.bits {
            Some(bits) => {
                bit_elems += e * bits as usize;
                quant_bytes += spec_of(a, bits).stored_bytes(n_in, n_out);
            }
            None => {
                bit_elems += e * info.dtype.bytes_for(1) * 8;
                quant_bytes += info.dtype.bytes_for(e);
            }
        }
    }
    let avg_bits = bit_elems as f64 / elems.max(1) as f64;
    if a.json {
        let mut j = serde_json::json!({
            "full_precision_loss": base, "threshold": a.threshold, "modules": results,
            "average_bits": avg_bits, "stored_bytes": stored, "quantized_bytes": quant_bytes,
            "bits_map": a.bits_map.display().to_string(),
        });
        if let Some((budget, predicted, measured)) = budgeted {
            j["budget"] = serde_json::json!(budget);
            j["predicted_penalty"] = serde_json::json!(predicted);
            j["measured_penalty"] = serde_json::json!(measured);
        }
        println!("{}", serde_json::to_string(&j)?);
        return Ok(());
    }
    match budgeted {
        Some((budget, predicted, measured)) => println!(
            "full precision loss {base:.5}; budget {budget} nats: the map's penalty {measured:.5} measured (sum of the modules alone {predicted:.5})"
        ),
        None => println!("full precision loss {base:.5}; limit {limit:.5} (+{:.1}%)", a.threshold * 100.0),
    }
    println!("{:<22} {:>5} {:>10}", "module", "bits", "loss");
    for r in results {
        let b = r.bits.map(|b| b.to_string()).unwrap_or_else(|| "full".into());
        println!("{:<22} {:>5} {:>10.5}", r.module, b, r.loss);
    }
    println!(
        "average {avg_bits:.2} bits per weight; {} -> {} ({:.1}% saved); bit map in {}",
        super::compile::human_bytes(stored),
        super::compile::human_bytes(quant_bytes),
        100.0 * (1.0 - quant_bytes as f64 / stored.max(1) as f64),
        a.bits_map.display()
    );
    Ok(())
}

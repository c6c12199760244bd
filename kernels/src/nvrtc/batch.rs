//! Every kernel of a program to CUBIN: in parallel (NVRTC compiles independent programs
//! concurrently), through the disk cache, with a report of each kernel's resources.

use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use serde::Serialize;

use super::cache::KernelCache;
use super::resources::{self, Resources};
use super::{Arch, Nvrtc};
use crate::cuda::emit::{CudaKernel, LaunchDims};
use crate::error::KernelError;

/// How to build.
#[derive(Clone, Copy, Debug)]
pub struct BuildOptions<'a> {
    pub arch: Arch,
    /// None: compile everything, keep nothing.
    pub cache: Option<&'a KernelCache>,
    /// Compiles at a time (at least 1).
    pub jobs: usize,
    /// Where the sources were written, to name the file in compile errors.
    pub source_dir: Option<&'a Path>,
}

/// One kernel as machine code.
#[derive(Clone, Debug)]
pub struct CompiledKernel {
    pub name: String,
    pub family: String,
    pub cubin: Vec<u8>,
    /// ptxas' account of it; None when its log had no report qatc could read (a newer ptxas
    /// wording, say): a warning in the build's report, never a failed build, since the CUBIN is
    /// whole either way.
    pub resources: Option<Resources>,
    pub launch: LaunchDims,
    /// Read from the cache rather than compiled.
    pub cached: bool,
    /// Seconds NVRTC took (0 when cached).
    pub compile_s: f64,
}

/// One line of the report.
#[derive(Clone, Debug, Serialize)]
pub struct KernelEntry {
    pub name: String,
    pub family: String,
    /// Flattened into the entry; absent where ptxas' report could not be read
    /// (`BuildReport::warnings` says which).
    #[serde(flatten)]
    pub resources: Option<Resources>,
    pub block: u32,
    pub grid: [u32; 3],
    pub cubin_bytes: usize,
    pub cached: bool,
    pub compile_ms: f64,
}

/// What a build did: `qatc compile --device cuda` prints it and writes it as
/// `OUT/kernels/report.json`.
#[derive(Clone, Debug, Serialize)]
pub struct BuildReport {
    pub arch: String,
    pub nvrtc: String,
    pub cache: Option<String>,
    pub kernels: usize,
    pub compiled: usize,
    pub cached: usize,
    /// Wall-clock seconds of the whole build.
    pub wall_s: f64,
    /// NVRTC seconds summed over kernels (more than `wall_s` when compiles overlap).
    pub compile_s: f64,
    pub jobs: usize,
    pub entries: Vec<KernelEntry>,
    /// What the build could not read but did not need: kernels whose resource report did not parse.
    pub warnings: Vec<String>,
}

impl BuildReport {
    /// The report as a table: one line per kernel, most registers first.
    pub fn table(&self) -> String {
        let mut rows: Vec<&KernelEntry> = self.entries.iter().collect();
        let regs = |e: &KernelEntry| e.resources.map_or(0, |r| r.registers);
        rows.sort_by(|a, b| regs(b).cmp(&regs(a)).then(a.name.cmp(&b.name)));
        let w = rows.iter().map(|e| e.name.len()).max().unwrap_or(6).max(6);
        let mut s =
            format!("{:<w$}  {:>4}  {:>6}  {:>6}  {:>11}  {:>5}  {}\n", "kernel", "regs", "smem", "stack", "spill st/ld", "block", "");
        for e in rows {
            let cell = |f: fn(&Resources) -> String| e.resources.as_ref().map_or("?".to_string(), f);
            s.push_str(&format!(
                "{:<w$}  {:>4}  {:>6}  {:>6}  {:>11}  {:>5}  {}\n",
                e.name,
                cell(|r| r.registers.to_string()),
                cell(|r| r.shared_bytes.to_string()),
                cell(|r| r.stack_bytes.to_string()),
                cell(|r| format!("{}/{}", r.spill_store_bytes, r.spill_load_bytes)),
                e.block,
                if e.cached { "cached" } else { "" }
            ));
        }
        s
    }

    /// One line: how many, for what, how long.
    pub fn summary(&self) -> String {
        let known = || self.entries.iter().filter_map(|e| e.resources);
        let spilling = known().filter(Resources::spills).count();
        let max_regs = known().map(|r| r.registers).max().unwrap_or(0);
        let unread = self.entries.len() - known().count();
        format!(
            "{} kernels for {} (NVRTC {}): {} compiled, {} from the cache, {:.2} s on {} threads; at most {} registers, {} spilling{}",
            self.kernels,
            self.arch,
            self.nvrtc,
            self.compiled,
            self.cached,
            self.wall_s,
            self.jobs,
            max_regs,
            spilling,
            if unread > 0 { format!("; warning: {unread} without a readable ptxas report") } else { String::new() }
        )
    }
}

/// Compiles (or finds in the cache) every kernel for `o.arch`. Kernels with the same name (the
/// same source) are compiled once. The first failure, in kernel order, is the error.
pub fn compile_cubins(nv: &Nvrtc, kernels: &[CudaKernel], o: &BuildOptions) -> Result<(Vec<CompiledKernel>, BuildReport), KernelError> {
    nv.check_arch(o.arch)?;
    let start = Instant::now();
    let mut seen = HashSet::new();
    let todo: Vec<&CudaKernel> = kernels.iter().filter(|k| seen.insert(k.name.clone())).collect();
    let options = Nvrtc::options(o.arch, true);
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<CompiledKernel, KernelError>>>> = Mutex::new((0..todo.len()).map(|_| None).collect());
    let jobs = o.jobs.clamp(1, todo.len().max(1));
    std::thread::scope(|s| {
        for _ in 0..jobs {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(k) = todo.get(i) else { break };
                let r = one(nv, k, o, &options);
                if let Ok(mut all) = results.lock() {
                    all[i] = Some(r);
                }
            });
        }
    });
    let results = results.into_inner().map_err(|_| KernelError::Internal("a compile thread panicked".into()))?;
    let mut out = Vec::with_capacity(todo.len());
    for (k, r) in todo.iter().zip(results) {
        out.push(r.ok_or_else(|| KernelError::Internal(format!("{}: not compiled", k.name)))??);
    }
    let entries = out
        .iter()
        .map(|c| KernelEntry {
            name: c.name.clone(),
            family: c.family.clone(),
            resources: c.resources,
            block: c.launch.block,
            grid: c.launch.grid,
            cubin_bytes: c.cubin.len(),
            cached: c.cached,
            compile_ms: c.compile_s * 1e3,
        })
        .collect();
    let cached = out.iter().filter(|c| c.cached).count();
    let warnings = out
        .iter()
        .filter(|c| c.resources.is_none())
        .map(|c| format!("{}: ptxas' resource report did not parse (registers, spills and shared memory unknown)", c.name))
        .collect();
    let report = BuildReport {
        arch: o.arch.name(),
        nvrtc: format!("{}.{}", nv.version.0, nv.version.1),
        cache: o.cache.map(|c| c.dir().display().to_string()),
        kernels: out.len(),
        compiled: out.len() - cached,
        cached,
        wall_s: start.elapsed().as_secs_f64(),
        compile_s: out.iter().map(|c| c.compile_s).sum(),
        jobs,
        entries,
        warnings,
    };
    Ok((out, report))
}

fn one(nv: &Nvrtc, k: &CudaKernel, o: &BuildOptions, options: &[String]) -> Result<CompiledKernel, KernelError> {
    let done = |cubin: Vec<u8>, resources: Option<Resources>, cached: bool, compile_s: f64| CompiledKernel {
        name: k.name.clone(),
        family: k.family.clone(),
        cubin,
        resources,
        launch: k.launch.clone(),
        cached,
        compile_s,
    };
    let key = KernelCache::key(nv.version, o.arch, options, &k.source);
    if let Some(e) = o.cache.and_then(|c| c.get(o.arch, &key)) {
        let r = resources::parse(&e.log, &k.name);
        return Ok(done(e.cubin, r, true, 0.0));
    }
    let t = Instant::now();
    let path = o.source_dir.map(|d| d.join(format!("{}.cu", k.name))).unwrap_or_else(|| format!("{}.cu (not written)", k.name).into());
    let out = super::program::compile(k, options, true).map_err(|e| e.into_error(k, o.arch, &path))?;
    let secs = t.elapsed().as_secs_f64();
    let r = resources::parse(&out.log, &k.name);
    if let Some(c) = o.cache {
        c.put(o.arch, &key, &out.image, &out.log)?;
    }
    Ok(done(out.image, r, false, secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, resources: Option<Resources>) -> KernelEntry {
        KernelEntry {
            name: name.into(),
            family: "f".into(),
            resources,
            block: 128,
            grid: [1, 1, 1],
            cubin_bytes: 8,
            cached: false,
            compile_ms: 1.0,
        }
    }

    /// A ptxas whose wording qatc cannot read costs the report its figures, not the build: the
    /// kernel is listed with "?" and counted in the summary, its JSON entry has no figures.
    #[test]
    fn an_unread_resource_report_is_a_warning() {
        let known = Resources { registers: 40, ..Resources::default() };
        let r = BuildReport {
            arch: "sm_90".into(),
            nvrtc: "13.0".into(),
            cache: None,
            kernels: 2,
            compiled: 2,
            cached: 0,
            wall_s: 0.1,
            compile_s: 0.1,
            jobs: 2,
            entries: vec![entry("a", Some(known)), entry("b", None)],
            warnings: vec!["b: ptxas' resource report did not parse".into()],
        };
        assert!(
            r.summary().contains("at most 40 registers") && r.summary().contains("1 without a readable ptxas report"),
            "{}",
            r.summary()
        );
        assert!(r.table().lines().any(|l| l.starts_with("b ") && l.contains(" ? ")), "{}", r.table());
        let json = serde_json::to_value(&r).expect("serializable");
        assert_eq!(json["entries"][0]["registers"], 40);
        assert!(json["entries"][1].get("registers").is_none(), "{json}");
    }
}

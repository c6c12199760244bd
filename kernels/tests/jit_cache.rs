//! The CPU backend's kernel cache within one process: a program compiled again (or another
//! program sharing its kernels) compiles nothing and runs the same code; given a directory, the
//! object code of each kernel compiled is kept there, one whole entry per kernel. (A fresh
//! process reading it back, and damaged entries, are `tests/kernel_cache.rs`'s: this process
//! would find every kernel in memory first.)
#![cfg(feature = "llvm")]

mod common;

use qatc_kernels::llvm::{Jit, JitOptions, ObjectCache};

fn kernels(g: &qatc_ir::Graph) -> Vec<qatc_kernels::kir::Kernel> {
    qatc_kernels::lower(g).expect("lowers").kernels
}

#[test]
fn a_second_compile_in_one_process_compiles_nothing() {
    let ks = kernels(&common::residual_layernorm());
    assert!(!ks.is_empty());
    let first = Jit::compile(&ks).expect("compiles");
    let r = first.report();
    assert_eq!((r.kernels, r.cached() + r.compiled), (ks.len(), ks.len()));
    let again = Jit::compile(&ks).expect("compiles");
    let r = again.report();
    assert_eq!((r.compiled, r.in_process, r.from_disk), (0, ks.len(), 0), "{r:?}");
    for i in 0..ks.len() {
        assert_eq!(first.function(i).map(|f| f as usize), again.function(i).map(|f| f as usize), "kernel {i}: the same code");
        assert_eq!(first.name(i), again.name(i));
    }
}

#[test]
fn another_vector_width_is_another_kernel() {
    // the width is an attribute of the module, so a part of its key: compiled anew, not shared
    let ks = kernels(&common::elementwise_chain());
    let narrow = Jit::compile_with(&ks, &JitOptions { vector_width: Some(128) }).expect("compiles");
    let wide = Jit::compile_with(&ks, &JitOptions { vector_width: Some(256) }).expect("compiles");
    assert_eq!(wide.report().in_process, 0, "{:?}", wide.report());
    assert_ne!(narrow.function(0).map(|f| f as usize), wide.function(0).map(|f| f as usize));
    let again = Jit::compile_with(&ks, &JitOptions { vector_width: Some(128) }).expect("compiles");
    assert_eq!(again.report().compiled, 0);
    assert_eq!(narrow.function(0).map(|f| f as usize), again.function(0).map(|f| f as usize));
}

#[test]
fn compiled_kernels_are_kept_on_disk_one_entry_each() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let cache = ObjectCache::new(dir.path());
    // a width no other test here uses, so that this process compiles these kernels here
    let opts = JitOptions { vector_width: Some(64) };
    let ks = kernels(&common::attention());
    let jit = Jit::compile_cached(&ks, &opts, Some(&cache)).expect("compiles");
    let r = jit.report();
    assert_eq!((r.compiled, r.cache_warning.as_deref()), (ks.len(), None), "{r:?}");
    let entries: Vec<_> = walk(&dir.path().join("cpu"));
    assert_eq!(entries.len(), ks.len(), "{entries:?}");
    assert!(entries.iter().all(|p| p.extension().is_some_and(|e| e == "o")), "{entries:?}");
    // in this process the next compile finds them in memory, before the disk
    let again = Jit::compile_cached(&ks, &opts, Some(&cache)).expect("compiles");
    assert_eq!((again.report().in_process, again.report().compiled), (ks.len(), 0));
}

#[test]
fn a_cache_that_cannot_be_written_is_a_warning() {
    let dir = tempfile::tempdir().expect("a temp dir");
    // a file where the cache's directory would be
    let blocked = dir.path().join("file");
    std::fs::write(&blocked, b"").expect("written");
    let opts = JitOptions { vector_width: Some(32) };
    let ks = kernels(&common::causal_softmax());
    let jit = Jit::compile_cached(&ks, &opts, Some(&ObjectCache::new(&blocked))).expect("the build goes on");
    assert_eq!(jit.report().compiled, ks.len());
    assert!(jit.report().cache_warning.is_some(), "{:?}", jit.report());
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

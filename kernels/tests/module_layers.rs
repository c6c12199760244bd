//! The files of a folder read in one direction: each folder whose `mod.rs` states its layers
//! (a doc line `//! Layers: a <- b/c <- d`: b and c use only a, d uses any of them) is held to
//! them. A file's uses of its siblings are its `super::NAME` and `crate::FOLDER::NAME` paths
//! outside its tests; any loop among them fails first, named, and then any use of a file that is
//! not to its left. `kernels/src/cuda/` and `kernels/src/lower/` must state theirs.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The folders that must state their layers (relative to `kernels/src`).
const REQUIRED: [&str; 2] = ["cuda", "lower"];

/// A folder's files (stem -> source outside its `#[cfg(test)]` part), `mod.rs` apart.
fn files(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for e in fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.expect("a directory entry").path();
        let Some(stem) = p.file_stem().and_then(|s| s.to_str()) else { continue };
        if p.extension().is_some_and(|x| x == "rs") && stem != "mod" {
            let text = fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            // a test module may read any file of the folder (`tables.rs`' tests read `emit`'s headers)
            let code = text.split("#[cfg(test)]").next().unwrap_or_default().to_string();
            out.insert(stem.to_string(), code);
        }
    }
    out
}

/// The names a path continues with after `prefix`: `prefix::name`, or each first name of a
/// group `prefix::{a, b::c, d as e}`.
fn used_after(code: &str, prefix: &str) -> BTreeSet<String> {
    let ident = |s: &str| s.trim_start().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(at) = rest.find(prefix) {
        rest = &rest[at + prefix.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // the group up to its closing brace, split at top-level commas
            let (mut depth, mut start) = (0, 0);
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        out.insert(ident(&group[start..i]));
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.insert(ident(&group[start..i]));
                        start = i + 1;
                    }
                    _ => {}
                }
            }
        } else {
            out.insert(ident(rest));
        }
    }
    out.remove("");
    out
}

/// Each file's uses of its siblings.
fn uses(folder: &str, files: &BTreeMap<String, String>) -> BTreeMap<String, BTreeSet<String>> {
    let crate_path = format!("crate::{}::", folder.replace('/', "::"));
    files
        .iter()
        .map(|(f, code)| {
            let mut used: BTreeSet<String> = used_after(code, "super::");
            used.extend(used_after(code, &crate_path));
            used.retain(|u| u != f && files.contains_key(u));
            (f.clone(), used)
        })
        .collect()
}

/// A loop among the uses, as `a -> b -> .. -> a`, if there is one.
fn a_loop(uses: &BTreeMap<String, BTreeSet<String>>) -> Option<String> {
    // 0: not seen, 1: on the current path, 2: done
    fn visit(
        f: &str,
        uses: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<String> {
        state.insert(f.to_string(), 1);
        path.push(f.to_string());
        for u in uses.get(f).into_iter().flatten() {
            match state.get(u.as_str()).copied().unwrap_or(0) {
                1 => {
                    let from = path.iter().position(|p| p == u).unwrap_or(0);
                    return Some(format!("{} -> {u}", path[from..].join(" -> ")));
                }
                0 => {
                    if let Some(l) = visit(u, uses, state, path) {
                        return Some(l);
                    }
                }
                _ => {}
            }
        }
        path.pop();
        state.insert(f.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for f in uses.keys() {
        if state.get(f.as_str()).copied().unwrap_or(0) == 0 {
            if let Some(l) = visit(f, uses, &mut state, &mut Vec::new()) {
                return Some(l);
            }
        }
    }
    None
}

/// The layers a `mod.rs` states: each file's layer index, or None when it states none.
fn stated(mod_rs: &str) -> Option<BTreeMap<String, usize>> {
    let line = mod_rs.lines().find_map(|l| l.trim_start().strip_prefix("//! Layers:"))?;
    let mut out = BTreeMap::new();
    for (i, layer) in line.split("<-").enumerate() {
        for f in layer.split('/') {
            out.insert(f.trim().to_string(), i);
        }
    }
    Some(out)
}

/// What is wrong with one folder's files, one line each.
fn problems(src: &Path, folder: &str) -> Vec<String> {
    let dir = src.join(folder);
    let files = files(&dir);
    let uses = uses(folder, &files);
    if let Some(l) = a_loop(&uses) {
        return vec![format!("{folder}/: the files use each other in a loop: {l}")];
    }
    let mod_rs = fs::read_to_string(dir.join("mod.rs")).unwrap_or_default();
    let Some(layers) = stated(&mod_rs) else {
        return if REQUIRED.contains(&folder) { vec![format!("{folder}/mod.rs states no `//! Layers:` line")] } else { Vec::new() };
    };
    let mut out = Vec::new();
    for f in files.keys().filter(|f| !layers.contains_key(*f)) {
        out.push(format!("{folder}/{f}.rs is in no layer of {folder}/mod.rs"));
    }
    for f in layers.keys().filter(|f| !files.contains_key(*f)) {
        out.push(format!("{folder}/mod.rs names {f}, which is no file of the folder"));
    }
    for (f, used) in &uses {
        for u in used {
            if let (Some(a), Some(b)) = (layers.get(f), layers.get(u)) {
                if b >= a {
                    out.push(format!("{folder}/{f}.rs uses {u}, which is not to its left in {folder}/mod.rs's layers"));
                }
            }
        }
    }
    out
}

/// Every folder under `dir` (relative to `src`) with a `mod.rs`.
fn folders(src: &Path, dir: &Path, out: &mut Vec<String>) {
    for e in fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p: PathBuf = e.expect("a directory entry").path();
        if p.is_dir() {
            if p.join("mod.rs").is_file() {
                let rel = p.strip_prefix(src).expect("under src").to_string_lossy().replace('\\', "/");
                out.push(rel);
            }
            folders(src, &p, out);
        }
    }
}

#[test]
fn the_files_of_each_stated_folder_read_in_one_direction() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    folders(&src, &src, &mut all);
    all.sort();
    for f in REQUIRED {
        assert!(all.iter().any(|a| a == f), "kernels/src/{f}/ is gone: update REQUIRED");
    }
    let stating: Vec<&String> = all
        .iter()
        .filter(|f| REQUIRED.contains(&f.as_str()) || stated(&fs::read_to_string(src.join(f).join("mod.rs")).unwrap_or_default()).is_some())
        .collect();
    let found: Vec<String> = stating.iter().flat_map(|f| problems(&src, f)).collect();
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// The checker itself: a loop is named, a use against the stated order is found, and grouped
/// paths count each of their names.
#[test]
fn the_checker_names_a_loop_and_a_use_out_of_order() {
    assert_eq!(
        used_after("use super::{a::X, b, c as d};\nuse super::e::{f, g};\nlet x = super::h::y();", "super::"),
        ["a", "b", "c", "e", "h"].map(String::from).into_iter().collect()
    );
    let edges = |pairs: &[(&str, &[&str])]| -> BTreeMap<String, BTreeSet<String>> {
        pairs.iter().map(|(f, us)| (f.to_string(), us.iter().map(|u| u.to_string()).collect())).collect()
    };
    assert_eq!(a_loop(&edges(&[("a", &[]), ("b", &["a", "c"]), ("c", &["d"]), ("d", &["b"])])), Some("b -> c -> d -> b".into()));
    assert_eq!(a_loop(&edges(&[("a", &[]), ("b", &["a"]), ("c", &["a", "b"])])), None);
    let layers = stated("//! text\n//! Layers: a <- b/c <- d\n").expect("stated");
    assert_eq!((layers["a"], layers["b"], layers["c"], layers["d"]), (0, 1, 1, 2));
}

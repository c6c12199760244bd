//! Sharded checkpoints: `model.safetensors.index.json` or `pytorch_model.bin.index.json` (what
//! `save_pretrained` writes past `max_shard_size`), whose `weight_map` names the shard of every
//! tensor. Each shard is read whole, as a file of its own format, and must hold exactly the
//! tensors the index places in it; a shard the index names but the directory lacks is an error
//! that names it.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use super::Checkpoint;
use crate::frontend::error::LoadError;

/// Largest accepted index (gpt2-xl's is about 40 KB).
const MAX_INDEX_BYTES: u64 = 1 << 20;

fn bad(path: &Path, why: impl Into<String>) -> LoadError {
    LoadError::NotCheckpoint { path: path.into(), why: why.into() }
}

pub(super) fn read(c: &mut Checkpoint, index: &Path) -> Result<(), LoadError> {
    let mut text = String::new();
    std::fs::File::open(index).and_then(|f| f.take(MAX_INDEX_BYTES + 1).read_to_string(&mut text)).map_err(|e| LoadError::io(index, e))?;
    if text.len() as u64 > MAX_INDEX_BYTES {
        return Err(bad(index, format!("over {MAX_INDEX_BYTES} bytes: not a checkpoint index")));
    }
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(index, format!("not a checkpoint index (JSON): {e}")))?;
    let map =
        v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| bad(index, "no \"weight_map\" object: not a checkpoint index"))?;
    // the tensors of each shard, shards in name order
    let mut shards: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| bad(index, format!("{tensor:?} is placed in {file}, not a file name")))?;
        // a shard lies beside its index: no path of its own
        if file.is_empty() || file.contains(['/', '\\']) || file == ".." || file == "." {
            return Err(bad(index, format!("{tensor:?} is placed in {file:?}, which is not a file beside the index")));
        }
        shards.entry(file).or_default().push(tensor.clone());
    }
    if shards.is_empty() {
        return Err(bad(index, "the weight_map places no tensor"));
    }
    let dir = index.parent().unwrap_or(Path::new("."));
    for (file, tensors) in shards {
        let shard = dir.join(file);
        if !shard.is_file() {
            return Err(bad(index, format!("names shard {file}, which is not there (a download cut short?)")));
        }
        if file.ends_with(".bin") {
            c.add_bin(&shard, Some(&tensors))?;
        } else {
            c.add_safetensors(&shard, Some(&tensors))?;
        }
    }
    Ok(())
}

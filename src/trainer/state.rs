//! The resume state a save writes and `--resume` reads back (`checkpoint/`): every persistent
//! input of the step bit for bit (trainable weights, Adam's moments, the step count, fp16's loss
//! scale), so that a resumed run continues exactly where an unbroken one would be.
//!
//! Over ranks with ZeRO (`mpirun -np N`, `--zero 1..3`) a rank holds only its blocks of what ZeRO
//! shards (the moments, 8-bit ones included; at stage 3 the trainable weights too). Those are
//! never gathered to be saved: each rank writes its own shard file (`save_shard`; `qatc train`
//! puts it beside rank 0's checkpoint), whose metadata says whose it is (`ShardOf`), and reads it
//! back on resume (`load_shard`). `save_state` holds the rest, which every rank holds alike and
//! rank 0 writes. A run without sharded state saves one file, as before.

use std::collections::HashMap;
use std::path::Path;

use anyhow::Context;
use qatc_ir::InputKind;
use qatc_passes::microbatch;
use qatc_runtime::{IntTensor, Tensor, Value};

use super::{f32_safetensors, Trainer};

/// Which rank's shard of a sharded state a file holds, and of which save: written in the file's
/// metadata, checked when it is read back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardOf {
    pub rank: usize,
    pub ranks: usize,
    /// The ZeRO stage.
    pub zero: u8,
    /// The optimizer steps done when it was saved.
    pub step: usize,
}

impl ShardOf {
    const KEYS: [&'static str; 4] = ["qatc.rank", "qatc.ranks", "qatc.zero", "qatc.step"];

    fn values(self) -> [usize; 4] {
        [self.rank, self.ranks, usize::from(self.zero), self.step]
    }

    fn metadata(self) -> HashMap<String, String> {
        Self::KEYS.iter().zip(self.values()).map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// The first of a file's metadata that is not `self`'s: the key, what the file says and what
    /// `self` is.
    fn differs(self, meta: Option<&HashMap<String, String>>) -> Option<(&'static str, String, usize)> {
        Self::KEYS.iter().zip(self.values()).find_map(|(k, want)| {
            let got = meta.and_then(|m| m.get(*k));
            (got != Some(&want.to_string())).then(|| (*k, got.cloned().unwrap_or_else(|| "nothing".into()), want))
        })
    }
}

impl Trainer {
    /// The persistent inputs as this rank holds them, in the graph's input order: its blocks of
    /// what ZeRO shards, the rest whole; not the gradient accumulation's sums (0 between
    /// optimizer steps).
    fn held(&self) -> anyhow::Result<Vec<(String, Value<f32>)>> {
        self.persistent_inputs()
            .into_iter()
            .map(|(name, _)| {
                let v = self.step.read_input(&name).with_context(|| format!("reading {name} back"))?;
                Ok((name, v))
            })
            .collect()
    }

    /// The persistent inputs' names and shapes as this rank holds them.
    fn persistent_inputs(&self) -> Vec<(String, Vec<usize>)> {
        self.graph
            .inputs()
            .into_iter()
            .filter(|&id| matches!(self.graph.input_kind(id), Some(InputKind::Trainable | InputKind::State)))
            .map(|id| (self.graph.node(id).name.clone().unwrap_or_default(), self.graph.ty(id).shape.dims().to_vec()))
            .filter(|(name, _)| !microbatch::is_sum(name))
            .collect()
    }

    /// The persistent state as this rank holds it (no collective), as f32 tensors, each with the
    /// index its first element has in the whole (every rank's blocks in rank order): 0 unless
    /// ZeRO shards it.
    pub fn held_tensors(&self) -> anyhow::Result<Vec<(String, Tensor<f32>, usize)>> {
        let rank = self.world.as_ref().map_or(0, |c| c.rank());
        let v = Self::tensors(self.held()?)?;
        Ok(v.into_iter()
            .map(|(n, t)| {
                let at = if self.whole.contains_key(&n) { rank * t.data.len() } else { 0 };
                (n, t, at)
            })
            .collect())
    }

    /// AdamW's step count (the steps whose update applied), read back; None without one.
    pub fn step_count(&self) -> anyhow::Result<Option<f32>> {
        if !self.inputs.contains("step") {
            return Ok(None);
        }
        match self.step.read_input("step").context("reading step back")? {
            Value::Float(t) => Ok(t.data.first().copied()),
            Value::Int(_) => anyhow::bail!("internal: the step count holds integers"),
        }
    }

    /// Which shard of a sharded state this rank saves after `step` steps; None where nothing is
    /// sharded (one rank, or ZeRO 0).
    pub fn shard(&self, step: usize) -> Option<ShardOf> {
        let world = self.world.as_ref()?;
        (!self.whole.is_empty()).then(|| ShardOf { rank: world.rank(), ranks: world.size(), zero: self.opts.parallel.zero, step })
    }

    /// The persistent state that every rank holds alike, as one safetensors file (raw f32: bit
    /// for bit; 8-bit moment codes as f32, which holds them exactly): all of it where nothing is
    /// sharded, else all but the blocks each rank saves itself (`save_shard`).
    pub fn save_state(&self) -> anyhow::Result<Vec<u8>> {
        let alike: Vec<_> = self.held()?.into_iter().filter(|(n, _)| !self.whole.contains_key(n)).collect();
        f32_safetensors(&Self::tensors(alike)?, HashMap::new())
    }

    /// This rank's blocks of the sharded state after `step` steps, as one safetensors file whose
    /// metadata says whose they are (`shard`); None where nothing is sharded.
    pub fn save_shard(&self, step: usize) -> anyhow::Result<Option<Vec<u8>>> {
        let Some(of) = self.shard(step) else { return Ok(None) };
        let mine: Vec<_> = self.held()?.into_iter().filter(|(n, _)| self.whole.contains_key(n)).collect();
        Ok(Some(f32_safetensors(&Self::tensors(mine)?, of.metadata())?))
    }

    /// Restores what `save_state` wrote; every input it holds must be there with its shape, and
    /// finite unless `allow_nonfinite`.
    pub fn load_state(&mut self, path: &Path, allow_nonfinite: bool) -> anyhow::Result<()> {
        let bytes = std::fs::read(path).with_context(|| format!("{}", path.display()))?;
        self.restore(path, &bytes, false, allow_nonfinite)
    }

    /// Restores this rank's blocks from `path`, which `save_shard(step)` wrote: its metadata must
    /// name this rank, the number of ranks, the ZeRO stage and `step`. Nothing to do where
    /// nothing is sharded.
    pub fn load_shard(&mut self, path: &Path, step: usize, allow_nonfinite: bool) -> anyhow::Result<()> {
        let Some(of) = self.shard(step) else { return Ok(()) };
        let whose = format!("rank {} of {}'s shard of the ZeRO {} state saved at step {step}", of.rank, of.ranks, of.zero);
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                anyhow::bail!("{}: missing: {whose} (a save is whole only with every rank's shard)", path.display())
            }
            Err(e) => return Err(e).with_context(|| format!("{}", path.display())),
        };
        let (_, meta) =
            safetensors::SafeTensors::read_metadata(&bytes).with_context(|| format!("{}: not a qatc resume state", path.display()))?;
        if let Some((key, got, want)) = of.differs(meta.metadata().as_ref()) {
            anyhow::bail!("{}: says {key} {got}, not {want}: it is not {whose}", path.display());
        }
        self.restore(path, &bytes, true, allow_nonfinite)
    }

    /// Gives the step the persistent inputs of the state file `bytes` (at `path`): the sharded
    /// ones (this rank's blocks) or the others.
    fn restore(&mut self, path: &Path, bytes: &[u8], sharded: bool, allow_nonfinite: bool) -> anyhow::Result<()> {
        let want: Vec<(String, Vec<usize>)> =
            self.persistent_inputs().into_iter().filter(|(n, _)| self.whole.contains_key(n) == sharded).collect();
        let floats: HashMap<String, bool> = self
            .graph
            .inputs()
            .into_iter()
            .map(|id| (self.graph.node(id).name.clone().unwrap_or_default(), self.graph.ty(id).dtype.is_float()))
            .collect();
        for (name, t) in read_state(path, bytes, &want, allow_nonfinite)? {
            let value = if floats.get(&name).copied().unwrap_or(true) {
                Value::Float(t)
            } else {
                // 8-bit moment codes, saved as f32
                if let Some(c) = t.data.iter().find(|c| !(c.fract() == 0.0 && (0.0..=255.0).contains(*c))) {
                    anyhow::bail!("{}: {name:?} holds {c}, not an 8-bit code", path.display());
                }
                Value::Int(IntTensor { shape: t.shape, data: t.data.into_iter().map(|c| c as i32).collect() })
            };
            self.step.set_input(&name, &value).with_context(|| format!("restoring {name}"))?;
        }
        Ok(())
    }
}

/// Reads a resume state (`bytes`, the file at `path`): every tensor `want` names, f32 with its
/// shape, and finite unless `allow_nonfinite`; other tensors in the file are ignored.
pub fn read_state(
    path: &Path,
    bytes: &[u8],
    want: &[(String, Vec<usize>)],
    allow_nonfinite: bool,
) -> anyhow::Result<Vec<(String, Tensor<f32>)>> {
    let st = safetensors::SafeTensors::deserialize(bytes).with_context(|| format!("{}: not a qatc resume state", path.display()))?;
    let mut out = Vec::with_capacity(want.len());
    for (name, shape) in want {
        let v = st.tensor(name).with_context(|| format!("{}: no state for {name:?}: were the options the same?", path.display()))?;
        if v.shape() != shape.as_slice() || v.dtype() != safetensors::Dtype::F32 {
            anyhow::bail!("{}: {name:?} is {:?} {:?}, the step needs f32 {shape:?}", path.display(), v.dtype(), v.shape());
        }
        let data: Vec<f32> = v.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        if !allow_nonfinite {
            crate::finite::check(path, name, shape, &data)?;
        }
        out.push((name.clone(), Tensor { shape: shape.clone(), data }));
    }
    Ok(out)
}

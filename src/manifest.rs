//! `manifest.json`: what was compiled, from what, and how big it is, for people and tools.

use std::collections::BTreeMap;

use qatc_ir::{Graph, InputKind, Op};
use qatc_passes::PassReport;
use serde::Serialize;

use crate::frontend::config::Gpt2Config;
use crate::model::Model;

#[derive(Serialize, Default, Clone, Debug, PartialEq)]
pub struct GroupSize {
    pub tensors: usize,
    pub params: usize,
    /// Bytes as stored in the checkpoint (its dtype).
    pub stored_bytes: usize,
}

#[derive(Serialize)]
pub struct Manifest<'a> {
    pub qatc_version: &'static str,
    pub model: String,
    pub config: &'a Gpt2Config,
    pub config_source: String,
    pub batch: usize,
    pub seq: usize,
    pub params_total: usize,
    /// Parameter count and bytes by group: embeddings, attention, mlp, layernorm.
    pub params_by_group: BTreeMap<&'static str, GroupSize>,
    pub trainable: GroupSize,
    pub frozen: GroupSize,
    pub passes: Vec<&'a PassReport>,
    pub artifacts: Vec<&'static str>,
}

/// The group a checkpoint tensor belongs to.
pub fn group_of(name: &str) -> &'static str {
    if name.starts_with("wte") || name.starts_with("wpe") || name.starts_with("lm_head") {
        "embeddings"
    } else if name.contains(".attn.") {
        "attention"
    } else if name.contains(".mlp.") {
        "mlp"
    } else {
        "layernorm"
    }
}

/// Sizes of the weight inputs of `g`, by group and by trainable/frozen.
pub fn sizes(model: &Model, g: &Graph) -> (BTreeMap<&'static str, GroupSize>, GroupSize, GroupSize) {
    let mut groups: BTreeMap<&'static str, GroupSize> = BTreeMap::new();
    let (mut tr, mut fr) = (GroupSize::default(), GroupSize::default());
    for id in g.inputs() {
        let node = g.node(id);
        let (Op::Input { kind, .. }, Some(name)) = (&node.op, &node.name) else { continue };
        if !kind.is_param() {
            continue;
        }
        let n = node.ty.numel();
        let bytes = model.ckpt.info(Model::tensor_name(name)).map(|i| i.dtype.bytes_for(n)).unwrap_or(node.ty.bytes());
        for s in [groups.entry(group_of(name)).or_default(), if *kind == InputKind::Trainable { &mut tr } else { &mut fr }] {
            s.tensors += 1;
            s.params += n;
            s.stored_bytes += bytes;
        }
    }
    (groups, tr, fr)
}

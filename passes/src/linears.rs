//! Finding GPT-2's linears in a graph: the weight input `h.{i}.{module}.weight`, the matmul that
//! consumes it (directly or through a FakeQuant), and the bias add that names the linear's output.
//! The quantization and LoRA passes act on these.

use qatc_ir::{Graph, NodeId, Op};

/// The four linears of a GPT-2 block, by module name within the block.
pub const MODULES: [&str; 4] = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"];

#[derive(Clone, Debug)]
pub struct Linear {
    /// e.g. `h.3.mlp.c_fc`
    pub module: String,
    pub weight: NodeId,
    pub matmul: NodeId,
    /// The activation input x [N, in].
    pub x: NodeId,
    /// The linear's output node (x W + b), named `module`.
    pub out: NodeId,
    pub n_in: usize,
    pub n_out: usize,
}

/// PEFT's target matching: a target names a module by suffix (`c_proj` hits `attn.c_proj` and
/// `mlp.c_proj`; `attn.c_proj` only the first).
pub fn matches(module: &str, target: &str) -> bool {
    module == target || module.ends_with(&format!(".{target}"))
}

/// The modules and their short names, for messages: `attn.c_attn, ... (or c_attn, c_proj, c_fc)`.
pub fn described() -> String {
    let mut short: Vec<&str> = Vec::new();
    for s in MODULES.iter().filter_map(|m| m.rsplit('.').next()) {
        if !short.contains(&s) {
            short.push(s);
        }
    }
    format!("{} (or {})", MODULES.join(", "), short.join(", "))
}

/// Whether `target` names any GPT-2 linear at all (for option validation).
pub fn is_known_target(target: &str) -> bool {
    MODULES.iter().any(|m| matches(&format!("h.0.{m}"), target))
}

/// Every linear of the graph's transformer blocks, in layer then module order.
pub fn find(g: &Graph) -> Vec<Linear> {
    let mut out = Vec::new();
    for l in 0.. {
        let mut any = false;
        for m in MODULES {
            let module = format!("h.{l}.{m}");
            let Some(w) = g.find_input(&format!("{module}.weight")) else { continue };
            any = true;
            // weight -> (fake_quant ->) matmul
            let mut via = w;
            let mut mm = None;
            for _ in 0..4 {
                let users = g.users(via);
                if let Some(&u) = users.iter().find(|&&u| matches!(g.node(u).op, Op::MatMul { .. })) {
                    mm = Some(u);
                    break;
                }
                match users.first() {
                    Some(&u) if users.len() == 1 => via = u,
                    _ => break,
                }
            }
            let Some(mm) = mm else { continue };
            let x = g.operands(mm)[0];
            let Some(add) = g.users(mm).into_iter().find(|&u| g.node(u).name.as_deref() == Some(module.as_str())) else {
                continue;
            };
            let dims = g.ty(w).shape.dims().to_vec();
            out.push(Linear { module, weight: w, matmul: mm, x, out: add, n_in: dims[0], n_out: dims[1] });
        }
        if !any {
            break;
        }
    }
    out
}

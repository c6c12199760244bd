//! The reference semantics of the collectives (`qatc_ir::collective`) over ranks simulated in one
//! process: each rank's operand in, each rank's result out. Sums are taken in f64 in rank order
//! and rounded once to the stored type, as the interpreter's other sums are, so the result does
//! not depend on how a real backend happens to order them beyond that rounding.

use qatc_ir::{Op, Reduce};

use crate::float::Float;
use crate::value::{Tensor, Value};

/// Every rank's result of collective `op`, from every rank's operand (rank order). The caller
/// has checked the types (each operand has the op's input type).
pub(crate) fn combine<T: Float>(op: &Op, args: &[&Value<T>]) -> Result<Vec<Value<T>>, String> {
    let world = match op {
        Op::AllReduce { world, .. } | Op::ReduceScatter { world, .. } | Op::AllGather { world } => *world,
        other => return Err(format!("{} is not a collective", other.mnemonic())),
    };
    if args.len() != world {
        return Err(format!("a collective over {world} ranks given {} ranks' operands", args.len()));
    }
    let floats = args
        .iter()
        .map(|v| match v {
            Value::Float(t) => Ok(t),
            Value::Int(_) => Err("collectives take float tensors".to_string()),
        })
        .collect::<Result<Vec<&Tensor<T>>, String>>()?;
    let shape = floats[0].shape.clone();
    if floats.iter().any(|t| t.shape != shape) {
        return Err("the ranks' operands differ in shape".into());
    }
    let reduced = |reduce: Reduce| -> Vec<T> {
        let n = floats[0].data.len();
        let scale = match reduce {
            Reduce::Sum => 1.0,
            Reduce::Mean => 1.0 / world as f64,
        };
        (0..n)
            .map(|i| {
                let s: f64 = floats.iter().map(|t| t.data[i].to_f64()).sum();
                T::from_f64(if reduce == Reduce::Mean { s * scale } else { s })
            })
            .collect()
    };
    Ok(match op {
        Op::AllReduce { reduce, .. } => {
            let data = reduced(*reduce);
            (0..world).map(|_| Value::Float(Tensor { shape: shape.clone(), data: data.clone() })).collect()
        }
        Op::ReduceScatter { reduce, .. } => {
            let data = reduced(*reduce);
            let block = data.len() / world;
            let mut out_shape = shape.clone();
            out_shape[0] /= world;
            (0..world).map(|r| Value::Float(Tensor { shape: out_shape.clone(), data: data[r * block..(r + 1) * block].to_vec() })).collect()
        }
        Op::AllGather { .. } => {
            let data: Vec<T> = floats.iter().flat_map(|t| t.data.iter().copied()).collect();
            let mut out_shape = shape.clone();
            out_shape[0] *= world;
            (0..world).map(|_| Value::Float(Tensor { shape: out_shape.clone(), data: data.clone() })).collect()
        }
        _ => unreachable!("checked above"),
    })
}

/// Whether `op` is a collective.
pub(crate) fn is_collective(op: &Op) -> bool {
    matches!(op, Op::AllReduce { .. } | Op::ReduceScatter { .. } | Op::AllGather { .. })
}

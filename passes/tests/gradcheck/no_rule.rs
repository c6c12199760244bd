//! Ops without a rule: `PassError::NoRule` when a trainable input reaches them, and no error when
//! none does.

use qatc_ir::{BinaryOp, DType, InputKind, NodeId, Op, Shape, UnaryOp};
use qatc_passes::autodiff::autodiff;
use qatc_passes::PassError;

use crate::harness::{Case, ANY, POSITIVE};

/// A graph where trainable `x` reaches `op`: autodiff must fail with NoRule naming the op.
fn assert_no_rule(mnemonic: &str, build: impl FnOnce(&mut Case, NodeId) -> NodeId) {
    let mut c = Case::new(mnemonic, 1800);
    let x = c.param("x", &[3, 4], ANY);
    let y = build(&mut c, x);
    assert_eq!(c.g.node(y).op.mnemonic(), mnemonic);
    c.finish(y);
    match autodiff(c.g) {
        Err(PassError::NoRule { op, node }) => {
            assert_eq!(op, mnemonic);
            assert!(node.contains(mnemonic), "{node}");
        }
        Err(e) => panic!("{mnemonic}: expected NoRule, got {e}"),
        Ok(_) => panic!("{mnemonic}: expected NoRule, autodiff succeeded"),
    }
}

#[test]
fn ops_without_a_rule_report_no_rule() {
    for b in [BinaryOp::Max, BinaryOp::Min, BinaryOp::GeluGrad] {
        let mn = Op::Binary(b).mnemonic();
        assert_no_rule(mn, |c, x| {
            let f = c.frozen("f", &[3, 4], ANY);
            c.bin(b, x, f)
        });
        // Also when the trainable input is the second operand.
        assert_no_rule(mn, |c, x| {
            let f = c.frozen("f", &[3, 4], ANY);
            c.bin(b, f, x)
        });
    }
    assert_no_rule("scatter_add", |c, x| {
        let ids = c.ids("ids", &[3], &[0, 2, 0]);
        c.op(Op::ScatterAdd { rows: 4 }, &[ids, x])
    });
    assert_no_rule("layernorm_grad_x", |c, x| {
        let g = c.frozen("g", &[4], ANY);
        let dy = c.frozen("dy", &[3, 4], ANY);
        c.op(Op::LayerNormGradX { eps: 1e-5 }, &[x, g, dy])
    });
    assert_no_rule("layernorm_grad_gamma", |c, x| {
        let dy = c.frozen("dy", &[3, 4], ANY);
        c.op(Op::LayerNormGradGamma { eps: 1e-5 }, &[dy, x])
    });
    assert_no_rule("softmax_grad", |c, x| {
        let dy = c.frozen("dy", &[3, 4], ANY);
        c.op(Op::SoftmaxGrad { scale: 1.0 }, &[x, dy])
    });
    assert_no_rule("cross_entropy_grad", |c, x| {
        let t = c.ids("t", &[3], &[0, 1, 3]);
        let dl = c.frozen("dl", &[], ANY);
        c.op(Op::CrossEntropyGrad, &[x, t, dl])
    });
    assert_no_rule("dequantize", |c, x| {
        // Trainable scales [3, 4] of a sym 4-bit weight [6, 4] in groups of 2.
        let codes = c.g.input("codes", InputKind::Data, DType::I4, [6, 4]).expect("input");
        let spec = qatc_ir::QuantSpec { bits: 4, group: 2, scheme: qatc_ir::QuantScheme::Sym };
        c.op(Op::Dequantize { spec, to: qatc_ir::DType::F32 }, &[codes, x])
    });
    assert_no_rule("fake_quant_learned_grad", |c, x| {
        // x [3, 4] as the gradient of a sym 4-bit weight [3, 4] in one group per column
        let w = c.frozen("wq", &[3, 4], ANY);
        let s = c.frozen("s", &[1, 4], POSITIVE);
        let spec = qatc_ir::QuantSpec { bits: 4, group: 0, scheme: qatc_ir::QuantScheme::Sym };
        c.op(Op::FakeQuantLearnedGrad { spec, wrt: qatc_ir::QuantParam::Scale }, &[w, s, x])
    });
    assert_no_rule("adam_m", |c, x| {
        let m = c.frozen("m", &[3, 4], ANY);
        c.op(Op::AdamM { beta1: 0.9 }, &[m, x])
    });
    assert_no_rule("adam_v", |c, x| {
        let v = c.frozen("v", &[3, 4], ANY);
        c.op(Op::AdamV { beta2: 0.999 }, &[v, x])
    });
    assert_no_rule("adam_param", |c, x| {
        let m = c.frozen("m", &[3, 4], ANY);
        let v = c.frozen("v", &[3, 4], POSITIVE);
        let lr = c.frozen("lr", &[], POSITIVE);
        let t = c.frozen("t", &[], POSITIVE);
        c.op(Op::AdamParam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }, &[x, m, v, lr, t])
    });
    assert_no_rule("all_finite", |c, x| c.op(Op::AllFinite, &[x]));
    assert_no_rule("select", |c, x| {
        let cond = c.frozen("cond", &[3, 4], ANY);
        let b = c.frozen("b", &[3, 4], ANY);
        c.op(Op::Select, &[cond, x, b])
    });
    assert_no_rule("loss_scale", |c, x| {
        let state = c.op(Op::Reshape { shape: Shape::new([12]) }, &[x]);
        let state = c.op(Op::Slice { axis: 0, start: 0, end: 2 }, &[state]);
        let finite = c.frozen("finite", &[], ANY);
        c.op(Op::LossScale { interval: 2000, growth: 2.0, backoff: 0.5 }, &[state, finite])
    });
    // 8-bit moments' quantization: optimizer ops, never differentiated
    assert_no_rule("block_absmax", |c, x| c.op(Op::BlockAbsMax, &[x]));
    assert_no_rule("block_dequant", |c, x| {
        let codes = c.g.input("codes", InputKind::Data, DType::U8, [3, 4]).expect("input");
        let a = c.op(Op::SumTo { shape: [1].into() }, &[x]);
        c.op(Op::BlockDequant { map: qatc_ir::DynMap::Signed }, &[codes, a])
    });
    for op in [Op::AllReduce { reduce: qatc_ir::Reduce::Mean, world: 1 }, Op::AllGather { world: 1 }] {
        let mn = op.mnemonic();
        assert_no_rule(mn, |c, x| c.op(op.clone(), &[x]));
    }
    assert_no_rule("reduce_scatter", |c, x| c.op(Op::ReduceScatter { reduce: qatc_ir::Reduce::Sum, world: 1 }, &[x]));
}

#[test]
fn ops_without_a_rule_are_fine_off_the_trainable_path() {
    // max of two frozen tensors feeds the loss, but no trainable input reaches it: no rule is
    // needed, and the gradient of the trainable branch is still right.
    let mut c = Case::new("max off path", 1900);
    let a = c.frozen("a", &[3, 4], ANY);
    let b = c.frozen("b", &[3, 4], ANY);
    let m = c.bin(BinaryOp::Max, a, b);
    let x = c.param("x", &[3, 4], ANY);
    let y = c.bin(BinaryOp::Mul, m, x);
    let y = c.un(UnaryOp::Tanh, y);
    c.check(y);
}

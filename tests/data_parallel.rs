//! Data parallelism and ZeRO over ranks simulated in one process (`Interpreter::run_ranks`, the
//! collectives' reference semantics; MPI and NCCL processes come later): N ranks of B / N rows
//! each take the step one rank of B rows takes, within 1e-6 in the loss and 1e-5 in the weights
//! after 3 steps, for 4-bit + LoRA and for a full fine-tune, at ZeRO 0, 1, 2 and 3, and with
//! gradient accumulation (whose sums ZeRO 2 shards). Every rank runs one program; only the data
//! input `rank` and its rows differ.
//!
//! AdamW's eps is 1e-4 here, not PyTorch's 1e-8: Adam divides each gradient by its own running
//! magnitude, so where a gradient is at rounding level (the keys' third of c_attn.bias is zero in
//! exact arithmetic: a softmax ignores a shift of its keys) the order of the sums decides a step
//! of up to lr, in the one-rank run as in the N-rank one. With eps 1e-8 three ranks at ZeRO 0
//! ended 1.03e-5 from one rank in h.0.attn.c_attn.weight after 3 steps (measured); with 1e-4
//! such noise moves nothing while the other gradients keep their steps (worst 2.1e-7).

mod common;

use std::collections::HashMap;

use qatc::data::TokenFile;
use qatc::model::Model;
use qatc::step::{self, StepOptions};
use qatc_ir::{Graph, InputKind, QuantScheme, QuantSpec};
use qatc_passes::lora::LoraOptions;
use qatc_passes::microbatch;
use qatc_passes::quant::QuantOptions;
use qatc_passes::zero::{Parallel, Shard, RANK};
use qatc_runtime::{Interpreter, Tensor, Value};

const LR: f64 = 1e-2;
const STEPS: usize = 3;
/// The global batch: 6 rows, which 2 and 3 ranks divide.
const B: usize = 6;
const T: usize = 16;

fn model() -> Model {
    Model::open(&common::fixture("tiny/f32_prefix/model.safetensors")).unwrap()
}

fn full() -> StepOptions {
    let mut o = StepOptions::new(B, T);
    o.adamw.weight_decay = 0.1;
    o.adamw.eps = 1e-4;
    o.clip = Some(0.5);
    o
}

fn qlora() -> StepOptions {
    let mut o = full();
    o.model.full_finetune = false;
    o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 32, scheme: QuantScheme::Sym }));
    o.model.lora = Some(LoraOptions::new(4));
    o
}

fn floats(v: &Value<f32>) -> Vec<f64> {
    match v {
        Value::Float(t) => t.data.iter().map(|&x| f64::from(x)).collect(),
        Value::Int(t) => t.data.iter().map(|&x| f64::from(x)).collect(),
    }
}

/// Rank `r`'s block of `whole` over `world` ranks (zero padding past its end).
fn block(whole: &Value<f32>, world: usize, r: usize) -> Value<f32> {
    let data = floats(whole);
    let s = Shard::new(data.len(), world);
    let mut b: Vec<f32> = data.iter().skip(r * s.block).take(s.block).map(|&x| x as f32).collect();
    b.resize(s.block, 0.0);
    Value::Float(Tensor { shape: vec![s.block], data: b })
}

/// The whole tensor (`numel` elements) from every rank's block.
fn unblock(blocks: &[&Value<f32>], numel: usize) -> Vec<f64> {
    blocks.iter().flat_map(|b| floats(b)).take(numel).collect()
}

/// A run of `STEPS` optimizer steps: the loss of each and the trained weights at the end, whole.
struct Run {
    losses: Vec<f64>,
    weights: HashMap<String, Vec<f64>>,
}

/// `STEPS` steps of `o` over `p.ranks` ranks of `B / ranks` rows, each rank its own rows of the
/// same global batches; every rank's copy of a replicated weight must agree bit for bit.
fn run(o: &StepOptions, p: Parallel) -> Run {
    let m = model();
    let data = TokenFile::open(&common::fixture("tiny/tokens.bin")).unwrap();
    let n = p.ranks;
    let rows = B / n;
    let mut ro = o.clone();
    ro.batch = rows;
    ro.parallel = p;
    let (g, _) = step::train(&m.cfg, &ro, |_, _| {}).unwrap();
    // the weights as one rank of B binds them (whole), cut into blocks where ZeRO 3 shards them
    let (whole_g, _) = step::train(&m.cfg, &StepOptions { batch: rows, ..o.clone() }, |_, _| {}).unwrap();
    let whole = m.bind::<f32>(&whole_g, None, 7).unwrap();
    let trainable: Vec<(String, usize)> = whole_g
        .inputs()
        .into_iter()
        .filter(|&id| whole_g.input_kind(id) == Some(InputKind::Trainable))
        .map(|id| (whole_g.node(id).name.clone().unwrap(), whole_g.ty(id).numel()))
        .collect();
    let mut states: Vec<HashMap<String, Value<f32>>> = (0..n)
        .map(|r| {
            let mut v = whole.clone();
            if p.shards_parameters() {
                for (name, _) in &trainable {
                    v.insert(name.clone(), block(&whole[name], n, r));
                }
            }
            common::zero_state(&g, &mut v);
            v.insert("lr".into(), Value::scalar(LR));
            v.insert(RANK.into(), Value::ints([1], vec![r as i32]).unwrap());
            v
        })
        .collect();
    let interp = Interpreter::<f32>::new(&g).unwrap();
    let k = o.grad_accum;
    let mut losses = Vec::new();
    for s in 0..STEPS {
        let mut loss = None;
        for i in 0..k {
            // the fixture holds two global batches: later steps see them again
            let (ids, tgt) = data.batch((s * k + i) % 2, B, T).unwrap();
            for (r, v) in states.iter_mut().enumerate() {
                let mine = |x: &[i32]| x[r * rows * T..(r + 1) * rows * T].to_vec();
                v.insert("ids".into(), Value::ints([rows, T], mine(&ids)).unwrap());
                v.insert("targets".into(), Value::ints([rows, T], mine(&tgt)).unwrap());
                v.insert(microbatch::APPLY.into(), Value::scalar(if i + 1 == k { 1.0 } else { 0.0 }));
            }
            let out = interp.run_ranks(&states).unwrap();
            for (r, res) in out.iter().enumerate() {
                assert_eq!(floats(&res.outputs["loss"]), floats(&out[0].outputs["loss"]), "rank {r}'s loss is rank 0's");
                states[r].extend(res.updates.clone());
            }
            loss = Some(floats(&out[0].outputs["loss"])[0]);
        }
        losses.push(loss.unwrap());
    }
    let mut weights = HashMap::new();
    for (name, numel) in &trainable {
        let w = if p.shards_parameters() {
            unblock(&states.iter().map(|v| &v[name]).collect::<Vec<_>>(), *numel)
        } else {
            for (r, v) in states.iter().enumerate() {
                assert_eq!(floats(&v[name]), floats(&states[0][name]), "{name}: rank {r}'s copy is rank 0's");
            }
            floats(&states[0][name])
        };
        weights.insert(name.clone(), w);
    }
    Run { losses, weights }
}

/// Every (ranks, stage) run of `o` against one rank of B rows.
fn ranks_equal_one(what: &str, o: &StepOptions, cases: &[(usize, u8)]) {
    let one = run(o, Parallel::default());
    for &(ranks, zero) in cases {
        let got = run(o, Parallel { ranks, zero });
        let mut worst = (0.0f64, String::new());
        for (s, (a, b)) in got.losses.iter().zip(&one.losses).enumerate() {
            let e = (a - b).abs() / b.abs();
            assert!(e <= 1e-6, "{what}, {ranks} ranks, ZeRO {zero}: step {s}'s loss {a} against {b} ({e:e})");
        }
        for (name, w) in &one.weights {
            let e = common::max_abs(&got.weights[name], w);
            assert!(e <= 1e-5, "{what}, {ranks} ranks, ZeRO {zero}: {name} differs by {e:e} after {STEPS} steps");
            if e > worst.0 {
                worst = (e, name.clone());
            }
        }
        eprintln!("{what}, {ranks} ranks, ZeRO {zero}: losses {:?}; worst weight {:.2e} ({})", got.losses, worst.0, worst.1);
    }
}

const ALL: [(usize, u8); 8] = [(2, 0), (3, 0), (2, 1), (3, 1), (2, 2), (3, 2), (2, 3), (3, 3)];

#[test]
fn full_finetune_over_two_and_three_ranks_at_every_zero_stage() {
    ranks_equal_one("full fine-tune", &full(), &ALL);
}

#[test]
fn qlora_over_two_and_three_ranks_at_every_zero_stage() {
    ranks_equal_one("4-bit + LoRA", &qlora(), &ALL);
}

/// With --grad-accum the sums are whole at ZeRO 0 and 1 and this rank's blocks at 2 and 3.
#[test]
fn gradient_accumulation_over_ranks() {
    let mut o = full();
    o.grad_accum = 2;
    ranks_equal_one("full fine-tune, K 2", &o, &[(2, 0), (3, 1), (2, 2), (3, 3)]);
}

/// At one rank the new stages do not run: the step is the one without them, node for node.
#[test]
fn one_rank_is_the_plain_step() {
    let m = model();
    let o = full();
    let (plain, _) = step::train(&m.cfg, &o, |_, _| {}).unwrap();
    let mut z = o.clone();
    z.parallel = Parallel { ranks: 1, zero: 3 };
    let (one, _) = step::train(&m.cfg, &z, |_, _| {}).unwrap();
    assert_eq!(qatc_ir::print(&plain), qatc_ir::print(&one));
}

/// The sharded step's collectives and blocks: one reduction per trainable tensor, the loss
/// all-reduced, ZeRO 1 gathering each updated weight, ZeRO 3 gathering before each use.
#[test]
fn the_collectives_each_stage_inserts() {
    let m = model();
    let o = full();
    let count = |p: Parallel| {
        let mut r = o.clone();
        r.batch = 2;
        r.parallel = p;
        let (g, _) = step::train(&m.cfg, &r, |_, _| {}).unwrap();
        let c = g.op_counts();
        let n = |k: &str| c.get(k).copied().unwrap_or(0);
        (n("all_reduce"), n("reduce_scatter"), n("all_gather"), g.find_input(RANK).is_some())
    };
    let (plain, _) = step::train(&m.cfg, &o, |_, _| {}).unwrap();
    let tensors = plain.inputs().into_iter().filter(|&id| plain.input_kind(id) == Some(InputKind::Trainable)).count();
    // the gradients and the loss
    assert_eq!(count(Parallel { ranks: 2, zero: 0 }), (tensors + 1, 0, 0, false));
    // the loss and the clipping norm's squares; each gradient reduce-scattered, each weight gathered
    assert_eq!(count(Parallel { ranks: 2, zero: 1 }), (2, tensors, tensors, true));
    let (ar, rs, ag, rank) = count(Parallel { ranks: 3, zero: 3 });
    assert_eq!((ar, rs, rank), (2, tensors, false));
    assert!(ag > tensors, "ZeRO 3 gathers a weight before each use: {ag} gathers of {tensors} tensors");
}

/// What a rank's lowered step writes its collectives and AdamW over (`kernels/src/lower/
/// overwrite.rs`): each gradient's all-reduce over the gradient itself (DDP's in-place bucket
/// reduction, no second copy of the gradients); under ZeRO 1 each AdamW kernel over its own
/// operands (the moments' inputs and this rank's block of the weight, no pack of every new value),
/// and each updated weight all-gathered straight into its input (no copy of the whole weight kept
/// to the end of the step), except where the padding stands between (a world that does not
/// divide the tensor). The runs above and `tests/mpi_train.rs` hold these programs' results.
#[test]
fn collectives_and_adamw_write_over_what_they_replace() {
    use qatc_kernels::program::{BufKind, Exchange, Step};
    let m = model();
    let lowered = |p: Parallel| {
        let mut r = full();
        r.batch = 2;
        r.parallel = p;
        // fused, as the CLI compiles it: AdamW one kernel per tensor
        r.fuse = Some(qatc_passes::fusion::FuseOptions::default());
        let (g, _) = step::train(&m.cfg, &r, |_, _| {}).unwrap();
        (qatc_kernels::lower::lower(&g).unwrap(), g)
    };
    let trainable = |g: &Graph| -> Vec<(String, usize)> {
        g.inputs()
            .into_iter()
            .filter(|&id| g.input_kind(id) == Some(InputKind::Trainable))
            .map(|id| (g.node(id).name.clone().unwrap(), g.ty(id).numel()))
            .collect()
    };
    let collectives = |prog: &qatc_kernels::program::Program| -> Vec<qatc_kernels::program::Collective> {
        prog.steps.iter().filter_map(|s| if let Step::Collective(c) = s { Some((**c).clone()) } else { None }).collect()
    };

    let (prog, g) = lowered(Parallel { ranks: 2, zero: 0 });
    let tensors = trainable(&g).len();
    let in_place = collectives(&prog).iter().filter(|c| matches!(c.exchange, Exchange::AllReduce(_)) && c.src.buf == c.dst.buf).count();
    assert!(in_place >= tensors, "{in_place} all-reduces written over their operands, {tensors} gradients");

    for world in [2, 3] {
        let (prog, g) = lowered(Parallel { ranks: world, zero: 1 });
        let weights = trainable(&g);
        let input_of = |b: usize| match &prog.buffers[b].kind {
            BufKind::Input(name, _) => Some(name.clone()),
            _ => None,
        };
        let gathered: Vec<String> =
            collectives(&prog).iter().filter(|c| c.exchange == Exchange::AllGather).filter_map(|c| input_of(c.dst.buf)).collect();
        let unpadded: Vec<&String> = weights.iter().filter(|(_, n)| Shard::new(*n, world).padding() == 0).map(|(name, _)| name).collect();
        assert!(!unpadded.is_empty() && (world == 3 || unpadded.len() == weights.len()), "{world} ranks: {unpadded:?}");
        for name in &unpadded {
            assert!(gathered.contains(name), "{world} ranks: {name} is not gathered into its input (into {gathered:?})");
        }
        // AdamW's launches write only over what existed before them: an input, or a block an
        // earlier step computed (updated in place), never a buffer of new values
        let mut adamw = 0;
        for (i, s) in prog.steps.iter().enumerate() {
            let Step::Launch { kernel, args, .. } = s else { continue };
            let k = &prog.kernels[*kernel];
            if !k.family.starts_with("adamw") {
                continue;
            }
            adamw += 1;
            for (p, &b) in k.params.iter().zip(args) {
                let earlier = prog.steps[..i].iter().any(|t| writes(t, &prog, b));
                assert!(
                    !p.write || input_of(b).is_some() || earlier,
                    "{world} ranks: {} writes {}, a new buffer",
                    k.family,
                    prog.buffers[b].name
                );
            }
        }
        assert_eq!(adamw, weights.len(), "{world} ranks: one AdamW kernel per tensor");
    }
}

/// Whether step `s` writes buffer `b`.
fn writes(s: &qatc_kernels::program::Step, prog: &qatc_kernels::program::Program, b: usize) -> bool {
    use qatc_kernels::program::Step;
    match s {
        Step::Launch { kernel, args, .. } => prog.kernels[*kernel].params.iter().zip(args).any(|(p, &c)| c == b && p.write),
        Step::Gemm(g) => g.c.buf == b,
        Step::Collective(c) => c.dst.buf == b,
    }
}

/// The verifier refuses a malformed collective: a reduce-scatter whose first dimension the
/// world does not divide (the padding is the pass's to make explicit), and a world of 0.
#[test]
fn the_verifier_catches_a_malformed_collective() {
    use qatc_ir::{DType, Op, Reduce};
    let mut g = Graph::new("bad");
    let x = g.input("x", InputKind::Data, DType::F32, [5usize, 2]).unwrap();
    let e = g.add(Op::ReduceScatter { reduce: Reduce::Mean, world: 2 }, &[x]).unwrap_err().to_string();
    assert!(e.contains("pad"), "{e}");
    let e = g.add(Op::AllGather { world: 0 }, &[x]).unwrap_err().to_string();
    assert!(e.contains("world") || e.contains("rank"), "{e}");
    let text = "graph \"bad\" {\n  %0 = input[kind=data] : f32[5, 2] \"x\"\n  %1 = reduce_scatter[reduce=sum, world=2](%0) : f32[2, 2]\n  output \"y\" = %1\n}\n";
    assert!(qatc_ir::parse(text).is_err(), "the parser's graph is verified too");
}

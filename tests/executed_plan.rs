//! One plan, the executed one: what `qatc plan` shows for the CPU (`qatc_driver::plan`)
//! is what the CPU executor `qatc train` builds (`qatc_driver::compile`) allocates: the same
//! peak (arena + persistent + data bytes) as the executor holds, and every buffer in the same
//! region at the same offset, on the demo step (the embedded Shakespeare model, B 4 T 128, Q4_0
//! g32 + LoRA 16) and the tiny step (full fine-tune and 4-bit + LoRA), under every checkpoint
//! policy. And `qatc train`'s memory line says the plan's peak and what it holds, equal. For CUDA,
//! what `qatc plan --device cuda` plans is what the CUDA executor (`qatc train --device cuda`'s
//! program, on the emulated GPU) lays out: the same regions, every buffer at the same offset, and
//! no GEMM scratch beyond them.

mod common;

#[test]
fn the_plan_is_what_the_cuda_executor_lays_out() {
    use qatc::model::Model;
    use qatc::step::{self, StepOptions};
    use qatc_driver::{Options, Target};
    use qatc_passes::fusion::FuseOptions;
    use qatc_passes::remat::Checkpoint;
    use qatc_runtime::cuda::{CudaProgram, HostGpu};
    let cuda = Target::cuda(None, Default::default());
    let demo = Model::open(&common::root().join("examples/gpt2-shakespeare-small/model.safetensors")).unwrap();
    for c in [Checkpoint::None, Checkpoint::Blocks] {
        let mut o = StepOptions::new(4, 128);
        o.fuse = Some(FuseOptions::default());
        o.checkpoint = c;
        let label = format!("demo full fine-tune, --checkpoint {}", c.describe());
        let (g, _) = step::train(&demo.cfg, &o, |_, _| {}).unwrap();
        let planned = qatc_driver::plan(&g, &cuda, &Options::default()).unwrap();
        let program = qatc_driver::lower(&g, &cuda, &Options::default()).unwrap().program;
        let exec = CudaProgram::new(program, HostGpu::new(1 << 30), &cuda, None).unwrap();
        assert!(planned.chunk.is_some(), "{label}: the chunked cross-entropy");
        let l = exec.layout();
        assert_eq!(planned.plan.peak_bytes(), l.arena_bytes + l.persistent_bytes + l.data_bytes, "{label}: the plan's peak");
        assert_eq!(planned.plan.buffers.len(), l.places.len(), "{label}: the same buffers");
        for (pb, place) in planned.plan.buffers.iter().zip(&l.places) {
            assert_eq!((pb.region, pb.offset), (place.region, place.offset), "{label}: buffer {} where the plan puts it", pb.name);
        }
        // the one allocation the plan does not list, the GEMM scratch (a strided operand packed
        // into a dense panel), is empty: the fused step's GEMMs all read and write in place
        // (under 1 MiB on 124M B 8 and 16 and 1.5B B 4 at T 1024, measured on 2026-11-26)
        assert_eq!(exec.bytes().scratch, 256, "{label}: the GEMM scratch is one alignment, nothing packed");
        eprintln!("{label}: planned peak = laid out = {} B", planned.plan.peak_bytes());
    }
}

/// The comparison needs the compiled CPU executor (LLVM).
#[cfg(feature = "llvm")]
mod compiled {
    use qatc::cli::options::{model_options, QuantArgs};
    use qatc::model::Model;
    use qatc::step::{self, StepOptions};
    use qatc_passes::fusion::FuseOptions;
    use qatc_passes::lora::LoraOptions;
    use qatc_passes::remat::Checkpoint;

    fn quant_lora(o: &mut StepOptions, scheme: &str, group: usize) {
        let q = QuantArgs { bits: Some(4), group: Some(group), scheme: qatc_ir::QuantScheme::from_name(scheme), ..Default::default() };
        o.model = model_options(&q, Some(LoraOptions::new(16)), false, true).unwrap();
    }

    /// Every policy, with a budget halfway between blocks' and none's peaks (in the `remat` pass's
    /// own model, the graph-level planner's over the unfused step, which its budgets are in).
    fn policies(m: &Model, o: &StepOptions) -> Vec<Checkpoint> {
        let peak = |c: Checkpoint| {
            let mut o = o.clone();
            o.checkpoint = c;
            o.fuse = None;
            let (g, _) = step::train(&m.cfg, &o, |_, _| {}).unwrap();
            qatc_passes::plan::plan(&g, &Default::default()).unwrap().peak_bytes()
        };
        let (none, blocks) = (peak(Checkpoint::None), peak(Checkpoint::Blocks));
        let mid = blocks.min(none) + none.abs_diff(blocks) / 2;
        vec![Checkpoint::None, Checkpoint::Blocks, Checkpoint::Sqrt, Checkpoint::Budget(mid), Checkpoint::Auto(mid)]
    }

    fn plan_equals_executor(what: &str, m: &Model, o: &StepOptions) {
        use qatc_driver::{cpu_program, Options, Target};
        let options = Options::default();
        for c in policies(m, o) {
            let mut o = o.clone();
            o.checkpoint = c;
            let label = format!("{what}, --checkpoint {}", c.describe());
            let (g, _) = step::train(&m.cfg, &o, |_, _| {}).unwrap();
            let planned = qatc_driver::plan(&g, &Target::cpu(), &options).unwrap();
            let (exec, _) = cpu_program(&g, &options).unwrap();
            assert_eq!(planned.plan.peak_bytes(), exec.held_bytes(), "{label}: the plan's peak is what the executor holds");
            assert_eq!(planned.program.buffers.len(), exec.program().buffers.len(), "{label}: the same buffers");
            for (b, pb) in planned.plan.buffers.iter().enumerate() {
                let (region, offset) = exec.address_of(b).unwrap();
                assert_eq!((pb.region, pb.offset), (region, offset), "{label}: buffer {} where the plan puts it", pb.name);
                assert_eq!(pb.name, exec.program().buffers[b].name, "{label}: buffer {b}");
            }
            eprintln!("{label}: planned peak = held = {} B, {} buffers", exec.held_bytes(), planned.plan.buffers.len());
        }
    }

    #[test]
    fn the_plan_is_what_the_cpu_executor_holds() {
        let demo = Model::open(&super::common::root().join("examples/gpt2-shakespeare-small/model.safetensors")).unwrap();
        let mut o = StepOptions::new(4, 128);
        quant_lora(&mut o, "q4_0", 32);
        o.fuse = Some(FuseOptions::default());
        plan_equals_executor("demo", &demo, &o);
        let tiny = Model::open(&super::common::fixture("tiny/f32_prefix/model.safetensors")).unwrap();
        let mut full = StepOptions::new(4, 32);
        full.fuse = Some(FuseOptions::default());
        plan_equals_executor("tiny, full fine-tune", &tiny, &full);
        let mut q = full.clone();
        quant_lora(&mut q, "sym", 16);
        plan_equals_executor("tiny, 4-bit + LoRA", &tiny, &q);
        // 8-bit AdamW, its moments updated blockwise over the codes (kernels/src/lower/adamw8.rs)
        let mut eight = full.clone();
        eight.adamw.moments = qatc_passes::optim::Moments::Blockwise8;
        plan_equals_executor("tiny, full fine-tune, adamw8bit", &tiny, &eight);
        let mut demo8 = StepOptions::new(2, 64);
        demo8.adamw.moments = qatc_passes::optim::Moments::Blockwise8;
        demo8.fuse = Some(FuseOptions::default());
        plan_equals_executor("demo, full fine-tune, adamw8bit", &demo, &demo8);
    }
}

#[cfg(not(feature = "llvm"))]
#[test]
fn the_plan_is_what_the_cpu_executor_holds() {
    eprintln!("skipped: this build has no LLVM, so no compiled CPU executor to compare the plan with");
}

/// `qatc train` says the plan's peak and what the executor holds: the same bytes.
#[test]
fn train_says_the_planned_peak_it_holds() {
    if !cfg!(feature = "llvm") {
        eprintln!("skipped: this build has no LLVM, so qatc train runs the interpreter, which has no plan");
        return;
    }
    let model = common::fixture("tiny/f32_prefix/model.safetensors");
    let data = common::fixture("tiny/tokens.bin");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("adapter");
    let args = [
        "train",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "1",
        "--device",
        "cpu",
        "--checkpoint",
        "blocks",
        "--full-finetune",
        "--out",
        out.to_str().unwrap(),
    ];
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_qatc")).args(args).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "{text}");
    let line = text.lines().find(|l| l.contains("planned peak")).unwrap_or_else(|| panic!("no memory line in:\n{text}"));
    let after = |key: &str| line.split(key).nth(1).and_then(|s| s.split(['(', ',', ';']).next()).map(|s| s.trim().to_string());
    let (planned, held) = (after("planned peak "), after("held "));
    assert!(planned.is_some() && planned == held, "planned {planned:?}, held {held:?}: {line}");
}

//! `qatc generate` (issue 32) on the embedded Shakespeare GPT-2: greedy tokens equal transformers'
//! `generate(do_sample=False)` on the same deployed weights, token for token (plain, a PEFT adapter
//! merged, fake-quantized + adapter, nf4; `gen_generate_fixtures.py`); the KV-cache passes give the
//! logits of the whole prefix recomputed; EOS stops it; sampling repeats with its seed; an adapter
//! qatc trained is sampled with the quantization in its `qatc.json`, as its export deploys it; bad
//! input is one line and exit code 2.

mod common;

use common::cli::{qatc, refused};
use qatc::cli::eval::{compile_bound, EvalSetup};
use qatc::cli::generate::{generate, Decoder, Stop};
use qatc::cli::options::QuantArgs;
use qatc::model::Model;
use qatc::sample::{argmax, Sampler, Sampling};
use qatc_ir::QuantScheme;
use qatc_passes::precision::Precision;
use qatc_runtime::{IntTensor, Value};
use serde_json::Value as Json;

fn demo() -> String {
    common::root().join("examples/gpt2-shakespeare-small/model.safetensors").display().to_string()
}

/// `qatc generate MODEL ARGS --json` on the CPU, its one JSON object.
fn generated(args: &[&str]) -> Json {
    let m = demo();
    let mut all = vec!["generate", m.as_str(), "--json", "--device", "cpu"];
    all.extend(args);
    let o = qatc(&all);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "qatc {all:?}: {err}");
    assert!(err.contains("tokens/s"), "no speed line: {err}");
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stdout)))
}

fn ids(v: &Json) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

/// The flags of a fixture case: its adapter, its quantization.
fn case_flags(c: &Json) -> Vec<String> {
    let mut f = vec!["--prompt".to_string(), c["prompt"].as_str().unwrap().to_string()];
    if let Some(a) = c["adapter"].as_str() {
        f.extend(["--adapter".to_string(), common::root().join(a).display().to_string()]);
    }
    if let Some(q) = c["quant"].as_object() {
        for k in ["bits", "group"] {
            f.extend([format!("--{k}"), q[k].to_string()]);
        }
        f.extend(["--scheme".to_string(), q["scheme"].as_str().unwrap().to_string()]);
    }
    f
}

#[test]
fn greedy_tokens_equal_transformers_generate() {
    let doc: Json = serde_json::from_str(&std::fs::read_to_string(common::fixture("generate/greedy.json")).unwrap()).unwrap();
    for c in doc["cases"].as_array().unwrap() {
        let name = c["name"].as_str().unwrap();
        let n = c["max_new_tokens"].to_string();
        let mut args = case_flags(c);
        args.extend(["--max-new-tokens".to_string(), n]);
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = generated(&a);
        assert_eq!(out["engine"], if cfg!(feature = "llvm") { "llvm" } else { "interpreter" }, "{name}");
        assert_eq!(ids(&out["prompt_tokens"]), ids(&c["prompt_tokens"]), "{name}: the prompt's ids");
        assert_eq!(ids(&out["tokens"]), ids(&c["tokens"]), "{name}: the new tokens");
        assert_eq!(out["stop"], c["stop"], "{name}");
    }
    // the reference interpreter too, on the first tokens of a quantized, adapted case
    let c = doc["cases"].as_array().unwrap().iter().find(|c| c["name"] == "q4_adapter_romeo").unwrap();
    let mut args = case_flags(c);
    args.extend(["--max-new-tokens", "6", "--interpreter"].map(String::from));
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = generated(&a);
    assert_eq!(out["engine"], "interpreter");
    assert_eq!(ids(&out["tokens"]), ids(&c["tokens"])[..6]);
}

/// Each decode step's logits against the evaluation forward over the whole sequence at once (no
/// cache: every position recomputed), for the compiled passes and the interpreter, plain and
/// 4-bit + adapter: within 1e-5 of the logits' largest magnitude.
#[test]
fn the_kv_cache_gives_the_logits_of_the_whole_prefix() {
    let m = Model::open(std::path::Path::new(&demo())).unwrap();
    let adapter = common::fixture("generate/adapter");
    let q4 = QuantArgs { bits: Some(4), group: Some(32), scheme: Some(QuantScheme::Sym), ..Default::default() };
    let prompt: Vec<u32> = vec![33676, 4720, 25, 198, 40, 716]; // "ROMEO:\nI am"
    for (what, quant, adapter, interpreter) in [
        ("plain, compiled", QuantArgs::default(), None, false),
        ("4-bit + adapter, compiled", q4.clone(), Some(adapter.as_path()), false),
        ("4-bit + adapter, interpreter", q4, Some(adapter.as_path()), true),
    ] {
        let mut setup = EvalSetup::new(&quant, adapter, Precision::Fp32, false).unwrap();
        setup.interpreter = interpreter;
        let new = if interpreter { 4 } else { 12 };
        let mut dec = Decoder::new(&m, &setup, prompt.len() + new).unwrap();
        let mut rows = vec![dec.prefill(&prompt).unwrap()];
        let mut seq = prompt.clone();
        for _ in 0..new {
            let t = argmax(rows.last().unwrap()) as u32;
            seq.push(t);
            rows.push(dec.step(t).unwrap());
        }
        let t = seq.len();
        let (g, _) = qatc::step::evaluation(&m.cfg, 1, t, true, &setup.model, Precision::Fp32, None, |_, _| {}).unwrap();
        let mut whole = compile_bound(&m, &g, &setup, None).unwrap().step;
        let data: Vec<i32> = seq.iter().map(|&x| x as i32).collect();
        whole.set_input("ids", &Value::Int(IntTensor { shape: vec![1, t], data: data.clone() })).unwrap();
        whole.set_input("targets", &Value::Int(IntTensor { shape: vec![1, t], data })).unwrap();
        whole.run().unwrap();
        let Value::Float(all) = whole.output("logits").unwrap() else { panic!("integer logits") };
        let v = m.cfg.vocab_size;
        let (mut worst, mut abs) = (0.0f64, 0.0f64);
        for (i, row) in rows.iter().enumerate() {
            let pos = prompt.len() - 1 + i;
            let want: Vec<f64> = all.data[pos * v..(pos + 1) * v].iter().map(|&x| x as f64).collect();
            let got: Vec<f64> = row.iter().map(|&x| x as f64).collect();
            worst = worst.max(common::rel_err(&got, &want));
            abs = abs.max(common::max_abs(&got, &want));
        }
        eprintln!("{what}: {} positions, largest difference {abs:.2e}, {worst:.2e} of the logits' magnitude", rows.len());
        // the interpreter sums in f64 and rounds once: the cache changes no sum it rounds (measured:
        // equal bits); compiled, the one-row products are GEMVs, the prefix's GEMMs (2e-6)
        let bound = if interpreter { 1e-7 } else { 1e-5 };
        assert!(worst < bound, "{what}: the KV cache's logits differ from the whole prefix's by {worst:.2e}");
    }
}

/// EOS stops a generation, and is its last token (as transformers returns it).
#[test]
fn generation_stops_at_eos() {
    let m = Model::open(std::path::Path::new(&demo())).unwrap();
    let setup = EvalSetup::new(&QuantArgs::default(), None, Precision::Fp32, false).unwrap();
    let prompt = [33676, 4720, 25];
    let run = |eos: &[usize]| {
        let mut dec = Decoder::new(&m, &setup, prompt.len() + 15).unwrap();
        let mut greedy = Sampler::new(Sampling::greedy(), 0).unwrap();
        generate(&mut dec, &prompt, 16, &mut greedy, eos).unwrap()
    };
    let all = run(&[]);
    assert_eq!((all.tokens.len(), all.stop), (16, Stop::Length));
    // an end token that first appears at position k (the greedy text repeats itself)
    let k = (1..all.tokens.len()).find(|&k| !all.tokens[..k].contains(&all.tokens[k])).unwrap();
    let cut = run(&[all.tokens[k] as usize]);
    assert_eq!(cut.stop, Stop::Eos);
    assert_eq!(cut.tokens, all.tokens[..=k]);
}

#[test]
fn sampling_repeats_with_its_seed() {
    let sample = |seed: &str, extra: &[&str]| {
        let mut a = vec!["--prompt", "JULIET:", "--max-new-tokens", "24", "--temperature", "0.9", "--seed", seed];
        a.extend(extra);
        ids(&generated(&a)["tokens"])
    };
    let cut = ["--top-k", "40", "--top-p", "0.95"];
    let first = sample("3", &cut);
    assert_eq!(first, sample("3", &cut), "the same seed gives the same text");
    assert_ne!(first, sample("4", &cut), "another seed, another text");
    // top-k 1 leaves the likeliest token alone: greedy, whatever the seed
    let greedy = ids(&generated(&["--prompt", "JULIET:", "--max-new-tokens", "24"])["tokens"]);
    assert_eq!(sample("5", &["--top-k", "1"]), greedy);
}

/// An adapter qatc trained (2-bit learned scales, `--qat merged`) carries its quantization in
/// `qatc.json`: generate reads it with no flag, and samples exactly what `qatc export` deploys.
#[test]
fn an_adapter_is_sampled_as_its_export_deploys_it() {
    let dir = tempfile::tempdir().unwrap();
    let (ad, ex) = (dir.path().join("adapter"), dir.path().join("export"));
    let (ad, ex) = (ad.to_str().unwrap(), ex.to_str().unwrap());
    let train = common::root().join("examples/shakespeare_train.bin").display().to_string();
    let m = demo();
    let o = qatc(&[
        "train",
        &m,
        "--data",
        &train,
        "--batch",
        "2",
        "--seq",
        "32",
        "--steps",
        "3",
        "--bits",
        "2",
        "--group",
        "64",
        "--scheme",
        "sym",
        "--scales",
        "learned",
        "--qat",
        "merged",
        "--lora",
        "r=4",
        "--lr",
        "1e-2",
        "--scale-lr",
        "1e-3",
        "--no-fuse",
        "--device",
        "cpu",
        "--out",
        ad,
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = qatc(&["export", &m, "--adapter", ad, "--out", ex]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let args = ["--prompt", "KING RICHARD:", "--max-new-tokens", "24"];
    let adapted = generated(&[&args[..], &["--adapter", ad]].concat());
    let exported = {
        let model = format!("{ex}/model.safetensors");
        let o = qatc(&[&["generate", model.as_str(), "--json", "--device", "cpu"][..], &args[..]].concat());
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice::<Json>(&o.stdout).unwrap()
    };
    assert_eq!(ids(&adapted["tokens"]), ids(&exported["tokens"]));
    // flags that disagree with the adapter's qatc.json are refused
    let o = qatc(&["generate", &m, "--prompt", "A", "--adapter", ad, "--bits", "4"]);
    assert!(refused(&o).contains("qatc.json"), "{}", refused(&o));
}

#[test]
fn bad_input_is_one_line() {
    let m = demo();
    let refusal = |args: &[&str]| refused(&qatc(&[&["generate", m.as_str()][..], args].concat()));
    let e = refusal(&["--prompt", ""]);
    assert!(e.contains("--prompt is empty"), "{e}");
    let e = refusal(&["--prompt", "ROMEO:", "--max-new-tokens", "300"]);
    assert!(e.contains("--max-new-tokens 300") && e.contains("context of 256"), "{e}");
    let e = refusal(&["--prompt", "ROMEO:", "--max-new-tokens", "0"]);
    assert!(e.contains("--max-new-tokens"), "{e}");
    let e = refusal(&["--prompt", "ROMEO:", "--adapter", "/nonexistent/adapter"]);
    assert!(e.contains("/nonexistent/adapter"), "{e}");
    let e = refusal(&["--prompt", "ROMEO:", "--top-k", "5"]);
    assert!(e.contains("--temperature"), "{e}");
    let e = refusal(&["--prompt", "ROMEO:", "--temperature", "1", "--top-p", "1.5"]);
    assert!(e.contains("--top-p"), "{e}");
    let e = refused(&qatc(&["generate", "/nonexistent/model.safetensors", "--prompt", "A"]));
    assert!(e.contains("/nonexistent/model.safetensors"), "{e}");
}

/// The passes on the CUDA executor, on its host emulation (`HostGpu`: no GPU is needed): the
/// tiny model 4-bit quantized, a prompt's pass and then one-position steps, the caches moved from
/// the first to the second through the host as `Decoder` does, against the compiled CPU.
#[test]
fn the_cached_passes_run_on_the_cuda_executor() {
    use qatc::cli::generate::decoder::run;
    use qatc::frontend::gpt2::cache_names;
    use qatc::model::Trained;
    use qatc_driver::{CudaSettings, Target};
    use qatc_runtime::cuda::{CudaProgram, HostGpu};
    use qatc_runtime::TrainStep;

    let m = Model::open(&common::fixture("tiny/f32_prefix/model.safetensors")).unwrap();
    let spec = qatc_ir::QuantSpec { bits: 4, group: 32, scheme: QuantScheme::Sym };
    let mo = qatc::step::ModelOptions { quant: Some(qatc_passes::quant::QuantOptions::all_linears(spec)), ..Default::default() };
    let (capacity, prompt, fed) = (9, [5u32, 17, 42], [3u32, 88, 61, 0, 96]);
    let pass = |tokens: usize, cuda: bool| -> Box<dyn TrainStep> {
        let (g, _) = qatc::step::cached(&m.cfg, tokens, capacity, &mo, |_, _| {}).unwrap();
        let inputs = m.bind_trained::<f32>(&g, &Trained::Fresh { seed: 0, scale_init: Default::default() }).unwrap();
        let mut exe: Box<dyn TrainStep> = if cuda {
            let target = Target::cuda(None, CudaSettings::default());
            let prog = qatc_driver::lower(&g, &target, &Default::default()).unwrap().program;
            Box::new(CudaProgram::new(prog, HostGpu::new(1 << 30), &target, None).unwrap())
        } else {
            let cpu = qatc_driver::Options { interpreter: !cfg!(feature = "llvm"), ..Default::default() };
            qatc_driver::compile(&g, &Target::cpu(), &cpu).unwrap().step
        };
        for (n, v) in &inputs {
            match exe.set_input(n, v) {
                Err(qatc_runtime::RuntimeError::UnknownInput(_)) => {}
                r => r.unwrap(),
            }
        }
        exe
    };
    let logits = |cuda: bool| -> Vec<Vec<f32>> {
        let mut first = pass(prompt.len(), cuda);
        let c = m.cfg.n_embd;
        let zeros = Value::Float(qatc_runtime::Tensor { shape: vec![capacity, c], data: vec![0.0; capacity * c] });
        let names: Vec<String> = (0..m.cfg.n_layer).flat_map(cache_names).collect();
        names.iter().for_each(|n| first.set_input(n, &zeros).unwrap());
        let mut out = vec![run(first.as_mut(), &prompt, 0, capacity, None).unwrap()];
        let mut one = pass(1, cuda);
        names.iter().for_each(|n| one.set_input(n, &first.read_input(n).unwrap()).unwrap());
        for (i, &t) in fed.iter().enumerate() {
            out.push(run(one.as_mut(), &[t], prompt.len() + i, capacity, None).unwrap());
        }
        out
    };
    let (cpu, gpu) = (logits(false), logits(true));
    for (i, (a, b)) in gpu.iter().zip(&cpu).enumerate() {
        let (a, b): (Vec<f64>, Vec<f64>) = (a.iter().map(|&x| x as f64).collect(), b.iter().map(|&x| x as f64).collect());
        let e = common::rel_err(&a, &b);
        assert!(e < 1e-5, "position {}: the emulated GPU's logits differ from the CPU's by {e:.2e}", prompt.len() - 1 + i);
    }
}

//! Resume states: a finished run's output copied and damaged (progress, tensors, values), then
//! resumed with the options it was started with. A refused resume leaves the run as it was.

use serde_json::Value;

use super::fixtures::{join, split, train_args, Base};
use crate::{s, Case};

/// Every file of the base run, under `r/`.
fn run_files(base: &Base) -> Vec<(String, Vec<u8>)> {
    crate::common::cli::files(&base.run()).into_iter().map(|(rel, bytes)| (format!("r/{rel}"), bytes)).collect()
}

/// An edit of a safetensors file's header and data.
type Edit<'a> = &'a dyn Fn(&mut serde_json::Map<String, Value>, &mut Vec<u8>);

const PROGRESS: &str = "r/checkpoint/resume.json";
const STATE: &str = "r/checkpoint/state.safetensors";

pub fn cases(base: &Base) -> Vec<Case> {
    let mut args = train_args(&s(&base.model()), &s(&base.tokens()), "r");
    args.extend(["--resume".into(), "r".into()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let files = run_files(base);
    let get = |name: &str| files.iter().find(|f| f.0 == name).map(|f| f.1.clone()).unwrap();
    let with = |name: &str, path: &str, bytes: Option<Vec<u8>>, culprit: &[&str]| {
        let mut fs: Vec<(String, Vec<u8>)> = files.iter().filter(|f| f.0 != path).cloned().collect();
        if let Some(b) = bytes {
            fs.push((path.into(), b));
        }
        Case::refused(name, &args, culprit).files(fs)
    };
    let progress = |f: fn(&mut Value)| {
        let mut p: Value = serde_json::from_slice(&get(PROGRESS)).unwrap();
        f(&mut p);
        p.to_string().into_bytes()
    };
    let state = |f: Edit| {
        let (mut h, mut d) = split(&get(STATE));
        f(&mut h, &mut d);
        join(&h, &d)
    };
    let set = |key: &'static str, i: usize, x: f32| {
        state(&move |h: &mut serde_json::Map<String, Value>, d: &mut Vec<u8>| {
            let at = h[key]["data_offsets"][0].as_u64().unwrap() as usize + 4 * i;
            d[at..at + 4].copy_from_slice(&x.to_le_bytes());
        })
    };
    let m = "adam.m:h.0.attn.c_attn.lora_B.weight";
    let w = "h.1.attn.c_attn.lora_A.weight";
    let mut v = vec![
        with("resume/progress-missing", PROGRESS, None, &["r/checkpoint/resume.json"]),
        with("resume/progress-not-json", PROGRESS, Some(b"{step: 2".to_vec()), &["r/checkpoint/resume.json", "not a qatc resume state"]),
        with("resume/progress-not-utf8", PROGRESS, Some(b"{\"step\": \xff}".to_vec()), &["r/checkpoint/resume.json", "invalid UTF-8"]),
        with("resume/progress-empty", PROGRESS, Some(vec![]), &["r/checkpoint/resume.json"]),
        with(
            "resume/step-beyond-steps",
            PROGRESS,
            Some(progress(|p| p["step"] = 7.into())),
            &["r/checkpoint/resume.json", "step 7", "--steps 2"],
        ),
        with(
            "resume/data-changed",
            PROGRESS,
            Some(progress(|p| p["data_tokens"] = 399.into())),
            &["tokens.bin", "holds 400 tokens", "trained on data of 399"],
        ),
        with("resume/data-tokens-string", PROGRESS, Some(progress(|p| p["data_tokens"] = "400".into())), &["r/checkpoint/resume.json"]),
        with("resume/step-negative", PROGRESS, Some(progress(|p| p["step"] = (-1).into())), &["r/checkpoint/resume.json"]),
        with("resume/step-string", PROGRESS, Some(progress(|p| p["step"] = "1".into())), &["r/checkpoint/resume.json"]),
        with(
            "resume/step-disagrees-with-state",
            PROGRESS,
            Some(progress(|p| p["step"] = 1.into())),
            &["state.safetensors", "step count is 2"],
        ),
        with("resume/state-missing", STATE, None, &["r/checkpoint/state.safetensors"]),
        with("resume/state-not-safetensors", STATE, Some(b"state".to_vec()), &["r/checkpoint/state.safetensors"]),
        with("resume/state-nan-moment", STATE, Some(set(m, 3, f32::NAN)), &["r/checkpoint/state.safetensors", m, "index 3"]),
        with("resume/state-inf-weight", STATE, Some(set(w, 0, f32::INFINITY)), &["r/checkpoint/state.safetensors", w, "index 0"]),
        with("resume/state-nan-step", STATE, Some(set("step", 0, f32::NAN)), &["r/checkpoint/state.safetensors", "\"step\""]),
        with(
            "resume/state-tensor-missing",
            STATE,
            Some(state(&|h: &mut serde_json::Map<String, Value>, _: &mut Vec<u8>| {
                let e = h.remove(m).unwrap();
                h.insert("unused".into(), e);
            })),
            &["r/checkpoint/state.safetensors", m],
        ),
        with(
            "resume/state-wrong-shape",
            STATE,
            Some(state(&|h: &mut serde_json::Map<String, Value>, _: &mut Vec<u8>| {
                let n = h[w]["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).product::<u64>();
                h.get_mut(w).unwrap()["shape"] = serde_json::json!([n]);
            })),
            &["r/checkpoint/state.safetensors", w],
        ),
    ];
    // other options than the run was started with
    let mut other = args.clone();
    let lr = other.iter().position(|a| *a == "--steps").unwrap();
    other[lr + 1] = "3";
    v.push(Case::refused("resume/other-options", &other, &["--resume r", "train.steps 2", "--steps"]).files(files.clone()));
    v.push(Case::refused("resume/not-a-run", &args, &["r/qatc.json", "No such file"]).dir("r"));
    // control: resuming the finished run changes nothing and succeeds
    v.push(Case::accepted("resume/control-finished", &args, &["r/checkpoint/state.safetensors"]).files(files.clone()));
    v
}

use super::*;

fn sample() -> RunConfig {
    RunConfig {
        version: VERSION,
        model: ModelConfig {
            path: "/m/model.safetensors".into(),
            quant: Some(QuantConfig {
                bits: 3,
                group: 32,
                scheme: QuantScheme::Sym,
                targets: vec!["c_attn".into()],
                modules: BTreeMap::from([("h.0.mlp.c_fc".into(), Some(QuantSpec { bits: 4, group: 32, scheme: QuantScheme::Nf4 }))]),
                act_bits: None,
                qat: Qat::Base,
                scales: Scales::Minmax,
            }),
            lora: Some(LoraConfig { r: 4, alpha: 8.0, dropout: 0.0, targets: vec!["c_attn".into()], rslora: false }),
            full_finetune: false,
        },
        step: None,
        train: None,
    }
}

#[test]
fn round_trips_and_names_the_first_difference() {
    let c = sample();
    let back = RunConfig::from_json(&c.to_json(), Path::new("x")).unwrap();
    assert_eq!(back, c);
    let mut d = c.clone();
    if let Some(q) = d.model.quant.as_mut() {
        q.modules.insert("h.0.mlp.c_fc".into(), Some(QuantSpec { bits: 3, group: 32, scheme: QuantScheme::Nf4 }));
    }
    let (field, a, b) = first_difference(&c, &d).unwrap();
    assert_eq!((field.as_str(), a.as_str(), b.as_str()), ("model.quant.modules.h.0.mlp.c_fc.bits", "4", "3"));
    assert!(first_difference(&c, &c).is_none());
}

#[test]
fn unknown_versions_and_fields_are_refused() {
    let text = sample().to_json();
    let e = RunConfig::from_json(&text.replace("\"version\": 1", "\"version\": 7"), Path::new("d/qatc.json")).unwrap_err();
    assert!(e.to_string().contains("version 7 is not one this qatc reads"), "{e}");
    let e = RunConfig::from_json(&text.replace("\"full_finetune\"", "\"bogus\": 1, \"full_finetune\""), Path::new("q")).unwrap_err();
    assert!(e.to_string().contains("unknown field `bogus`"), "{e}");
}

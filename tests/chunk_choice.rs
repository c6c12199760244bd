//! The chunked cross-entropy's rows per chunk, chosen by the planner (`qatc_driver::chunk`):
//! the largest power-of-two multiple of the fusion rule's floor whose executed plan peaks no
//! higher than the floor's (0.1% allowed: the per-row statistics). On the demo step and GPT-2
//! 124M configurations: the chosen size is the program's, the plan's peak is at most the floor's,
//! the next size up raises it (unless every row is already in one chunk), and the plan's text and
//! JSON say it. A frozen head on the CPU walks the vocabulary in tiles (one scratch tile whatever
//! the rows), so there every row goes in one chunk, or as many as keep the peak. Sizes the
//! floor's plan bounds above the floor's peak are ruled out without being planned: the bound is
//! held below every size's planned peak, and the choice to the one planning every size gives.
//! Where the tiles make every row in one chunk the first size planned, and its peak is what the
//! step holds outside the cross-entropy (the same read off every size's plan), it is the answer
//! without the floor's plan.

mod common;

use qatc::cli::options::{model_options, QuantArgs};
use qatc::frontend::config::Gpt2Config;
use qatc::memory::Executed;
use qatc::model::Model;
use qatc::step::{self, StepOptions};
use qatc_driver::{Options, Target};
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::LoraOptions;
use qatc_passes::remat::Checkpoint;

fn options(b: usize, t: usize, lora: Option<(&str, usize)>) -> StepOptions {
    let mut o = StepOptions::new(b, t);
    o.model = match lora {
        Some((scheme, group)) => {
            let q = QuantArgs { bits: Some(4), group: Some(group), scheme: qatc_ir::QuantScheme::from_name(scheme), ..Default::default() };
            model_options(&q, Some(LoraOptions::new(16)), false, true).unwrap()
        }
        None => model_options(&QuantArgs::default(), None, true, true).unwrap(),
    };
    o.fuse = Some(FuseOptions::default());
    o
}

/// The plan of `o` on the CPU, its choice checked against the rule; returns the rows chosen.
fn check(what: &str, cfg: &Gpt2Config, o: &StepOptions) -> (usize, Executed) {
    let (g, _) = step::train(cfg, o, |_, _| {}).unwrap();
    let e = qatc_driver::plan(&g, &Target::cpu(), &Options::default()).unwrap();
    let k = e.chunk.clone().unwrap_or_else(|| panic!("{what}: no chunk choice"));
    let ce = &e.program.cross_entropy;
    assert_eq!(ce.len(), 1, "{what}: one chunked cross-entropy");
    assert_eq!(ce[0].chunk_rows, k.rows, "{what}: the program runs the chosen size");
    assert_eq!(k.total_rows, o.batch * o.seq, "{what}");
    // every size planned for real, the floor first
    let every = qatc_driver::chunk::every_size(&g, &Target::cpu(), &Options::default()).unwrap();
    let floor_peak = every[0].peak;
    assert_eq!(every[0].rows, k.floor, "{what}: the floor");
    let kept = floor_peak + floor_peak / 1000;
    // the floor planned first, or where the vocabulary is walked in tiles, every row in one chunk
    // (then alone, where what the step holds outside the cross-entropy shows no size is lower)
    let online = ce[0].tile_cols != ce[0].vocab && k.floor < k.total_rows;
    let first = if online { k.total_rows } else { k.floor };
    assert!(k.tried.iter().any(|t| t.0 == first), "{what}: {first} rows planned first: {k:?}");
    if !k.tried.iter().any(|t| t.0 == k.floor) {
        assert_eq!((k.rows, k.tried.len()), (k.total_rows, 1), "{what}: the floor not planned: {k:?}");
        assert!(k.why.contains("no size keeps a lower one"), "{what}: {}", k.why);
    }
    assert!(e.plan.peak_bytes() <= kept, "{what}: the chosen size keeps the floor's peak ({} > {floor_peak})", e.plan.peak_bytes());
    for &(r, p) in &k.tried {
        if r <= k.rows {
            assert!(p <= kept, "{what}: {r} rows peak at {p} > {floor_peak}");
        }
    }
    if k.rows < k.total_rows {
        // the next size up, planned or ruled out by a bound of its peak
        let next = k
            .tried
            .iter()
            .chain(&k.ruled_out)
            .filter(|t| t.0 > k.rows)
            .min()
            .unwrap_or_else(|| panic!("{what}: the next size was neither tried nor ruled out"));
        assert!(next.1 > kept, "{what}: {} rows would not raise the peak, yet {} were chosen", next.0, k.rows);
    }
    // against every size planned: the bounds below each one's peak (what is held outside the
    // cross-entropy the same from every size's plan), the same size chosen
    let least = every[0].least.unwrap_or_else(|| panic!("{what}: no least peak"));
    for s in &every {
        assert!(s.bound.is_none_or(|b| b <= s.peak), "{what}: {} rows peak at {}, below the bound {:?}", s.rows, s.peak, s.bound);
        assert!(least <= s.peak, "{what}: {} rows peak at {}, below the least of any size {least}", s.rows, s.peak);
        assert_eq!(s.least, Some(least), "{what}: {} rows' plan holds another least", s.rows);
        // every size's plan bounds every size's peak from below, not only the floor's
        for (from, b) in every.iter().zip(&s.bounds) {
            assert!(
                b.is_none_or(|b| b <= from.peak),
                "{what}: {} rows' plan bounds {} rows' peak {} by {b:?}",
                s.rows,
                from.rows,
                from.peak
            );
        }
        if let Some(&(_, b)) = k.ruled_out.iter().find(|t| t.0 == s.rows) {
            assert!(b <= s.peak && b > kept, "{what}: {} rows ruled out by {b}: its peak is {}", s.rows, s.peak);
        }
    }
    let largest = every.iter().filter(|s| s.peak <= kept).map(|s| s.rows).max();
    assert_eq!(largest, Some(k.rows), "{what}: planning every size chooses another ({every:?})");
    assert!(k.rows >= k.floor && k.rows.is_power_of_two() || k.rows == k.total_rows, "{what}: {k:?}");
    eprintln!("{what}: {}", k.why);
    // planned against a memory it cannot fit in whatever the rows: the size planned first,
    // nothing searched; against one it can: the same choice
    let e_tight = qatc_driver::plan(&g, &Target::cpu(), &Options { fit_within: Some(least - 1), ..Options::default() }).unwrap();
    let t = e_tight.chunk.unwrap();
    assert_eq!((t.rows, t.tried.len()), (first, 1), "{what}: {t:?}");
    assert!(t.why.contains("not searched"), "{what}: {}", t.why);
    let e_loose = qatc_driver::plan(&g, &Target::cpu(), &Options { fit_within: Some(least), ..Options::default() }).unwrap();
    assert_eq!(e_loose.chunk.unwrap().rows, k.rows, "{what}: planned against a memory it may fit in");
    (k.rows, e)
}

#[test]
fn the_planner_chooses_the_rows_per_chunk() {
    let demo = Model::open(&common::root().join("examples/gpt2-shakespeare-small/model.safetensors")).unwrap();
    let gpt2 = Gpt2Config::preset("124M").unwrap();
    // the demo's LoRA step: the frozen head in vocabulary tiles, every row in one chunk
    let (rows, e) = check("demo, Q4_0 g32 + LoRA 16, B 4 T 128", &demo.cfg, &options(4, 128, Some(("q4_0", 32))));
    assert_eq!(rows, 512);
    let ce = &e.program.cross_entropy[0];
    assert_eq!((ce.tile_cols, ce.scratch_bytes()), (4096, 8 << 20), "one 8 MiB tile of 4096 columns");
    // the demo's full fine-tune (a trainable head: whole rows): the cross-entropy is at the
    // peak, so the floor stays
    let (rows, e) = check("demo, full fine-tune, B 4 T 128", &demo.cfg, &options(4, 128, None));
    assert_eq!(rows, 128);
    let json = qatc::memory::json::to_json(&e, serde_json::json!({})).unwrap();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let chosen = &v["summary"]["cross_entropy"][0]["chosen"];
    assert_eq!(chosen["floor"], 128);
    assert!(chosen["why"].as_str().unwrap().contains("the floor"), "{chosen}");
    assert_eq!(chosen["tried"][0]["peak_bytes"], v["summary"]["peak_bytes"], "the floor chosen: its peak");
    let table = qatc::cli::plan::table(&e, "demo", None);
    assert!(table.contains("chunk size: 128 rows per chunk"), "{table}");
    // 124M, B 1 T 256, full fine-tune: the peak is elsewhere, every row in one chunk is free
    let (rows, _) = check("124M full fine-tune, B 1 T 256", &gpt2, &options(1, 256, None));
    assert_eq!(rows, 256);
    // 124M, B 8 T 1024, 4-bit + LoRA, blocks: every row in one chunk, 1024-column tiles
    let mut o = options(8, 1024, Some(("sym", 64)));
    o.checkpoint = Checkpoint::Blocks;
    let (rows, _) = check("124M 4-bit g64 + LoRA 16, B 8 T 1024, blocks", &gpt2, &o);
    assert_eq!(rows, 8192);
    // the same without recompute: the cross-entropy is at the peak, and past 2048 rows the
    // tile (at least 1024 columns) grows past 8 MiB and raises it
    let (rows, _) = check("124M 4-bit g64 + LoRA 16, B 8 T 1024", &gpt2, &options(8, 1024, Some(("sym", 64))));
    assert_eq!(rows, 2048);
}

#[test]
fn sixteen_bit_logits_rule_sizes_out_without_planning_them() {
    use qatc_passes::precision::Precision;
    let demo = Model::open(&common::root().join("examples/gpt2-shakespeare-small/model.safetensors")).unwrap();
    let gpt2 = Gpt2Config::preset("124M").unwrap();
    // 16-bit logits hold whole rows of the vocabulary: the scratch grows with the rows
    for precision in [Precision::Bf16, Precision::Fp16] {
        let mut o = options(4, 128, Some(("q4_0", 32)));
        o.precision = precision;
        check(&format!("demo, Q4_0 g32 + LoRA 16, B 4 T 128, {}", precision.name()), &demo.cfg, &o);
    }
    // 124M: the floor stays, every larger size ruled out by the floor's plan alone
    let mut o = options(4, 256, Some(("sym", 64)));
    o.precision = Precision::Bf16;
    let (rows, e) = check("124M 4-bit g64 + LoRA 16, B 4 T 256, bf16", &gpt2, &o);
    let k = e.chunk.unwrap();
    assert_eq!((rows, k.tried.len(), k.ruled_out.len()), (128, 1, 3), "{k:?}");
    // GPT-2 124M at T 1024: the bound rules out the sizes past the answer, whose plan is then
    // the one lowering beyond the floor's (B 8), or the answer the second one under a size the
    // bound let through (blocks: the layout packs the scratch into what is free beside it)
    for (b, checkpoint, rows_chosen, planned) in
        [(8, Checkpoint::None, 512, 2), (8, Checkpoint::Blocks, 1024, 3), (16, Checkpoint::Blocks, 2048, 3)]
    {
        let mut o = options(b, 1024, Some(("sym", 64)));
        o.precision = Precision::Bf16;
        o.checkpoint = checkpoint;
        let (rows, e) = check(&format!("124M 4-bit g64 + LoRA 16, B {b} T 1024, bf16, {}", checkpoint.describe()), &gpt2, &o);
        let k = e.chunk.unwrap();
        assert_eq!((rows, k.tried.len()), (rows_chosen, planned), "{k:?}");
        assert!(!k.ruled_out.is_empty(), "{k:?}");
    }
}

/// Given room (`--memory`, less the device's reserve: `Options::room`), the rows per chunk grow
/// past the floor's peak to the largest size whose plan fits the room (fewer, taller GEMMs;
/// bench/RESULTS.md): on the demo step in bf16 (whole 16-bit rows in the scratch, so each size
/// peaks higher), a room of exactly some size's peak chooses that size, one byte less the size
/// under it, a room below every raised peak keeps the rule without room, and a room for
/// everything puts every row in one chunk; the plan's peak is within the room, and its reason
/// says --memory.
#[test]
fn room_given_grows_the_rows_within_it() {
    use qatc_passes::precision::Precision;
    let demo = Model::open(&common::root().join("examples/gpt2-shakespeare-small/model.safetensors")).unwrap();
    let mut o = options(4, 128, Some(("q4_0", 32)));
    o.precision = Precision::Bf16;
    let (g, _) = step::train(&demo.cfg, &o, |_, _| {}).unwrap();
    let every = qatc_driver::chunk::every_size(&g, &Target::cpu(), &Options::default()).unwrap();
    let (floor, base) = (every[0].rows, every[0].peak);
    let kept = base + base / 1000;
    let without = qatc_driver::plan(&g, &Target::cpu(), &Options::default()).unwrap().chunk.unwrap().rows;
    // the sizes that raise the peak, their peaks rising with the rows
    let raised: Vec<_> = every.iter().filter(|s| s.peak > kept).collect();
    assert!(raised.len() >= 2, "sizes above the floor's peak: {every:?}");
    assert!(raised.windows(2).all(|w| w[0].peak <= w[1].peak), "{every:?}");
    let chosen = |room: usize| {
        let e = qatc_driver::plan(&g, &Target::cpu(), &Options { room: Some(room), ..Options::default() }).unwrap();
        let k = e.chunk.unwrap();
        assert_eq!(e.program.cross_entropy[0].chunk_rows, k.rows, "the program runs the chosen size");
        assert!(e.plan.peak_bytes() <= room.max(kept), "{} rows peak at {} past the room {room}", k.rows, e.plan.peak_bytes());
        if k.rows != without {
            assert!(k.why.contains("--memory"), "{}", k.why);
        }
        k.rows
    };
    for (i, s) in raised.iter().enumerate() {
        assert_eq!(chosen(s.peak), s.rows, "a room of {} rows' peak {}", s.rows, s.peak);
        let under = if i == 0 { without } else { raised[i - 1].rows };
        if raised.get(i.wrapping_sub(1)).is_none_or(|u| u.peak < s.peak) {
            assert_eq!(chosen(s.peak - 1), under, "a byte less than {} rows' peak", s.rows);
        }
    }
    assert_eq!(chosen(raised[0].peak - 1), without, "a room below every raised peak keeps the rule without room");
    assert_eq!(chosen(usize::MAX / 2), every.last().unwrap().rows, "room for everything: every row in one chunk");
    assert!(without >= floor);
}

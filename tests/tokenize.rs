//! Text data is tokenized exactly as Hugging Face's GPT-2 tokenizer does (fixture from
//! tests/fixtures/gen_tokenizer_fixture.py: 20k characters of the Shakespeare validation text plus
//! unusual characters), and the llm.c token files of the Shakespeare split were made with it.

mod common;

#[test]
fn same_ids_as_transformers_gpt2_tokenizer() {
    let text = std::fs::read_to_string(common::fixture("tokenizer/sample.txt")).unwrap();
    let want: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(common::fixture("tokenizer/sample_ids.json")).unwrap()).unwrap();
    let want: Vec<u16> = want["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u16).collect();
    let ours = qatc::tokenize::encode(&text).unwrap();
    assert_eq!(ours.len(), want.len());
    if let Some(i) = ours.iter().zip(&want).position(|(a, b)| a != b) {
        panic!("first difference at token {i}: {} vs {}", ours[i], want[i]);
    }
    assert_eq!(qatc::tokenize::decode(&ours).unwrap(), text);
}

#[test]
fn text_files_load_as_tokens_and_match_the_llm_c_file() {
    // the validation .bin starts with the same ids as tokenizing the text's opening
    let bin = qatc::data::TokenFile::open(&common::root().join("examples/shakespeare_val.bin")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("head.txt");
    let text = std::fs::read_to_string(common::fixture("tokenizer/sample.txt")).unwrap();
    std::fs::write(&p, &text[..5000]).unwrap();
    let t = qatc::data::TokenFile::load(&p).unwrap();
    let n = t.len() - 2; // the cut may split the last word
    assert_eq!(&t.tokens()[..n], &bin.tokens()[..n]);
    // and a binary that is neither format is one clear error
    std::fs::write(&p, [0xffu8, 0xfe, 0x00, 0x01]).unwrap();
    let e = qatc::data::TokenFile::load(&p).unwrap_err().to_string();
    assert!(e.contains("neither an llm.c token file (shorter than its 1024-byte header) nor UTF-8 text (invalid UTF-8 at byte 0)"), "{e}");
}

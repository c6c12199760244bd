//! Any text as IR: `parse` must not panic, and whatever it accepts must print, parse back and
//! print identically; the verifier must not panic on it.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let Ok(g) = qatc_ir::parse(&text) else { return };
    let printed = qatc_ir::print(&g);
    let again = match qatc_ir::parse(&printed) {
        Ok(g2) => g2,
        Err(e) => panic!("printed graph does not parse: {e}\n{printed}"),
    };
    assert_eq!(qatc_ir::print(&again), printed, "print(parse(print(g))) != print(g)");
    let _ = qatc_ir::verify(&g);
});

//! `qatc_tables.cuh`, the helper header written from the IR's constants: NF4's code values
//! (`qatc_ir::NF4`) and the 8-bit dynamic maps (`qatc_ir::DynMap`). Device code cannot read a Rust
//! constant, and a copy spelled out by hand in a header is a second home of the same table; this
//! one is generated from the values every other backend reads, so it cannot differ from them.

use std::sync::OnceLock;

use qatc_ir::{DynMap, NF4};

use super::syntax::float_lit;
use super::writer::Writer;
use crate::kir::Ty;

/// The header's file name (`qatc_quant.cuh` includes it).
pub const TABLES_HEADER: &str = "qatc_tables.cuh";

/// The name of NF4's table in the header.
pub const NF4_TABLE: &str = "NF4";

/// Values per line of a table.
const PER_LINE: usize = 8;

/// The name of a dynamic map's table in the header.
pub fn dyn_table(m: DynMap) -> &'static str {
    match m {
        DynMap::Signed => "DYN_SIGNED",
        DynMap::Unsigned => "DYN_UNSIGNED",
    }
}

/// The tables the header defines, in order: (name, values).
pub fn tables() -> Vec<(&'static str, &'static [f32])> {
    let mut t: Vec<(&'static str, &'static [f32])> = vec![(NF4_TABLE, &NF4)];
    t.extend(DynMap::ALL.map(|m| (dyn_table(m), &m.values()[..])));
    t
}

/// The header's text, written once: each table as `__constant__` floats, every value the
/// shortest literal that reads back as its f32 (`float_lit`).
pub fn tables_header() -> &'static str {
    static TEXT: OnceLock<String> = OnceLock::new();
    TEXT.get_or_init(|| {
        let mut w = Writer::new();
        w.line(format!("// {TABLES_HEADER}: written by qatc's code generator (kernels/src/cuda/tables.rs) from the IR's"));
        w.line("// constants, qatc_ir::NF4 and the 8-bit dynamic maps of qatc_ir::qmap; not a file to edit.");
        w.line("#pragma once");
        w.blank();
        w.line("namespace qatc {");
        for (name, values) in tables() {
            w.blank();
            w.line(format!("__device__ __constant__ float {name}[{}] = {{", values.len()));
            w.indent();
            for row in values.chunks(PER_LINE) {
                let lits: Vec<String> = row.iter().map(|&v| float_lit(f64::from(v), Ty::F32)).collect();
                w.line(format!("{},", lits.join(", ")));
            }
            w.dedent();
            w.line("};");
        }
        w.blank();
        w.line("}  // namespace qatc");
        w.finish()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The values of table `name` as the header spells them, read back as f32.
    fn parsed(text: &str, name: &str) -> Vec<f32> {
        let head = format!("float {name}[");
        let start = text.find(&head).unwrap_or_else(|| panic!("the {name} table"));
        let body = &text[start..];
        let body = &body[body.find('{').expect("the table's start") + 1..body.find("};").expect("the table's end")];
        body.split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(|t| {
                t.strip_suffix('f')
                    .unwrap_or_else(|| panic!("{t}: not an f32 literal"))
                    .parse::<f32>()
                    .unwrap_or_else(|e| panic!("{t}: {e}"))
            })
            .collect()
    }

    /// The generated header's tables are the IR's constants, bit for bit (a value that did not
    /// read back as itself, or a table cut short, would fail here before any device saw it).
    #[test]
    fn the_generated_tables_are_the_irs_constants_bit_for_bit() {
        let text = tables_header();
        let want: Vec<(&str, Vec<f32>)> =
            std::iter::once((NF4_TABLE, NF4.to_vec())).chain(DynMap::ALL.map(|m| (dyn_table(m), m.values().to_vec()))).collect();
        for (name, values) in want {
            let got = parsed(text, name);
            assert_eq!(got.len(), values.len(), "{name}");
            for (i, (g, w)) in got.iter().zip(&values).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{name}[{i}]: {g} vs {w}");
            }
        }
        assert!(text.contains(&format!("float {NF4_TABLE}[16] = {{")) && text.contains("float DYN_SIGNED[256] = {"));
    }

    /// The headers written by hand hold no table: `qatc_quant.cuh` includes the generated one.
    #[test]
    fn no_hand_written_header_spells_a_table() {
        let headers = crate::cuda::headers();
        let quant = headers.iter().find(|(n, _)| *n == "qatc_quant.cuh").map(|h| h.1).expect("the quant header");
        assert!(quant.contains(&format!("#include \"{TABLES_HEADER}\"")));
        for (name, text) in headers.iter().filter(|(n, _)| *n != TABLES_HEADER) {
            for (table, _) in tables() {
                assert!(!text.contains(&format!("float {table}[")), "{name} defines {table} by hand");
            }
        }
        assert!(headers.iter().any(|(n, t)| *n == TABLES_HEADER && *t == tables_header()));
    }
}

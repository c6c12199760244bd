//! The CUDA C backend: kernel IR -> readable CUDA C for NVRTC, with shared helpers in
//! `include/*.cuh`.

pub mod attention;
pub mod blas;
pub mod codegen;
pub mod emit;
mod launch;
mod loop_nest;
pub mod writer;

pub use codegen::{Variant, Variants};
pub use emit::{emit, emit_with, CudaKernel, LaunchDims, HEADERS};

#[cfg(test)]
mod tests {
    fn table(name: &str) -> Vec<f32> {
        let (_, text) = super::HEADERS.iter().find(|(n, _)| *n == "qatc_quant.cuh").expect("the quant header");
        let start = text.find(name).unwrap_or_else(|| panic!("the {name} table")) + name.len();
        let body = &text[start..start + text[start..].find("};").expect("the table's end")];
        body.split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(|t| t.trim_end_matches('f').parse::<f32>().unwrap_or_else(|e| panic!("{t}: {e}")))
            .collect()
    }

    /// The 8-bit dynamic maps in `qatc_quant.cuh` are `qatc_ir::qmap`'s, bit for bit.
    #[test]
    fn the_headers_dynamic_maps_are_the_irs() {
        for m in qatc_ir::DynMap::ALL {
            let got = table(&format!("{}[256] = {{", super::emit::dyn_table(m)));
            let want = m.values();
            assert_eq!(got.len(), 256);
            for (g, w) in got.iter().zip(want) {
                assert_eq!(g.to_bits(), w.to_bits(), "{m:?}: {g} vs {w}");
            }
        }
    }

    /// `qatc_quant.cuh` spells the NF4 table as literals (device code cannot read a Rust
    /// constant); they must be `qatc_ir::NF4`'s values exactly, the table every backend reads.
    #[test]
    fn the_headers_nf4_table_is_the_irs() {
        let (_, text) = super::HEADERS.iter().find(|(n, _)| *n == "qatc_quant.cuh").expect("the quant header");
        let start = text.find("NF4[16] = {").expect("the NF4 table") + "NF4[16] = {".len();
        let body = &text[start..start + text[start..].find("};").expect("the table's end")];
        let got: Vec<f32> = body
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(|t| t.trim_end_matches('f').parse::<f32>().unwrap_or_else(|e| panic!("{t}: {e}")))
            .collect();
        let want = qatc_ir::NF4;
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert_eq!(g.to_bits(), w.to_bits(), "{g} vs {w}");
        }
    }
}

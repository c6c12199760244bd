//! The CUDA C backend: kernel IR -> readable CUDA C for NVRTC, with shared helpers in
//! `include/*.cuh`.

pub mod attention;
pub mod blas;
pub mod emit;
pub mod writer;

pub use emit::{emit, CudaKernel, LaunchDims, HEADERS};

#[cfg(test)]
mod tests {
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

//! The hash kernels are named and cached by (`Kernel::identity`).

/// FNV-1a, 64 bit: stable across runs, platforms and Rust versions (std's hashers are not).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h = Fnv1a64::default();
    h.bytes(bytes);
    h.0
}

/// [`fnv1a64`] fed as it goes: bytes, or text as `write!` produces it (no String of it made).
pub struct Fnv1a64(pub u64);

impl Default for Fnv1a64 {
    fn default() -> Self {
        Fnv1a64(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a64 {
    pub fn bytes(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

impl std::fmt::Write for Fnv1a64 {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.bytes(s.as_bytes());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kir::{Body, Expr, Ix, Kernel, Param, Space, Stmt, Ty};
    use qatc_ir::DType;

    /// A kernel's identity (hence its name and its cache key) is the FNV-1a hash of its Debug
    /// text, whether or not that text is made as a String first.
    #[test]
    fn identity_is_the_hash_of_the_debug_text() {
        let k = Kernel {
            family: "add".into(),
            params: vec![Param { name: "y".into(), dtype: DType::F32, shape: vec![4], write: true }],
            index_ty: Ty::I32,
            body: Body::Loops {
                space: Space::Elements { shape: vec![4] },
                stmts: vec![Stmt::Store { param: 0, index: Expr::Ix(Ix::Elem), value: Expr::f32(1.5) }],
            },
            note: "y = 1.5".into(),
            names: Default::default(),
        };
        let text = format!("{:?}", (&k.family, &k.params, &k.index_ty, &k.body));
        assert_eq!(k.identity(), fnv1a64(text.as_bytes()));
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}

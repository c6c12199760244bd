//! Element types, shapes and tensor types. Shapes are static: every dimension is known when the
//! graph is built, which is what lets the memory planner and code generators work ahead of time.

use std::fmt;

/// The element types qatc's graphs carry. `I4` is packed 4-bit: two codes per byte, so a tensor of
/// `n` logical elements occupies `ceil(n / 2)` bytes (the frozen-weight storage of quantized models).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F32,
    F16,
    BF16,
    I32,
    U8,
    I4,
}

impl DType {
    pub const ALL: [DType; 6] = [DType::F32, DType::F16, DType::BF16, DType::I32, DType::U8, DType::I4];

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// Bytes taken by `n` elements of this type (packed 4-bit rounds up to whole bytes).
    pub fn bytes_for(self, n: usize) -> usize {
        match self {
            DType::F32 | DType::I32 => n * 4,
            DType::F16 | DType::BF16 => n * 2,
            DType::U8 => n,
            DType::I4 => n.div_ceil(2),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::U8 => "u8",
            DType::I4 => "i4",
        }
    }

    pub fn from_name(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == s)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A static shape. Rank 0 is a scalar.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Shape(pub Vec<usize>);

impl Shape {
    pub fn new(dims: impl Into<Vec<usize>>) -> Shape {
        Shape(dims.into())
    }
    pub fn scalar() -> Shape {
        Shape(Vec::new())
    }
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    pub fn dims(&self) -> &[usize] {
        &self.0
    }
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }
    /// The last dimension (1 for scalars): the row length of row-wise ops.
    pub fn last(&self) -> usize {
        self.0.last().copied().unwrap_or(1)
    }
    /// Row-major strides in elements.
    pub fn strides(&self) -> Vec<usize> {
        let mut s = vec![1; self.0.len()];
        for i in (0..self.0.len().saturating_sub(1)).rev() {
            s[i] = s[i + 1] * self.0[i + 1];
        }
        s
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Shape {
        Shape(v)
    }
}

impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Shape {
        Shape(v.to_vec())
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Shape {
        Shape(v.to_vec())
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// The type of a node's value: element type and static shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Shape,
}

impl TensorType {
    pub fn new(dtype: DType, shape: impl Into<Shape>) -> TensorType {
        TensorType { dtype, shape: shape.into() }
    }
    pub fn f32(shape: impl Into<Shape>) -> TensorType {
        TensorType::new(DType::F32, shape)
    }
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }
    pub fn bytes(&self) -> usize {
        self.dtype.bytes_for(self.numel())
    }
    /// The bytes of a value of this type, if they fit in [`MAX_VALUE_BYTES`]: a shape whose
    /// element count or byte size overflows is no tensor any machine can hold.
    pub fn checked_bytes(&self) -> Option<usize> {
        let n = self.shape.0.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
        let b = match self.dtype {
            DType::I4 => n.div_ceil(2),
            d => n.checked_mul(d.bytes_for(1))?,
        };
        (b <= MAX_VALUE_BYTES).then_some(b)
    }
}

/// The most bytes one value may have: 2^60 (an exabyte), far above any device, and low enough
/// that a step's sums of value sizes cannot overflow a 64-bit size.
pub const MAX_VALUE_BYTES: usize = 1 << 60;

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}

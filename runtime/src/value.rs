//! Run-time values: row-major tensors of the compute float `T`, or of i32 for integer dtypes.

use crate::error::RuntimeError;
use crate::float::Float;

/// A row-major float tensor. Whatever the graph's float dtype (f32/f16/bf16), elements are held in
/// `T`; f16/bf16 values are already rounded to their dtype.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor<T> {
    pub shape: Vec<usize>,
    pub data: Vec<T>,
}

/// A row-major integer tensor for dtype i32, and for u8/i4 codes (one code per element for now).
#[derive(Clone, Debug, PartialEq)]
pub struct IntTensor {
    pub shape: Vec<usize>,
    pub data: Vec<i32>,
}

fn check_len(shape: &[usize], got: usize) -> Result<(), RuntimeError> {
    let want = shape.iter().product::<usize>();
    if want == got {
        Ok(())
    } else {
        Err(RuntimeError::BadTensor { shape: shape.to_vec(), want, got })
    }
}

impl<T: Float> Tensor<T> {
    /// A tensor from its data; fails when `data` does not have `shape`'s element count.
    pub fn new(shape: impl Into<Vec<usize>>, data: Vec<T>) -> Result<Self, RuntimeError> {
        let shape = shape.into();
        check_len(&shape, data.len())?;
        Ok(Tensor { shape, data })
    }
    pub fn full(shape: impl Into<Vec<usize>>, v: T) -> Self {
        let shape = shape.into();
        let n = shape.iter().product();
        Tensor { shape, data: vec![v; n] }
    }
    pub fn zeros(shape: impl Into<Vec<usize>>) -> Self {
        Self::full(shape, T::ZERO)
    }
    /// Converts from f64 values (the usual way tests and loaders build inputs).
    pub fn from_f64(shape: impl Into<Vec<usize>>, data: &[f64]) -> Result<Self, RuntimeError> {
        Self::new(shape, data.iter().map(|&v| T::from_f64(v)).collect())
    }
    pub fn numel(&self) -> usize {
        self.data.len()
    }
    pub fn to_f64_vec(&self) -> Vec<f64> {
        self.data.iter().map(|v| v.to_f64()).collect()
    }
}

impl IntTensor {
    pub fn new(shape: impl Into<Vec<usize>>, data: Vec<i32>) -> Result<Self, RuntimeError> {
        let shape = shape.into();
        check_len(&shape, data.len())?;
        Ok(IntTensor { shape, data })
    }
    pub fn full(shape: impl Into<Vec<usize>>, v: i32) -> Self {
        let shape = shape.into();
        let n = shape.iter().product();
        IntTensor { shape, data: vec![v; n] }
    }
    pub fn numel(&self) -> usize {
        self.data.len()
    }
}

/// A node's value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value<T> {
    Float(Tensor<T>),
    Int(IntTensor),
}

impl<T: Float> Value<T> {
    /// A float scalar (shape `[]`): learning rates, step counts, dloss.
    pub fn scalar(v: f64) -> Self {
        Value::Float(Tensor { shape: Vec::new(), data: vec![T::from_f64(v)] })
    }
    /// A float tensor from f64 data.
    pub fn floats(shape: impl Into<Vec<usize>>, data: &[f64]) -> Result<Self, RuntimeError> {
        Ok(Value::Float(Tensor::from_f64(shape, data)?))
    }
    /// An integer tensor (token ids, targets).
    pub fn ints(shape: impl Into<Vec<usize>>, data: Vec<i32>) -> Result<Self, RuntimeError> {
        Ok(Value::Int(IntTensor::new(shape, data)?))
    }
    pub fn as_float(&self) -> Option<&Tensor<T>> {
        match self {
            Value::Float(t) => Some(t),
            Value::Int(_) => None,
        }
    }
    pub fn as_int(&self) -> Option<&IntTensor> {
        match self {
            Value::Int(t) => Some(t),
            Value::Float(_) => None,
        }
    }
    pub fn into_float(self) -> Option<Tensor<T>> {
        match self {
            Value::Float(t) => Some(t),
            Value::Int(_) => None,
        }
    }
    pub fn into_int(self) -> Option<IntTensor> {
        match self {
            Value::Int(t) => Some(t),
            Value::Float(_) => None,
        }
    }
    pub fn shape(&self) -> &[usize] {
        match self {
            Value::Float(t) => &t.shape,
            Value::Int(t) => &t.shape,
        }
    }
    /// Element count of the data actually held (may disagree with `shape` for hand-built values).
    pub fn len(&self) -> usize {
        match self {
            Value::Float(t) => t.data.len(),
            Value::Int(t) => t.data.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The single element of a scalar (or any one-element tensor), as f64.
    pub fn item(&self) -> Option<f64> {
        match self {
            Value::Float(t) if t.data.len() == 1 => Some(t.data[0].to_f64()),
            Value::Int(t) if t.data.len() == 1 => Some(f64::from(t.data[0])),
            _ => None,
        }
    }
    /// "f32 tensor" / "int tensor", for messages.
    pub(crate) fn kind_name(&self) -> &'static str {
        match self {
            Value::Float(_) => "float",
            Value::Int(_) => "int",
        }
    }
}

impl<T> From<Tensor<T>> for Value<T> {
    fn from(t: Tensor<T>) -> Self {
        Value::Float(t)
    }
}

impl<T> From<IntTensor> for Value<T> {
    fn from(t: IntTensor) -> Self {
        Value::Int(t)
    }
}

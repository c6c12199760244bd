//! The mixed-precision ops of dynamic loss scaling (`qatc_passes::precision`), with PyTorch
//! GradScaler's semantics: the finiteness test of the gradients, the switch that keeps the old
//! state when a step is skipped, and the scale's update (`torch._amp_update_scale_`).

use crate::float::Float;

/// 1 when every element is finite (neither NaN nor infinite), else 0.
pub fn all_finite<T: Float>(x: &[T]) -> T {
    if x.iter().all(|v| v.to_f64().is_finite()) {
        T::ONE
    } else {
        T::ZERO
    }
}

/// a where cond != 0 (NaN counts as nonzero), else b.
pub fn select<T: Float>(cond: &[T], a: &[T], b: &[T]) -> Result<Vec<T>, String> {
    if cond.len() != a.len() || a.len() != b.len() {
        return Err(format!("select of {} conditions over {} and {} elements", cond.len(), a.len(), b.len()));
    }
    Ok(cond.iter().zip(a.iter().zip(b)).map(|(&c, (&x, &y))| if c != T::ZERO { x } else { y }).collect())
}

/// The next [scale, good steps] from the current one and the step's finiteness flag. Computed in
/// f32 as PyTorch's kernel does (the scale is an f32 tensor there).
pub fn loss_scale<T: Float>(state: &[T], finite: f64, interval: usize, growth: f64, backoff: f64) -> Result<[f32; 2], String> {
    let [scale, good] = state else { return Err(format!("loss_scale state has {} elements, not 2", state.len())) };
    let (scale, good) = (scale.to_f64() as f32, good.to_f64() as f32);
    if finite == 0.0 {
        return Ok([scale * backoff as f32, 0.0]);
    }
    let next = good + 1.0;
    // `successful == growth_interval`, as PyTorch compares
    if next == interval as f32 {
        let grown = scale * growth as f32;
        Ok([if grown.is_finite() { grown } else { scale }, 0.0])
    } else {
        Ok([scale, next])
    }
}

//! `unrope_keys`: RoPE taken off keys before they are sealed (the core's `attention::unrope`).

use crate::attention::{array, Floats};
use crate::errors::{invalid_input, run};
use kakeyaturbo::attention::{unrope_bf16, unrope_f32, UnropeShape};
use numpy::{PyArray1, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;

/// Keys `x` `[B, H, T, D]` (float32, or bfloat16 as its bits: `uint16`) with RoPE taken off
/// their first `rows` rows (all by default): `y = x * c' - rot(x) * s'`, `c' = cos / (cos^2 +
/// sin^2)` and `s'` alike in float64, the rows in float32; `cos`/`sin` float32 `[1 or B, rows,
/// rot]` as a rotary module gives them (one entry per channel; channels past `rot` pass
/// through); `style` `"half"` or `"interleaved"`. Returns float32 `[B, H, rows, D]`.
#[pyfunction]
#[pyo3(signature = (x, cos, sin, style, rows=None))]
pub fn unrope_keys<'py>(
    py: Python<'py>,
    x: Floats<'py>,
    cos: PyReadonlyArrayDyn<'py, f32>,
    sin: PyReadonlyArrayDyn<'py, f32>,
    style: &str,
    rows: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
    let style = crate::params::rope_style(py, style)?;
    let rows: Option<usize> = match rows {
        Some(r) if !r.is_none() => {
            Some(crate::convert::int_in(py, r, "rows", 0, u32::MAX as i128)?)
        }
        _ => None,
    };
    let (c, cshape) = array(py, &cos, "cos", 3)?;
    let (s, sshape) = array(py, &sin, "sin", 3)?;
    if cshape != sshape {
        return Err(invalid_input(
            py,
            format!("cos and sin differ in shape: {cshape:?} and {sshape:?}"),
        ));
    }
    let xshape = match &x {
        Floats::F32(a) => a.shape().to_vec(),
        Floats::Bf16(a) => a.shape().to_vec(),
    };
    if xshape.len() != 4 {
        return Err(invalid_input(
            py,
            format!("x must be [B, H, T, D], got shape {xshape:?}"),
        ));
    }
    let n = rows.unwrap_or(xshape[2]);
    if cshape[1] != n {
        return Err(invalid_input(
            py,
            format!("cos and sin must have one row per turned row ({n}), got {cshape:?}"),
        ));
    }
    let sh = UnropeShape {
        batch: xshape[0],
        heads: xshape[1],
        t: xshape[2],
        d: xshape[3],
        rows: n,
        table_batch: cshape[0],
        rot: cshape[2],
    };
    let out = match &x {
        Floats::F32(a) => {
            let xs = array(py, a, "x", 4)?.0;
            run(py, || unrope_f32(xs, sh, c, s, style))?
        }
        Floats::Bf16(a) => {
            let xs = array(py, a, "x", 4)?.0;
            run(py, || unrope_bf16(xs, sh, c, s, style))?
        }
    };
    let shape = [xshape[0], xshape[1], n, xshape[3]];
    PyArray1::from_vec(py, out).reshape(shape.to_vec())
}

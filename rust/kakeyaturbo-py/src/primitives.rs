//! The stage primitives: sign pattern, Hadamard, rotation, packing, Lloyd-Max tables.

use crate::convert::{self, matrix, to_array2};
use crate::errors::{invalid_input, run};
use kakeyaturbo::limits::MAX_SIGN_PATTERN;
use kakeyaturbo::quant::MAX_BITS;
use kakeyaturbo::{pack, quant, rng, wht};
use numpy::{PyArray1, PyArray2, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// A bit width of the packing primitives and tables: 1..=8.
fn width(py: Python<'_>, bits: &Bound<'_, PyAny>) -> PyResult<u8> {
    convert::int_in(py, bits, "bits", 1, MAX_BITS as i128)
}

#[pyfunction]
pub fn wht_sign_pattern<'py>(
    py: Python<'py>,
    seed: &Bound<'py, PyAny>,
    n: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let seed = convert::seed(py, seed, "seed")?;
    let n: usize = convert::int_in(py, n, "n", 0, MAX_SIGN_PATTERN as i128)?;
    let s = run(py, || Ok(rng::sign_pattern(seed, n)))?;
    Ok(PyArray1::from_vec(py, s))
}

fn rows_op<'py>(
    py: Python<'py>,
    x: PyReadonlyArray2<'py, f32>,
    op: impl Fn(&mut [f32]) + Send + Sync,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let (s, n, d) = matrix(py, &x)?;
    if !d.is_power_of_two() {
        return Err(invalid_input(
            py,
            format!("row length must be a power of two, got {d}"),
        ));
    }
    let out = run(py, || {
        let mut v = s.to_vec();
        v.chunks_exact_mut(d).for_each(&op);
        Ok(v)
    })?;
    to_array2(py, out, n, d)
}

/// The sign pattern of a rotation of `x`'s rows, made inside the panic guard.
fn signs(py: Python<'_>, seed: &Bound<'_, PyAny>, width: usize) -> PyResult<Vec<f32>> {
    let seed = convert::seed(py, seed, "seed")?;
    run(py, || Ok(rng::sign_pattern(seed, width)))
}

#[pyfunction]
pub fn wht_rows<'py>(
    py: Python<'py>,
    x: PyReadonlyArray2<'py, f32>,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    rows_op(py, x, wht::fwht)
}

#[pyfunction]
pub fn rotate_rows<'py>(
    py: Python<'py>,
    x: PyReadonlyArray2<'py, f32>,
    seed: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let s = signs(py, seed, x.shape()[1])?;
    rows_op(py, x, move |r| wht::rotate(r, &s))
}

#[pyfunction]
pub fn inverse_rotate_rows<'py>(
    py: Python<'py>,
    y: PyReadonlyArray2<'py, f32>,
    seed: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let s = signs(py, seed, y.shape()[1])?;
    rows_op(py, y, move |r| wht::inverse_rotate(r, &s))
}

#[pyfunction]
pub fn pack_bits<'py>(
    py: Python<'py>,
    values: PyReadonlyArray1<'py, u8>,
    bits: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let bits = width(py, bits)? as u32;
    let v = values
        .as_slice()
        .map_err(|_| invalid_input(py, "values must be contiguous"))?;
    let out = run(py, || pack::pack_bits(v, bits))?;
    Ok(PyBytes::new(py, &out))
}

#[pyfunction]
pub fn unpack_bits<'py>(
    py: Python<'py>,
    data: &[u8],
    bits: &Bound<'py, PyAny>,
    count: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray1<u8>>> {
    let bits = width(py, bits)? as u32;
    // Any count the machine can address; what the bytes cannot hold is CorruptDataError.
    let count: usize = convert::int_in(py, count, "count", 0, usize::MAX as i128)?;
    let out = run(py, || pack::unpack_bits(data, bits, count))?;
    Ok(PyArray1::from_vec(py, out))
}

#[pyfunction]
pub fn centroids_gaussian<'py>(
    py: Python<'py>,
    bits: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let bits = width(py, bits)?;
    let c = run(py, || quant::gaussian_centroids(bits))?;
    Ok(PyArray1::from_vec(py, c))
}

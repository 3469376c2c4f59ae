//! The stage primitives: sign pattern, Hadamard, rotation, packing, Lloyd-Max tables.

use crate::errors::{invalid_input, run, to_py};
use crate::layer::{matrix, to_array2};
use kakeyaturbo::{pack, quant, rng, wht};
use numpy::{PyArray1, PyArray2, PyReadonlyArray1, PyReadonlyArray2};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

#[pyfunction]
pub fn wht_sign_pattern<'py>(py: Python<'py>, seed: u64, n: usize) -> Bound<'py, PyArray1<f32>> {
    PyArray1::from_vec(py, rng::sign_pattern(seed, n))
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
    seed: u64,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let s = rng::sign_pattern(seed, x.shape()[1]);
    rows_op(py, x, move |r| wht::rotate(r, &s))
}

#[pyfunction]
pub fn inverse_rotate_rows<'py>(
    py: Python<'py>,
    y: PyReadonlyArray2<'py, f32>,
    seed: u64,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let s = rng::sign_pattern(seed, y.shape()[1]);
    rows_op(py, y, move |r| wht::inverse_rotate(r, &s))
}

#[pyfunction]
pub fn pack_bits<'py>(
    py: Python<'py>,
    values: PyReadonlyArray1<'py, u8>,
    bits: u32,
) -> PyResult<Bound<'py, PyBytes>> {
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
    bits: u32,
    count: usize,
) -> PyResult<Bound<'py, PyArray1<u8>>> {
    let out = run(py, || pack::unpack_bits(data, bits, count))?;
    Ok(PyArray1::from_vec(py, out))
}

#[pyfunction]
pub fn centroids_gaussian<'py>(py: Python<'py>, bits: u8) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let c = quant::gaussian_centroids(bits).map_err(|e| to_py(py, e))?;
    Ok(PyArray1::from_vec(py, c))
}

use numpy::PyUntypedArrayMethods;

//! `roundtrip_layer`, `encode_layer`, `decode_layer`, `inspect_layer`.

use crate::convert::{self, matrix, to_array2};
use crate::errors::{invalid_input, run};
use crate::params;
use kakeyaturbo::perblock::block::StageTimes;
use kakeyaturbo::perblock::{container, layer, many};
use kakeyaturbo::{ByteBreakdown, EncodedLayer};
use numpy::{
    PyArray1, PyArray2, PyArray3, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2,
    PyReadonlyArray3, PyReadwriteArray3,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::time::Instant;

fn weights_of<'a>(
    py: Python<'_>,
    w: &'a Option<PyReadonlyArray1<'_, f32>>,
) -> PyResult<Option<&'a [f32]>> {
    w.as_ref()
        .map(|w| {
            w.as_slice()
                .map_err(|_| invalid_input(py, "weights must be contiguous"))
        })
        .transpose()
}

/// Sums for a report's error fields: (squared error, squared input, largest absolute error).
pub fn error_sums(x: &[f32], y: &[f32]) -> (f64, f64, f64) {
    let (mut se, mut sx, mut mx) = (0f64, 0f64, 0f64);
    for (a, b) in x.iter().zip(y) {
        let e = (*a as f64) - (*b as f64);
        se += e * e;
        sx += (*a as f64) * (*a as f64);
        mx = mx.max(e.abs());
    }
    (se, sx, mx)
}

/// Writes `mse`, `relative_error` (`||x - y|| / ||x||`) and `max_abs_error` into a report.
pub fn set_errors(r: &Bound<'_, PyDict>, sums: (f64, f64, f64), elems: usize) -> PyResult<()> {
    let (se, sx, mx) = sums;
    r.set_item("mse", se / elems as f64)?;
    r.set_item(
        "relative_error",
        if sx > 0.0 {
            (se / sx).sqrt()
        } else {
            se.sqrt()
        },
    )?;
    r.set_item("max_abs_error", mx)
}

/// The parts of a report that depend only on the encoded layer.
fn describe<'py>(
    py: Python<'py>,
    e: &EncodedLayer,
    parts: &ByteBreakdown,
) -> PyResult<Bound<'py, PyDict>> {
    let r = PyDict::new(py);
    let elems = (e.n * e.d) as f64;
    let total = parts.total();
    r.set_item("params", params::to_dict(py, &e.params)?)?;
    r.set_item("num_blocks", e.blocks.len())?;
    r.set_item("num_vecs", e.n)?;
    r.set_item("dim", e.d)?;
    r.set_item("header_bytes", parts.header)?;
    r.set_item("skeleton_bytes", parts.skeleton)?;
    r.set_item("code_bytes", parts.codes)?;
    r.set_item("outlier_bytes", parts.outliers)?;
    r.set_item("compressed_bytes", total)?;
    r.set_item("bits_per_element", 8.0 * total as f64 / elems)?;
    r.set_item("ratio_vs_bf16", 2.0 * elems / total as f64)?;
    r.set_item(
        "num_outliers",
        e.blocks
            .iter()
            .map(|b| b.1.outlier_pos.len())
            .sum::<usize>(),
    )?;
    r.set_item(
        "d_eff",
        e.blocks.iter().map(|b| b.0.d_eff).collect::<Vec<_>>(),
    )?;
    r.set_item(
        "k_eff",
        e.blocks.iter().map(|b| b.0.k_eff).collect::<Vec<_>>(),
    )?;
    Ok(r)
}

fn encode(
    py: Python<'_>,
    x: &[f32],
    n: usize,
    d: usize,
    w: Option<&[f32]>,
    p: &kakeyaturbo::CodecParams,
    threads: Option<usize>,
) -> PyResult<(EncodedLayer, StageTimes, f64)> {
    run(py, || {
        let t0 = Instant::now();
        let (e, t) = layer::encode_layer(x, n, d, w, p, threads)?;
        Ok((e, t, t0.elapsed().as_secs_f64()))
    })
}

#[pyfunction]
#[pyo3(signature = (array, params, weights=None, threads=None))]
pub fn roundtrip_layer<'py>(
    py: Python<'py>,
    array: PyReadonlyArray2<'py, f32>,
    params: &Bound<'py, PyDict>,
    weights: Option<PyReadonlyArray1<'py, f32>>,
    threads: Option<&Bound<'py, PyAny>>,
) -> PyResult<(Bound<'py, PyArray2<f32>>, Bound<'py, PyDict>)> {
    let threads = convert::threads(py, threads)?;
    let p = params::parse(py, params)?;
    let (x, n, d) = matrix(py, &array)?;
    let w = weights_of(py, &weights)?;
    let (e, times, enc_s) = encode(py, x, n, d, w, &p, threads)?;
    let (y, dec_s, parts, stats) = run(py, || {
        // The bytes are produced (and counted) but not re-parsed: decode the same structure.
        let (_bytes, parts) = container::to_bytes(&e);
        let t0 = Instant::now();
        let y = layer::decode_layer(&e, threads)?;
        let dec = t0.elapsed().as_secs_f64();
        let stats = error_sums(x, &y);
        Ok((y, dec, parts, stats))
    })?;
    let r = describe(py, &e, &parts)?;
    r.set_item("encode_seconds", enc_s)?;
    r.set_item("decode_seconds", dec_s)?;
    r.set_item("fit_seconds", times.fit)?;
    r.set_item("code_seconds", times.code)?;
    set_errors(&r, stats, n * d)?;
    Ok((to_array2(py, y, n, d)?, r))
}

#[pyfunction]
#[pyo3(signature = (array, params, weights=None, threads=None))]
pub fn encode_layer<'py>(
    py: Python<'py>,
    array: PyReadonlyArray2<'py, f32>,
    params: &Bound<'py, PyDict>,
    weights: Option<PyReadonlyArray1<'py, f32>>,
    threads: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let threads = convert::threads(py, threads)?;
    let p = params::parse(py, params)?;
    let (x, n, d) = matrix(py, &array)?;
    let w = weights_of(py, &weights)?;
    let (e, _, _) = encode(py, x, n, d, w, &p, threads)?;
    let bytes = run(py, || Ok(container::to_bytes(&e).0))?;
    Ok(PyBytes::new(py, &bytes))
}

#[pyfunction]
#[pyo3(signature = (data, threads=None))]
pub fn decode_layer<'py>(
    py: Python<'py>,
    data: &[u8],
    threads: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let threads = convert::threads(py, threads)?;
    let (y, n, d) = run(py, || {
        let e = container::from_bytes(data)?;
        Ok((layer::decode_layer(&e, threads)?, e.n, e.d))
    })?;
    to_array2(py, y, n, d)
}

/// `array [G, T, D]` (C-contiguous float32) in blocks of `block_rows`, every block coded with
/// `params` (as `encode_layer` codes it): the containers `[block][g]`, every encode of the call
/// spread over `threads` threads (`kakeyaturbo::perblock::many::encode_many`).
#[pyfunction]
#[pyo3(signature = (array, block_rows, params, threads=None))]
pub fn encode_layer_blocks<'py>(
    py: Python<'py>,
    array: PyReadonlyArray3<'py, f32>,
    block_rows: usize,
    params: &Bound<'py, PyDict>,
    threads: Option<&Bound<'py, PyAny>>,
) -> PyResult<Vec<Vec<Bound<'py, PyBytes>>>> {
    let threads = convert::threads(py, threads)?;
    let p = params::parse(py, params)?;
    let (rows, [g, _, d]) = convert::block_rows_of(py, &array, block_rows)?;
    let jobs: Vec<(&[f32], usize)> = rows.into_iter().map(|(_, x)| (x, block_rows)).collect();
    let out = run(py, || many::encode_many(&jobs, d, &p, threads))?;
    Ok(convert::by_block(py, out, g))
}

/// Per-block containers `blobs[block][g]`, each of `block_rows` rows and all of one width:
/// float32 `[G, blocks * block_rows, D]`, block `j` of row set `g` at rows `j * block_rows ..`,
/// each as `decode_layer` gives it, every decode of the call spread over `threads` threads
/// (`kakeyaturbo::perblock::many::decode_blocks`).
#[pyfunction]
#[pyo3(signature = (blobs, block_rows, threads=None))]
pub fn decode_layer_blocks<'py>(
    py: Python<'py>,
    blobs: Vec<Vec<Bound<'py, PyBytes>>>,
    block_rows: usize,
    threads: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyArray3<f32>>> {
    let threads = convert::threads(py, threads)?;
    let (jobs, g) = block_jobs(py, &blobs)?;
    let (out, d) = run(py, || many::decode_blocks(&jobs, g, block_rows, threads))?;
    PyArray1::from_vec(py, out).reshape([g, blobs.len() * block_rows, d])
}

/// [`decode_layer_blocks`] into rows `at ..` of each row set of `out`, a C-contiguous float32
/// `[G, rows, D]` array (written in place; the rest of it left as it is): a cache decodes a
/// layer's sealed blocks between the raw rows it attends with
/// (`kakeyaturbo::perblock::many::decode_blocks_into`).
#[pyfunction]
#[pyo3(signature = (blobs, block_rows, out, at, threads=None))]
pub fn decode_layer_blocks_into<'py>(
    py: Python<'py>,
    blobs: Vec<Vec<Bound<'py, PyBytes>>>,
    block_rows: usize,
    mut out: PyReadwriteArray3<'py, f32>,
    at: usize,
    threads: Option<&Bound<'py, PyAny>>,
) -> PyResult<()> {
    let threads = convert::threads(py, threads)?;
    let (jobs, g) = block_jobs(py, &blobs)?;
    let (dst, rows, d) = convert::rows_out(py, &mut out, g, None)?;
    run(py, || {
        many::decode_blocks_into(&jobs, g, block_rows, dst, rows, d, at, threads)
    })
}

/// The containers of `blobs[block][g]`, block-major, and `G`; refused where a block holds
/// another count of containers, or none.
fn block_jobs<'a>(
    py: Python<'_>,
    blobs: &'a [Vec<Bound<'_, PyBytes>>],
) -> PyResult<(Vec<&'a [u8]>, usize)> {
    let g = blobs.first().map_or(0, Vec::len);
    if g == 0 || blobs.iter().any(|row| row.len() != g) {
        return Err(invalid_input(
            py,
            "every block must hold the same count of containers, at least one",
        ));
    }
    Ok((blobs.iter().flatten().map(|b| b.as_bytes()).collect(), g))
}

#[pyfunction]
pub fn inspect_layer<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    let (e, parts) = run(py, || {
        let e = container::from_bytes(data)?;
        let parts = container::to_bytes(&e).1;
        Ok((e, parts))
    })?;
    describe(py, &e, &parts)
}

//! Python values to Rust values and back, checked once here: arrays (borrowed, contiguous),
//! integers and floats (a wrong type is `TypeError`; an int or float out of range is
//! `InvalidParameterError` naming the parameter and its range), and the entries of a parts
//! dict.

use crate::errors::{invalid_input, invalid_parameter, type_error};
use numpy::{
    PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray2, PyReadonlyArray3, PyReadwriteArray3,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyString};

/// Borrows a C-contiguous float32 matrix (the Python wrapper has already made it one).
pub fn matrix<'a>(
    py: Python<'_>,
    a: &'a PyReadonlyArray2<'_, f32>,
) -> PyResult<(&'a [f32], usize, usize)> {
    let shape = a.shape();
    let s = a
        .as_slice()
        .map_err(|_| invalid_input(py, "array must be C-contiguous"))?;
    Ok((s, shape[0], shape[1]))
}

pub fn to_array2<'py>(
    py: Python<'py>,
    v: Vec<f32>,
    n: usize,
    d: usize,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    PyArray1::from_vec(py, v).reshape([n, d])
}

pub fn to_array2_u8<'py>(
    py: Python<'py>,
    v: Vec<u8>,
    n: usize,
    d: usize,
) -> PyResult<Bound<'py, PyArray2<u8>>> {
    PyArray1::from_vec(py, v).reshape([n, d])
}

pub fn vec1<'py, T: numpy::Element>(py: Python<'py>, v: Vec<T>) -> Bound<'py, PyArray1<T>> {
    PyArray1::from_vec(py, v)
}

fn type_name(v: &Bound<'_, PyAny>) -> String {
    v.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_default()
}

/// A short rendering of a value for a message (huge ints are cut).
fn shown(v: &Bound<'_, PyAny>) -> String {
    let s = v.repr().map(|r| r.to_string()).unwrap_or_default();
    if s.len() > 40 {
        format!("{}... ({} digits)", &s[..20], s.len())
    } else {
        s
    }
}

/// An integer argument (a Python int or numpy integer; not a bool, float or str) in
/// `lo..=hi`, converted to `T`.
pub fn int_in<T: TryFrom<i128>>(
    py: Python<'_>,
    v: &Bound<'_, PyAny>,
    what: &str,
    lo: i128,
    hi: i128,
) -> PyResult<T> {
    if v.is_instance_of::<PyBool>() {
        return Err(type_error(format!("{what} must be an int, got bool")));
    }
    let out_of_range = || {
        invalid_parameter(
            py,
            format!("{what} must be in {lo}..={hi}, got {}", shown(v)),
        )
    };
    match v.extract::<i128>() {
        Ok(x) if (lo..=hi).contains(&x) => T::try_from(x).map_err(|_| out_of_range()),
        Ok(_) => Err(out_of_range()),
        // An int too large even for 128 bits.
        Err(e) if e.is_instance_of::<PyOverflowError>(py) => Err(out_of_range()),
        Err(_) => Err(type_error(format!(
            "{what} must be an int, got {}",
            type_name(v)
        ))),
    }
}

/// A 64-bit seed: an int in `0..=2**64 - 1`.
pub fn seed(py: Python<'_>, v: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    int_in(py, v, what, 0, u64::MAX as i128)
}

/// `threads`: `None`, or an int >= 1; counts above the number of cores are capped by the core
/// (`kakeyaturbo::threads`).
pub fn threads(py: Python<'_>, v: Option<&Bound<'_, PyAny>>) -> PyResult<Option<usize>> {
    match v {
        None => Ok(None),
        Some(v) if v.is_none() => Ok(None),
        Some(v) => {
            if v.is_instance_of::<PyBool>() {
                return Err(type_error("threads must be an int, got bool"));
            }
            match v.extract::<i128>() {
                Ok(t) if t >= 1 => Ok(Some(usize::try_from(t).unwrap_or(usize::MAX))),
                Ok(t) => Err(invalid_parameter(
                    py,
                    format!("threads must be >= 1, got {t}"),
                )),
                Err(e) if e.is_instance_of::<PyOverflowError>(py) => {
                    // Beyond 128 bits: positive ones are capped like any large count.
                    if v.gt(0)? {
                        Ok(Some(usize::MAX))
                    } else {
                        Err(invalid_parameter(py, "threads must be >= 1"))
                    }
                }
                Err(_) => Err(type_error(format!(
                    "threads must be an int, got {}",
                    type_name(v)
                ))),
            }
        }
    }
}

/// A real number (int or float, not bool or str); an int too large for a double is out of
/// range.
pub fn float(py: Python<'_>, v: &Bound<'_, PyAny>, what: &str) -> PyResult<f64> {
    if v.is_instance_of::<PyBool>() || v.is_instance_of::<PyString>() {
        return Err(type_error(format!(
            "{what} must be a float, got {}",
            type_name(v)
        )));
    }
    match v.extract::<f64>() {
        Ok(x) => Ok(x),
        Err(e) if e.is_instance_of::<PyOverflowError>(py) => Err(invalid_parameter(
            py,
            format!("{what} = {} is beyond the float range", shown(v)),
        )),
        Err(_) => Err(type_error(format!(
            "{what} must be a float, got {}",
            type_name(v)
        ))),
    }
}

/// `parts[key]`; a missing key is a `TypeError` (the dict is not a parts dict).
pub fn item<'py>(parts: &Bound<'py, PyDict>, key: &str) -> PyResult<Bound<'py, PyAny>> {
    parts
        .get_item(key)?
        .ok_or_else(|| type_error(format!("parts is missing {key:?}")))
}

/// An integer entry of a parts dict in `lo..=hi`.
pub fn int_item<T: TryFrom<i128>>(
    py: Python<'_>,
    parts: &Bound<'_, PyDict>,
    key: &str,
    lo: i128,
    hi: i128,
) -> PyResult<T> {
    int_in(py, &item(parts, key)?, &format!("parts[{key:?}]"), lo, hi)
}

/// An array entry of a parts dict with exactly `len` values of type `T` (any shape), counted
/// before anything is copied (a broadcast view may describe far more values than it holds).
pub fn arr<T: numpy::Element + Copy>(
    py: Python<'_>,
    parts: &Bound<'_, PyDict>,
    key: &str,
    len: usize,
    expected: &str,
) -> PyResult<Vec<T>> {
    counted(py, parts, key, len..=len, expected)
}

/// [`arr`] with at most `max` values (`expected` names the bound).
pub fn arr_up_to<T: numpy::Element + Copy>(
    py: Python<'_>,
    parts: &Bound<'_, PyDict>,
    key: &str,
    max: usize,
    expected: &str,
) -> PyResult<Vec<T>> {
    counted(py, parts, key, 0..=max, expected)
}

/// The values of `parts[key]`, once their count is known to be in `range`.
fn counted<T: numpy::Element + Copy>(
    py: Python<'_>,
    parts: &Bound<'_, PyDict>,
    key: &str,
    range: std::ops::RangeInclusive<usize>,
    expected: &str,
) -> PyResult<Vec<T>> {
    let a = typed_arr::<T>(parts, key)?;
    if !range.contains(&a.len()) {
        let most = if range.start() == range.end() {
            ""
        } else {
            "at most "
        };
        return Err(invalid_input(
            py,
            format!(
                "parts[{key:?}] has {} values, expected {most}{expected} = {}",
                a.len(),
                range.end()
            ),
        ));
    }
    Ok(a.readonly().as_array().iter().copied().collect())
}

/// `parts[key]` as a numpy array of `T` (TypeError otherwise).
fn typed_arr<'py, T: numpy::Element>(
    parts: &Bound<'py, PyDict>,
    key: &str,
) -> PyResult<Bound<'py, numpy::PyArrayDyn<T>>> {
    item(parts, key)?
        .cast_into::<numpy::PyArrayDyn<T>>()
        .map_err(|_| {
            type_error(format!(
                "parts[{key:?}] must be a numpy array of {}",
                std::any::type_name::<T>()
            ))
        })
}

/// `out`, the C-contiguous float32 `[G, rows, D]` array a decode writes in place: its values,
/// `rows` and `D`. InvalidInput unless it has `g` row sets (and `D` = `d` where given) and is
/// C-contiguous.
pub fn rows_out<'a>(
    py: Python<'_>,
    out: &'a mut PyReadwriteArray3<'_, f32>,
    g: usize,
    d: Option<usize>,
) -> PyResult<(&'a mut [f32], usize, usize)> {
    let shape = out.shape().to_vec();
    if shape[0] != g || d.is_some_and(|d| shape[2] != d) {
        let d = d.map_or("D".to_string(), |d| d.to_string());
        return Err(invalid_input(
            py,
            format!("out has shape {shape:?}, not [{g}, rows, {d}]"),
        ));
    }
    let dst = out
        .as_slice_mut()
        .map_err(|_| invalid_input(py, "out must be C-contiguous"))?;
    Ok((dst, shape[1], shape[2]))
}

/// Blocks of rows, block-major, each with the row set it belongs to.
pub type BlockRows<'a> = Vec<(usize, &'a [f32])>;

/// The rows of `array [G, T, D]` (C-contiguous float32) in blocks of `block_rows`, block-major:
/// `(set, rows)` for block 0 of every set, then block 1, ...; with `(G, T, D)`.
/// InvalidParameterError for `block_rows` 0, InvalidInputError for rows that are not whole
/// blocks or a non-contiguous array.
pub fn block_rows_of<'a>(
    py: Python<'_>,
    array: &'a PyReadonlyArray3<'_, f32>,
    block_rows: usize,
) -> PyResult<(BlockRows<'a>, [usize; 3])> {
    let s = array.shape();
    let (g, t, d) = (s[0], s[1], s[2]);
    let x = array
        .as_slice()
        .map_err(|_| invalid_input(py, "array must be C-contiguous"))?;
    if block_rows == 0 {
        return Err(invalid_parameter(py, "block_rows must be >= 1, got 0"));
    }
    if t % block_rows != 0 {
        return Err(invalid_input(
            py,
            format!("{t} rows are not whole blocks of {block_rows}"),
        ));
    }
    let jobs = (0..t / block_rows)
        .flat_map(|j| (0..g).map(move |h| (j, h)))
        .map(|(j, h)| {
            let at = (h * t + j * block_rows) * d;
            (h, &x[at..at + block_rows * d])
        })
        .collect();
    Ok((jobs, [g, t, d]))
}

/// Containers in block-major order (as [`block_rows_of`] lays the jobs out) as `[block][g]`.
pub fn by_block<'py>(
    py: Python<'py>,
    out: Vec<Vec<u8>>,
    g: usize,
) -> Vec<Vec<Bound<'py, PyBytes>>> {
    let mut it = out.into_iter();
    let blocks = it.len() / g.max(1);
    (0..blocks)
        .map(|_| it.by_ref().take(g).map(|b| PyBytes::new(py, &b)).collect())
        .collect()
}

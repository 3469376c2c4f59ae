//! `encode_block_codes` and `decode_block_from_parts`: one block as a dict of named parts,
//! the oracle that GPU kernels are compared against.

use crate::errors::{invalid_input, run, type_error};
use crate::layer::{matrix, to_array2};
use crate::params;
use kakeyaturbo::f16::ScaledF16;
use kakeyaturbo::limits::check_input;
use kakeyaturbo::pack::{packed_len, unpack_bits};
use kakeyaturbo::perblock::block::{self, BlockCodes, Rotation, Skeleton};
use kakeyaturbo::quant::Quantizer;
use kakeyaturbo::wht::padded_len;
use kakeyaturbo::{CodecParams, SkeletonDtype};
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

pub(crate) fn vec1<'py, T: numpy::Element>(py: Python<'py>, v: Vec<T>) -> Bound<'py, PyArray1<T>> {
    PyArray1::from_vec(py, v)
}

#[pyfunction]
#[pyo3(signature = (array, params, weights=None))]
pub fn encode_block_codes<'py>(
    py: Python<'py>,
    array: PyReadonlyArray2<'py, f32>,
    params: &Bound<'py, PyDict>,
    weights: Option<PyReadonlyArray1<'py, f32>>,
) -> PyResult<Bound<'py, PyDict>> {
    let p = params::parse(py, params)?;
    let (x, n, d) = matrix(py, &array)?;
    let w = weights
        .as_ref()
        .map(|w| {
            w.as_slice()
                .map_err(|_| invalid_input(py, "weights must be contiguous"))
        })
        .transpose()?;
    let (s, c, q) = run(py, || {
        check_input(x, n, d, w)?;
        let q = p.validate()?;
        let (s, c, _) = block::encode_block(x, d, w, &p, &q, 0, None)?;
        Ok((s, c, q))
    })?;
    parts_dict(py, &p, &q, &s, &c)
}

fn parts_dict<'py>(
    py: Python<'py>,
    p: &CodecParams,
    q: &Quantizer,
    s: &Skeleton,
    c: &BlockCodes,
) -> PyResult<Bound<'py, PyDict>> {
    let r = PyDict::new(py);
    let (n, de) = (c.n, s.d_eff);
    r.set_item("n", n)?;
    r.set_item("d", s.d)?;
    r.set_item("d_eff", de)?;
    r.set_item("k", s.k_eff)?;
    r.set_item("wht_len", padded_len(de))?;
    r.set_item("bands", kakeyaturbo::wht::bands(de))?;
    r.set_item("bit_width", p.bit_width)?;
    r.set_item("metric", p.metric.name())?;
    r.set_item("rotation_seed", p.rotation_seed)?;
    r.set_item(
        "skeleton_dtype",
        match s.dtype {
            SkeletonDtype::F16 => "fp16",
            SkeletonDtype::F32 => "fp32",
        },
    )?;
    r.set_item("outlier_threshold", p.outlier_threshold)?;
    r.set_item("centroids", vec1(py, q.centroids().to_vec()))?;
    r.set_item("mean", vec1(py, s.mean.clone()))?;
    r.set_item("mean_exp", s.mean_exp)?;
    r.set_item("basis", to_array2(py, s.basis.clone(), de, s.d)?)?;
    r.set_item("centers", to_array2(py, s.centers.clone(), s.k_eff, de)?)?;
    r.set_item(
        "seg_id",
        vec1(py, c.seg.iter().map(|&v| v as i32).collect()),
    )?;
    r.set_item("t", vec1(py, c.t.decode()))?;
    r.set_item("t_exp", c.t.exp)?;
    r.set_item("t_bits", vec1(py, c.t.bits.clone()))?;
    r.set_item("norm", vec1(py, c.scale.decode()))?;
    r.set_item("norm_exp", c.scale.exp)?;
    r.set_item("norm_bits", vec1(py, c.scale.bits.clone()))?;
    r.set_item("residual_packed", PyBytes::new(py, &c.residual))?;
    let codes = unpack_bits(&c.residual, p.bit_width as u32, n * de)
        .map_err(|e| crate::errors::to_py(py, e))?;
    r.set_item("residual_codes", to_array2_u8(py, codes, n, de)?)?;
    r.set_item(
        "outlier_pos",
        vec1(py, c.outlier_pos.iter().map(|&v| v as i64).collect()),
    )?;
    r.set_item("outlier_bits", vec1(py, c.outlier_val.clone()))?;
    r.set_item(
        "outlier_val",
        vec1(
            py,
            c.outlier_val
                .iter()
                .map(|&b| half::f16::from_bits(b).to_f32())
                .collect(),
        ),
    )?;
    Ok(r)
}

pub(crate) fn to_array2_u8<'py>(
    py: Python<'py>,
    v: Vec<u8>,
    n: usize,
    d: usize,
) -> PyResult<Bound<'py, numpy::PyArray2<u8>>> {
    PyArray1::from_vec(py, v).reshape([n, d])
}

pub(crate) fn item<'py>(parts: &Bound<'py, PyDict>, key: &str) -> PyResult<Bound<'py, PyAny>> {
    parts
        .get_item(key)?
        .ok_or_else(|| type_error(format!("parts is missing {key:?}")))
}

pub(crate) fn arr<T: numpy::Element + Copy>(
    parts: &Bound<'_, PyDict>,
    key: &str,
    len: usize,
) -> PyResult<Vec<T>> {
    let a = item(parts, key)?;
    let a = a.cast_into::<numpy::PyArrayDyn<T>>().map_err(|_| {
        type_error(format!(
            "parts[{key:?}] must be a numpy array of {}",
            std::any::type_name::<T>()
        ))
    })?;
    let ro = a.readonly();
    let v: Vec<T> = ro.as_array().iter().copied().collect();
    if v.len() != len {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "parts[{key:?}] has {} values, expected {len}",
            v.len()
        )));
    }
    Ok(v)
}

#[pyfunction]
pub fn decode_block_from_parts<'py>(
    py: Python<'py>,
    parts: &Bound<'py, PyDict>,
) -> PyResult<Bound<'py, numpy::PyArray2<f32>>> {
    let n: usize = item(parts, "n")?.extract()?;
    let d: usize = item(parts, "d")?.extract()?;
    let de: usize = item(parts, "d_eff")?.extract()?;
    let k: usize = item(parts, "k")?.extract()?;
    let bw: u8 = item(parts, "bit_width")?.extract()?;
    let seed: u64 = item(parts, "rotation_seed")?.extract()?;
    if n == 0 || d == 0 || de == 0 || de > d || k == 0 {
        return Err(invalid_input(
            py,
            format!("inconsistent parts: n={n} d={d} d_eff={de} k={k}"),
        ));
    }
    let table: Vec<f32> = arr(parts, "centroids", 1usize << bw.min(8))?;
    let q = Quantizer::new(table, bw).map_err(|e| crate::errors::to_py(py, e))?;
    let residual: Vec<u8> = item(parts, "residual_packed")?.extract()?;
    if residual.len() != packed_len(n * de, bw as u32) {
        return Err(invalid_input(py, "residual_packed has the wrong length"));
    }
    let seg: Vec<i32> = arr(parts, "seg_id", n)?;
    if seg.iter().any(|&s| s < 0 || s as usize >= k) {
        return Err(invalid_input(py, "seg_id out of range"));
    }
    let opos: Vec<i64> = {
        let a = item(parts, "outlier_pos")?;
        let a = a
            .cast_into::<numpy::PyArrayDyn<i64>>()
            .map_err(|_| type_error("outlier_pos must be int64"))?;
        let v: Vec<i64> = a.readonly().as_array().iter().copied().collect();
        v
    };
    let cells = (n * de) as i64;
    if opos.iter().any(|&p| p < 0 || p >= cells) {
        return Err(invalid_input(py, "outlier_pos out of range"));
    }
    let skel = Skeleton {
        d,
        d_eff: de,
        k_eff: k,
        dtype: SkeletonDtype::F32,
        mean_exp: 0,
        mean: arr(parts, "mean", d)?,
        basis: arr(parts, "basis", de * d)?,
        centers: arr(parts, "centers", k * de)?,
    };
    let codes = BlockCodes {
        n,
        seg: seg.iter().map(|&s| s as u32).collect(),
        t: ScaledF16 {
            exp: item(parts, "t_exp")?.extract()?,
            bits: arr(parts, "t_bits", n)?,
        },
        scale: ScaledF16 {
            exp: item(parts, "norm_exp")?.extract()?,
            bits: arr(parts, "norm_bits", n)?,
        },
        residual,
        outlier_pos: opos.iter().map(|&p| p as u32).collect(),
        outlier_val: arr(parts, "outlier_bits", opos.len())?,
    };
    let out = run(py, || {
        let mut out = vec![0f32; n * d];
        block::decode_block(&skel, &codes, bw, &q, &Rotation::new(seed, de), &mut out);
        Ok(out)
    })?;
    to_array2(py, out, n, d)
}

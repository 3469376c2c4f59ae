//! `encode_block_codes` and `decode_block_from_parts`: one block as a dict of named parts,
//! the oracle that GPU kernels are compared against.

use crate::convert::{arr, arr_up_to, int_item, item, matrix, to_array2, to_array2_u8, vec1};
use crate::errors::{invalid_input, run, type_error};
use crate::params;
use kakeyaturbo::f16::{ScaledF16, MAX_EXP, MIN_EXP};
use kakeyaturbo::limits::{saturate, MAX_DIM, MAX_ROWS};
use kakeyaturbo::pack::unpack_bits;
use kakeyaturbo::perblock::block::{BlockCodes, Rotation, Skeleton};
use kakeyaturbo::perblock::decode;
use kakeyaturbo::perblock::layer::encode_single_block;
use kakeyaturbo::quant::Quantizer;
use kakeyaturbo::wht::padded_len;
use kakeyaturbo::{CodecParams, SkeletonDtype};
use numpy::{PyArray2, PyReadonlyArray1, PyReadonlyArray2};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::sync::Arc;

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
    let (s, c, q) = run(py, || encode_single_block(x, n, d, w, &p))?;
    parts_dict(py, &p, &q, &s, &c)
}

/// The stored values of a scaled-fp16 field in f32 (beyond the float32 range: saturated).
fn saturated(s: &ScaledF16) -> Vec<f32> {
    s.decode_f64().into_iter().map(saturate).collect()
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
    r.set_item("mean", vec1(py, s.mean.to_vec()))?;
    r.set_item("mean_exp", s.mean_exp)?;
    r.set_item("basis", to_array2(py, s.basis.to_vec(), de, s.d)?)?;
    r.set_item("centers", to_array2(py, s.centers.clone(), s.k_eff, de)?)?;
    r.set_item(
        "seg_id",
        vec1(py, c.seg.iter().map(|&v| v as i32).collect()),
    )?;
    r.set_item("t", vec1(py, saturated(&c.t)))?;
    r.set_item("t_exp", c.t.exp)?;
    r.set_item("t_bits", vec1(py, c.t.bits.clone()))?;
    r.set_item("norm", vec1(py, saturated(&c.scale)))?;
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

#[pyfunction]
pub fn decode_block_from_parts<'py>(
    py: Python<'py>,
    parts: &Bound<'py, PyDict>,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    // Scalars first, each in its range, so that every size below is bounded.
    let n: usize = int_item(py, parts, "n", 1, MAX_ROWS as i128)?;
    let d: usize = int_item(py, parts, "d", 1, MAX_DIM as i128)?;
    let de: usize = int_item(py, parts, "d_eff", 1, d as i128)?;
    let k: usize = int_item(py, parts, "k", 1, n as i128)?;
    let bw: u8 = int_item(py, parts, "bit_width", 1, 4)?;
    let seed: u64 = int_item(py, parts, "rotation_seed", 0, u64::MAX as i128)?;
    let (lo, hi) = (MIN_EXP as i128, MAX_EXP as i128);
    let t_exp: i8 = int_item(py, parts, "t_exp", lo, hi)?;
    let norm_exp: i8 = int_item(py, parts, "norm_exp", lo, hi)?;
    let table: Vec<f32> = arr(py, parts, "centroids", 1usize << bw, "2**bit_width")?;
    let q = Quantizer::new(table, bw).map_err(|e| crate::errors::to_py(py, e))?;
    let residual: Vec<u8> = item(parts, "residual_packed")?
        .extract()
        .map_err(|_| type_error("parts[\"residual_packed\"] must be bytes"))?;
    let seg: Vec<i32> = arr(py, parts, "seg_id", n, "n")?;
    if seg.iter().any(|&s| s < 0) {
        return Err(invalid_input(py, "seg_id out of range"));
    }
    let opos: Vec<i64> = arr_up_to(py, parts, "outlier_pos", n * de, "n x d_eff")?;
    if opos.iter().any(|&p| p < 0 || p > u32::MAX as i64) {
        return Err(invalid_input(py, "outlier_pos out of range"));
    }
    let skel = Skeleton {
        d,
        d_eff: de,
        k_eff: k,
        dtype: SkeletonDtype::F32,
        mean_exp: 0,
        mean: Arc::new(arr(py, parts, "mean", d, "d")?),
        basis: Arc::new(arr(py, parts, "basis", de * d, "d_eff x d")?),
        centers: arr(py, parts, "centers", k * de, "k x d_eff")?,
    };
    let codes = BlockCodes {
        n,
        seg: seg.iter().map(|&s| s as u32).collect(),
        t: ScaledF16 {
            exp: t_exp,
            bits: arr(py, parts, "t_bits", n, "n")?,
        },
        scale: ScaledF16 {
            exp: norm_exp,
            bits: arr(py, parts, "norm_bits", n, "n")?,
        },
        residual,
        outlier_pos: opos.iter().map(|&p| p as u32).collect(),
        outlier_val: arr(py, parts, "outlier_bits", opos.len(), "len(outlier_pos)")?,
    };
    let out = run(py, || {
        decode::check_parts(&skel, &codes, bw)?;
        let mut out = kakeyaturbo::limits::zeros(n * d, "the decoded block")?;
        decode::decode_block(&skel, &codes, bw, &q, &Rotation::new(seed, de), &mut out)?;
        Ok(out)
    })?;
    to_array2(py, out, n, d)
}

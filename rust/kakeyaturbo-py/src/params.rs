//! Codec parameters from the Python keyword dictionary (names checked on the Python side).

use crate::convert;
use crate::errors::{invalid_parameter, type_error};
use kakeyaturbo::perblock::params::{MAX_KMEANS_ITER, MAX_POWER_ITERS};
use kakeyaturbo::{CodecParams, Metric, PcaMethod, SkeletonDtype};
use pyo3::prelude::*;
use pyo3::types::PyDict;

fn get<'py>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
    Ok(d.get_item(key)?.filter(|v| !v.is_none()))
}

/// An integer keyword in `lo..=hi` (the documented range, or the range of the stored field).
fn int<T: TryFrom<i128>>(
    py: Python<'_>,
    d: &Bound<'_, PyDict>,
    key: &str,
    lo: i128,
    hi: i128,
) -> PyResult<Option<T>> {
    get(d, key)?
        .map(|v| convert::int_in(py, &v, key, lo, hi))
        .transpose()
}

fn float(py: Python<'_>, d: &Bound<'_, PyDict>, key: &str) -> PyResult<Option<f64>> {
    get(d, key)?
        .map(|v| convert::float(py, &v, key))
        .transpose()
}

fn string(d: &Bound<'_, PyDict>, key: &str) -> PyResult<Option<String>> {
    match get(d, key)? {
        None => Ok(None),
        Some(v) => v
            .extract::<String>()
            .map(Some)
            .map_err(|_| type_error(format!("{key} must be a str"))),
    }
}

/// A metric by name (`ip` is an alias of `inner_product`).
pub fn metric(py: Python<'_>, m: &str) -> PyResult<Metric> {
    Ok(match m {
        "mse" => Metric::Mse,
        "inner_product" | "ip" => Metric::InnerProduct,
        "linf" => Metric::Linf,
        _ => {
            return Err(invalid_parameter(
                py,
                format!("metric must be 'mse', 'inner_product' ('ip') or 'linf', got {m:?}"),
            ))
        }
    })
}

/// How keys coded before RoPE are synthesised, by name (`bf16`, `f32`, `i16`).
/// A RoPE pairing by its name: `"half"` or `"interleaved"`.
pub fn rope_style(py: Python<'_>, s: &str) -> PyResult<kakeyaturbo::attention::RopeStyle> {
    use kakeyaturbo::attention::RopeStyle;
    Ok(match s {
        "half" => RopeStyle::Half,
        "interleaved" => RopeStyle::Interleaved,
        other => {
            return Err(invalid_parameter(
                py,
                format!("rope style must be 'half' or 'interleaved', got {other:?}"),
            ))
        }
    })
}

pub fn synthesis(py: Python<'_>, s: &str) -> PyResult<kakeyaturbo::attention::Synthesis> {
    use kakeyaturbo::attention::Synthesis;
    Ok(match s {
        "bf16" => Synthesis::Bf16,
        "f32" => Synthesis::F32,
        "i16" => Synthesis::I16,
        _ => {
            return Err(invalid_parameter(
                py,
                format!("synthesis must be 'bf16', 'f32' or 'i16', got {s:?}"),
            ))
        }
    })
}

/// Builds [`CodecParams`] from a dict of the keyword arguments (missing keys: defaults).
pub fn parse(py: Python<'_>, d: &Bound<'_, PyDict>) -> PyResult<CodecParams> {
    let mut p = CodecParams::default();
    if let Some(m) = string(d, "metric")? {
        p.metric = metric(py, &m)?;
    }
    // Ranges: the documented ones where they are small, else the range of the stored field.
    const U32: i128 = u32::MAX as i128;
    if let Some(v) = int(py, d, "block_size", 1, U32)? {
        p.block_size = v;
    }
    if let Some(v) = int(py, d, "bit_width", 1, 4)? {
        p.bit_width = v;
    }
    if let Some(v) = float(py, d, "variance_ratio")? {
        p.variance_ratio = v;
    }
    if let Some(v) = int(py, d, "k", 1, U32)? {
        p.k = v;
    }
    if let Some(v) = int(py, d, "rotation_seed", 0, u64::MAX as i128)? {
        p.rotation_seed = v;
    }
    if let Some(v) = int(py, d, "kmeans_max_iter", 0, MAX_KMEANS_ITER as i128)? {
        p.kmeans_max_iter = v;
    }
    if let Some(v) = int(py, d, "rank_cap", 1, U32)? {
        p.rank_cap = Some(v);
    }
    let method = string(d, "pca_method")?.unwrap_or_else(|| "exact".into());
    p.pca_method = match method.as_str() {
        "exact" => PcaMethod::Exact,
        "randomized" => PcaMethod::Randomized {
            target_rank: int(py, d, "rsvd_target_rank", 1, U32)?,
            oversample: int(py, d, "rsvd_oversample", 0, U32)?.unwrap_or(8),
            power_iters: int(py, d, "rsvd_power_iters", 0, MAX_POWER_ITERS as i128)?.unwrap_or(2),
        },
        _ => {
            return Err(invalid_parameter(
                py,
                format!("pca_method must be 'exact' or 'randomized', got {method:?}"),
            ))
        }
    };
    if let Some(s) = string(d, "skeleton_dtype")? {
        p.skeleton_dtype = match s.as_str() {
            "fp16" | "float16" => SkeletonDtype::F16,
            "fp32" | "float32" => SkeletonDtype::F32,
            _ => {
                return Err(invalid_parameter(
                    py,
                    format!("skeleton_dtype must be 'fp16' or 'fp32', got {s:?}"),
                ))
            }
        };
    }
    if let Some(c) = get(d, "centroids")? {
        let v: Vec<f64> = c
            .extract()
            .map_err(|_| type_error("centroids must be a sequence of floats"))?;
        p.centroids = Some(v.into_iter().map(|x| x as f32).collect());
    }
    if let Some(t) = float(py, d, "outlier_threshold")? {
        p.outlier_threshold = Some(t as f32);
    }
    if let Some(s) = get(d, "share_basis")? {
        p.share_basis = s
            .extract()
            .map_err(|_| type_error("share_basis must be a bool"))?;
    }
    Ok(p)
}

/// The parameters as a plain dict, for reports.
pub fn to_dict<'py>(py: Python<'py>, p: &CodecParams) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("metric", p.metric.name())?;
    d.set_item("block_size", p.block_size)?;
    d.set_item("bit_width", p.bit_width)?;
    d.set_item("variance_ratio", p.variance_ratio)?;
    d.set_item("k", p.k)?;
    d.set_item("rotation_seed", p.rotation_seed)?;
    d.set_item("kmeans_max_iter", p.kmeans_max_iter)?;
    match p.pca_method {
        PcaMethod::Exact => d.set_item("pca_method", "exact")?,
        PcaMethod::Randomized {
            target_rank,
            oversample,
            power_iters,
        } => {
            d.set_item("pca_method", "randomized")?;
            d.set_item("rsvd_target_rank", target_rank)?;
            d.set_item("rsvd_oversample", oversample)?;
            d.set_item("rsvd_power_iters", power_iters)?;
        }
    }
    d.set_item(
        "skeleton_dtype",
        match p.skeleton_dtype {
            SkeletonDtype::F16 => "fp16",
            SkeletonDtype::F32 => "fp32",
        },
    )?;
    d.set_item("rank_cap", p.rank_cap)?;
    d.set_item("centroids", p.centroids.clone())?;
    d.set_item("outlier_threshold", p.outlier_threshold)?;
    d.set_item("share_basis", p.share_basis)?;
    Ok(d)
}

/// Checks a dict of codec keyword arguments without coding anything: parses and validates
/// them as `encode_layer` would, and returns the complete parameters (defaults filled in).
#[pyfunction]
pub fn check_params<'py>(
    py: Python<'py>,
    params: &Bound<'py, PyDict>,
) -> PyResult<Bound<'py, PyDict>> {
    let p = parse(py, params)?;
    crate::errors::run(py, || p.validate().map(|_| ()))?;
    to_dict(py, &p)
}

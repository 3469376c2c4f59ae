//! Codec parameters from the Python keyword dictionary (names checked on the Python side).

use crate::errors::{invalid_parameter, type_error};
use kakeyaturbo::{CodecParams, Metric, PcaMethod, SkeletonDtype};
use pyo3::prelude::*;
use pyo3::types::PyDict;

fn get<'py>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
    Ok(d.get_item(key)?.filter(|v| !v.is_none()))
}

fn int(d: &Bound<'_, PyDict>, key: &str) -> PyResult<Option<i128>> {
    match get(d, key)? {
        None => Ok(None),
        Some(v) => {
            if v.is_instance_of::<pyo3::types::PyBool>() {
                return Err(type_error(format!("{key} must be an int, got bool")));
            }
            v.extract::<i128>().map(Some).map_err(|_| {
                type_error(format!(
                    "{key} must be an int, got {}",
                    v.get_type()
                        .name()
                        .map(|n| n.to_string())
                        .unwrap_or_default()
                ))
            })
        }
    }
}

fn ranged<T: TryFrom<i128>>(py: Python<'_>, key: &str, v: i128) -> PyResult<T> {
    T::try_from(v).map_err(|_| invalid_parameter(py, format!("{key} = {v} is out of range")))
}

fn float(d: &Bound<'_, PyDict>, key: &str) -> PyResult<Option<f64>> {
    match get(d, key)? {
        None => Ok(None),
        Some(v) => v
            .extract::<f64>()
            .map(Some)
            .map_err(|_| type_error(format!("{key} must be a float"))),
    }
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

/// Builds [`CodecParams`] from a dict of the keyword arguments (missing keys: defaults).
pub fn parse(py: Python<'_>, d: &Bound<'_, PyDict>) -> PyResult<CodecParams> {
    let mut p = CodecParams::default();
    if let Some(m) = string(d, "metric")? {
        p.metric = metric(py, &m)?;
    }
    if let Some(v) = int(d, "block_size")? {
        p.block_size = ranged(py, "block_size", v)?;
    }
    if let Some(v) = int(d, "bit_width")? {
        p.bit_width = ranged(py, "bit_width", v)?;
    }
    if let Some(v) = float(d, "variance_ratio")? {
        p.variance_ratio = v;
    }
    if let Some(v) = int(d, "k")? {
        p.k = ranged(py, "k", v)?;
    }
    if let Some(v) = int(d, "rotation_seed")? {
        p.rotation_seed = ranged(py, "rotation_seed", v)?;
    }
    if let Some(v) = int(d, "kmeans_max_iter")? {
        p.kmeans_max_iter = ranged(py, "kmeans_max_iter", v)?;
    }
    if let Some(v) = int(d, "rank_cap")? {
        p.rank_cap = Some(ranged(py, "rank_cap", v)?);
    }
    let method = string(d, "pca_method")?.unwrap_or_else(|| "exact".into());
    p.pca_method = match method.as_str() {
        "exact" => PcaMethod::Exact,
        "randomized" => PcaMethod::Randomized {
            target_rank: int(d, "rsvd_target_rank")?
                .map(|v| ranged(py, "rsvd_target_rank", v))
                .transpose()?,
            oversample: int(d, "rsvd_oversample")?
                .map(|v| ranged(py, "rsvd_oversample", v))
                .transpose()?
                .unwrap_or(8),
            power_iters: int(d, "rsvd_power_iters")?
                .map(|v| ranged(py, "rsvd_power_iters", v))
                .transpose()?
                .unwrap_or(2),
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
    if let Some(t) = float(d, "outlier_threshold")? {
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
pub fn check_params<'py>(py: Python<'py>, params: &Bound<'py, PyDict>) -> PyResult<Bound<'py, PyDict>> {
    let p = parse(py, params)?;
    crate::errors::run(py, || p.validate().map(|_| ()))?;
    to_dict(py, &p)
}

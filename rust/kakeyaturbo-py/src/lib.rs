//! Python binding of the kakeyaturbo codec. One file per exposed part of the core; this file
//! only lists the exports.

mod attention;
mod block;
mod calibrated;
mod convert;
mod errors;
mod layer;
mod params;
mod primitives;
#[cfg(unix)]
mod team;
mod unrope;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    #[cfg(unix)]
    team::install();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("FORMAT_VERSION", kakeyaturbo::perblock::container::VERSION)?;
    m.add("MAX_DIM", kakeyaturbo::limits::MAX_DIM)?;
    m.add("MAX_ROWS", kakeyaturbo::limits::MAX_ROWS)?;
    m.add_function(wrap_pyfunction!(layer::roundtrip_layer, m)?)?;
    m.add_function(wrap_pyfunction!(layer::encode_layer, m)?)?;
    m.add_function(wrap_pyfunction!(layer::decode_layer, m)?)?;
    m.add_function(wrap_pyfunction!(layer::decode_layer_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(layer::decode_layer_blocks_into, m)?)?;
    m.add_function(wrap_pyfunction!(layer::encode_layer_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(layer::inspect_layer, m)?)?;
    m.add_function(wrap_pyfunction!(params::check_params, m)?)?;
    m.add_function(wrap_pyfunction!(block::encode_block_codes, m)?)?;
    m.add_class::<calibrated::PyCalibratedCodec>()?;
    m.add_function(wrap_pyfunction!(calibrated::encode_calibrated_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(calibrated::decode_calibrated_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(
        calibrated::decode_calibrated_blocks_into,
        m
    )?)?;
    m.add_class::<attention::PyLayerCodes>()?;
    m.add_function(wrap_pyfunction!(attention::attention_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(unrope::unrope_keys, m)?)?;
    m.add_function(wrap_pyfunction!(attention::attention_team, m)?)?;
    m.add(
        "CALIBRATED_FORMAT_VERSION",
        kakeyaturbo::calibrated::VERSION,
    )?;
    m.add_function(wrap_pyfunction!(block::decode_block_from_parts, m)?)?;
    m.add_function(wrap_pyfunction!(primitives::wht_sign_pattern, m)?)?;
    m.add_function(wrap_pyfunction!(primitives::wht_rows, m)?)?;
    m.add_function(wrap_pyfunction!(primitives::rotate_rows, m)?)?;
    m.add_function(wrap_pyfunction!(primitives::inverse_rotate_rows, m)?)?;
    m.add_function(wrap_pyfunction!(primitives::pack_bits, m)?)?;
    m.add_function(wrap_pyfunction!(primitives::unpack_bits, m)?)?;
    m.add_function(wrap_pyfunction!(primitives::centroids_gaussian, m)?)?;
    Ok(())
}

//! Error mapping and the GIL helper: every call into the core goes through [`run`].

use kakeyaturbo::Error;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// The exception classes live in `kakeyaturbo.errors` (Python, so that they can inherit
/// from both `KakeyaError` and `ValueError`); this looks one up once.
fn class<'py>(
    py: Python<'py>,
    cell: &'static PyOnceLock<Py<PyType>>,
    name: &str,
) -> Bound<'py, PyType> {
    cell.get_or_try_init(py, || -> PyResult<_> {
        let m = py.import("kakeyaturbo.errors")?;
        Ok(m.getattr(name)?.cast_into::<PyType>()?.unbind())
    })
    .map(|c| c.bind(py).clone())
    .unwrap_or_else(|_| py.get_type::<pyo3::exceptions::PyRuntimeError>())
}

macro_rules! exc {
    ($fn:ident, $name:literal) => {
        pub fn $fn(py: Python<'_>, msg: impl Into<String>) -> PyErr {
            static CELL: PyOnceLock<Py<PyType>> = PyOnceLock::new();
            PyErr::from_type(class(py, &CELL, $name), msg.into())
        }
    };
}

exc!(invalid_input, "InvalidInputError");
exc!(invalid_parameter, "InvalidParameterError");
exc!(corrupt, "CorruptDataError");
exc!(unsupported_version, "UnsupportedVersionError");
exc!(numerical, "NumericalError");
exc!(internal, "InternalError");

pub fn type_error(msg: impl Into<String>) -> PyErr {
    PyTypeError::new_err(msg.into())
}

/// Maps a core error onto its exception class.
pub fn to_py(py: Python<'_>, e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::InvalidInput(_) => invalid_input(py, msg),
        Error::InvalidParameter(_) => invalid_parameter(py, msg),
        Error::Corrupt(_) => corrupt(py, msg),
        Error::UnsupportedVersion { .. } => unsupported_version(py, msg),
        Error::Numerical(_) => numerical(py, msg),
    }
}

/// Runs `f` with the GIL released; core errors become typed exceptions and a panic becomes
/// `InternalError` instead of aborting the interpreter.
pub fn run<T: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> kakeyaturbo::Result<T> + Send,
) -> PyResult<T> {
    match py.detach(|| catch_unwind(AssertUnwindSafe(f))) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(to_py(py, e)),
        Err(p) => {
            let what = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(internal(
                py,
                format!("internal error in the codec (please report): {what}"),
            ))
        }
    }
}

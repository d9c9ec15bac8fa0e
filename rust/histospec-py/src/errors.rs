//! CoreError -> Python exception, in one place.
//!
//! The exception classes live in `histospec_sgl.errors` (so they can also derive from the built-in
//! KeyError / ValueError); they are looked up when an error is raised, which is never on a hot path.

use histospec_index::CoreError;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

fn raise(py: Python<'_>, class: &str, msg: String) -> PyErr {
    match py
        .import("histospec_sgl.errors")
        .and_then(|m| m.getattr(class))
    {
        Ok(cls) => PyErr::from_type(cls.cast_into().expect("exception class"), msg),
        Err(_) => PyRuntimeError::new_err(msg),
    }
}

/// Converts a core error into the matching Python exception.
pub fn to_py(e: CoreError) -> PyErr {
    Python::attach(|py| {
        let msg = e.to_string();
        match e {
            CoreError::InvalidToken { .. } => raise(py, "InvalidTokenError", msg),
            CoreError::UnknownRequest(_) => raise(py, "UnknownRequestError", msg),
            CoreError::DuplicateRequest(_) => raise(py, "DuplicateRequestError", msg),
            CoreError::InvalidArgument(_) | CoreError::BufferShape { .. } => {
                PyValueError::new_err(msg)
            }
            CoreError::CorruptSnapshot(_) | CoreError::SnapshotVersion { .. } => {
                raise(py, "SnapshotError", msg)
            }
            CoreError::Io { .. } => raise(py, "SnapshotError", msg),
        }
    })
}

/// Error for a lock poisoned by an earlier internal failure.
pub fn poisoned() -> PyErr {
    PyRuntimeError::new_err(
        "the history index is unusable after an earlier internal error; recreate it",
    )
}

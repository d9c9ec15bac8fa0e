//! Python objects -> flat Rust slices, with the checks done at the door.

use numpy::{PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};

use pyo3::prelude::*;

/// Token ids from a numpy integer array (any shape, C-contiguous) or a sequence of ints.
/// Values outside int32 become `i32::MIN` markers rejected by the core with a clear message.
pub fn tokens(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<i32>> {
    if let Ok(a) = obj.extract::<PyReadonlyArrayDyn<'_, i32>>() {
        return Ok(contiguous(&a, what)?.to_vec());
    }
    if let Ok(a) = obj.extract::<PyReadonlyArrayDyn<'_, i64>>() {
        return contiguous(&a, what)?
            .iter()
            .map(|&v| narrow(v, what))
            .collect();
    }
    if let Ok(v) = obj.extract::<Vec<i64>>() {
        return v.into_iter().map(|x| narrow(x, what)).collect();
    }
    Err(PyTypeError::new_err(format!(
        "{what} must be a sequence of ints or an int32/int64 numpy array, got {}",
        obj.get_type().name()?
    )))
}

fn narrow(v: i64, _what: &str) -> PyResult<i32> {
    i32::try_from(v).map_err(|_| {
        crate::errors::to_py(histospec_index::CoreError::InvalidToken {
            token: v,
            limit: i32::MAX as u64 + 1,
        })
    })
}

/// Request ids from an int64 array or a sequence of non-negative ints.
pub fn rids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let raw: Vec<i64> = if let Ok(a) = obj.extract::<PyReadonlyArrayDyn<'_, i64>>() {
        contiguous(&a, "rids")?.to_vec()
    } else if let Ok(v) = obj.extract::<Vec<i64>>() {
        v
    } else {
        return Err(PyTypeError::new_err(
            "rids must be an int64 numpy array or a sequence of ints",
        ));
    };
    raw.into_iter()
        .map(|r| {
            u64::try_from(r)
                .map_err(|_| PyValueError::new_err(format!("request ids must be >= 0, got {r}")))
        })
        .collect()
}

/// Borrows a C-contiguous array as a slice.
pub fn contiguous<'a, T: numpy::Element>(
    a: &'a PyReadonlyArrayDyn<'_, T>,
    what: &str,
) -> PyResult<&'a [T]> {
    a.as_slice().map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be C-contiguous (shape {:?})",
            a.shape()
        ))
    })
}

/// A draft tree as Python lists: (tokens, parents), the root's parent as -1.
pub fn tree_lists(nodes: &[histospec_index::Node]) -> (Vec<i64>, Vec<i64>) {
    let toks = nodes.iter().map(|n| n.tok as i64).collect();
    let parents = nodes
        .iter()
        .map(|n| {
            if n.parent == u32::MAX {
                -1
            } else {
                n.parent as i64
            }
        })
        .collect();
    (toks, parents)
}

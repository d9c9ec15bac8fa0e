//! `histospec_sgl._core`: the native module. Glue only; the logic lives in `histospec-index`.

mod convert;
mod errors;
mod index;
mod peers;
mod wire;

use pyo3::prelude::*;

/// XXH3-64 of the prompt's token ids as little-endian int32 bytes: the group key every component uses.
#[pyfunction]
fn prompt_key(prompt_ids: &Bound<'_, PyAny>) -> PyResult<u64> {
    let toks = convert::tokens(prompt_ids, "prompt_ids")?;
    Ok(histospec_index::prompt_key(&toks))
}

/// The group key every component keys history by (`histospec_index::group_key`): `group` None,
/// `prompt_key(prompt_ids)`; an int in [-2**63, 2**64), itself (negative ones modulo 2**64); a str,
/// the named group's key (XXH3-64 of its UTF-8 bytes in a domain apart from prompts').
#[pyfunction]
#[pyo3(signature = (prompt_ids=None, group=None))]
fn group_key(
    prompt_ids: Option<&Bound<'_, PyAny>>,
    group: Option<&Bound<'_, PyAny>>,
) -> PyResult<u64> {
    let has_group = group.is_some_and(|g| !g.is_none());
    let toks = match prompt_ids.filter(|p| !p.is_none()) {
        Some(p) => convert::tokens(p, "prompt_ids")?,
        None if has_group => Vec::new(),
        None => {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "group_key needs prompt_ids or a group",
            ))
        }
    };
    index::group_or_key(group, &toks)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<index::PyHistoryIndex>()?;
    m.add_class::<peers::PyTriePeer>()?;
    m.add_function(wrap_pyfunction!(prompt_key, m)?)?;
    m.add_function(wrap_pyfunction!(group_key, m)?)?;
    m.add_function(wrap_pyfunction!(wire::encode_publish, m)?)?;
    m.add_function(wrap_pyfunction!(wire::decode_publish_response, m)?)?;
    m.add_function(wrap_pyfunction!(wire::encode_subscribe, m)?)?;
    m.add_function(wrap_pyfunction!(wire::encode_follow, m)?)?;
    m.add_function(wrap_pyfunction!(wire::encode_announce, m)?)?;
    m.add_function(wrap_pyfunction!(wire::decode_announce, m)?)?;
    m.add_function(wrap_pyfunction!(wire::follow_span, m)?)?;
    m.add_function(wrap_pyfunction!(wire::decode_stats, m)?)?;
    m.add_function(wrap_pyfunction!(wire::decode_records, m)?)?;
    m.add_function(wrap_pyfunction!(wire::apply_records, m)?)?;
    m.add_function(wrap_pyfunction!(wire::wire_span, m)?)?;
    m.add_function(wrap_pyfunction!(wire::draft_server_main, m)?)?;
    m.add_function(wrap_pyfunction!(wire::draft_server_help, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("SNAPSHOT_FORMAT_VERSION", histospec_index::FORMAT_VERSION)?;
    Ok(())
}

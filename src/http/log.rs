//! `GET /api/v1/nodes/{id}/log`: the last lines a node's installer sent to pxed (issue
//! 11), for `pxed node show --log` and scripts. Under the API's bearer token.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, Query, State};
use serde::Deserialize;

use super::error::ApiError;
use crate::state::AppState;
use crate::wire::InstallLog;

/// Query of `GET /api/v1/nodes/{id}/log`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogQuery {
    /// Which generation (default: the node's current one).
    pub generation: Option<i64>,
    /// At most this many lines, the newest (default and cap: `syslog.lines_per_node`).
    pub limit: Option<u32>,
}

/// `GET /api/v1/nodes/{id}/log` (id, name, hostname or MAC).
pub async fn node_log(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    Query(q): Query<LogQuery>,
) -> Result<Json<InstallLog>, ApiError> {
    let n = st
        .store
        .find_node(&id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("node {id}")))?;
    let cap = st.cfg.syslog.lines_per_node;
    let generation = q.generation.unwrap_or(n.generation);
    let lines = st
        .store
        .install_log(n.id, generation, q.limit.unwrap_or(cap).min(cap))
        .await?;
    Ok(Json(InstallLog {
        node_id: n.id,
        generation,
        lines,
    }))
}

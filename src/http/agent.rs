//! What installers and the first-boot agent talk to, authenticated by the node's
//! per-generation boot token: generated install configs under `/cfg/{token}/...` and
//! callbacks under `/cb/{token}/...`.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};

use super::error::{ApiError, JsonBody};
use crate::app::AppState;
use crate::images::Arch;
use crate::lifecycle::transition::Event;
use crate::store::nodes::NodeRow;
use crate::wire::{FirstBootReport, HealthReport, HealthStatus};

/// Routes for installers and agents.
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/cfg/{token}/{file}", get(config))
        .route("/cb/{token}/installed", post(installed))
        .route("/cb/{token}/first-boot", post(first_boot))
        .route("/cb/{token}/health", post(health))
}

/// The node that holds `token` now. An unknown token (another node's old one, or an
/// older generation's) is refused with 403 and logged without the token itself.
async fn by_token(st: &AppState, token: &str, what: &str) -> Result<NodeRow, ApiError> {
    match st.store.node_by_token(token).await? {
        Some(n) => Ok(n),
        None => {
            tracing::warn!(
                token_prefix = token.get(..6).unwrap_or(""),
                what,
                "refused: unknown or stale boot token"
            );
            st.stats.stale_tokens.inc();
            Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "stale_token",
                "unknown or stale boot token: this install was superseded",
            ))
        }
    }
}

/// `http://host[:port]` as the client reached us (falls back to the configured server).
pub fn base_url(st: &AppState, headers: &HeaderMap) -> String {
    if let Some(h) = headers.get(header::HOST).and_then(|h| h.to_str().ok())
        && !h.is_empty()
        && h.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | ':' | '-' | '[' | ']'))
    {
        return format!("http://{h}");
    }
    st.default_base_url()
}

async fn config(
    State(st): State<Arc<AppState>>,
    Path((token, file)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let n = by_token(&st, &token, "config").await?;
    let base = base_url(&st, &headers);
    let text = st.render_config(&n, &file, &base, &token).await?;
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response())
}

async fn apply_cb(st: &AppState, n: &NodeRow, event: Event) -> Result<Response, ApiError> {
    let applied = st.lifecycle.apply(n.id, &event, "agent").await?;
    Ok((
        StatusCode::OK,
        Json(serde_json::json!({
            "node_id": applied.node.id,
            "state": applied.node.state,
            "generation": applied.node.generation,
        })),
    )
        .into_response())
}

async fn installed(
    State(st): State<Arc<AppState>>,
    Path(token): Path<String>,
) -> Result<Response, ApiError> {
    let n = by_token(&st, &token, "installed").await?;
    apply_cb(
        &st,
        &n,
        Event::InstallFinished {
            generation: n.generation,
        },
    )
    .await
}

/// `POST /cb/{token}/first-boot`.
async fn first_boot(
    State(st): State<Arc<AppState>>,
    Path(token): Path<String>,
    JsonBody(r): JsonBody<FirstBootReport>,
) -> Result<Response, ApiError> {
    let n = by_token(&st, &token, "first-boot").await?;
    if r.hostname.is_empty() || r.hostname.len() > 253 {
        return Err(ApiError::bad_request("hostname must be 1..253 characters"));
    }
    let arch = r.arch.as_deref().and_then(Arch::parse);
    let facts = serde_json::json!({
        "reported_hostname": r.hostname,
        "arch": arch.map(|a| a.as_str()),
        "hardware": r.facts,
    });
    if let Some(a) = arch {
        st.store.set_arch(n.id, a.as_str()).await?;
    }
    apply_cb(
        &st,
        &n,
        Event::FirstBootReported {
            generation: n.generation,
            hostname: r.hostname,
            facts: facts.to_string(),
        },
    )
    .await
}

/// `POST /cb/{token}/health`.
async fn health(
    State(st): State<Arc<AppState>>,
    Path(token): Path<String>,
    JsonBody(r): JsonBody<HealthReport>,
) -> Result<Response, ApiError> {
    let n = by_token(&st, &token, "health").await?;
    let event = match r.status {
        HealthStatus::Pass => Event::HealthPassed {
            generation: n.generation,
        },
        HealthStatus::Fail => Event::HealthFailed {
            generation: n.generation,
            detail: if r.detail.is_empty() {
                "health check failed (no detail)".into()
            } else {
                r.detail
            },
        },
    };
    apply_cb(&st, &n, event).await
}

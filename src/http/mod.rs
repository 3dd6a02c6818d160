//! HTTP: boot scripts, images and iPXE binaries, health and metrics.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio_util::sync::CancellationToken;
use tower_http::services::ServeDir;

use crate::model::Mac;
use crate::script;
use crate::state::AppState;

pub mod agent;
pub mod api;
pub mod error;
pub mod status;

/// Request bodies larger than this are refused with 413 (callbacks and API are small).
pub const MAX_BODY: usize = 64 * 1024;

/// Builds the router over the shared state.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/boot/{file}", get(boot_script))
        .nest("/api/v1", api::routes(state.clone()))
        .merge(agent::routes())
        .merge(status::routes())
        .nest_service("/ipxe", ServeDir::new(&state.cfg.ipxe_dir))
        .nest_service("/images", ServeDir::new(&state.cfg.images_dir))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .with_state(state)
}

/// Serves until `cancel` fires, then drains open connections.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    cancel: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(cancel.cancelled_owned())
        .await
}

/// Liveness, per component: `ok` and 200 when pxed can do its job, else `degraded`
/// and 503, each line naming a component and its state. Servers that stop end the
/// daemon, so a running pxed has all its listeners.
async fn healthz(State(st): State<Arc<AppState>>) -> Response {
    let store = st.store.probe_write().await;
    let mut body = String::from(if store.is_ok() { "ok\n" } else { "degraded\n" });
    match &store {
        Ok(()) => body.push_str("store: writable\n"),
        Err(e) => body.push_str(&format!("store: not writable: {e}\n")),
    }
    body.push_str(&format!(
        "listeners: http {}, tftp {}, dhcp {:?}\n",
        st.cfg.http, st.cfg.tftp, st.cfg.dhcp.mode
    ));
    body.push_str(&format!(
        "worker: {} deadlines armed\n",
        st.lifecycle.armed_deadlines()
    ));
    let status = if store.is_ok() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, body).into_response()
}

/// Readiness: 200 when the store takes writes (every boot decision is one), else 503
/// with the reason.
async fn readyz(State(st): State<Arc<AppState>>) -> Response {
    match st.store.probe_write().await {
        Ok(()) => (StatusCode::OK, "ready\n").into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: store: {e}\n"),
        )
            .into_response(),
    }
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let body = st.render_metrics();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

/// `/boot/{mac}.ipxe`: the per-node script.
async fn boot_script(
    State(st): State<Arc<AppState>>,
    Path(file): Path<String>,
    headers: axum::http::HeaderMap,
) -> Response {
    let Some(mac) = file.strip_suffix(".ipxe").and_then(|m| {
        m.replace("%3A", ":")
            .replace("%3a", ":")
            .parse::<Mac>()
            .ok()
    }) else {
        return (StatusCode::NOT_FOUND, "expected /boot/<mac>.ipxe\n").into_response();
    };
    let base = agent::base_url(&st, &headers);
    let (action, reason) = crate::provision::boot_action(&st, mac, &base).await;
    match script::render(&mac.to_string(), &action, &reason) {
        Ok(s) => ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], s).into_response(),
        Err(e) => {
            tracing::error!(%mac, error = %e, "rendering boot script");
            (StatusCode::INTERNAL_SERVER_ERROR, "script error\n").into_response()
        }
    }
}

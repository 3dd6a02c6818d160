//! The technicians' status page: every node, where it is, since when and why it
//! failed, updated live over server-sent events. Read-only and without secrets, but
//! it lists every node's MACs and state, so it needs a credential unless the
//! operator sets `status_public` (the demo does, on loopback): the API token as a
//! bearer token, or once as `/?token=…`, which sets a cookie holding a read-only
//! viewer credential derived from it (the cookie cannot call the API).

use std::convert::Infallible;
use std::sync::Arc;

use askama::Template;
use axum::extract::{Path, State};
use axum::http::header;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;

use super::api::{NodeView, PageQuery, view};
use super::error::{ApiError, QueryParams};
use crate::state::AppState;
use crate::store::nodes::EventRow;

/// Routes of the status page.
pub fn routes(state: Arc<AppState>) -> Router<Arc<AppState>> {
    Router::new()
        .route("/", get(page))
        .route("/status.json", get(status_json))
        .route("/nodes/{id}", get(node_page))
        .route("/events", get(events))
        .route_layer(axum::middleware::from_fn_with_state(state, viewer_auth))
}

/// The cookie that carries the viewer credential.
const COOKIE: &str = "pxed_viewer";

/// The read-only credential derived from the API token: what the cookie holds.
pub fn viewer_credential(api_token: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(format!("pxed-status-v1:{api_token}")))
}

/// Lets a request through when the page is public or it carries the API token
/// (bearer) or the viewer cookie; `?token=<API token>` sets the cookie and redirects
/// to the same page without the token in its URL.
async fn viewer_auth(
    State(st): State<Arc<AppState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    use axum::http::StatusCode;
    if st.cfg.status_public {
        return next.run(req).await;
    }
    let viewer = viewer_credential(&st.api_token);
    let bearer = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let cookie = req
        .headers()
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().strip_prefix(&format!("{COOKIE}=")))
        .any(|c| super::api::constant_time_eq(c.as_bytes(), viewer.as_bytes()));
    if cookie
        || bearer
            .is_some_and(|b| super::api::constant_time_eq(b.as_bytes(), st.api_token.as_bytes()))
    {
        return next.run(req).await;
    }
    let query_token = req.uri().query().and_then(|q| {
        q.split('&')
            .find_map(|kv| kv.strip_prefix("token="))
            .map(str::to_string)
    });
    if let Some(t) = query_token
        && super::api::constant_time_eq(t.as_bytes(), st.api_token.as_bytes())
    {
        let path = req.uri().path().to_string();
        return (
            StatusCode::SEE_OTHER,
            [
                (header::LOCATION, path),
                (
                    header::SET_COOKIE,
                    format!("{COOKIE}={viewer}; Path=/; HttpOnly; SameSite=Strict"),
                ),
            ],
        )
            .into_response();
    }
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "the status page needs the API token: open /?token=<API token> once, or set status_public",
    )
    .into_response()
}

/// What the page shows: counts over every node, and one page of nodes (see
/// [`PageQuery`]).
#[derive(Debug, Serialize)]
pub struct Status {
    pub nodes: Vec<NodeView>,
    pub counts: Vec<(String, i64)>,
    /// Nodes in the inventory.
    pub total: i64,
    /// The state this page is filtered on, if any.
    pub state: Option<String>,
    /// Query string of the next page (`/status.json?…`, `/?…`), if there is more.
    pub next: Option<String>,
    pub generated_at: String,
}

async fn status(st: &AppState, q: &PageQuery) -> Result<Status, ApiError> {
    let counts = st.store.state_counts().await?;
    let p = super::api::page(st, q).await?;
    Ok(Status {
        nodes: p.nodes,
        total: counts.iter().map(|(_, n)| n).sum(),
        counts: counts
            .into_iter()
            .map(|(s, n)| (s.to_string(), n))
            .collect(),
        state: q.state.map(|s| s.to_string()),
        next: p.next,
        generated_at: crate::store::nodes::now(),
    })
}

#[derive(Template)]
#[template(path = "status.html")]
struct StatusPage<'a> {
    s: &'a Status,
}

async fn page(
    State(st): State<Arc<AppState>>,
    QueryParams(q): QueryParams<PageQuery>,
) -> Result<Response, ApiError> {
    let s = status(&st, &q).await?;
    render(StatusPage { s: &s })
}

async fn status_json(
    State(st): State<Arc<AppState>>,
    QueryParams(q): QueryParams<PageQuery>,
) -> Result<Json<Status>, ApiError> {
    Ok(Json(status(&st, &q).await?))
}

#[derive(Template)]
#[template(path = "node.html")]
struct NodePage<'a> {
    n: &'a NodeView,
    events: &'a [EventRow],
    log: &'a [crate::wire::InstallLogLine],
}

async fn node_page(
    State(st): State<Arc<AppState>>,
    Path(id): Path<i64>,
) -> Result<Response, ApiError> {
    let row = st
        .store
        .node(id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("node {id}")))?;
    let events = st.store.events(id).await?;
    let log = st.store.install_log(id, row.generation, 50).await?;
    let n = view(&st, row).await?;
    render(NodePage {
        n: &n,
        events: &events,
        log: &log,
    })
}

fn render(t: impl Template) -> Result<Response, ApiError> {
    let html = t.render().map_err(|e| {
        ApiError::new(
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            "render",
            e.to_string(),
        )
    })?;
    Ok(([(header::CACHE_CONTROL, "no-store")], Html(html)).into_response())
}

/// `GET /events`: one SSE message per committed change.
/// Most status pages streaming at once; each holds a connection and a subscription.
pub const MAX_SUBSCRIBERS: usize = 64;

async fn events(State(st): State<Arc<AppState>>) -> Response {
    let Ok(permit) = st.subscribers.clone().try_acquire_owned() else {
        return ApiError::new(
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            "busy",
            format!(
                "{MAX_SUBSCRIBERS} status pages are streaming already; /status.json still answers"
            ),
        )
        .into_response();
    };
    let rx = st.lifecycle.subscribe();
    // The permit lives as long as the stream's state.
    let stream = futures::stream::unfold((rx, permit), |(mut rx, permit)| async move {
        let event = match rx.recv().await {
            Ok(c) => Event::default()
                .event("node")
                .data(serde_json::to_string(&c).unwrap_or_default()),
            // A slow page missed some: tell it to reload everything.
            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                Event::default().event("resync").data("{}")
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
        };
        Some((Ok::<_, Infallible>(event), (rx, permit)))
    });
    // Ends on shutdown: an open page must not hold SIGTERM for the drain deadline.
    let stream = futures::StreamExt::take_until(stream, st.shutdown.clone().cancelled_owned());
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

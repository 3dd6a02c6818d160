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
use super::board::{self, StageView};
use super::error::{ApiError, QueryParams};
use crate::lifecycle::transition::State as NodeState;
use crate::state::AppState;
use crate::store::board::Labels;
use crate::store::nodes::{BmcRow, EventRow};

/// Routes of the status page.
pub fn routes(state: Arc<AppState>) -> Router<Arc<AppState>> {
    Router::new()
        .route("/", get(page))
        .route("/status.json", get(status_json))
        .route("/nodes/{id}", get(node_page))
        .route("/events", get(events))
        .route_layer(axum::middleware::from_fn_with_state(state, viewer_auth))
        .route("/login", axum::routing::post(login))
        .route("/logout", axum::routing::post(logout))
}

/// The login form, shown instead of a page that needs a credential.
#[derive(Template)]
#[template(path = "login.html")]
struct LoginPage<'a> {
    next: &'a str,
    error: Option<&'a str>,
}

/// `next` when it is a path on this server (never `//host` or a URL), else `/`.
fn local_path(next: &str) -> &str {
    if next.starts_with('/') && !next.starts_with("//") && !next.contains('\\') {
        next
    } else {
        "/"
    }
}

fn login_page(status: axum::http::StatusCode, next: &str, error: Option<&str>) -> Response {
    match (LoginPage {
        next: local_path(next),
        error,
    })
    .render()
    {
        Ok(html) => (status, [(header::CACHE_CONTROL, "no-store")], Html(html)).into_response(),
        Err(e) => ApiError::new(
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            "render",
            e.to_string(),
        )
        .into_response(),
    }
}

fn viewer_cookie(viewer: &str) -> String {
    format!("{COOKIE}={viewer}; Path=/; HttpOnly; SameSite=Strict")
}

#[derive(serde::Deserialize)]
struct LoginForm {
    token: String,
    #[serde(default)]
    next: String,
}

/// `POST /login` (form `token`, `next`): the API token buys a viewer cookie, which
/// holds a credential derived from the token, never the token.
async fn login(State(st): State<Arc<AppState>>, axum::Form(f): axum::Form<LoginForm>) -> Response {
    use axum::http::StatusCode;
    let next = local_path(&f.next).to_string();
    if !super::api::constant_time_eq(f.token.trim().as_bytes(), st.api_token.as_bytes()) {
        return login_page(
            StatusCode::UNAUTHORIZED,
            &next,
            Some("that is not the API token"),
        );
    }
    (
        StatusCode::SEE_OTHER,
        [
            (header::LOCATION, next),
            (
                header::SET_COOKIE,
                viewer_cookie(&viewer_credential(&st.api_token)),
            ),
        ],
    )
        .into_response()
}

/// `POST /logout`: drops the viewer cookie.
async fn logout() -> Response {
    (
        axum::http::StatusCode::SEE_OTHER,
        [
            (header::LOCATION, "/".to_string()),
            (
                header::SET_COOKIE,
                format!("{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"),
            ),
        ],
    )
        .into_response()
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
                (header::SET_COOKIE, viewer_cookie(&viewer)),
            ],
        )
            .into_response();
    }
    // A browser gets the login form; anything else a JSON reason.
    let wants_html = req.method() == axum::http::Method::GET
        && req
            .headers()
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|a| a.contains("text/html"));
    if wants_html {
        let next = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str())
            .unwrap_or("/");
        return login_page(StatusCode::UNAUTHORIZED, next, None);
    }
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "the status page needs the API token: log in at / with it, open /?token=<API token> once, or set status_public",
    )
    .into_response()
}

/// One row of the board: the node, its labels, its current stage and why it failed.
#[derive(Debug, Serialize)]
pub struct BoardRow {
    #[serde(flatten)]
    pub node: NodeView,
    pub labels: Labels,
    /// The name links and titles use (name, else hostname, else `node N`).
    pub title: String,
    pub stage: StageView,
    /// `<step>: <reason>` when failed or quarantined.
    pub reason: Option<String>,
}

impl BoardRow {
    /// `rack=r12, row=b`.
    pub fn labels_text(&self) -> String {
        self.labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// `3 min 5 s of 15 min 0 s` (or just the elapsed time in a resting state).
    pub fn in_stage(&self) -> String {
        self.stage.text()
    }
}

/// What the page shows: counts over every node, and one page of nodes (see
/// [`PageQuery`]).
#[derive(Debug, Serialize)]
pub struct Status {
    pub nodes: Vec<BoardRow>,
    pub counts: Vec<(String, i64)>,
    /// Nodes in the inventory.
    pub total: i64,
    /// The state this page is filtered on, if any.
    pub state: Option<String>,
    pub arch: Option<String>,
    pub label: Option<String>,
    pub q: Option<String>,
    pub profile: Option<String>,
    pub drifted: Option<bool>,
    pub site: Option<String>,
    /// Whether to show the site column: this instance has a site, or a node on the
    /// page has one.
    pub sites: bool,
    /// The configured hardware profiles (the filter's choices).
    pub profiles: Vec<String>,
    /// The filters as a query string (for links to the same selection).
    pub query: String,
    /// Nodes on this page past their stage's expected duration.
    pub overdue: usize,
    /// Query string of the next page (`/status.json?…`, `/?…`), if there is more.
    pub next: Option<String>,
    pub generated_at: String,
}

impl Status {
    /// Whether any filter is set.
    pub fn filtered(&self) -> bool {
        self.state.is_some()
            || self.arch.is_some()
            || self.label.is_some()
            || self.q.is_some()
            || self.profile.is_some()
            || self.drifted.is_some()
            || self.site.is_some()
    }
}

async fn status(st: &AppState, q: &PageQuery) -> Result<Status, ApiError> {
    let counts = st.store.state_counts().await?;
    let p = super::api::page(st, q).await?;
    let policy = st.lifecycle.policy();
    let now = chrono::Utc::now();
    let wire = st.store.current_stages().await?;
    let expected = &st.cfg.stages.expected;
    let nodes: Vec<BoardRow> = p
        .nodes
        .into_iter()
        .zip(p.labels)
        .map(|(node, labels)| BoardRow {
            title: board::title_of(&node),
            stage: board::stage_of(
                &node,
                &policy,
                wire.get(&node.id).map(|(s, at)| (*s, at.as_str())),
                expected,
                now,
            ),
            reason: board::reason_of(&node),
            labels,
            node,
        })
        .collect();
    let sites = st.cfg.site.is_some() || nodes.iter().any(|r| r.node.site.is_some());
    Ok(Status {
        sites,
        site: q.site.clone(),
        overdue: nodes.iter().filter(|r| r.stage.overdue).count(),
        nodes,
        total: counts.iter().map(|(_, n)| n).sum(),
        counts: counts
            .into_iter()
            .map(|(s, n)| (s.to_string(), n))
            .collect(),
        query: q.filter_query(),
        state: q.state.map(|s| s.to_string()),
        arch: q.arch.map(|a| a.to_string()),
        label: q.label.clone(),
        q: q.q.clone(),
        profile: q.profile.clone(),
        drifted: q.drifted,
        profiles: st.cfg.profiles.iter().map(|p| p.name.clone()).collect(),
        next: p.next,
        generated_at: crate::store::nodes::now(),
    })
}

#[derive(Template)]
#[template(path = "status.html")]
struct StatusPage<'a> {
    s: &'a Status,
    states: &'a [NodeState],
}

async fn page(
    State(st): State<Arc<AppState>>,
    QueryParams(q): QueryParams<PageQuery>,
) -> Result<Response, ApiError> {
    let s = status(&st, &q).await?;
    render(StatusPage {
        s: &s,
        states: &NodeState::ALL,
    })
}

async fn status_json(
    State(st): State<Arc<AppState>>,
    QueryParams(q): QueryParams<PageQuery>,
) -> Result<Json<Status>, ApiError> {
    Ok(Json(status(&st, &q).await?))
}

/// An operator button on the node page: what it calls, and whether it applies now.
#[derive(Debug)]
struct Button {
    /// `reinstall`, `power-cycle`, `mark-available`, `quarantine`.
    id: &'static str,
    label: &'static str,
    method: &'static str,
    /// Path under `/api/v1`.
    path: String,
    /// Why it is off in this state, if it is.
    off: Option<String>,
    /// Asks for a reason first.
    reason: bool,
}

fn buttons(n: &NodeView, has_bmc: bool) -> Vec<Button> {
    use crate::lifecycle::transition::{State as S, a_node_in, operator_actions};
    let id = n.id;
    let reinstall_off = (!operator_actions(n.state).contains(&"reinstall"))
        .then(|| format!("{} cannot be reinstalled", a_node_in(n.state)));
    let cycle_off = if !has_bmc {
        Some("no BMC is registered".to_string())
    } else if n.state == S::Reclaiming {
        Some("the reinstall is power-cycling it".to_string())
    } else {
        None
    };
    // `available` is reached from here by the action that leaves this state.
    let (avail_action, avail_off) = match n.state {
        S::Discovered => ("enroll", None),
        S::Allocated => ("release", None),
        S::Quarantined => ("restore", None),
        s => (
            "restore",
            Some(format!(
                "from {s}: {}",
                if s == S::Failed {
                    "reinstall it"
                } else {
                    "not an operator's step"
                }
            )),
        ),
    };
    vec![
        Button {
            id: "reinstall",
            label: "reinstall",
            method: "POST",
            path: format!("/nodes/{id}/reinstall"),
            off: reinstall_off,
            reason: false,
        },
        Button {
            id: "power-cycle",
            label: "power cycle",
            method: "POST",
            path: format!("/nodes/{id}/bmc/power-cycle"),
            off: cycle_off,
            reason: false,
        },
        Button {
            id: "mark-available",
            label: "mark available",
            method: "POST",
            path: format!("/nodes/{id}/actions/{avail_action}"),
            off: avail_off,
            reason: false,
        },
        Button {
            id: "accept-hardware",
            label: "accept hardware",
            method: "POST",
            path: format!("/nodes/{id}/inventory/accept"),
            off: (!(n.state == S::Quarantined
                && n.failed_reason
                    .as_deref()
                    .is_some_and(|r| r.starts_with("inventory:"))))
            .then(|| "the acceptance gate did not quarantine it".to_string()),
            reason: false,
        },
        Button {
            id: "quarantine",
            label: "quarantine",
            method: "POST",
            path: format!("/nodes/{id}/actions/quarantine"),
            off: (n.state == S::Quarantined).then(|| "already quarantined".to_string()),
            reason: true,
        },
    ]
}

#[derive(Template)]
#[template(path = "node.html")]
struct NodePage<'a> {
    n: &'a NodeView,
    title: &'a str,
    labels: &'a Labels,
    stage: &'a StageView,
    reason: Option<&'a str>,
    /// What a reinstall without an image would install.
    image_next: &'a str,
    bmc: Option<&'a BmcRow>,
    timeline: Option<&'a board::Timeline>,
    previous: &'a [board::GenerationSummary],
    events: &'a [EventRow],
    leased: &'a [String],
    /// This generation's stages from the wire (DHCP, TFTP, HTTP, callbacks), in order.
    wire: &'a [WireRow],
    log: &'a [crate::wire::InstallLogLine],
    buttons: &'a [Button],
    hardware: &'a HardwareView,
    axis_width: f64,
    generated_at: &'a str,
}

/// The node page's hardware section.
struct HardwareView {
    profile: String,
    baseline: String,
    gate: String,
    /// The newest generation with an inventory, and who reported it.
    reported: String,
    lines: Vec<String>,
    /// Changes since the baseline: text and whether it is a loss.
    changes: Vec<(String, bool)>,
}

async fn hardware_view(st: &AppState, id: i64) -> Result<HardwareView, ApiError> {
    let hw = st.store.hardware(id).await?;
    let rows = st.store.inventories(id).await?;
    let generation = crate::hardware::newest(&rows);
    let inv = generation.and_then(|g| crate::hardware::shown(&rows, g));
    let verdict =
        generation.and_then(|g| crate::hardware::verdict(&st.cfg.profiles, &hw, &rows, g));
    Ok(HardwareView {
        profile: hw.profile.clone().unwrap_or_else(|| "none".into()),
        baseline: hw
            .baseline_generation
            .map_or_else(|| "none yet".into(), |g| format!("generation {g}")),
        gate: match (hw.checked_generation, hw.passed) {
            (Some(g), Some(true)) => format!("passed in generation {g}"),
            (Some(g), Some(false)) => format!(
                "failed in generation {g}: {}",
                hw.verdict.as_ref().map(|v| v.reason()).unwrap_or_default()
            ),
            _ => "not run yet".into(),
        },
        reported: match generation {
            None => String::new(),
            Some(g) => format!(
                "generation {g}, from {}",
                rows.iter()
                    .filter(|r| r.generation == g)
                    .map(|r| match r.took_ms {
                        Some(ms) => format!("{} ({ms} ms)", r.source),
                        None => r.source.to_string(),
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        },
        lines: inv
            .as_ref()
            .map(crate::inventory::summary)
            .unwrap_or_default(),
        changes: verdict
            .map(|v| {
                v.changes
                    .iter()
                    .map(|c| (c.to_string(), c.degraded))
                    .collect()
            })
            .unwrap_or_default(),
    })
}

/// What a reinstall that names no image installs, as the API decides it: the config's
/// `default_image`, else the node's last image, else nothing (the reinstall is refused).
fn image_next(last: Option<&str>, default: Option<&str>) -> String {
    match (default, last) {
        (Some(d), Some(l)) if d == l => "a reinstall without an image installs it again".into(),
        (Some(d), _) => format!("a reinstall without an image installs {d} (default_image)"),
        (None, Some(_)) => "a reinstall without an image installs it again".into(),
        (None, None) => "a reinstall must name an image: no default_image is configured".into(),
    }
}

/// One stage seen on the wire, as the node page lists it.
struct WireRow {
    stage: String,
    at: String,
    /// `10485760 bytes in 812 ms`, the script's action, a failure reason.
    what: String,
    /// `12 s (expected 2 min 0 s)`; empty for the current stage.
    lasted: String,
    over: bool,
}

fn wire_rows(views: &[crate::wire::StageView]) -> Vec<WireRow> {
    views
        .iter()
        .map(|v| {
            let mut what = Vec::new();
            if let Some(b) = v.bytes {
                what.push(match v.took_ms {
                    Some(ms) => format!("{b} bytes in {ms} ms"),
                    None => format!("{b} bytes"),
                });
            }
            if let Some(d) = &v.detail {
                what.push(d.clone());
            }
            let secs = |ms: u64| board::human(i64::try_from(ms / 1000).unwrap_or(i64::MAX));
            let lasted = match (v.lasted_ms, v.expected_ms) {
                (Some(l), Some(e)) => format!("{} (expected {})", secs(l), secs(e)),
                (Some(l), None) => secs(l),
                (None, _) => String::new(),
            };
            WireRow {
                stage: v.stage.to_string(),
                at: v.at.clone(),
                what: what.join("; "),
                lasted,
                over: matches!((v.lasted_ms, v.expected_ms), (Some(l), Some(e)) if l > e),
            }
        })
        .collect()
}

/// `/nodes/{id}`: `{id}` is what the API takes (the id, name, hostname or a MAC in any
/// notation), so a technician can type the name from a label on the machine.
async fn node_page(
    State(st): State<Arc<AppState>>,
    Path(reference): Path<String>,
) -> Result<Response, ApiError> {
    let Some(row) = st.store.find_node(&reference).await? else {
        // A page, not JSON: this is a browser. The reference is not echoed back.
        return Ok((
            axum::http::StatusCode::NOT_FOUND,
            [(header::CACHE_CONTROL, "no-store")],
            Html(
                "<!doctype html><meta charset=\"utf-8\"><title>no such node</title>\
                 <p>No node has that id, name, hostname or MAC. \
                 <a href=\"/\">Back to the board</a>.</p>\n",
            ),
        )
            .into_response());
    };
    let id = row.id;
    let mut events = st.store.events(id).await?;
    let log = st.store.install_log(id, row.generation, 50).await?;
    let bmc = st.store.bmc(id).await?;
    let labels = st.store.labels(id).await?;
    let now_unix = i64::try_from(crate::dhcp::unix_now()).unwrap_or(i64::MAX);
    let mut leased = st.store.leased_ips(id, now_unix).await?;
    if let Some(ip) = &row.boot_ip {
        leased.push(format!("{ip} (installer served to)"));
    }
    let n = view(&st, row).await?;
    let policy = st.lifecycle.policy();
    let now = chrono::Utc::now();
    let timeline = board::timeline(&n, &events, &policy, now);
    let previous = board::previous_generations(&n, &events);
    // Newest first in the audit table.
    events.reverse();
    let title = board::title_of(&n);
    let rows = crate::stages::ordered(st.store.generation_stages(n.id, n.generation).await?);
    let wire = wire_rows(&crate::stages::views(&rows, &st.cfg.stages.expected));
    let stage = board::stage_of(
        &n,
        &policy,
        rows.last().map(|r| (r.stage, r.at.as_str())),
        &st.cfg.stages.expected,
        now,
    );
    let reason = board::reason_of(&n);
    let image_next = image_next(n.image.as_deref(), st.cfg.default_image.as_deref());
    let buttons = buttons(&n, bmc.is_some());
    let hardware = hardware_view(&st, id).await?;
    render(NodePage {
        n: &n,
        title: &title,
        labels: &labels,
        stage: &stage,
        reason: reason.as_deref(),
        image_next: &image_next,
        bmc: bmc.as_ref(),
        timeline: timeline.as_ref(),
        previous: &previous,
        events: &events,
        leased: &leased,
        wire: &wire,
        log: &log,
        buttons: &buttons,
        hardware: &hardware,
        axis_width: board::AXIS_WIDTH,
        generated_at: &crate::store::nodes::now(),
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

#[cfg(test)]
mod tests {
    use super::image_next;

    /// The node page's image line follows the API's choice: the request's image, else
    /// `default_image`, else the node's last image.
    #[test]
    fn image_next_says_what_a_bare_reinstall_installs() {
        assert_eq!(
            image_next(Some("rocky-9"), Some("debian-12")),
            "a reinstall without an image installs debian-12 (default_image)"
        );
        assert_eq!(
            image_next(None, Some("debian-12")),
            "a reinstall without an image installs debian-12 (default_image)"
        );
        assert_eq!(
            image_next(Some("debian-12"), Some("debian-12")),
            "a reinstall without an image installs it again"
        );
        assert_eq!(
            image_next(Some("rocky-9"), None),
            "a reinstall without an image installs it again"
        );
        assert!(image_next(None, None).contains("must name an image"));
    }
}

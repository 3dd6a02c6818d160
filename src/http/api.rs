//! `/api/v1`: the JSON API (bearer-token auth) for nodes, reinstalls and images.

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

use super::error::{ApiError, JsonBody, QueryParams};
use crate::lifecycle::apply::Hooks;
use crate::lifecycle::transition::{BootToken, Event, Outcome, State as NodeState};
use crate::lifecycle::worker::ConnectError;
use crate::model::{Mac, NodeArch};
use crate::state::AppState;
use crate::store::nodes::{BmcRow, NewNode, NodeRow};
pub use crate::wire::{
    BmcCheck, BmcView, CreateBmc, CreateNode, EventView, NodeDetail, NodeView, Operation,
    ReinstallRequest, SshKeys,
};

/// Routes under `/api/v1` (auth applied by the caller).
pub fn routes(state: Arc<AppState>) -> Router<Arc<AppState>> {
    Router::new()
        .route("/nodes", get(list_nodes).post(create_node))
        .route("/nodes/{id}", get(get_node).delete(delete_node))
        .route("/nodes/{id}/reinstall", post(reinstall))
        .route("/nodes/{id}/log", get(super::log::node_log))
        .route("/nodes/{id}/ssh-keys", put(set_ssh_keys))
        .route("/nodes/{id}/stages", get(node_stages))
        .route("/report", get(report))
        .route("/nodes/{id}/actions/{action}", post(action))
        .route("/nodes/{id}/bmc/check", post(bmc_check))
        .route("/nodes/{id}/bmc/power-cycle", post(bmc_power_cycle))
        .route("/nodes/{id}/labels", get(get_labels).put(put_labels))
        .merge(super::hardware::routes())
        .route("/images", get(list_images))
        .route("/leftovers", get(super::leftovers::list))
        .route(
            "/leftovers/{kind}/{subject}/resolve",
            post(super::leftovers::resolve),
        )
        // After every route: it applies to the routes registered before it.
        .method_not_allowed_fallback(|method: axum::http::Method| async move {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                format!("{method} is not allowed on this path (the Allow header lists what is)"),
            )
        })
        .fallback(|| async { ApiError::not_found("API route") })
        .route_layer(axum::middleware::from_fn_with_state(state, auth))
}

/// Bearer-token check, constant time. The token is never logged.
async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if !constant_time_eq(given.as_bytes(), st.api_token.as_bytes()) {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or wrong bearer token",
        )
        .into_response();
    }
    next.run(req).await
}

/// Compares secrets in constant time.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    use sha2::Digest;
    // Hashing first makes the comparison independent of the lengths too.
    let (ha, hb) = (sha2::Sha256::digest(a), sha2::Sha256::digest(b));
    ha.iter()
        .zip(hb.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
        && !b.is_empty()
}

fn bmc_view(b: BmcRow) -> BmcView {
    BmcView {
        driver: b.driver,
        address: b.address,
        username: b.username,
        system_id: b.system_id,
        tls_pin: b.tls_pin,
        tls_insecure: b.tls_insecure,
    }
}

/// Builds the API view of a stored node.
pub async fn view(st: &AppState, n: NodeRow) -> Result<NodeView, ApiError> {
    let macs = st.store.macs(n.id).await?;
    Ok(view_with(n, macs))
}

/// The view of a node whose MACs were loaded already (listings load them all at once).
pub fn view_with(n: NodeRow, macs: Vec<Mac>) -> NodeView {
    NodeView {
        id: n.id,
        facts: n
            .facts
            .as_deref()
            .and_then(|f| serde_json::from_str(f).ok()),
        name: n.name,
        hostname: n.hostname,
        arch: n.arch,
        state: n.state,
        since: n.state_since,
        generation: n.generation,
        attempt: n.attempt,
        image: n.image,
        failed_step: n.failed_step,
        failed_reason: n.failed_reason,
        macs,
        site: n.site,
    }
}

/// Most nodes in one page of a listing (`?limit=`), and the page size when none is
/// asked for: a listing's memory and time stay bounded whatever the inventory holds.
pub const MAX_PAGE: u32 = 1000;
pub const DEFAULT_PAGE: u32 = 500;

/// `?limit=&after=&state=&arch=&label=&q=&site=` of a node listing (the API and the status
/// page): nodes with an id above `after`, in id order, optionally only those in
/// `state`, of `arch`, carrying `label` (`rack=r12` or `rack`) and whose MAC, name or
/// hostname contains `q`. An empty value (a form's "any") is no filter.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PageQuery {
    pub limit: Option<u32>,
    pub after: Option<i64>,
    #[serde(default, deserialize_with = "empty_as_none")]
    pub state: Option<NodeState>,
    #[serde(default, deserialize_with = "empty_as_none")]
    pub arch: Option<NodeArch>,
    #[serde(default, deserialize_with = "empty_as_none")]
    pub label: Option<String>,
    #[serde(default, deserialize_with = "empty_as_none")]
    pub q: Option<String>,
    /// Held to this hardware profile.
    #[serde(default, deserialize_with = "empty_as_none")]
    pub profile: Option<String>,
    /// `true`: lost hardware since the accepted baseline; `false`: did not.
    #[serde(default, deserialize_with = "empty_as_none")]
    pub drifted: Option<bool>,
    /// Served by this site.
    #[serde(default, deserialize_with = "empty_as_none")]
    pub site: Option<String>,
}

impl PageQuery {
    /// The filters, as the store takes them.
    pub fn filter(&self) -> crate::store::board::NodeFilter {
        crate::store::board::NodeFilter {
            state: self.state,
            arch: self.arch,
            label: self
                .label
                .as_deref()
                .and_then(crate::store::board::NodeFilter::label_of),
            text: self.q.clone(),
            profile: self.profile.clone(),
            drifted: self.drifted,
            site: self.site.clone(),
        }
    }

    /// The filters as a query string (`state=failed&q=52%3A54`), empty without any.
    pub fn filter_query(&self) -> String {
        use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
        let mut parts = Vec::new();
        let mut add = |k: &str, v: Option<String>| {
            if let Some(v) = v {
                parts.push(format!("{k}={}", utf8_percent_encode(&v, NON_ALPHANUMERIC)));
            }
        };
        add("state", self.state.map(|s| s.to_string()));
        add("arch", self.arch.map(|a| a.to_string()));
        add("label", self.label.clone());
        add("q", self.q.clone());
        add("profile", self.profile.clone());
        add("drifted", self.drifted.map(|d| d.to_string()));
        add("site", self.site.clone());
        parts.join("&")
    }
}

/// A query value that is empty (or only blanks) is absent; any other is parsed.
fn empty_as_none<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: std::str::FromStr,
    T::Err: std::fmt::Display,
{
    let s: Option<String> = Option::deserialize(d)?;
    match s.as_deref().map(str::trim) {
        None | Some("") => Ok(None),
        Some(v) => v.parse().map(Some).map_err(serde::de::Error::custom),
    }
}

/// One page of a listing, and the query string of the next page if there is more.
#[derive(Debug)]
pub struct Page {
    pub nodes: Vec<NodeView>,
    /// The labels of each node in `nodes`, in the same order.
    pub labels: Vec<crate::store::board::Labels>,
    pub next: Option<String>,
}

/// One page of nodes, in three queries however many there are.
pub async fn page(st: &AppState, q: &PageQuery) -> Result<Page, ApiError> {
    let limit = q.limit.unwrap_or(DEFAULT_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "bad_limit",
            format!("limit must be 1 to {MAX_PAGE} (got {limit})"),
        ));
    }
    let after = q.after.unwrap_or(0);
    let mut rows = st
        .store
        .nodes_filtered(after, limit + 1, &q.filter())
        .await?;
    let more = rows.len() > limit as usize;
    rows.truncate(limit as usize);
    let next = match rows.last() {
        Some((last, _, _)) if more => {
            let mut n = format!("after={}&limit={limit}", last.id);
            let f = q.filter_query();
            if !f.is_empty() {
                n.push('&');
                n.push_str(&f);
            }
            Some(n)
        }
        _ => None,
    };
    let mut nodes = Vec::with_capacity(rows.len());
    let mut labels = Vec::with_capacity(rows.len());
    for (n, m, l) in rows {
        nodes.push(view_with(n, m));
        labels.push(l);
    }
    Ok(Page {
        nodes,
        labels,
        next,
    })
}

/// `GET /api/v1/nodes`: one page (see [`PageQuery`]); when there is more, a
/// `Link: </api/v1/nodes?after=…>; rel="next"` header (RFC 8288) gives the next.
async fn list_nodes(
    State(st): State<Arc<AppState>>,
    QueryParams(q): QueryParams<PageQuery>,
) -> Result<Response, ApiError> {
    let p = page(&st, &q).await?;
    let mut resp = Json(p.nodes).into_response();
    if let Some(next) = p.next
        && let Ok(v) = format!("</api/v1/nodes?{next}>; rel=\"next\"").parse()
    {
        resp.headers_mut().insert(header::LINK, v);
    }
    Ok(resp)
}

pub(super) async fn find(st: &AppState, reference: &str) -> Result<NodeRow, ApiError> {
    st.store
        .find_node(reference)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("node {reference}")))
}

async fn get_node(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<NodeDetail>, ApiError> {
    let n = find(&st, &id).await?;
    let nid = n.id;
    // Boot MAC first.
    let macs = st.store.macs(nid).await?;
    let boot_mac = macs.first().copied();
    let bmc = st.store.bmc(nid).await?.map(bmc_view);
    let events = st.store.events(nid).await?;
    let ssh_authorized_keys = st.store.node_ssh_keys(nid).await?;
    let stages = crate::stages::ordered(st.store.generation_stages(nid, n.generation).await?);
    let stage = crate::stages::current(n.state, &stages, &st.stages.expected, chrono::Utc::now());
    Ok(Json(NodeDetail {
        node: view_with(n, macs),
        boot_mac,
        bmc,
        ssh_authorized_keys,
        events,
        stage,
    }))
}

/// Each key one OpenSSH line, and not too many.
fn check_ssh_keys(keys: &[String]) -> Result<(), ApiError> {
    if keys.len() > crate::model::MAX_NODE_SSH_KEYS {
        return Err(ApiError::bad_request(format!(
            "at most {} ssh_authorized_keys per node",
            crate::model::MAX_NODE_SSH_KEYS
        )));
    }
    for (i, k) in keys.iter().enumerate() {
        crate::model::check_authorized_key(k)
            .map_err(|e| ApiError::bad_request(format!("ssh_authorized_keys[{i}]: {e}")))?;
    }
    Ok(())
}

/// `PUT /api/v1/nodes/{id}/ssh-keys`: replaces the node's own keys; they reach the
/// installed system at its next install.
async fn set_ssh_keys(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<SshKeys>,
) -> Result<Json<SshKeys>, ApiError> {
    check_ssh_keys(&req.ssh_authorized_keys)?;
    let n = find(&st, &id).await?;
    if !st
        .store
        .set_node_ssh_keys(n.id, &req.ssh_authorized_keys, "api")
        .await?
    {
        return Err(ApiError::not_found(format!(
            "node {id} was deleted meanwhile"
        )));
    }
    Ok(Json(SshKeys {
        ssh_authorized_keys: st.store.node_ssh_keys(n.id).await?,
    }))
}

async fn create_node(
    State(st): State<Arc<AppState>>,
    JsonBody(req): JsonBody<CreateNode>,
) -> Result<(StatusCode, Json<NodeView>), ApiError> {
    // MACs, arch, state and driver were parsed by their types when the body was read.
    let mut macs: Vec<Mac> = Vec::new();
    for &m in &req.macs {
        if !macs.contains(&m) {
            macs.push(m);
        }
    }
    if macs.is_empty() {
        return Err(ApiError::bad_request("a node needs at least one MAC"));
    }
    check_labels(&req.labels)?;
    // Nodes are found by id, MAC, name or hostname, in that order: a name that reads
    // as an id or a MAC would be shadowed by it.
    if let Some(name) = &req.name
        && (name.parse::<i64>().is_ok() || name.parse::<Mac>().is_ok() || name.trim().is_empty())
    {
        return Err(ApiError::bad_request(format!(
            "name `{name}` reads as a node id or a MAC address (or is empty); choose another"
        )));
    }
    if let Some(m) = req.boot_mac
        && !macs.contains(&m)
    {
        return Err(ApiError::bad_request("boot_mac must be one of macs"));
    }
    check_ssh_keys(&req.ssh_authorized_keys)?;
    let arch = req.arch.unwrap_or(NodeArch::UNKNOWN);
    let state = match req.state {
        None => NodeState::Available,
        Some(s @ (NodeState::Available | NodeState::Discovered)) => s,
        Some(_) => {
            return Err(ApiError::bad_request(format!(
                "a new node starts {} or {}",
                NodeState::Available,
                NodeState::Discovered
            )));
        }
    };
    // A name another node answers to (as its name or hostname) would make `pxed node
    // show NAME` ambiguous; the store's unique index alone would say it in SQL.
    if let Some(name) = &req.name
        && let Some(other) = st.store.find_node(name).await?
    {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "conflict",
            format!("node {} is already called `{name}`", other.id),
        ));
    }
    for &m in &macs {
        if let Some(other) = st.store.node_by_mac(m).await? {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "conflict",
                format!("{m} already belongs to node {}", other.id),
            ));
        }
    }
    if let Some(b) = &req.bmc {
        crate::bmc::check_address(b.driver, &b.address).map_err(ApiError::bad_request)?;
    }
    let bmc_driver = req.bmc.as_ref().map(|b| b.driver);
    let bmc = match req.bmc {
        Some(b) => Some((
            BmcRow {
                node_id: 0,
                driver: b.driver,
                address: b.address,
                username: b.username,
                system_id: b.system_id,
                tls_pin: None,
                tls_insecure: b.tls_insecure,
            },
            b.password,
        )),
        None => None,
    };
    let id = st
        .store
        .create_node(
            &NewNode {
                name: req.name,
                arch,
                state,
                macs,
                boot_mac: req.boot_mac,
                bmc,
                ssh_authorized_keys: req.ssh_authorized_keys,
            },
            "api",
        )
        .await?;
    let n = st
        .store
        .node(id)
        .await?
        .ok_or_else(|| ApiError::not_found(id))?;
    if !req.labels.is_empty() {
        st.store.set_labels(id, &req.labels).await?;
    }
    st.lifecycle.notify(id, "registered", n.state);
    // Discovery's inventory: what the BMC knows, before anything boots (generation 0).
    if let Some(driver) = bmc_driver {
        st.lifecycle.collect_bmc_inventory(id, n.generation, driver);
    }
    Ok((StatusCode::CREATED, Json(view(&st, n).await?)))
}

async fn delete_node(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let n = find(&st, &id).await?;
    let macs = st.store.macs(n.id).await?;
    st.store.delete_node(n.id, "api").await?;
    // If the machine netboots again it is discovered anew.
    st.forget_macs(&macs);
    st.lifecycle.booted(n.id);
    st.lifecycle.notify(n.id, "deleted", n.state);
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Serialize, Deserialize)]
struct Stored {
    status: u16,
    body: Operation,
}

async fn reinstall(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let req: ReinstallRequest = if body.iter().all(u8::is_ascii_whitespace) {
        ReinstallRequest::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?
    };
    let key = headers
        .get("idempotency-key")
        .map(|v| {
            v.to_str()
                .map_err(|_| ApiError::bad_request("Idempotency-Key must be ASCII"))
                .map(str::to_string)
        })
        .transpose()?;
    if let Some(k) = &key
        && (k.is_empty() || k.len() > 200)
    {
        return Err(ApiError::bad_request(
            "Idempotency-Key must be 1..200 characters",
        ));
    }
    let n = find(&st, &id).await?;
    if let Some(k) = &key
        && let Some((node_id, text)) = st.store.idempotent(k).await?
    {
        if node_id != n.id {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency_key_reused",
                "this Idempotency-Key was used for another node",
            ));
        }
        let s: Stored = serde_json::from_str(&text).map_err(|e| {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
        })?;
        return Ok(stored_response(s));
    }
    if let Some(img) = &req.image
        && !st.image_exists(img).await?
    {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "unknown_image",
            format!("image {img} is not imported (pxed image add {img})"),
        ));
    }
    // The image: the request's, else the config's `default_image`, else the node's
    // last (the transition falls back to it).
    let image = req.image.clone().or_else(|| st.cfg.default_image.clone());
    mirror_gate(&st, &n, image.as_deref()).await?;
    let token = BootToken::random();
    let event = Event::ReinstallRequested { image, token };
    let answer = |row: &NodeRow, outcome: &Outcome| {
        let s = operation(row, outcome);
        serde_json::to_string(&s).unwrap_or_default()
    };
    let applied = st
        .lifecycle
        .apply_with(
            n.id,
            &event,
            "api",
            Hooks {
                hostname_prefix: Some(&st.cfg.hostname_prefix),
                idempotency_key: key.as_deref(),
                answer: Some(&answer),
                ..Hooks::default()
            },
        )
        .await?;
    Ok(stored_response(operation(&applied.node, &applied.outcome)))
}

/// Refuses a reinstall, before the node is touched, whose installer would stop on a
/// mirror that lacks what it fetches (see [`crate::images::MirrorGate`]). A node
/// already mid-reinstall is not checked: the call only reports on it.
async fn mirror_gate(st: &AppState, n: &NodeRow, image: Option<&str>) -> Result<(), ApiError> {
    if matches!(
        n.state,
        NodeState::Reclaiming
            | NodeState::Netbooting
            | NodeState::Installing
            | NodeState::FirstBoot
    ) {
        return Ok(());
    }
    let Some(name) = image.map(str::to_string).or_else(|| n.image.clone()) else {
        return Ok(());
    };
    let Some(row) = st.store.image(&name).await? else {
        return Ok(());
    };
    let Ok(img) = crate::images::StoredImage::decode(&name, &row.definition) else {
        return Ok(());
    };
    st.mirror_gate
        .check(&img, n.arch.0, st.cfg.mirror_base.as_deref())
        .await
        .map_err(|reason| {
            tracing::warn!(node = n.id, image = %name, %reason, "reinstall refused");
            ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "mirror_incomplete",
                format!("{reason} (nothing was changed; see pxed image check {name})"),
            )
        })
}

fn operation(row: &NodeRow, outcome: &Outcome) -> Stored {
    let in_progress = matches!(outcome, Outcome::InProgress { .. });
    Stored {
        status: if in_progress { 200 } else { 202 },
        body: Operation {
            node_id: row.id,
            generation: row.generation,
            state: row.state,
            since: row.state_since.clone(),
            image: row.image.clone(),
            already_in_progress: in_progress,
        },
    }
}

fn stored_response(s: Stored) -> Response {
    let status = StatusCode::from_u16(s.status).unwrap_or(StatusCode::OK);
    (status, Json(s.body)).into_response()
}

/// A fresh one-time boot token (256 bits, hex).
pub fn random_token() -> String {
    let bytes: [u8; 32] = rand::random();
    hex::encode(bytes)
}

async fn action(
    State(st): State<Arc<AppState>>,
    Path((id, action)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> Result<Json<NodeView>, ApiError> {
    #[derive(Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    struct Reason {
        reason: Option<String>,
    }
    let r: Reason = if body.is_empty() {
        Reason::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?
    };
    let reason = r.reason.unwrap_or_else(|| "operator".into());
    let event = match action.as_str() {
        "enroll" => Event::Enrolled,
        "allocate" => Event::Allocated,
        "release" => Event::Released,
        "quarantine" => Event::Quarantined { reason },
        "restore" => Event::Restored,
        "fail" => Event::MarkedFailed { reason },
        other => {
            return Err(ApiError::not_found(format!(
                "action {other} (enroll, allocate, release, quarantine, restore, fail)"
            )));
        }
    };
    let n = find(&st, &id).await?;
    let applied = st.lifecycle.apply(n.id, &event, "api").await?;
    Ok(Json(view(&st, applied.node).await?))
}

/// Runs `pxed bmc check` on the server, where the BMC secrets are: the answer has none.
async fn bmc_check(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<BmcCheck>, ApiError> {
    let n = find(&st, &id).await?;
    let bmc = st
        .store
        .bmc(n.id)
        .await?
        .map(bmc_view)
        .ok_or_else(|| no_bmc(n.id))?;
    let report = tokio::select! {
        // CANCEL-SAFETY: the check only reads; a Redfish session it leaves open expires
        // on the BMC.
        _ = st.shutdown.cancelled() => {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting_down",
                "pxed is shutting down",
            ));
        }
        // CANCEL-SAFETY: bounded by the BMC call policy; see above.
        r = st.lifecycle.check_bmc(n.id) => r,
    };
    match report {
        Ok(report) => Ok(Json(BmcCheck {
            node_id: n.id,
            bmc,
            report,
        })),
        Err(ConnectError::NoBmc) => Err(no_bmc(n.id)),
        Err(ConnectError::Store(e)) => Err(e.into()),
        // The BMC failed, not the API: 502 with the typed kind as the code.
        Err(e) => Err(ApiError::new(
            StatusCode::BAD_GATEWAY,
            e.kind(),
            e.to_string(),
        )),
    }
}

fn check_labels(labels: &crate::store::board::Labels) -> Result<(), ApiError> {
    if labels.len() > 32 {
        return Err(ApiError::bad_request("at most 32 labels per node"));
    }
    for (k, v) in labels {
        crate::store::board::check_label(k, v).map_err(ApiError::bad_request)?;
    }
    Ok(())
}

/// `GET /api/v1/nodes/{id}/labels`: `{"rack": "r12", …}`.
async fn get_labels(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<crate::store::board::Labels>, ApiError> {
    let n = find(&st, &id).await?;
    Ok(Json(st.store.labels(n.id).await?))
}

/// `PUT /api/v1/nodes/{id}/labels`: replaces the node's labels with the body's.
async fn put_labels(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    JsonBody(labels): JsonBody<crate::store::board::Labels>,
) -> Result<Json<crate::store::board::Labels>, ApiError> {
    check_labels(&labels)?;
    let n = find(&st, &id).await?;
    st.store.set_labels(n.id, &labels).await?;
    st.lifecycle.notify(n.id, "labelled", n.state);
    Ok(Json(labels))
}

/// `POST /api/v1/nodes/{id}/bmc/power-cycle`: an operator's power cycle through the
/// node's BMC (the state does not change; the audit log says who did it). For a
/// machine that hangs; a reinstall power-cycles by itself.
async fn bmc_power_cycle(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<NodeView>, ApiError> {
    let n = find(&st, &id).await?;
    if n.state == NodeState::Reclaiming {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "reclaiming",
            format!(
                "node {} is reclaiming: its reinstall power-cycles it (cancel by quarantining)",
                n.id
            ),
        ));
    }
    let r = tokio::select! {
        // CANCEL-SAFETY: a power cycle the BMC already took stays taken; nothing to undo.
        _ = st.shutdown.cancelled() => {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting_down",
                "pxed is shutting down",
            ));
        }
        // CANCEL-SAFETY: bounded by the BMC call policy.
        r = st.lifecycle.operator_power_cycle(n.id, "api") => r,
    };
    match r {
        Ok(()) => {}
        Err(ConnectError::NoBmc) => return Err(no_bmc(n.id)),
        Err(ConnectError::Store(e)) => return Err(e.into()),
        Err(e) => {
            return Err(ApiError::new(
                StatusCode::BAD_GATEWAY,
                e.kind(),
                e.to_string(),
            ));
        }
    }
    let row = st
        .store
        .node(n.id)
        .await?
        .ok_or_else(|| ApiError::not_found(n.id))?;
    st.lifecycle
        .notify(n.id, "power_cycled_by_operator", row.state);
    Ok(Json(view(&st, row).await?))
}

fn no_bmc(id: i64) -> ApiError {
    ApiError::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "no_bmc",
        format!("node {id} has no BMC"),
    )
}

async fn list_images(
    State(st): State<Arc<AppState>>,
) -> Result<Json<Vec<serde_json::Value>>, ApiError> {
    Ok(Json(
        st.store
            .images()
            .await?
            .into_iter()
            .map(|r| serde_json::json!({"name": r.name, "family": r.family, "imported_at": r.imported_at}))
            .collect(),
    ))
}

/// Whether `s` names a lifecycle state (for filters).
pub fn is_state(s: &str) -> bool {
    s.parse::<NodeState>().is_ok()
}

/// `GET /api/v1/nodes/{id}/stages`: the current generation's stages in order, and
/// how long each stage of the earlier generations kept lasted.
async fn node_stages(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<crate::wire::StagesView>, ApiError> {
    let n = find(&st, &id).await?;
    let mut by_generation: std::collections::BTreeMap<i64, Vec<_>> = Default::default();
    for r in st.store.stages(n.id).await? {
        by_generation.entry(r.generation).or_default().push(r);
    }
    let current_rows =
        crate::stages::ordered(by_generation.remove(&n.generation).unwrap_or_default());
    let expected = &st.stages.expected;
    let previous = by_generation
        .into_iter()
        .rev()
        .filter(|(g, _)| *g < n.generation)
        .map(|(g, rows)| crate::stages::generation_summary(g, &crate::stages::ordered(rows)))
        .collect();
    Ok(Json(crate::wire::StagesView {
        node_id: n.id,
        generation: n.generation,
        state: n.state,
        current: crate::stages::current(n.state, &current_rows, expected, chrono::Utc::now()),
        stages: crate::stages::views(&current_rows, expected),
        previous,
    }))
}

/// `?since=7d`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReportQuery {
    since: Option<String>,
}

/// `GET /api/v1/report?since=7d`: reinstalls requested over the period and the
/// nodes left over now.
async fn report(
    State(st): State<Arc<AppState>>,
    QueryParams(q): QueryParams<ReportQuery>,
) -> Result<Json<crate::wire::Report>, ApiError> {
    let period = match q.since.as_deref() {
        None => std::time::Duration::from_secs(7 * 86_400),
        Some(s) => crate::config::parse_duration(s)
            .map_err(|e| ApiError::bad_request(format!("since: {e}")))?,
    };
    let now = chrono::Utc::now();
    let since = chrono::Duration::from_std(period)
        .ok()
        .and_then(|d| now.checked_sub_signed(d))
        .ok_or_else(|| ApiError::bad_request("since: too long ago"))?
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let reinstalls = st.store.reinstalls_since(&since).await?;
    let mut failed_stages = std::collections::BTreeMap::new();
    for r in reinstalls
        .iter()
        .filter(|r| r.outcome == Some(NodeState::Failed))
    {
        let rows =
            crate::stages::ordered(st.store.generation_stages(r.node_id, r.generation).await?);
        if let Some(last) = rows.iter().rev().find(|s| !s.stage.is_final()) {
            failed_stages.insert((r.node_id, r.generation), last.stage);
        }
    }
    let tracked = st.store.tracked_nodes().await?;
    Ok(Json(crate::stages::report(
        &since,
        now,
        &reinstalls,
        &failed_stages,
        &tracked,
        &st.stages.expected,
    )))
}

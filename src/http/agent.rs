//! What installers and the first-boot agent talk to: generated install configs under
//! `/cfg/{token}/...` and callbacks under `/cb/{token}/...`.
//!
//! Every URL takes one of the node's two credentials for the current generation
//! (see [`crate::credential`]), and each call names the one it needs; the path's shape
//! is the same for both, so the kind is found by lookup, never trusted from the URL:
//!
//! | call | credential | from |
//! |---|---|---|
//! | `GET /cfg/{token}/{file}`, `GET /cb/{token}/deploy`, `POST /cb/{token}/deploy/{facts,progress}`, `POST /cb/{token}/{installed,failure,events}` | boot token | the address the installer was served to |
//! | `POST /cb/{token}/{first-boot,health}` | agent token | anywhere on the VLAN (the installed OS has its own address) |
//!
//! In full DHCP mode both also need an address pxed leased to one of the node's MACs,
//! when it leased any. A refusal is 403 JSON (`stale_token`, `token_wrong_stage`,
//! `token_wrong_address`), counted in `/metrics`, logged and written to the node's
//! audit log with the addresses involved, never the token.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};

use super::Conn;
use super::error::{ApiError, JsonBody};
use crate::credential::{self, Kind, Refusal};
use crate::images::Arch;
use crate::lifecycle::transition::Event;
use crate::model::InventorySource;
use crate::state::AppState;
use crate::store::nodes::NodeRow;
use crate::wire::{
    AgentFacts, DeployProgress, FailedReport, FirstBootReport, HealthReport, HealthStatus,
};

/// Routes for installers and agents.
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/cfg/{token}/{file}", get(config))
        .route("/cb/{token}/installed", post(installed))
        .route("/cb/{token}/failure", post(failed))
        .route("/cb/{token}/events", post(events))
        .route("/cb/{token}/deploy", get(deploy_plan))
        // A GPU server lists hundreds of PCI functions: the inventory outgrows MAX_BODY.
        .route(
            "/cb/{token}/deploy/facts",
            post(deploy_facts).layer(axum::extract::DefaultBodyLimit::max(MAX_INVENTORY_BODY)),
        )
        .route("/cb/{token}/deploy/progress", post(deploy_progress))
        .route(
            "/cb/{token}/first-boot",
            post(first_boot).layer(axum::extract::DefaultBodyLimit::max(MAX_INVENTORY_BODY)),
        )
        .route("/cb/{token}/health", post(health))
}

/// Largest facts or first-boot report (with its hardware inventory) taken.
const MAX_INVENTORY_BODY: usize = 2 << 20;

/// The node that holds `token` now, if `wanted` is the kind of credential it is and
/// the request comes from where that credential may be used. An unknown token (another
/// node's old one, or an older generation's) is refused with 403 and logged without
/// the token itself; so are the wrong kind and the wrong address.
async fn by_token(
    st: &AppState,
    token: &str,
    conn: Conn,
    what: &str,
    wanted: Kind,
) -> Result<NodeRow, ApiError> {
    let prefix = token.get(..6).unwrap_or("");
    let Some(n) = st.store.node_by_credential(token).await? else {
        tracing::warn!(
            token_prefix = prefix,
            what,
            client = ?conn.client,
            "refused: unknown or stale token"
        );
        st.stats.stale_tokens.inc();
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "stale_token",
            "unknown or stale token: this install was superseded",
        ));
    };
    let presented = if n.boot_token.as_ref().is_some_and(|t| t.as_str() == token) {
        Kind::Boot
    } else {
        Kind::Agent
    };
    let w = st.whereabouts(&n).await?;
    let Err(why) = credential::admit(wanted, presented, &w, conn.client) else {
        return Ok(n);
    };
    let (error, event) = match &why {
        Refusal::WrongStage { .. } => {
            st.stats.wrong_stage_tokens.inc();
            ("token_wrong_stage", "token_refused_stage")
        }
        Refusal::WrongAddress(_) => {
            st.stats.wrong_address_tokens.inc();
            ("token_wrong_address", "token_refused_address")
        }
    };
    tracing::warn!(
        node = n.id,
        generation = n.generation,
        what,
        client = ?conn.client,
        reason = %why,
        "refused: {}",
        presented.as_str()
    );
    let detail = format!("{} for {what}: {why}", presented.as_str());
    st.audit_refusal(&n, event, &detail).await;
    Err(ApiError::new(StatusCode::FORBIDDEN, error, why.to_string()))
}

/// `http://host[:port]` for URLs in a response: the configured server (see
/// [`AppState::base_url_at`]), or the request's `Host` header when the operator set
/// `trust_host_header` (behind a proxy that sets it; a client can send any).
pub fn base_url(st: &AppState, headers: &HeaderMap, conn: Conn) -> String {
    if st.cfg.trust_host_header
        && let Some(h) = headers.get(header::HOST).and_then(|h| h.to_str().ok())
        && !h.is_empty()
        && h.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | ':' | '-' | '[' | ']'))
    {
        return format!("http://{h}");
    }
    st.base_url_at(conn.local)
}

async fn config(
    State(st): State<Arc<AppState>>,
    Path((token, file)): Path<(String, String)>,
    conn: Conn,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let n = by_token(&st, &token, conn, "config", Kind::Boot).await?;
    // The installer is running: the node no longer counts as booting (its place goes
    // to the next paced power-on).
    st.lifecycle.booted(n.id);
    let base = base_url(&st, &headers, conn);
    let text = crate::provision::render_config(&st, &n, &file, &base, &token).await?;
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
    conn: Conn,
) -> Result<Response, ApiError> {
    let n = by_token(&st, &token, conn, "installed", Kind::Boot).await?;
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
    conn: Conn,
    JsonBody(r): JsonBody<FirstBootReport>,
) -> Result<Response, ApiError> {
    let n = by_token(&st, &token, conn, "first-boot", Kind::Agent).await?;
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
        st.store.set_arch(n.id, a).await?;
    }
    // Only while the node awaits this report: a late repeat must not replace what the
    // gate already judged.
    if let Some(inv) = &r.inventory
        && matches!(
            n.state,
            crate::model::State::FirstBoot | crate::model::State::Installing
        )
    {
        st.store
            .put_inventory(n.id, n.generation, InventorySource::FirstBoot, None, inv)
            .await?;
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
    conn: Conn,
    JsonBody(r): JsonBody<HealthReport>,
) -> Result<Response, ApiError> {
    let n = by_token(&st, &token, conn, "health", Kind::Agent).await?;
    let event = match r.status {
        // Healthy: the acceptance gate decides whether it is still the machine it was
        // (only once, while the node awaits this report; a repeat gets the usual answer).
        // Only once the first boot was reported: a health report before it is refused by
        // the transition, and must not set a baseline on its way.
        HealthStatus::Pass
            if n.state == crate::model::State::FirstBoot
                && st
                    .store
                    .events(n.id)
                    .await?
                    .iter()
                    .any(|e| e.generation == n.generation && e.event == "first_boot_reported") =>
        {
            match crate::hardware::check(&st.store, &st.cfg.profiles, n.id, n.generation, n.state)
                .await?
            {
                Some(v) if !v.passed() => Event::InventoryRejected {
                    generation: n.generation,
                    reason: bounded(&v.reason(), 4000),
                },
                _ => Event::HealthPassed {
                    generation: n.generation,
                },
            }
        }
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

/// `POST /cb/{token}/failure`: the installer or deploy agent gave up; the node fails now
/// with the agent's own reason, not at a deadline.
async fn failed(
    State(st): State<Arc<AppState>>,
    Path(token): Path<String>,
    conn: Conn,
    JsonBody(r): JsonBody<FailedReport>,
) -> Result<Response, ApiError> {
    let n = by_token(&st, &token, conn, "failure", Kind::Boot).await?;
    let (stage, reason) = (bounded(&r.stage, 64), bounded(&r.reason, 2000));
    if stage.is_empty() || reason.is_empty() {
        return Err(ApiError::bad_request("stage and reason must not be empty"));
    }
    tracing::warn!(node = n.id, generation = n.generation, %stage, %reason, "install failed (agent report)");
    apply_cb(
        &st,
        &n,
        Event::InstallFailed {
            generation: n.generation,
            stage,
            reason,
        },
    )
    .await
}

/// `POST /cb/{token}/events`: one curtin / subiquity reporting event (the autoinstall
/// `reporting` webhook). Stored and recognised like the installer's syslog lines; a
/// `FAIL` result ends the install.
async fn events(
    State(st): State<Arc<AppState>>,
    Path(token): Path<String>,
    conn: Conn,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let n = by_token(&st, &token, conn, "events", Kind::Boot).await?;
    // cloud-init's webhook reporter posts JSON without always saying so: read the body
    // whatever its content type.
    let ev: crate::telemetry::CurtinEvent = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("not a reporting event: {e}")))?;
    st.telemetry.stats.webhook_events.inc();
    st.telemetry
        .submit(crate::telemetry::recorder::webhook_line(
            n.id,
            n.generation,
            &ev,
        ));
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// At most `max` bytes of `s` (on a character boundary), control characters dropped:
/// agent text goes to the audit log and the status page.
fn bounded(s: &str, max: usize) -> String {
    let mut out = String::new();
    for c in s.trim().chars().filter(|c| !c.is_control() || *c == ' ') {
        if out.len() + c.len_utf8() > max {
            break;
        }
        out.push(c);
    }
    out
}

/// `GET /cb/{token}/deploy`: the deploy agent's plan. Only while the node is being
/// installed: a node in any other state has nothing to deploy.
async fn deploy_plan(
    State(st): State<Arc<AppState>>,
    Path(token): Path<String>,
    conn: Conn,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let n = by_token(&st, &token, conn, "deploy", Kind::Boot).await?;
    if !n.state.serves_installer() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "not_installing",
            format!("node {} is {}, not installing", n.id, n.state),
        ));
    }
    let base = base_url(&st, &headers, conn);
    let plan = crate::provision::deploy_plan(&st, &n, &base, &token).await?;
    st.store
        .note(
            n.id,
            n.generation,
            n.state,
            "deploy_started",
            "agent",
            &format!("plan for image {}", plan.image.name),
        )
        .await?;
    // The deploy agent is running: the node no longer counts as booting.
    st.lifecycle.booted(n.id);
    st.lifecycle.notify(n.id, "deploy_started", n.state);
    Ok(Json(plan).into_response())
}

async fn deploy_facts(
    State(st): State<Arc<AppState>>,
    Path(token): Path<String>,
    conn: Conn,
    JsonBody(f): JsonBody<AgentFacts>,
) -> Result<Response, ApiError> {
    let n = by_token(&st, &token, conn, "deploy facts", Kind::Boot).await?;
    let disks: Vec<String> = f
        .disks
        .iter()
        .map(|d| format!("{} {} bytes", d.name, d.size))
        .collect();
    let detail = format!(
        "{} cpus, {} kB, {}; disks: {}; nics: {}",
        f.cpus,
        f.mem_kb,
        f.machine,
        disks.join(", "),
        f.nics
            .iter()
            .map(|n| n.mac.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    st.store
        .note(
            n.id,
            n.generation,
            n.state,
            "deploy_facts",
            "agent",
            &bounded(&detail, 2000),
        )
        .await?;
    if let Some(inv) = &f.inventory {
        let took = f.inventory_ms.map(|ms| ms.min(i64::MAX as u64) as i64);
        st.store
            .put_inventory(n.id, n.generation, InventorySource::Deploy, took, inv)
            .await?;
        let summary = format!(
            "{} PCI functions, {} GPUs/accelerators, {} NICs, {} disks, {} firmware components{}",
            inv.pci.len(),
            inv.pci
                .iter()
                .filter(|d| d.is_accelerator())
                .count()
                .max(inv.gpus.len()),
            inv.nics.len(),
            inv.disks.len(),
            inv.firmware.len(),
            took.map_or_else(String::new, |ms| format!("; collected in {ms} ms")),
        );
        st.store
            .note(n.id, n.generation, n.state, "inventory", "agent", &summary)
            .await?;
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn deploy_progress(
    State(st): State<Arc<AppState>>,
    Path(token): Path<String>,
    conn: Conn,
    JsonBody(p): JsonBody<DeployProgress>,
) -> Result<Response, ApiError> {
    let n = by_token(&st, &token, conn, "deploy progress", Kind::Boot).await?;
    let mut detail = format!("{}: {}", p.stage, bounded(&p.message, 500));
    if let Some(b) = p.bytes {
        detail.push_str(&format!(" ({b} bytes)"));
    }
    let event = format!("deploy_{}", p.stage);
    st.store
        .note(n.id, n.generation, n.state, &event, "agent", &detail)
        .await?;
    st.lifecycle.notify(n.id, &event, n.state);
    Ok(StatusCode::NO_CONTENT.into_response())
}

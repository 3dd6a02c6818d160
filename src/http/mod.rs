//! HTTP: boot scripts, images and iPXE binaries, health and metrics.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio_util::sync::CancellationToken;
use tower_http::services::ServeDir;

use crate::model::Mac;
use crate::net::ConnLimits;
use crate::pacing::{Slot, SlotGuard, Slots};
use crate::script;
use crate::state::AppState;

pub mod agent;
pub mod api;
pub mod board;
pub mod error;
pub mod hardware;
pub mod leftovers;
pub mod log;
pub mod sendfile;
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
        .merge(status::routes(state.clone()))
        .nest_service(
            "/ipxe",
            files(&state.cfg.ipxe_dir, &state.slots, Slot::FirstStage),
        )
        .nest_service(
            "/images",
            files(&state.cfg.images_dir, &state.slots, Slot::Stream),
        )
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            crate::stages::http::track,
        ))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .with_state(state)
}

/// Header-read timeout of an ordinary connection: a client that has not sent a whole
/// request head by then (including an idle keep-alive connection) is disconnected.
/// Firmware and agents send theirs at once.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// Header-read timeout of a connection taken from the reserve (see [`ConnLimits`]).
pub const RESERVE_HEADER_TIMEOUT: Duration = Duration::from_secs(1);

/// HTTP connection counters, rendered at `/metrics`.
#[derive(Debug, Default)]
pub struct ConnStats {
    pub open: crate::metrics::Gauge,
    pub reserved: crate::metrics::Counter,
    pub refused: crate::metrics::Counter,
    pub accept_errors: crate::metrics::Counter,
    pub sendfile_responses: crate::metrics::Counter,
    pub sendfile_bytes: crate::metrics::Counter,
}

impl crate::metrics::Render for ConnStats {
    fn render(&self, out: &mut String) {
        use crate::metrics::sample;
        sample(
            out,
            "pxed_http_connections",
            "Open HTTP connections",
            "gauge",
            self.open.get(),
        );
        sample(
            out,
            "pxed_http_connections_reserved_total",
            "Connections served from the reserve (API, health and metrics only)",
            "counter",
            self.reserved.get(),
        );
        sample(
            out,
            "pxed_http_connections_refused_total",
            "Connections closed at once because every slot was taken",
            "counter",
            self.refused.get(),
        );
        sample(
            out,
            "pxed_http_accept_errors_total",
            "Errors accepting connections (e.g. out of file descriptors)",
            "counter",
            self.accept_errors.get(),
        );
        sample(
            out,
            "pxed_http_sendfile_responses_total",
            "Static file responses sent with sendfile (plain GET/HEAD under /ipxe and /images)",
            "counter",
            self.sendfile_responses.get(),
        );
        sample(
            out,
            "pxed_http_sendfile_bytes_total",
            "File bytes sent with sendfile",
            "counter",
            self.sendfile_bytes.get(),
        );
    }
}

/// Paths a connection from the reserve may use.
fn reserved_path(path: &str) -> bool {
    matches!(path, "/healthz" | "/readyz" | "/metrics") || path.starts_with("/api/")
}

/// Static files under `root` (Range, ETag, HEAD through tower-http's `ServeDir`), but
/// only regular files whose real path lies inside `root`: a FIFO or device would
/// hang a reader thread, and a symlink must not lead out of the served tree.
/// Each GET whose body is streaming counts as one `slot` for DHCP pacing.
fn files(
    root: &std::path::Path,
    slots: &Arc<Slots>,
    slot: Slot,
) -> impl tower::Service<
    axum::extract::Request,
    Response = Response,
    Error = std::convert::Infallible,
    Future = impl Send + 'static,
> + Clone
+ Send
+ 'static {
    let serve = ServeDir::new(root);
    let files = Files {
        root: Arc::new(root.to_owned()),
        slots: slots.clone(),
        slot,
    };
    tower::Layer::layer(
        &axum::middleware::from_fn_with_state(files, regular_files_only),
        serve,
    )
}

/// What [`regular_files_only`] needs: the served tree and the pacing slot a GET takes.
#[derive(Clone)]
struct Files {
    root: Arc<std::path::PathBuf>,
    slots: Arc<Slots>,
    slot: Slot,
}

/// A response body that holds a pacing slot until it is dropped: when the last byte
/// went out, or when the client went away mid-file (hyper drops the body either way).
struct Counted {
    body: axum::body::Body,
    _slot: SlotGuard,
}

impl http_body::Body for Counted {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// The real path of `rel` under `root` when it is a regular file inside the tree
/// (after following every link), else `None`. Touches the disk: call it off the
/// async threads.
pub(crate) fn regular_file_inside(root: &std::path::Path, rel: &str) -> Option<std::path::PathBuf> {
    let root = std::fs::canonicalize(root).ok()?;
    let real = std::fs::canonicalize(root.join(rel)).ok()?;
    // metadata() follows links: `real` has none left, so this is the file itself.
    (real.starts_with(&root) && std::fs::metadata(&real).ok()?.is_file()).then_some(real)
}

async fn regular_files_only(
    State(Files { root, slots, slot }): State<Files>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let rel = percent_encoding::percent_decode_str(req.uri().path())
        .decode_utf8_lossy()
        .trim_start_matches('/')
        .to_string();
    let allowed = tokio::task::spawn_blocking(move || regular_file_inside(&root, &rel))
        .await
        .ok()
        .flatten()
        .is_some();
    if !allowed {
        return (StatusCode::NOT_FOUND, "not found\n").into_response();
    }
    let get = req.method() == axum::http::Method::GET;
    let res = next.run(req).await;
    if !(get && res.status().is_success()) {
        return res;
    }
    let guard = slots.acquire(slot);
    res.map(|body| axum::body::Body::new(Counted { body, _slot: guard }))
}

/// The address a connection arrived on (ours): inserted by [`serve`] next to the
/// peer's `ConnectInfo`.
#[derive(Debug, Clone, Copy)]
pub struct LocalAddr(pub SocketAddr);

/// Both ends of the request's connection, as far as known: a router driven without
/// [`serve`] (a test calling it directly) has neither, and every decision that needs
/// them treats "unknown" as the unsafe case.
#[derive(Debug, Clone, Copy, Default)]
pub struct Conn {
    /// The client's address (IPv4 clients of a dual-stack socket as IPv4).
    pub client: Option<IpAddr>,
    /// The address the client connected to.
    pub local: Option<SocketAddr>,
}

impl<S: Send + Sync> FromRequestParts<S> for Conn {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(Conn {
            client: parts
                .extensions
                .get::<axum::extract::ConnectInfo<SocketAddr>>()
                .map(|c| crate::credential::canonical(c.0.ip())),
            local: parts.extensions.get::<LocalAddr>().map(|l| l.0),
        })
    }
}

/// Serves until `cancel` fires, then drains open connections. Every connection has a
/// header-read timeout and counts against [`ConnLimits`]; handlers see both ends of
/// the connection through [`Conn`].
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    cancel: CancellationToken,
) -> std::io::Result<()> {
    use axum::extract::ConnectInfo;
    use hyper_util::rt::{TokioIo, TokioTimer};
    use tokio::sync::Semaphore;

    let limits: ConnLimits = state.conn_limits;
    sendfile::set_transfer_nice(state.cfg.pacing.transfer_nice);
    let stats = Arc::new(ConnStats::default());
    state.renders.lock().expect("lock").push(stats.clone());
    let app = router(state.clone());
    let tasks = tokio_util::task::TaskTracker::new();
    let general = Arc::new(Semaphore::new(limits.max - limits.reserve));
    let reserve = Arc::new(Semaphore::new(limits.reserve));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        let (stream, peer) = tokio::select! {
            // CANCEL-SAFETY: accept is cancel-safe; nothing was taken yet.
            _ = cancel.cancelled() => break,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of descriptors (EMFILE/ENFILE) or an aborted handshake:
                    // count, wait a moment (no busy loop) and go on.
                    stats.accept_errors.inc();
                    crate::net::after_recv_error("http", &e).await;
                    continue;
                }
            },
        };
        let (permit, reserved) = match general.clone().try_acquire_owned() {
            Ok(p) => (p, false),
            Err(_) => match reserve.clone().try_acquire_owned() {
                Ok(p) => {
                    stats.reserved.inc();
                    (p, true)
                }
                Err(_) => {
                    stats.refused.inc();
                    tracing::debug!(%peer, "HTTP connection refused: every slot is taken");
                    continue;
                }
            },
        };
        let local = stream.local_addr().ok();
        let app = app.clone();
        let svc =
            hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(ConnectInfo(peer));
                if let Some(l) = local {
                    req.extensions_mut().insert(LocalAddr(l));
                }
                let busy = reserved && !reserved_path(req.uri().path());
                let app = app.clone();
                async move {
                    if busy {
                        return Ok::<_, std::convert::Infallible>(
                            (
                                StatusCode::SERVICE_UNAVAILABLE,
                                [(header::RETRY_AFTER, "1")],
                                "busy: every connection slot is taken; try again\n",
                            )
                                .into_response(),
                        );
                    }
                    Ok(tower::ServiceExt::oneshot(app, req).await.into_response())
                }
            });
        let stats = stats.clone();
        let st = state.clone();
        let watcher = graceful.watcher();
        let cancel = cancel.clone();
        stats.open.inc();
        tasks.spawn(async move {
            // Plain file requests first, with sendfile; a reserve connection may not
            // fetch files at all, so hyper answers it (503) at once.
            let stream = if reserved {
                Some(stream)
            } else {
                sendfile::files_first(stream, peer, &st, &stats, &cancel).await
            };
            if let Some(stream) = stream {
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(if reserved {
                        RESERVE_HEADER_TIMEOUT
                    } else {
                        HEADER_TIMEOUT
                    })
                    .serve_connection(TokioIo::new(stream), svc);
                if let Err(e) = watcher.watch(conn).await {
                    tracing::debug!(%peer, error = %e, "HTTP connection ended with an error");
                }
            }
            stats.open.dec();
            drop(permit);
        });
    }
    drop(listener);
    // Connections still in hyper finish their responses; those in sendfile end after
    // the transfer under way.
    graceful.shutdown().await;
    tasks.close();
    tasks.wait().await;
    Ok(())
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
    // Bounded: a health check answers while the database does not (a monitor's own
    // timeout must not hide the reason).
    const DESCRIBE: std::time::Duration = std::time::Duration::from_secs(2);
    match tokio::time::timeout(DESCRIBE, st.store.describe()).await {
        Ok(Ok(d)) => body.push_str(&format!("database: {d}\n")),
        Ok(Err(e)) => body.push_str(&format!("database: unreadable: {e}\n")),
        Err(_) => body.push_str(&format!("database: no answer within {DESCRIBE:?}\n")),
    }
    body.push_str(&format!(
        "listeners: http {}, tftp {}, dhcp {:?}\n",
        st.cfg.http, st.cfg.tftp, st.cfg.dhcp.mode
    ));
    // Installers are pointed at the receiver only while it listens.
    match (st.cfg.syslog.enabled, st.telemetry.listening()) {
        (_, Some(addr)) => body.push_str(&format!("syslog: listening on {addr}\n")),
        (true, None) => body.push_str(&format!(
            "syslog: not listening (could not bind {}): installers do not report\n",
            st.cfg.syslog.address
        )),
        (false, None) => body.push_str("syslog: off\n"),
    }
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
    conn: Conn,
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
    let base = agent::base_url(&st, &headers, conn);
    let (action, reason) = crate::provision::boot_action(&st, mac, &base, conn.client).await;
    match script::render(&mac.to_string(), &action, &reason) {
        Ok(s) => {
            st.stages.saw(crate::stages::script_sighting(mac, &action));
            // iPXE keeps connections for its next fetch: closing this one sends the
            // kernel and initrd down a new connection, where sendfile serves them.
            (
                [
                    (header::CONTENT_TYPE, "text/plain; charset=utf-8"),
                    (header::CONNECTION, "close"),
                ],
                s,
            )
                .into_response()
        }
        Err(e) => {
            tracing::error!(%mac, error = %e, "rendering boot script");
            (StatusCode::INTERNAL_SERVER_ERROR, "script error\n").into_response()
        }
    }
}

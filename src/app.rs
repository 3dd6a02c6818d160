//! Wiring: binds the configured sockets, starts every server on one runtime, and
//! shuts them down in order when the root cancellation token fires.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::script::Action;
use crate::store::Store;

/// State shared by the HTTP handlers and workers.
#[derive(Debug)]
pub struct AppState {
    pub cfg: Arc<Config>,
    pub store: Store,
}

impl AppState {
    /// Prometheus text for every component.
    pub fn render_metrics(&self) -> String {
        let out = String::new();
        out
    }

    /// What `/boot/{mac}.ipxe` tells this node to do, and why.
    pub async fn boot_action(&self, _mac: &str) -> (Action, String) {
        (Action::LocalBoot, "no install scheduled".into())
    }
}

/// How long in-flight work may take to drain after cancellation.
pub const DRAIN: Duration = Duration::from_millis(1500);

/// Runs pxed until `cancel` fires.
pub async fn run(cfg: Config, cancel: CancellationToken) -> anyhow::Result<()> {
    let cfg = Arc::new(cfg);
    let store = Store::open(&cfg.data_dir)
        .await
        .with_context(|| format!("opening the store in {}", cfg.data_dir.display()))?;
    let state = Arc::new(AppState {
        cfg: cfg.clone(),
        store: store.clone(),
    });
    let mut tasks: JoinSet<anyhow::Result<()>> = JoinSet::new();

    let http = crate::net::bind_tcp(cfg.http).context("HTTP")?;
    tracing::info!(addr = %http.local_addr()?, "HTTP listening");
    {
        let (st, c) = (state.clone(), cancel.clone());
        tasks.spawn(async move { Ok(crate::http::serve(http, st, c).await?) });
    }

    if cfg.dhcp.mode != crate::config::DhcpMode::Off {
        let sockets = crate::dhcp::bind(&cfg)?;
        // Discovery events: nothing consumes them yet, so the receiver is dropped
        // and try_send fails as Closed (not counted as a drop).
        let (seen, _) = tokio::sync::mpsc::channel(1024);
        let stats = Arc::new(crate::dhcp::DhcpStats::default());
        let ctx = crate::dhcp::DhcpContext::new(&cfg, store.clone(), seen, stats);
        let c = cancel.clone();
        tasks.spawn(async move { Ok(crate::dhcp::serve(sockets, ctx, c).await?) });
    }

    // TFTP and DHCP servers are added here.

    let result = tokio::select! {
        // Cancellation first: servers end promptly once it fires, and that is not a failure.
        biased;
        // CANCEL-SAFETY: only waits; nothing is lost when the other branch wins.
        _ = cancel.cancelled() => Ok(()),
        // CANCEL-SAFETY: join_next is cancel-safe.
        Some(r) = tasks.join_next() => {
            cancel.cancel();
            match r {
                Ok(Ok(())) => Err(anyhow::anyhow!("a server stopped unexpectedly")),
                Ok(Err(e)) => Err(e),
                Err(e) => Err(anyhow::anyhow!("a server panicked: {e}")),
            }
        }
    };
    let drained = tokio::time::timeout(DRAIN, async {
        while let Some(r) = tasks.join_next().await {
            if let Ok(Err(e)) = r {
                tracing::warn!(error = %e, "server ended with an error during shutdown");
            }
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!("drain deadline passed; aborting remaining tasks");
        tasks.abort_all();
    }
    store.close().await;
    tracing::info!("stopped");
    result
}

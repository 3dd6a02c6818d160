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

    let tftp = crate::net::bind_udp(cfg.tftp, None, false).context("TFTP")?;
    {
        let (root, settings, c) = (
            cfg.ipxe_dir.clone(),
            cfg.tftp_server.clone(),
            cancel.clone(),
        );
        let stats = Arc::new(crate::tftp::TftpStats::default());
        tasks.spawn(async move { Ok(crate::tftp::serve(tftp, root, settings, stats, c).await?) });
    }
    // TFTP and DHCP servers are added here.

    let result = tokio::select! {
        // Servers return Ok as soon as they see the cancel; without `biased` a
        // clean SIGTERM could be reported as "a server stopped unexpectedly".
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

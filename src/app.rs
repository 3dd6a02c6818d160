//! Wiring: binds the configured sockets, starts every server on one runtime, and
//! shuts them down in order when the root cancellation token fires.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::lifecycle::worker::StoreBmcs;
use crate::state::AppState;
use crate::store::Store;

/// The iPXE dir exists; every named interface exists and has an address; a full-mode
/// pool lies in the subnet of the interface it is served on.
fn preflight(cfg: &Config) -> anyhow::Result<()> {
    for w in cfg.warnings() {
        tracing::warn!("{w}");
    }
    if !cfg.ipxe_dir.is_dir() {
        anyhow::bail!(
            "iPXE dir {} does not exist (fetch the binaries with ipxe/fetch.sh {0}, or set --ipxe-dir)",
            cfg.ipxe_dir.display()
        );
    }
    for name in &cfg.interfaces {
        let iface = crate::net::interface(name)?;
        if cfg.dhcp.mode == crate::config::DhcpMode::Full
            && let Some(sub) = &cfg.dhcp.local
            && !(iface.contains(sub.pool.start) && iface.contains(sub.pool.end))
        {
            anyhow::bail!(
                "pool {}-{} is outside the subnet of {name} ({}/{})",
                sub.pool.start,
                sub.pool.end,
                iface.addr,
                iface.netmask
            );
        }
    }
    Ok(())
}

/// The API token: configured, or generated once into `<data_dir>/api-token` (0600).
fn api_token(cfg: &Config) -> anyhow::Result<String> {
    if let Some(t) = &cfg.api_token {
        return Ok(t.clone());
    }
    let path = cfg.data_dir.join("api-token");
    if let Ok(t) = std::fs::read_to_string(&path)
        && !t.trim().is_empty()
    {
        tracing::info!(file = %path.display(), "API token read from file");
        return Ok(t.trim().to_string());
    }
    let t = crate::http::api::random_token();
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .with_context(|| format!("writing {}", path.display()))?;
        f.write_all(t.as_bytes())?;
    }
    tracing::info!(file = %path.display(), "generated an API token (set PXED_API_TOKEN or --api-token-file to choose one)");
    Ok(t)
}

/// The syslog receiver's UDP socket and a TCP listener on the same address and port
/// (with port 0, the port UDP got).
///
/// A free UDP port may be in use for TCP by another process: with port 0, pxed then
/// tries another UDP port (up to 16, each refused one held until the end so the kernel
/// does not hand it out again) rather than start without a receiver. A configured port
/// is tried once.
fn bind_syslog(
    addr: std::net::SocketAddr,
) -> anyhow::Result<(tokio::net::UdpSocket, tokio::net::TcpListener)> {
    let tries = if addr.port() == 0 { 16 } else { 1 };
    let mut refused = Vec::new();
    loop {
        let udp = crate::net::bind_udp(addr, None, false).context("syslog UDP")?;
        let port = udp.local_addr()?.port();
        match crate::net::bind_tcp(std::net::SocketAddr::new(addr.ip(), port)) {
            Ok(tcp) => return Ok((udp, tcp)),
            Err(e @ crate::net::NetError::InUse { .. }) if refused.len() + 1 < tries => {
                tracing::debug!(error = %e, "syslog: TCP port taken, trying another");
                refused.push(udp);
            }
            Err(e) => return Err(anyhow::Error::new(e).context("syslog TCP")),
        }
    }
}

/// How long in-flight work may take to drain after cancellation.
pub const DRAIN: Duration = Duration::from_millis(1500);

/// The top-level keys whose values differ between two configurations (one level
/// deeper for sections: `lifecycle.max_attempts`). Only names, never values: some
/// are secrets.
pub fn changed_keys(old: &Config, new: &Config) -> Vec<String> {
    let (Ok(serde_json::Value::Object(a)), Ok(serde_json::Value::Object(b))) =
        (serde_json::to_value(old), serde_json::to_value(new))
    else {
        return vec!["(unreadable)".into()];
    };
    let mut out = Vec::new();
    for (k, va) in &a {
        let vb = b.get(k).unwrap_or(&serde_json::Value::Null);
        match (va, vb) {
            (serde_json::Value::Object(x), serde_json::Value::Object(y)) => {
                for (sk, sva) in x {
                    if y.get(sk) != Some(sva) {
                        out.push(format!("{k}.{sk}"));
                    }
                }
                out.extend(
                    y.keys()
                        .filter(|sk| !x.contains_key(*sk))
                        .map(|sk| format!("{k}.{sk}")),
                );
            }
            _ if va != vb => out.push(k.clone()),
            _ => {}
        }
    }
    out
}

/// Applies a re-read configuration: what can change live does (the lifecycle
/// policy: deadlines, retries, backoff; the power-on waves and booting limit); the rest is named as
/// needing a restart.
fn reload(state: &AppState, running: &Config, new: &Config) {
    let changed = changed_keys(running, new);
    let (live, restart): (Vec<String>, Vec<String>) = changed.into_iter().partition(|k| {
        k.starts_with("lifecycle.")
            || k.starts_with("pacing.power_on_")
            || k == "pacing.max_booting"
    });
    if live.iter().any(|k| k.starts_with("lifecycle.")) {
        state
            .lifecycle
            .set_policy(crate::lifecycle::transition::Policy::from_config(
                &new.lifecycle,
            ));
        state.lifecycle.set_owner_ttl(new.lifecycle.owner_ttl);
    }
    if live.iter().any(|k| k.starts_with("pacing.power_on_")) {
        state
            .lifecycle
            .set_waves(crate::lifecycle::pacing::Waves::from_config(&new.pacing));
    }
    if live.iter().any(|k| k == "pacing.max_booting") {
        state
            .lifecycle
            .set_max_booting(new.pacing.max_booting_within(state.conn_limits));
    }
    tracing::info!(
        reloaded = %if live.is_empty() { "nothing".into() } else { live.join(", ") },
        needs_restart = %if restart.is_empty() { "nothing".into() } else { restart.join(", ") },
        "SIGHUP: configuration re-read"
    );
}

/// Runs pxed until `cancel` fires, applying each configuration that arrives on
/// `reloads` (SIGHUP).
/// Runs `job` while this instance holds `duty` (on SQLite: always): waits for the
/// duty, runs the job, and stops it when the duty's lock is lost (the database went
/// away: another instance may take the duty), then waits for the duty again. Until
/// `cancel`.
async fn run_as_duty<F, Fut, E>(
    store: &Store,
    duty: crate::store::cluster::Duty,
    cancel: CancellationToken,
    mut job: F,
) -> anyhow::Result<()>
where
    F: FnMut(CancellationToken) -> Fut,
    Fut: std::future::Future<Output = Result<(), E>>,
    E: std::error::Error + Send + Sync + 'static,
{
    const CHECK: Duration = Duration::from_secs(1);
    loop {
        let mut lock = loop {
            match store.try_duty(duty).await {
                Ok(Some(lock)) => break lock,
                Ok(None) => {}
                Err(e) => tracing::warn!(?duty, error = %e, "taking a duty"),
            }
            tokio::select! {
                // CANCEL-SAFETY: only waits.
                _ = cancel.cancelled() => return Ok(()),
                // CANCEL-SAFETY: a sleep.
                _ = tokio::time::sleep(CHECK) => {}
            }
        };
        tracing::info!(?duty, "this instance runs the duty");
        let stop = cancel.child_token();
        let run = job(stop.clone());
        tokio::pin!(run);
        loop {
            tokio::select! {
                // CANCEL-SAFETY: the job is polled again in the next turn.
                r = &mut run => {
                    r?;
                    return Ok(());
                }
                // CANCEL-SAFETY: a sleep.
                _ = tokio::time::sleep(CHECK) => {
                    if !cancel.is_cancelled() && !lock.still_held().await {
                        break;
                    }
                }
            }
        }
        tracing::warn!(?duty, "the duty's database lock was lost: stopping it here");
        stop.cancel();
        (&mut run).await?;
    }
}

pub async fn run(
    cfg: Config,
    cancel: CancellationToken,
    mut reloads: tokio::sync::mpsc::Receiver<Config>,
) -> anyhow::Result<()> {
    let cfg = Arc::new(cfg);
    preflight(&cfg)?;
    let nofile = crate::net::raise_fd_limit();
    let http = crate::net::ConnLimits::for_fd_limit(nofile);
    tracing::info!(
        nofile,
        http_connections = http.max,
        http_reserved = http.reserve,
        max_booting = cfg.pacing.max_booting_within(http),
        "open-files limit"
    );
    let store = Store::open_configured(&cfg.data_dir, cfg.database_url.as_deref())
        .await
        .with_context(|| match &cfg.database_url {
            // The error names the server (never the password).
            Some(_) => "opening the PostgreSQL store".to_string(),
            None => format!("opening the store in {}", cfg.data_dir.display()),
        })?;
    let token = api_token(&cfg)?;
    let state = AppState::new(
        cfg.clone(),
        store.clone(),
        Arc::new(StoreBmcs::new(cfg.bmc.call_policy())),
        token,
        cancel.child_token(),
    );
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
        let _ = stats.observer.set(state.stages.clone());
        let _ = stats.slots.set(state.slots.clone());
        state.renders.lock().expect("lock").push(stats.clone());
        tasks.spawn(async move { Ok(crate::tftp::serve(tftp, root, settings, stats, c).await?) });
    }

    {
        // The recorder runs whether or not the syslog receiver does: the reporting
        // webhook feeds it too. Tracked, so its last batch is written before the store
        // closes.
        let settings = crate::telemetry::recorder::Settings {
            lines_per_node: cfg.syslog.lines_per_node,
            ..Default::default()
        };
        let rx = state
            .telemetry
            .take_receiver()
            .context("the telemetry queue was taken already")?;
        let (st, c) = (state.clone(), cancel.clone());
        tasks.spawn(async move {
            crate::telemetry::recorder::run(st, rx, settings, c).await;
            Ok(())
        });
    }
    {
        // Tracked, so its last batch is written before the store closes.
        let settings = crate::stages::recorder::Settings {
            keep_generations: cfg.stages.keep_generations,
            ..Default::default()
        };
        let (rx, changes) = state
            .stages
            .take_receivers()
            .context("the stage queue was taken already")?;
        let (st, c) = (state.clone(), cancel.clone());
        tasks.spawn(async move {
            crate::stages::recorder::run(st, rx, changes, settings, c).await;
            Ok(())
        });
    }
    if cfg.syslog.enabled {
        match bind_syslog(cfg.syslog.address) {
            Ok((udp, tcp)) => {
                let addr = udp.local_addr()?;
                tracing::info!(%addr, "syslog listening");
                state.telemetry.set_listening(addr);
                let limits = crate::telemetry::server::Limits {
                    max_connections: cfg.syslog.max_connections as usize,
                    idle_timeout: cfg.syslog.idle_timeout,
                    max_line: cfg.syslog.max_line as usize,
                };
                let (t, c) = (state.telemetry.clone(), cancel.clone());
                tasks.spawn(async move {
                    Ok(crate::telemetry::server::serve(udp, tcp, t, limits, c).await?)
                });
            }
            // Another syslog daemon may hold the port: pxed still serves, and installers
            // are not pointed at a receiver that is not there.
            Err(e) => tracing::error!(
                addr = %cfg.syslog.address,
                error = format!("{e:#}"),
                "syslog receiver not started (installers will not report their logs; set [syslog] address or enabled = false)"
            ),
        }
    }

    if cfg.dhcp.mode != crate::config::DhcpMode::Off {
        let sockets = crate::dhcp::bind(&cfg)?;
        let (seen, rx) = tokio::sync::mpsc::channel(1024);
        let stats = Arc::new(crate::dhcp::DhcpStats::default());
        state.renders.lock().expect("lock").push(stats.clone());
        let ctx = crate::dhcp::DhcpContext::new(&cfg, store.clone(), seen, stats)
            .with_slots(state.slots.clone());
        let c = cancel.clone();
        tasks.spawn(async move { Ok(crate::dhcp::serve(sockets, ctx, c).await?) });
        // Tracked, so it ends (with the DHCP server's sender) before the store closes.
        let st = state.clone();
        tasks.spawn(async move {
            st.discovery.run(&st.store, &st.lifecycle, rx).await;
            Ok(())
        });
    }

    {
        // Started even with no URL configured: it keeps the outbox empty.
        let stats = Arc::new(crate::webhook::WebhookStats::new(
            cfg.webhooks.targets.len(),
        ));
        state.renders.lock().expect("lock").push(stats.clone());
        let (st, settings, c) = (store.clone(), cfg.webhooks.clone(), cancel.clone());
        tasks.spawn(async move {
            // Once per database: with several instances, the one holding the duty
            // delivers (and another takes over when it dies).
            let duty = crate::store::cluster::Duty::Webhooks;
            run_as_duty(&st, duty, c, |c| {
                crate::webhook::run(st.clone(), settings.clone(), stats.clone(), c)
            })
            .await
        });
        let (st, c) = (state.clone(), cancel.clone());
        let every = cfg.lifecycle.leftovers_interval;
        tasks.spawn(async move {
            crate::leftovers::Leftovers::run(st, every, c).await;
            Ok(())
        });
    }

    {
        let (st, c) = (state.clone(), cancel.clone());
        tasks.spawn(async move {
            st.lifecycle.keep_claims(c).await;
            Ok(())
        });
        let (st, c) = (state.clone(), cancel.clone());
        tasks.spawn(async move {
            st.lifecycle.follow_others(c).await;
            Ok(())
        });
    }
    let resumed = state.lifecycle.resume().await?;
    if resumed > 0 {
        tracing::info!(nodes = resumed, "resumed in-progress nodes from the store");
    }

    let mut running = (*cfg).clone();
    let result = loop {
        tokio::select! {
            // Servers return Ok as soon as they see the cancel; without `biased` a
            // clean SIGTERM could be reported as "a server stopped unexpectedly".
            biased;
            // CANCEL-SAFETY: only waits; nothing is lost when the other branch wins.
            _ = cancel.cancelled() => break Ok(()),
            // CANCEL-SAFETY: join_next is cancel-safe.
            Some(r) = tasks.join_next() => {
                let shutting_down = cancel.is_cancelled();
                cancel.cancel();
                break match r {
                    Ok(Ok(())) if shutting_down => Ok(()),
                    Ok(Ok(())) => Err(anyhow::anyhow!("a server stopped unexpectedly")),
                    Ok(Err(e)) => Err(e),
                    Err(e) => Err(anyhow::anyhow!("a server panicked: {e}")),
                };
            }
            // CANCEL-SAFETY: recv is cancel-safe.
            Some(new) = reloads.recv() => {
                reload(&state, &running, &new);
                running = new;
            }
        }
    };
    let drained = tokio::time::timeout(DRAIN, async {
        while let Some(r) = tasks.join_next().await {
            if let Ok(Err(e)) = r {
                tracing::warn!(error = %e, "server ended with an error during shutdown");
            }
        }
        state.lifecycle.drain().await;
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

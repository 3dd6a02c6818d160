//! DHCP server (full and proxy).
//!
//! The receive loop parses a datagram ([`packet::parse`]), calls the pure
//! [`decide`], applies the lease change to the in-memory [`LeaseTable`] and sends.
//! Replies that bind a lease (ACKs) go through one writer task that commits leases
//! in batches, one transaction per batch, and sends those replies only after the
//! commit: an ACKed lease is always durable, and a burst of clients costs one fsync
//! per batch rather than one per client. Offers, NAKs and INFORM replies are sent at
//! once, except OFFERs to netboot clients while the transfer slots they are about to
//! use are full: those are held (see [`crate::pacing`]) by a task of their own that
//! sends them when a slot frees or `pacing.offer_delay_max_ms` passes; the receive
//! loop never waits for them. Replies to clients with no address yet are broadcast
//! (RFC 2131 §4.1 allows it) rather than unicast to yiaddr, which would need an ARP
//! entry written first.

pub mod decide;
pub mod packet;
pub mod stats;
pub mod table;

use std::collections::{HashMap, HashSet};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::boot::BootDecision;
use crate::config::{Config, DhcpMode, Pacing, Reservation};
use crate::net::{Interface, NetError};
use crate::pacing::{Pace, Slots, Wants, pace, wants};
use crate::store::leases::{LeaseRow, LeaseWrite, RefusedLease};
use crate::store::{Store, StoreError};

pub use decide::{Action, Decision, DropReason, Policy, Reply, ReplyKind, decide};
pub use packet::{Mac, Malformed, Port, Request};
pub use stats::DhcpStats;
pub use table::{Change, Lease, LeaseState, LeaseTable, PersistOp};

/// DHCP server errors (startup and fatal runtime errors; per-packet problems are
/// counted, never returned).
#[derive(Debug, thiserror::Error)]
pub enum DhcpError {
    #[error("DHCP: {0}")]
    Net(#[from] NetError),
    #[error("DHCP pool {start}-{end} is not in the subnet of interface {iface} ({addr}/{netmask})")]
    PoolOutsideInterface {
        iface: String,
        start: Ipv4Addr,
        end: Ipv4Addr,
        addr: Ipv4Addr,
        netmask: Ipv4Addr,
    },
    #[error("DHCP mode is off")]
    Off,
    #[error("DHCP lease store: {0}")]
    Store(#[from] StoreError),
}

/// A netboot client was heard from (for discovery of unknown machines).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DhcpSeen {
    pub mac: Mac,
    pub arch: Option<u16>,
    pub vendor_class: Option<String>,
    pub user_class_ipxe: bool,
    /// The address the client asked for or holds (a REQUEST's option 50, else its
    /// `ciaddr`): in proxy mode, where the site's DHCP server leases, the address the
    /// node's boot token may be bound to (see `Discovery::sighted`).
    pub address: Option<Ipv4Addr>,
}

/// The sockets of one interface.
#[derive(Debug)]
pub struct DhcpSocket {
    pub iface: Interface,
    /// 0.0.0.0:67 bound to the interface.
    pub dhcp: Arc<UdpSocket>,
    /// 0.0.0.0:4011 bound to the interface (proxy mode only).
    pub pxe: Option<Arc<UdpSocket>>,
}

/// What the server runs with besides its sockets.
#[derive(Debug, Clone)]
pub struct DhcpContext {
    pub policy: Policy,
    pub reservations: Vec<Reservation>,
    pub store: Store,
    pub seen: mpsc::Sender<DhcpSeen>,
    pub stats: Arc<DhcpStats>,
    /// Transfer slots in use (shared with TFTP and HTTP) and the limits that hold
    /// offers.
    pub slots: Arc<Slots>,
    pub pacing: Pacing,
}

impl DhcpContext {
    /// A context from the daemon config.
    pub fn new(
        cfg: &Config,
        store: Store,
        seen: mpsc::Sender<DhcpSeen>,
        stats: Arc<DhcpStats>,
    ) -> Self {
        DhcpContext {
            policy: Policy::from_config(cfg),
            reservations: cfg.dhcp.reservations.clone(),
            store,
            seen,
            stats,
            slots: Slots::new(),
            pacing: cfg.pacing.clone(),
        }
    }

    /// The same context counting the slots of the servers sharing `slots`.
    pub fn with_slots(self, slots: Arc<Slots>) -> Self {
        DhcpContext { slots, ..self }
    }
}

/// Binds the DHCP sockets of every configured interface.
pub fn bind(cfg: &Config) -> Result<Vec<DhcpSocket>, DhcpError> {
    if cfg.dhcp.mode == DhcpMode::Off {
        return Err(DhcpError::Off);
    }
    cfg.interfaces
        .iter()
        .map(|name| bind_interface(name, cfg))
        .collect()
}

/// Binds 0.0.0.0:67 (and :4011 in proxy mode) on one interface, after checking that
/// the pool (full mode) is in the interface's subnet. No SO_REUSEADDR: sockets on
/// different devices do not clash, and another DHCP server on the port is reported.
pub fn bind_interface(name: &str, cfg: &Config) -> Result<DhcpSocket, DhcpError> {
    let iface = crate::net::interface(name)?;
    if cfg.dhcp.mode == DhcpMode::Full
        && let Some(local) = &cfg.dhcp.local
        && !(iface.contains(local.pool.start) && iface.contains(local.pool.end))
    {
        return Err(DhcpError::PoolOutsideInterface {
            iface: name.into(),
            start: local.pool.start,
            end: local.pool.end,
            addr: iface.addr,
            netmask: iface.netmask,
        });
    }
    let any = |port| SocketAddr::from((Ipv4Addr::UNSPECIFIED, port));
    let dhcp = Arc::new(crate::net::bind_udp(any(67), Some(name), false)?);
    let pxe = match cfg.dhcp.mode {
        DhcpMode::Proxy => Some(Arc::new(crate::net::bind_udp(
            any(4011),
            Some(name),
            false,
        )?)),
        _ => None,
    };
    tracing::info!(iface = name, addr = %iface.addr, mode = cfg.dhcp.mode.as_str(), "DHCP listening");
    Ok(DhcpSocket { iface, dhcp, pxe })
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Most lease writes committed in one transaction.
const MAX_BATCH: usize = 4096;
/// How often expired leases are forgotten.
const SWEEP_EVERY: Duration = Duration::from_secs(60);
/// Most offers held at once; past it offers go at once (a held offer is a task and a
/// copy of the reply: a flood of made-up MACs must not grow them without bound).
pub const MAX_HELD: usize = 4096;

struct Shared {
    table: Mutex<LeaseTable>,
    policy: Policy,
    stats: Arc<DhcpStats>,
    seen: mpsc::Sender<DhcpSeen>,
    slots: Arc<Slots>,
    pacing: Pacing,
    /// Clients with an offer held, and the xid of their latest DISCOVER (a retry
    /// with a new xid gets the held offer under its own xid).
    held: Mutex<HashMap<Mac, u32>>,
    /// Ends the held offers' tasks at shutdown.
    cancel: CancellationToken,
}

/// A reply waiting for its lease to be committed.
struct Outgoing {
    socket: Arc<UdpSocket>,
    bytes: Vec<u8>,
    dest: SocketAddrV4,
    kind: ReplyKind,
}

struct Job {
    writes: Vec<LeaseWrite>,
    reply: Option<Outgoing>,
}

/// Serves DHCP on `sockets` until `cancel` fires; then commits what is pending.
pub async fn serve(
    sockets: Vec<DhcpSocket>,
    ctx: DhcpContext,
    cancel: CancellationToken,
) -> Result<(), DhcpError> {
    let store = ctx.store.clone();
    let mut loaded = Vec::new();
    if ctx.policy.mode == DhcpMode::Full {
        store.sync_reservations(&ctx.reservations).await?;
        loaded = store.load_leases(unix_now() as i64).await?;
    }
    let count = loaded.len();
    let table = LeaseTable::new(&ctx.reservations, loaded.into_iter().filter_map(from_row));
    tracing::info!(
        leases = count,
        reservations = ctx.reservations.len(),
        "DHCP lease table loaded"
    );
    let loops_cancel = cancel.child_token();
    let shared = Arc::new(Shared {
        table: Mutex::new(table),
        policy: ctx.policy,
        stats: ctx.stats.clone(),
        seen: ctx.seen,
        slots: ctx.slots,
        pacing: ctx.pacing,
        held: Mutex::new(HashMap::new()),
        cancel: loops_cancel.clone(),
    });
    // With other instances on the database, the table follows what they commit.
    let follower =
        match store.changes(store_pg::coord::Channel::Leases).await {
            Ok(Some(changes)) if shared.policy.mode == DhcpMode::Full => Some(tokio::spawn(
                follow(changes, store.clone(), shared.clone(), loops_cancel.clone()),
            )),
            Ok(_) => None,
            Err(e) => {
                // Not fatal: the database still refuses every lease another holds.
                tracing::warn!(error = %e, "not following other instances' leases");
                None
            }
        };
    let (jobs, rx) = mpsc::channel::<Job>(MAX_BATCH * 2);
    let writer = tokio::spawn(writer(rx, store.clone(), ctx.stats.clone(), shared.clone()));
    let mut loops = JoinSet::new();
    for s in sockets {
        let mut socks = vec![(s.dhcp, Port::Dhcp)];
        socks.extend(s.pxe.map(|p| (p, Port::PxeBoot)));
        for (sock, port) in socks {
            loops.spawn(recv_loop(
                sock,
                port,
                s.iface.clone(),
                shared.clone(),
                jobs.clone(),
                loops_cancel.clone(),
            ));
        }
    }
    drop(jobs);
    let mut sweep = tokio::time::interval(SWEEP_EVERY);
    sweep.tick().await;
    loop {
        tokio::select! {
            // CANCEL-SAFETY: only waits.
            _ = cancel.cancelled() => break,
            // CANCEL-SAFETY: join_next is cancel-safe.
            r = loops.join_next() => {
                if let Some(Err(e)) = r {
                    tracing::error!(error = %e, "a DHCP receive loop panicked");
                }
                if loops.is_empty() {
                    break;
                }
            }
            // CANCEL-SAFETY: a missed tick is simply taken at the next one.
            _ = sweep.tick() => {
                let now = unix_now();
                let gone = shared.table.lock().unwrap_or_else(|e| e.into_inner()).sweep(now);
                if let Err(e) = store.purge_expired_leases(now as i64).await {
                    tracing::warn!(error = %e, "purging expired leases");
                }
                tracing::debug!(gone, "expired leases swept");
            }
        }
    }
    loops_cancel.cancel();
    while loops.join_next().await.is_some() {}
    if let Some(f) = follower {
        let _ = f.await;
    }
    // Every sender is gone now: the writer commits what is left and ends.
    if let Err(e) = writer.await {
        tracing::error!(error = %e, "DHCP lease writer panicked");
    }
    Ok(())
}

async fn recv_loop(
    sock: Arc<UdpSocket>,
    port: Port,
    iface: Interface,
    shared: Arc<Shared>,
    jobs: mpsc::Sender<Job>,
    cancel: CancellationToken,
) {
    let mut buf = vec![0u8; packet::MAX_PACKET + 1];
    loop {
        let r = tokio::select! {
            // CANCEL-SAFETY: only waits.
            _ = cancel.cancelled() => return,
            // CANCEL-SAFETY: recv_from is cancel-safe (no datagram is consumed unless it completes).
            r = sock.recv_from(&mut buf) => r,
        };
        match r {
            Ok((n, SocketAddr::V4(src))) => {
                handle(&buf[..n], src, port, &sock, &iface, &shared, &jobs).await
            }
            Ok(_) => shared.stats.malformed.inc(),
            Err(e) => {
                // ICMP errors from earlier sends surface here; they must not stop the loop.
                if !crate::net::after_recv_error("dhcp", &e).await {
                    shared.stats.recv_errors.inc();
                }
            }
        }
    }
}

async fn handle(
    buf: &[u8],
    src: SocketAddrV4,
    port: Port,
    sock: &Arc<UdpSocket>,
    iface: &Interface,
    shared: &Arc<Shared>,
    jobs: &mpsc::Sender<Job>,
) {
    let stats = &shared.stats;
    stats.received.inc();
    let req = match packet::parse(buf, src, port) {
        Ok(r) => r,
        Err(e) => {
            stats.malformed.inc();
            tracing::debug!(%src, error = %e, "malformed DHCP packet dropped");
            return;
        }
    };
    stats.count_type(req.msg_type);
    // Only machines that try to netboot are inventory; phones, switches and BMCs
    // asking for an address are not.
    if req.client.is_netboot() {
        let seen = DhcpSeen {
            mac: req.client.mac,
            arch: req.client.arch,
            vendor_class: req.client.vendor_class.clone(),
            user_class_ipxe: req.client.user_class_ipxe,
            address: (req.msg_type == dhcproto::v4::MessageType::Request)
                .then(|| {
                    req.requested_ip
                        .or(Some(req.ciaddr()).filter(|a| !a.is_unspecified()))
                })
                .flatten(),
        };
        if let Err(mpsc::error::TrySendError::Full(_)) = shared.seen.try_send(seen) {
            stats.seen_dropped.inc();
        }
    }
    let now = unix_now();
    let (decision, writes) = {
        let mut table = shared.table.lock().unwrap_or_else(|e| e.into_inner());
        let d = decide(&req, &table, &shared.policy, iface, now);
        let ops = match &d.action {
            Action::Reply {
                change: Some(c), ..
            }
            | Action::Record(c) => table.apply(c),
            _ => Vec::new(),
        };
        (d, ops)
    };
    if let BootDecision::UnknownArch(arch) = decision.boot {
        stats.count_unknown_arch(arch);
        tracing::info!(mac = %req.mac, ?arch, "boot client of an architecture with no boot file");
    }
    let writes: Vec<LeaseWrite> = writes.into_iter().map(to_write).collect();
    let fetches = wants(req.msg_type, &decision.boot);
    match decision.action {
        Action::Drop(reason) => {
            stats.ignored.inc();
            if reason == DropReason::PoolExhausted {
                stats.pool_exhausted.inc();
                tracing::warn!(mac = %req.mac, "no free address in the pool");
            }
            tracing::debug!(mac = %req.mac, ?reason, "not answered");
        }
        Action::Record(_) => {
            if !writes.is_empty() {
                let _ = jobs
                    .send(Job {
                        writes,
                        reply: None,
                    })
                    .await;
            }
        }
        Action::Reply { reply, .. } => {
            let bytes = match packet::encode(&reply.msg, req.relay_info.as_deref()) {
                Ok(b) => b,
                Err(e) => {
                    stats.send_errors.inc();
                    tracing::warn!(mac = %req.mac, error = %e, "encoding a reply");
                    return;
                }
            };
            let out = Outgoing {
                socket: sock.clone(),
                bytes,
                dest: reply.dest,
                kind: reply.kind,
            };
            if writes.is_empty() {
                // An offer that persists nothing may wait for a slot; one that
                // persists goes through the writer like any other reply.
                let out = if out.kind == ReplyKind::Offer
                    && pace(fetches, shared.slots.in_use(), &shared.pacing) == Pace::Hold
                {
                    hold(shared, fetches, out, req.mac)
                } else {
                    Some(out)
                };
                if let Some(out) = out {
                    send(&out, stats).await;
                }
            } else {
                let _ = jobs
                    .send(Job {
                        writes,
                        reply: Some(out),
                    })
                    .await;
            }
        }
    }
}

/// Holds the offer `out` to `mac` until a slot of the kind it `wants` frees or
/// `offer_delay_max_ms` passes, in a task of its own. A client whose offer is held
/// already gets no second one: its held offer takes the retry's xid. Returns `out`
/// when it must go at once (too many offers held).
fn hold(shared: &Arc<Shared>, wants: Wants, out: Outgoing, mac: Mac) -> Option<Outgoing> {
    let Some(xid) = xid_of(&out.bytes) else {
        return Some(out);
    };
    {
        let mut held = shared.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(x) = held.get_mut(&mac) {
            *x = xid;
            shared.slots.held_duplicates.inc();
            tracing::debug!(%mac, xid, "DISCOVER retry while its offer is held");
            return None;
        }
        if held.len() >= MAX_HELD {
            shared.slots.held_overflow.inc();
            return Some(out);
        }
        held.insert(mac, xid);
    }
    shared.slots.held.inc();
    shared.slots.held_now.inc();
    tracing::debug!(%mac, ?wants, "offer held: transfer slots full");
    let shared = shared.clone();
    tokio::spawn(async move {
        let since = tokio::time::Instant::now();
        let waited_for =
            wait_for_slot(&shared, wants, since + shared.pacing.offer_delay_max()).await;
        let xid = shared
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&mac);
        let waited = since.elapsed();
        shared.slots.held_now.dec();
        shared
            .slots
            .held_ms
            .add(u64::try_from(waited.as_millis()).unwrap_or(u64::MAX));
        match waited_for {
            Held::Slot => {}
            Held::Expired => shared.slots.held_expired.inc(),
            Held::Shutdown => return,
        }
        let mut out = out;
        if let Some(xid) = xid {
            set_xid(&mut out.bytes, xid);
        }
        tracing::debug!(%mac, ?waited, "held offer sent");
        send(&out, &shared.stats).await;
    });
    None
}

/// How a held offer's wait ended.
enum Held {
    /// A slot of its kind is free: it goes.
    Slot,
    /// `offer_delay_max_ms` passed with the slots still full: it goes anyway.
    Expired,
    /// The server is shutting down: it is dropped.
    Shutdown,
}

/// Waits until the pacing decision for `wants` is to send, or `deadline`.
async fn wait_for_slot(shared: &Shared, wants: Wants, deadline: tokio::time::Instant) -> Held {
    let Some(freed) = shared.slots.freed(wants) else {
        return Held::Slot;
    };
    loop {
        // Registered before the check, so a slot freed between the check and the
        // wait still wakes us.
        let notified = freed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if pace(wants, shared.slots.in_use(), &shared.pacing) == Pace::Send {
            return Held::Slot;
        }
        tokio::select! {
            // CANCEL-SAFETY: a wake-up taken by a dropped `Notified` is handed on to
            // the next waiter by tokio.
            _ = &mut notified => {}
            // CANCEL-SAFETY: only waits.
            _ = tokio::time::sleep_until(deadline) => return Held::Expired,
            // CANCEL-SAFETY: only waits.
            _ = shared.cancel.cancelled() => return Held::Shutdown,
        }
    }
}

/// The xid of an encoded DHCP message (bytes 4..8, RFC 2131 §2).
fn xid_of(bytes: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(bytes.get(4..8)?.try_into().ok()?))
}

fn set_xid(bytes: &mut [u8], xid: u32) {
    if let Some(b) = bytes.get_mut(4..8) {
        b.copy_from_slice(&xid.to_be_bytes());
    }
}

async fn send(out: &Outgoing, stats: &DhcpStats) {
    match out.socket.send_to(&out.bytes, out.dest).await {
        Ok(_) => match out.kind {
            ReplyKind::Offer => stats.offers.inc(),
            ReplyKind::Ack => stats.acks.inc(),
            ReplyKind::Nak => stats.naks.inc(),
        },
        Err(e) => {
            stats.send_errors.inc();
            tracing::debug!(dest = %out.dest, error = %e, "sending a DHCP reply");
        }
    }
}

/// Group commit: takes everything queued, commits it in one transaction, then sends
/// the replies that waited for it. While a commit runs the next batch queues up.
async fn writer(
    mut rx: mpsc::Receiver<Job>,
    store: Store,
    stats: Arc<DhcpStats>,
    table: Arc<Shared>,
) {
    let mut batch = Vec::new();
    while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
        let writes: Vec<LeaseWrite> = batch
            .iter()
            .flat_map(|j| j.writes.iter().cloned())
            .collect();
        match store.commit_leases(&writes).await {
            Ok(refused) => {
                stats.commits.inc();
                let refused = learn_refused(&table, refused, &stats);
                for j in &batch {
                    // A reply whose lease another instance holds is withheld: the
                    // client retries and is offered an address that is free.
                    let lost = !refused.is_empty()
                        && j.writes
                            .iter()
                            .any(|w| matches!(w, LeaseWrite::Upsert(l) if refused.contains(&l.ip)));
                    if let (Some(out), false) = (&j.reply, lost) {
                        send(out, &stats).await;
                    }
                }
            }
            Err(e) => {
                // No ACK for a lease we could not store; the clients will retry.
                stats.commit_errors.inc();
                tracing::error!(error = %e, n = batch.len(), "committing DHCP leases; replies withheld");
            }
        }
        batch.clear();
    }
}

/// Most addresses reloaded in one query when other instances' changes come in a burst.
const FOLLOW_BATCH: usize = 512;

/// Keeps the lease table in step with what other instances commit: each announced
/// address is read back from the database (a burst in one query) and put in the
/// table; after a lost connection every lease is read again. Until `cancel`.
async fn follow(
    mut changes: store_pg::coord::Changes,
    store: Store,
    shared: Arc<Shared>,
    cancel: CancellationToken,
) {
    use store_pg::coord::Change;
    loop {
        let first = tokio::select! {
            // CANCEL-SAFETY: only waits.
            _ = cancel.cancelled() => return,
            // CANCEL-SAFETY: a notification is consumed only when next() completes.
            c = changes.next() => c,
        };
        let mut ips: Vec<Ipv4Addr> = Vec::new();
        let mut resync = false;
        let note = |c: Change, ips: &mut Vec<Ipv4Addr>, resync: &mut bool| match c {
            Change::Lease(ip) => ips.extend(ip.parse::<Ipv4Addr>().ok()),
            Change::Resync => *resync = true,
            Change::Event { .. } => {}
        };
        match first {
            Ok(c) => note(c, &mut ips, &mut resync),
            Err(e) => {
                tracing::warn!(error = %e, "listening for other instances' leases; again in 1 s");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        }
        // Whatever else is already announced joins this batch.
        while ips.len() < FOLLOW_BATCH {
            match tokio::time::timeout(Duration::from_millis(5), changes.next()).await {
                Ok(Ok(c)) => note(c, &mut ips, &mut resync),
                _ => break,
            }
        }
        let rows = if resync {
            store.load_leases(unix_now() as i64).await
        } else {
            store.leases_at(&ips).await
        };
        let rows = match rows {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "reading leases other instances changed");
                continue;
            }
        };
        let stored: HashMap<Ipv4Addr, Lease> = rows
            .into_iter()
            .filter_map(from_row)
            .map(|l| (l.ip, l))
            .collect();
        shared
            .stats
            .leases_followed
            .add(if resync { stored.len() } else { ips.len() } as u64);
        let mut table = shared.table.lock().unwrap_or_else(|e| e.into_inner());
        if resync {
            for (ip, l) in stored {
                table.follow(ip, Some(l));
            }
        } else {
            // An address announced twice in one burst is read once: the row is as
            // it is now, whichever change came last.
            for ip in ips {
                table.follow(ip, stored.get(&ip).cloned());
            }
        }
    }
}

/// Puts the leases another instance holds into the table in place of the ones this
/// instance could not bind; returns the refused addresses.
fn learn_refused(
    shared: &Shared,
    refused: Vec<RefusedLease>,
    stats: &DhcpStats,
) -> HashSet<Ipv4Addr> {
    // The usual case (and always on SQLite): nothing refused, the table not locked.
    if refused.is_empty() {
        return HashSet::new();
    }
    let mut table = shared.table.lock().unwrap_or_else(|e| e.into_inner());
    refused
        .into_iter()
        .map(|r| {
            stats.lease_conflicts.inc();
            tracing::info!(ip = %r.ip, holder = ?r.holder.as_ref().map(|h| &h.mac), "address held by another instance: reply withheld");
            table.learn(r.ip, r.holder.and_then(from_row));
            r.ip
        })
        .collect()
}

fn to_write(op: PersistOp) -> LeaseWrite {
    match op {
        PersistOp::Delete(ip) => LeaseWrite::Delete(ip),
        PersistOp::Upsert(l) => LeaseWrite::Upsert(LeaseRow {
            ip: l.ip,
            mac: l.mac.to_string(),
            client_id: l.client_id.as_deref().map(hex::encode),
            hostname: l.hostname,
            state: l.state.as_db().to_string(),
            expires_at: l.expires.min(i64::MAX as u64) as i64,
        }),
    }
}

fn from_row(r: LeaseRow) -> Option<Lease> {
    let Ok(mac) = r.mac.parse::<Mac>() else {
        tracing::warn!(mac = %r.mac, "skipping a lease with a bad MAC");
        return None;
    };
    // An unknown state is not guessed at: a lease read as bound that was something
    // else could hand one address to two clients, or keep a declined one in use.
    let Some(state) = LeaseState::from_db(&r.state) else {
        tracing::warn!(ip = %r.ip, state = %r.state, "skipping a lease with an unknown state");
        return None;
    };
    Some(Lease {
        ip: r.ip,
        mac,
        client_id: r.client_id.and_then(|c| hex::decode(c).ok()),
        hostname: r.hostname,
        state,
        expires: r.expires_at.max(0) as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DhcpFlags, Flags, load};

    fn cfg(iface: &str, pool: &str) -> Config {
        let f = Flags {
            interfaces: vec![iface.into()],
            dhcp: DhcpFlags {
                mode: Some(DhcpMode::Full),
                pool: Some(pool.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        load(None, Vec::<(String, String)>::new(), &f).unwrap()
    }

    #[test]
    fn startup_errors_are_clear() {
        let e = bind(&cfg("nope0", "10.0.0.10-10.0.0.20")).unwrap_err();
        assert!(matches!(e, DhcpError::Net(NetError::NoInterface(_))), "{e}");
        let e = bind(&cfg("lo", "10.0.0.10-10.0.0.20")).unwrap_err();
        assert!(matches!(e, DhcpError::PoolOutsideInterface { .. }), "{e}");
        assert!(
            e.to_string().contains("not in the subnet of interface lo"),
            "{e}"
        );
    }

    #[test]
    fn a_held_offer_takes_the_xid_of_the_latest_retry() {
        let mut m = dhcproto::v4::Message::default();
        m.set_xid(0x1234_5678);
        let mut bytes = packet::encode(&m, None).unwrap();
        assert_eq!(xid_of(&bytes), Some(0x1234_5678));
        set_xid(&mut bytes, 0xdead_beef);
        assert_eq!(xid_of(&bytes), Some(0xdead_beef));
        let back = dhcproto::Decodable::decode(&mut dhcproto::Decoder::new(&bytes));
        let back: dhcproto::v4::Message = back.unwrap();
        assert_eq!(back.xid(), 0xdead_beef);
        assert_eq!(xid_of(&bytes[..7]), None);
    }

    #[test]
    fn rows_round_trip_to_leases() {
        let l = Lease {
            ip: Ipv4Addr::new(10, 0, 0, 9),
            mac: "52:54:00:00:00:09".parse().unwrap(),
            client_id: Some(vec![1, 0xaa]),
            hostname: Some("h".into()),
            state: LeaseState::Declined,
            expires: 77,
        };
        let LeaseWrite::Upsert(row) = to_write(PersistOp::Upsert(l.clone())) else {
            panic!()
        };
        assert_eq!(row.client_id.as_deref(), Some("01aa"));
        assert_eq!(from_row(row.clone()), Some(l));
        // An unknown stored state is skipped, never read as bound.
        let odd = LeaseRow {
            state: "offered".into(),
            ..row
        };
        assert_eq!(from_row(odd), None);
    }
}

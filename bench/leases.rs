//! Durable lease commits per second: pxed's SQLite store (what the DHCP server commits
//! through today: one writer, group commit, `synchronous=FULL`) beside the PostgreSQL
//! store's lease claim (one conditional upsert per lease, each its own transaction,
//! `synchronous_commit=on`), with one and two instances on one database.
//!
//! `cargo bench --bench leases [-- SECONDS CLIENTS]` (defaults 5 s, 64 clients). Each
//! client renews its own address in a loop, as DHCP clients renewing do: every write
//! is an update that must reach disk before it returns. The PostgreSQL server is a
//! private cluster on this machine (Unix socket), so both stores pay this disk's fsync
//! and share the same 2 cores with the load.
//!
//! This is the lease-commit part of a DORA, not DORA/s: the DHCP server does not run
//! on PostgreSQL yet (issue 15).
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pxed::store::Store;
use pxed::store::leases::{LeaseRow, LeaseWrite};
use store_pg::PgStore;
use store_pg::cluster::Cluster;
use store_pg::coord::{LeaseClaim, NewLease};

const NOW: i64 = 1_900_000_000;

fn ip(client: usize) -> String {
    format!(
        "10.{}.{}.{}",
        client / 65536,
        (client / 256) % 256,
        client % 256
    )
}

fn mac(client: usize) -> String {
    format!(
        "52:54:00:{:02x}:{:02x}:{:02x}",
        client / 65536,
        (client / 256) % 256,
        client % 256
    )
}

/// Runs `clients` loops of `one(client, round)` for `secs`: commits per second.
async fn drive<F, Fut>(secs: u64, clients: usize, one: F) -> f64
where
    F: Fn(usize, i64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let one = Arc::new(one);
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + Duration::from_secs(secs);
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (one, done) = (one.clone(), done.clone());
            tokio::spawn(async move {
                let mut round = 0;
                while Instant::now() < until {
                    round += 1;
                    one(c, round).await;
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("client");
    }
    done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

async fn sqlite(secs: u64, clients: usize) -> f64 {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).await.expect("open");
    let s = store.clone();
    let rate = drive(secs, clients, move |c, round| {
        let s = s.clone();
        async move {
            let row = LeaseRow {
                ip: ip(c).parse().expect("ip"),
                mac: mac(c),
                client_id: None,
                hostname: None,
                state: "bound".into(),
                expires_at: NOW + round,
            };
            s.commit_leases(&[LeaseWrite::Upsert(row)])
                .await
                .expect("commit");
        }
    })
    .await;
    store.close().await;
    rate
}

async fn postgres(cluster: &Cluster, db: &str, secs: u64, clients: usize, instances: usize) -> f64 {
    let url = cluster.create_database(db).expect("create database");
    let mut stores = Vec::new();
    for _ in 0..instances {
        // Each instance a pool of its own, as a pxed process has.
        stores.push(PgStore::connect(&url, 8).await.expect("connect"));
    }
    stores[0].migrate().await.expect("migrate");
    let pools = Arc::new(stores.clone());
    let rate = drive(secs, clients, move |c, round| {
        let pools = pools.clone();
        async move {
            let (ip, mac) = (ip(c), mac(c));
            let lease = NewLease {
                ip: &ip,
                mac: &mac,
                client_id: None,
                hostname: None,
                expires_at: NOW + round,
            };
            let got = pools[c % pools.len()]
                .claim_lease(&lease, NOW)
                .await
                .expect("claim");
            assert_eq!(got, LeaseClaim::Granted);
        }
    })
    .await;
    for s in stores {
        s.close().await;
    }
    rate
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let secs: u64 = args.first().and_then(|a| a.parse().ok()).unwrap_or(5);
    let clients: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(64);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let cluster = Cluster::start().expect("a private PostgreSQL (Debian's postgresql package)");
    let version = cluster
        .psql("postgres", "SHOW server_version")
        .unwrap_or_default()
        .split_whitespace()
        .next()
        .unwrap_or("?")
        .to_owned();
    println!(
        "durable lease commits/s, {clients} clients renewing their own address, {secs} s each"
    );
    let lite = rt.block_on(sqlite(secs, clients));
    let one = rt.block_on(postgres(&cluster, "one", secs, clients, 1));
    let two = rt.block_on(postgres(&cluster, "two", secs, clients, 2));
    println!(
        "  {:<52} {lite:>7.0}/s",
        "pxed SQLite store (one writer, group commit)"
    );
    println!(
        "  {:<52} {one:>7.0}/s  {:.2}x SQLite",
        format!("PostgreSQL {version}, 1 instance (8 connections)"),
        one / lite
    );
    println!(
        "  {:<52} {two:>7.0}/s  {:.2}x SQLite",
        format!("PostgreSQL {version}, 2 instances (8 connections each)"),
        two / lite
    );
}

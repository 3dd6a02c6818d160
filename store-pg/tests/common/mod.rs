//! The private PostgreSQL of one test binary and a new database per test.

#![allow(dead_code)]

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

use store_pg::PgStore;
use store_pg::cluster::Cluster;

pub fn cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    CLUSTER.get_or_init(|| Cluster::start().expect("start a private PostgreSQL"))
}

/// A new, empty database for one test: its name and URL.
pub fn new_database() -> (String, String) {
    static N: AtomicU32 = AtomicU32::new(0);
    let name = format!("t{}", N.fetch_add(1, Ordering::Relaxed));
    let url = cluster().create_database(&name).expect("create database");
    (name, url)
}

/// A new, empty database for one test: its URL.
pub fn database() -> String {
    new_database().1
}

/// A new database with the schema applied: its name and a pool of `connections`.
pub async fn migrated(connections: u32) -> (String, PgStore) {
    let (name, url) = new_database();
    let store = PgStore::connect(&url, connections).await.unwrap();
    store.migrate().await.unwrap();
    (name, store)
}

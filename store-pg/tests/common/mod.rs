//! The private PostgreSQL of one test binary and a new database per test.

#![allow(dead_code)]

use store_pg::PgStore;
use store_pg::cluster::Cluster;

pub fn cluster() -> &'static Cluster {
    Cluster::shared()
}

/// A new, empty database for one test: its name and URL.
pub fn new_database() -> (String, String) {
    cluster().new_database().expect("create database")
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

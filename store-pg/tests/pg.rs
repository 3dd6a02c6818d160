//! The PostgreSQL store against a real PostgreSQL (a private cluster per test binary).

mod common;

use common::{cluster, database};
use store_pg::cluster::Cluster;
use store_pg::{MIGRATOR, PgError, PgStore, Role};

fn migrations() -> i64 {
    std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"))
        .unwrap()
        .count() as i64
}

#[tokio::test]
async fn migrate_applies_every_migration_once_and_describes_the_server() {
    let url = database();
    let store = PgStore::connect(&url, 2).await.unwrap();
    assert_eq!(store.schema_version().await.unwrap(), 0);
    assert_eq!(store.migrate().await.unwrap(), migrations());
    // Again: nothing to apply, same version.
    assert_eq!(store.migrate().await.unwrap(), migrations());
    let d = store.describe().await.unwrap();
    assert_eq!(d.role, Role::Primary);
    assert_eq!(d.schema, migrations());
    assert!(d.version.starts_with(char::is_numeric), "{d:?}");
    let line = d.to_string();
    assert!(line.starts_with("postgresql "), "{line}");
    assert!(line.contains(", primary, schema version "), "{line}");
    assert!(
        line.contains(&cluster().socket_dir().display().to_string()),
        "{line}"
    );
    store.close().await;
}

#[tokio::test]
async fn several_processes_migrating_one_new_database_at_once_all_succeed() {
    // sqlx's PostgreSQL migrator takes an advisory lock: the others wait, then find
    // every migration applied. Without it two would run migration 1 at once.
    for _ in 0..3 {
        let url = database();
        let runs = (0..4).map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                let store = PgStore::connect(&url, 1).await?;
                let v = store.migrate().await;
                store.close().await;
                v
            })
        });
        for r in futures_join(runs).await {
            assert_eq!(r.expect("task").expect("migrate"), migrations());
        }
    }
}

async fn futures_join<T>(
    tasks: impl Iterator<Item = tokio::task::JoinHandle<T>>,
) -> Vec<Result<T, tokio::task::JoinError>> {
    let mut out = Vec::new();
    for t in tasks.collect::<Vec<_>>() {
        out.push(t.await);
    }
    out
}

#[tokio::test]
async fn the_audit_log_is_append_only() {
    let url = database();
    let store = PgStore::connect(&url, 1).await.unwrap();
    store.migrate().await.unwrap();
    let c = cluster();
    let db = url.split('/').nth(3).unwrap().split('?').next().unwrap();
    c.psql(db, "INSERT INTO node_events (node_id, generation, event, to_state, at, actor) VALUES (1, 0, 'register', 'available', 'now', 'test')")
        .unwrap();
    for sql in [
        "UPDATE node_events SET actor = 'x'",
        "DELETE FROM node_events",
        "TRUNCATE node_events",
    ] {
        let e = c.psql(db, sql).unwrap_err().to_string();
        assert!(e.contains("node_events is append-only"), "{sql}: {e}");
    }
    assert_eq!(c.psql(db, "SELECT count(*) FROM node_events").unwrap(), "1");
    store.close().await;
}

#[tokio::test]
async fn a_newer_schema_than_this_binary_knows_is_refused() {
    let url = database();
    let store = PgStore::connect(&url, 1).await.unwrap();
    store.migrate().await.unwrap();
    let db = url.split('/').nth(3).unwrap().split('?').next().unwrap();
    let next = migrations() + 1;
    cluster()
        .psql(db, &format!(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) VALUES ({next}, 'from a newer pxed', true, '\\x00', 0)"
        ))
        .unwrap();
    let e = store.migrate().await.unwrap_err();
    assert!(matches!(e, PgError::Migrate(_)), "{e}");
    assert!(e.to_string().contains(&next.to_string()), "{e}");
    store.close().await;
}

#[tokio::test]
async fn bad_urls_and_unreachable_servers_say_so_without_the_password() {
    let e = PgStore::connect("mysql://u:hunter2@db/x", 1)
        .await
        .unwrap_err();
    assert!(matches!(e, PgError::Url(_)), "{e}");
    let e = PgStore::connect(
        "postgres://pxed:hunter2@localhost:1/pxed?host=/nonexistent",
        1,
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("cannot connect to postgres://pxed@localhost:1/pxed?host=/nonexistent: "),
        "{e}"
    );
    assert!(!e.contains("hunter2"), "{e}");
}

#[tokio::test]
async fn the_pool_reconnects_after_the_server_restarts() {
    // Its own cluster: a restart would disturb the other tests' server.
    let own = Cluster::start().unwrap();
    let url = own.create_database("r").unwrap();
    let store = PgStore::connect(&url, 2).await.unwrap();
    store.migrate().await.unwrap();
    own.kill();
    assert!(store.describe().await.is_err(), "the server is down");
    own.restart().unwrap();
    let d = store.describe().await.expect("reconnected");
    assert_eq!(d.schema, migrations());
    store.close().await;
}

#[test]
fn the_embedded_migrations_are_the_files() {
    let embedded: Vec<i64> = MIGRATOR.iter().map(|m| m.version).collect();
    assert_eq!(embedded, (1..=migrations()).collect::<Vec<_>>());
}

/// A streaming replica of the test cluster: the store on it says it is a replica,
/// refuses to migrate there with the reason, sees what the primary commits, and after
/// a promotion (a failover) says primary and takes writes.
#[tokio::test]
async fn a_replica_says_so_and_a_promoted_one_takes_writes() {
    let primary = Cluster::start().unwrap();
    let url = primary.create_database("site").unwrap();
    let p = PgStore::connect(&url, 1).await.unwrap();
    p.migrate().await.unwrap();
    let replica = primary.start_replica().unwrap();
    let r = PgStore::connect(&replica.url("site"), 1).await.unwrap();
    let d = r.describe().await.unwrap();
    assert_eq!((d.role, d.schema), (Role::Replica, migrations()));
    assert!(d.to_string().contains(", replica (read-only), "), "{d}");
    let e = r.migrate().await.unwrap_err();
    assert!(matches!(e, PgError::Replica(_)), "{e}");
    assert!(e.to_string().contains("read-only replica"), "{e}");

    primary
        .psql(
            "site",
            "INSERT INTO reservations (mac, ip) VALUES ('52:54:00:00:00:01', '10.0.0.9')",
        )
        .unwrap();
    let mut seen = String::new();
    for _ in 0..100 {
        seen = replica.psql("site", "SELECT ip FROM reservations").unwrap();
        if !seen.is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(seen, "10.0.0.9", "streamed to the replica");

    primary.kill();
    replica.promote().unwrap();
    let d = r.describe().await.unwrap();
    assert_eq!(d.role, Role::Primary);
    assert_eq!(r.migrate().await.unwrap(), migrations());
    replica
        .psql(
            "site",
            "INSERT INTO reservations (mac, ip) VALUES ('52:54:00:00:00:02', '10.0.0.10')",
        )
        .unwrap();
    r.close().await;
    p.close().await;
}

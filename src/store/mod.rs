//! SQLite store (WAL) through sqlx; migrations are embedded in the binary.
//!
//! Queries are checked at compile time against the committed `.sqlx/` cache.

pub mod board;
pub mod cluster;
pub mod dump;
pub mod hardware;
pub mod images;
pub mod install_log;
pub mod intents;
pub mod leases;
pub mod netboot;
pub mod nodes;
#[cfg(test)]
mod parity;
pub mod secrets;
pub mod stages;
pub mod webhooks;
mod writer;

pub use writer::Write;

use std::path::Path;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{ConnectOptions, Connection, SqlitePool};

use crate::metrics::{Render, sample};

/// Store errors.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("data dir {path}: {source}")]
    DataDir {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error("migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error(
        "{path} is empty (0 bytes): it was truncated or never written. Restore it from a backup, or delete it to start a new, empty inventory"
    )]
    EmptyFile { path: std::path::PathBuf },
    #[error("{path} failed its integrity check ({detail}); restore it from a backup")]
    Corrupt {
        path: std::path::PathBuf,
        detail: String,
    },
    #[error("{path} does not take writes: {source}")]
    NotWritable {
        path: std::path::PathBuf,
        source: Box<StoreError>,
    },
    #[error("{path} is not writable ({source}): pxed writes every boot decision and lease")]
    ReadOnly {
        path: std::path::PathBuf,
        source: nix::Error,
    },
    #[error(transparent)]
    Secret(#[from] secrets::SecretError),
    #[error("the write check did not finish within {0:?}")]
    ProbeTimeout(Duration),
    #[error(transparent)]
    Pg(#[from] store_pg::PgError),
    /// A PostgreSQL database `pxed migrate` has not brought to this binary's schema
    /// (`serve` never migrates PostgreSQL: a shared database's schema changes when an
    /// operator runs `pxed migrate`, not when some instance happens to start).
    #[error(
        "{server} is at schema version {have}, this pxed needs {want}: run `pxed migrate` (with this pxed) first"
    )]
    Schema {
        server: String,
        have: i64,
        want: i64,
    },
    /// A path that only SQLite has (its group-commit writer, its file checks) reached
    /// on PostgreSQL: every store method has its PostgreSQL branch, so this is a bug.
    #[error("{0} is not implemented on PostgreSQL")]
    NotOnPostgres(&'static str),
}

impl StoreError {
    /// The database could not be reached (no connection, a connection lost, the server
    /// shutting down or starting, a pool with no connection in time): nothing was
    /// decided, and the same request may succeed once it is back.
    pub fn is_unavailable(&self) -> bool {
        fn sqlx_unavailable(e: &sqlx::Error) -> bool {
            match e {
                sqlx::Error::Io(_)
                | sqlx::Error::Tls(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::WorkerCrashed => true,
                // PostgreSQL: connection exceptions (08), shutdown or startup (57P01-03),
                // too many connections (53300).
                sqlx::Error::Database(d) => d.code().is_some_and(|c| {
                    c.starts_with("08") || matches!(&*c, "57P01" | "57P02" | "57P03" | "53300")
                }),
                _ => false,
            }
        }
        match self {
            StoreError::Db(e) => sqlx_unavailable(e),
            StoreError::Pg(store_pg::PgError::Db(e)) => sqlx_unavailable(e),
            StoreError::Pg(store_pg::PgError::Connect { .. }) | StoreError::ProbeTimeout(_) => true,
            StoreError::NotWritable { source, .. } => source.is_unavailable(),
            _ => false,
        }
    }
}

/// Connections to PostgreSQL (each one a server process there).
const PG_POOL_SIZE: u32 = 16;

/// Connections in the pool (SQLite has one writer; readers run beside it in WAL).
const POOL_SIZE: u32 = 8;

/// How long a write-probe result is reused: `/healthz` and `/readyz` may be polled
/// often, and each probe is a commit (an fsync).
const PROBE_CACHE: Duration = Duration::from_secs(1);

/// How long a write probe may take before the store counts as not writable.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// What the store knows about its own health.
#[derive(Debug, Default)]
pub struct StoreHealth {
    /// Connections closed because a failed statement (disk full, I/O error) left them
    /// inside a transaction: the writer's after a failed COMMIT, a reader's on
    /// release; fresh ones are opened.
    recycled: AtomicU64,
    /// Write probes that failed.
    probe_failures: AtomicU64,
    /// Batches the writer committed, and the writes in them (group commit).
    commits: AtomicU64,
    writes: AtomicU64,
    /// Microseconds writes waited for their turn at the writer, and held it (their
    /// statements; a batch's COMMIT counts to the write that runs it).
    write_wait_us: AtomicU64,
    write_hold_us: AtomicU64,
    /// Writes waiting for their turn right now.
    write_queued: AtomicU64,
    /// Writes dropped without a commit (rolled back to their savepoint).
    write_dropped: AtomicU64,
    /// The last probe: when, and its error if it failed.
    last_probe: Mutex<Option<(Instant, Option<String>)>>,
}

impl Render for StoreHealth {
    fn render(&self, out: &mut String) {
        sample(
            out,
            "pxed_store_connections_recycled_total",
            "Store connections closed because an error left them inside a transaction",
            "counter",
            self.recycled.load(Ordering::Relaxed),
        );
        sample(
            out,
            "pxed_store_write_probe_failures_total",
            "Write checks (readyz, healthz) the store failed",
            "counter",
            self.probe_failures.load(Ordering::Relaxed),
        );
        sample(
            out,
            "pxed_store_commits_total",
            "Store commits (each one fsync); several writes share one when they queue",
            "counter",
            self.commits.load(Ordering::Relaxed),
        );
        sample(
            out,
            "pxed_store_writes_total",
            "Store writes committed",
            "counter",
            self.writes.load(Ordering::Relaxed),
        );
        sample(
            out,
            "pxed_store_write_wait_seconds_total",
            "Seconds writes waited for their turn at the one writer connection, summed",
            "counter",
            self.write_wait_us.load(Ordering::Relaxed) as f64 / 1e6,
        );
        sample(
            out,
            "pxed_store_write_hold_seconds_total",
            "Seconds writes held the writer connection (statements and COMMITs), summed",
            "counter",
            self.write_hold_us.load(Ordering::Relaxed) as f64 / 1e6,
        );
        sample(
            out,
            "pxed_store_writes_queued",
            "Writes waiting for their turn at the writer connection now",
            "gauge",
            self.write_queued.load(Ordering::Relaxed),
        );
        sample(
            out,
            "pxed_store_writes_rolled_back_total",
            "Store writes ended without a commit (an error, nothing to change, a cancelled request)",
            "counter",
            self.write_dropped.load(Ordering::Relaxed),
        );
        let writable = match &*self.last_probe.lock().expect("lock") {
            Some((_, None)) | None => 1,
            Some((_, Some(_))) => 0,
        };
        sample(
            out,
            "pxed_store_writable",
            "1 if the last write check succeeded",
            "gauge",
            writable,
        );
    }
}

/// The shared store handle (cheap to clone).
#[derive(Debug, Clone)]
pub struct Store {
    /// Private: every query lives in this module's files, so callers never see SQL
    /// and a second backend changes nothing outside `store`.
    db: Db,
    health: Arc<StoreHealth>,
    /// Seals BMC passwords at rest.
    key: Arc<secrets::SecretKey>,
}

/// The database behind a [`Store`].
#[derive(Debug, Clone)]
enum Db {
    Sqlite(Arc<Sqlite>),
    Postgres(store_pg::PgStore),
}

/// The SQLite backend: a local file in WAL mode.
#[derive(Debug)]
struct Sqlite {
    /// Readers only.
    pool: SqlitePool,
    /// Every write goes through it (group commit); the pool's connections only read.
    writer: Arc<writer::Writer>,
    /// The database file.
    file: std::path::PathBuf,
}

impl Store {
    /// Opens (creating if needed) `pxed.sqlite` under `data_dir` and runs migrations.
    pub async fn open(data_dir: &Path) -> Result<Store, StoreError> {
        #[cfg(test)]
        if std::env::var("TEST_DATABASE").as_deref() == Ok("postgresql") {
            return Ok(test_postgres(data_dir).await);
        }
        Store::open_sqlite(data_dir).await
    }

    /// Opens (creating if needed) `pxed.sqlite` under `data_dir` and runs migrations.
    pub(crate) async fn open_sqlite(data_dir: &Path) -> Result<Store, StoreError> {
        let file = data_dir.join("pxed.sqlite");
        create_data_dir(data_dir)?;
        check_writable(data_dir, &file)?;
        // Held until the store is ready: another process opening this data dir at
        // the same moment (a second daemon, `pxed migrate` beside a start) waits
        // rather than meeting a file still being created, a half-run migration or a
        // key file still being written.
        let setup = setup_lock(data_dir).await?;
        prepare_file(data_dir, &file)?;
        let url = format!("sqlite://{}", file.display());
        let opts = SqliteConnectOptions::from_str(&url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // FULL: a commit is on disk before we answer (leases, audit log).
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(5));
        // All connections opened up front and never recycled or pinged: SQLite is a
        // local file, and timers in the pool would otherwise race the lifecycle's
        // deadlines under tokio's paused clock in tests.
        let health = Arc::new(StoreHealth::default());
        let h = health.clone();
        // The writer's connection first: it creates the file, switches it to WAL and
        // runs the migrations.
        let mut first = opts.clone().connect().await?;
        sqlx::migrate!("./migrations").run(&mut first).await?;
        let writer = Arc::new(writer::Writer::new(first, opts.clone(), health.clone()));
        let pool = SqlitePoolOptions::new()
            .max_connections(POOL_SIZE)
            // A statement that failed inside a transaction (SQLITE_FULL at COMMIT, an
            // I/O error) can leave its connection in that transaction; returned to the
            // pool it would refuse every later BEGIN until a restart. Close it instead:
            // SQLite rolls back, and the pool opens a fresh connection when needed.
            .after_release(move |conn, _| {
                let stuck = conn.is_in_transaction();
                if stuck {
                    h.recycled.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("closing a store connection left inside a failed transaction");
                }
                Box::pin(async move { Ok(!stuck) })
            })
            .test_before_acquire(false)
            .idle_timeout(None)
            .max_lifetime(None)
            // Readers only: a write that does not go through the writer fails at once
            // instead of competing with it for SQLite's lock.
            .connect_with(opts.clone().pragma("query_only", "ON"))
            .await?;
        // Open them all now that the file is in WAL mode (switching a new file to WAL
        // from several connections at once can fail with "database is locked").
        let mut held = Vec::new();
        for _ in 0..POOL_SIZE {
            held.push(pool.acquire().await?);
        }
        drop(held);
        let key = Arc::new(secrets::SecretKey::load(data_dir)?);
        let store = Store {
            db: Db::Sqlite(Arc::new(Sqlite {
                pool,
                writer,
                file: file.clone(),
            })),
            health,
            key,
        };
        store.check(&file).await?;
        store.seal_plaintext_secrets().await?;
        drop(setup);
        Ok(store)
    }

    /// The configured store: PostgreSQL if `database_url` is set, else the SQLite file
    /// in `data_dir` (which holds the secret key either way).
    pub async fn open_configured(
        data_dir: &Path,
        database_url: Option<&str>,
    ) -> Result<Store, StoreError> {
        match database_url {
            Some(url) => Store::open_postgres(url, data_dir).await,
            None => Store::open(data_dir).await,
        }
    }

    /// Connects to the PostgreSQL database at `url`, whose schema `pxed migrate` has
    /// brought to this binary's version; BMC passwords are sealed with the key in
    /// `data_dir` (the same key on every instance that shares the database).
    pub async fn open_postgres(url: &str, data_dir: &Path) -> Result<Store, StoreError> {
        create_data_dir(data_dir)?;
        let pg = store_pg::PgStore::connect(url, PG_POOL_SIZE).await?;
        let have = pg.schema_version().await?;
        let want = store_pg::latest_version();
        if have != want {
            return Err(StoreError::Schema {
                server: pg.describe().await?.server,
                have,
                want,
            });
        }
        let key = Arc::new(secrets::SecretKey::load(data_dir)?);
        Ok(Store {
            db: Db::Postgres(pg),
            health: Arc::new(StoreHealth::default()),
            key,
        })
    }

    /// Which database this is and its role, for `/healthz`: with SQLite, one local
    /// file that is its own primary (no replica to reach).
    pub async fn describe(&self) -> Result<String, StoreError> {
        match &self.db {
            Db::Sqlite(lite) => Ok(format!(
                "sqlite {}, primary (one local file, no replica), schema version {}",
                lite.file.display(),
                self.schema_version().await?
            )),
            Db::Postgres(pg) => Ok(pg.describe().await?.to_string()),
        }
    }

    /// Start-up checks: the file passes SQLite's quick integrity check and takes a
    /// write, so a corrupt or read-only database is refused with the reason instead
    /// of serving boot scripts that claim writes which never happen.
    async fn check(&self, file: &Path) -> Result<(), StoreError> {
        let verdict: Vec<String> = sqlx::query_scalar("PRAGMA quick_check")
            .fetch_all(self.pool()?)
            .await?;
        if verdict != ["ok"] {
            return Err(StoreError::Corrupt {
                path: file.to_owned(),
                detail: verdict.join("; "),
            });
        }
        self.probe_write()
            .await
            .map_err(|e| StoreError::NotWritable {
                path: file.to_owned(),
                source: Box::new(e),
            })
    }

    /// Commits one tiny row: whether the store takes writes right now (disk space,
    /// permissions, locks). Reuses a result younger than a second.
    pub async fn probe_write(&self) -> Result<(), StoreError> {
        if let Some((at, result)) = &*self.health.last_probe.lock().expect("lock")
            && at.elapsed() < PROBE_CACHE
        {
            return match result {
                None => Ok(()),
                Some(e) => Err(StoreError::Db(sqlx::Error::Protocol(e.clone()))),
            };
        }
        let at = nodes::now();
        let write = async {
            match &self.db {
                Db::Postgres(pg) => Ok(pg.probe_write(&at).await?),
                Db::Sqlite(_) => self
                    .write_one(sqlx::query!(
                        "INSERT INTO store_probe (id, at) VALUES (1, ?) ON CONFLICT (id) DO UPDATE SET at = excluded.at",
                        at
                    ))
                    .await
                    .map(drop),
            }
        };
        let result = match tokio::time::timeout(PROBE_TIMEOUT, write).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::ProbeTimeout(PROBE_TIMEOUT)),
        };
        if result.is_err() {
            self.health.probe_failures.fetch_add(1, Ordering::Relaxed);
        }
        *self.health.last_probe.lock().expect("lock") = Some((
            Instant::now(),
            result.as_ref().err().map(ToString::to_string),
        ));
        result
    }

    /// Begins a write: every change to the database goes through one (see [`Write`]).
    pub(crate) async fn write(&self) -> Result<Write, StoreError> {
        self.lite("this write")?.writer.begin().await
    }

    /// The SQLite backend, or an error naming what is not available on PostgreSQL yet.
    fn lite(&self, what: &'static str) -> Result<&Sqlite, StoreError> {
        match &self.db {
            Db::Sqlite(lite) => Ok(lite),
            Db::Postgres(_) => Err(StoreError::NotOnPostgres(what)),
        }
    }

    /// The SQLite read pool (see [`Store::lite`]).
    fn pool(&self) -> Result<&SqlitePool, StoreError> {
        Ok(&self.lite("this query")?.pool)
    }

    /// Runs one statement as a write of its own.
    pub(crate) async fn write_one<'q, A>(
        &self,
        q: sqlx::query::Query<'q, sqlx::Sqlite, A>,
    ) -> Result<sqlx::sqlite::SqliteQueryResult, StoreError>
    where
        A: 'q + Send + sqlx::IntoArguments<sqlx::Sqlite>,
    {
        let mut w = self.write().await?;
        let r = q.execute(&mut *w).await?;
        w.commit().await?;
        Ok(r)
    }

    /// The store's health counters, for `/metrics`.
    pub fn health(&self) -> Arc<StoreHealth> {
        self.health.clone()
    }

    /// Closes the pool (last step of shutdown).
    pub async fn close(&self) {
        match &self.db {
            Db::Sqlite(lite) => {
                lite.writer.close().await;
                lite.pool.close().await;
            }
            Db::Postgres(pg) => pg.close().await,
        }
    }
}

/// Creates the data dir (0700 whatever the umask: the inventory holds BMC
/// credentials).
fn create_data_dir(data_dir: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::DirBuilderExt;
    if data_dir.is_dir() {
        return Ok(());
    }
    if data_dir.exists() {
        return Err(StoreError::DataDir {
            path: data_dir.to_owned(),
            source: std::io::Error::from_raw_os_error(nix::errno::Errno::ENOTDIR as i32),
        });
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(data_dir)
        .map_err(|source| StoreError::DataDir {
            path: data_dir.to_owned(),
            source,
        })
}

/// The data dir's set-up lock (`flock` on `setup.lock`), released when the returned
/// file is dropped or the process dies.
async fn setup_lock(data_dir: &Path) -> Result<std::fs::File, StoreError> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = data_dir.join("setup.lock");
    let io = |source| StoreError::DataDir {
        path: path.clone(),
        source,
    };
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&path)
        .map_err(io)?;
    tokio::task::spawn_blocking(move || f.lock().map(|()| f))
        .await
        .map_err(|e| io(std::io::Error::other(e)))?
        .map_err(io)
}

/// The data dir and the database file (if it exists) must be writable.
fn check_writable(data_dir: &Path, file: &Path) -> Result<(), StoreError> {
    // The directory too: SQLite creates the -wal and -shm files beside the database.
    for p in [data_dir, file] {
        if p.exists() {
            nix::unistd::access(p, nix::unistd::AccessFlags::W_OK).map_err(|source| {
                StoreError::ReadOnly {
                    path: p.to_owned(),
                    source,
                }
            })?;
        }
    }
    Ok(())
}

/// Creates a missing database file (0600 whatever the umask). A file that exists but
/// is empty is refused: SQLite would take it for a new database and pxed would start
/// with no inventory and no leases (and, in full DHCP mode, hand out addresses that
/// are in use).
fn prepare_file(data_dir: &Path, file: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::OpenOptionsExt;
    let io = |source| StoreError::DataDir {
        path: data_dir.to_owned(),
        source,
    };
    match std::fs::metadata(file) {
        Ok(m) if m.len() == 0 => Err(StoreError::EmptyFile {
            path: file.to_owned(),
        }),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(file)
                .map_err(io)?;
            Ok(())
        }
        Err(e) => Err(io(e)),
    }
}

/// A new, empty database on this test binary's private PostgreSQL: its name and URL.
#[cfg(test)]
pub(crate) fn test_pg_database() -> (String, String) {
    store_pg::cluster::Cluster::shared()
        .new_database()
        .expect("create a database")
}

/// A store on a new, migrated database of the test cluster, its key in `data_dir`:
/// what `Store::open` gives in unit tests run with `TEST_DATABASE=postgresql`, so the
/// whole unit suite can run on PostgreSQL.
#[cfg(test)]
async fn test_postgres(data_dir: &Path) -> Store {
    let (_, url) = test_pg_database();
    let pg = store_pg::PgStore::connect(&url, 1).await.expect("connect");
    pg.migrate().await.expect("migrate");
    pg.close().await;
    Store::open_postgres(&url, data_dir)
        .await
        .expect("open postgres")
}

/// One store of each backend, each new and empty, for tests that must hold on both:
/// SQLite in `dir`, PostgreSQL on a new database of the test cluster (migrated) with
/// its key in `dir/pg`.
#[cfg(test)]
pub(crate) async fn test_stores(dir: &Path) -> [Store; 2] {
    let lite = Store::open_sqlite(&dir.join("sqlite"))
        .await
        .expect("open sqlite");
    [lite, test_postgres(&dir.join("pg")).await]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// Unreachable (the request may be sent again) against every other failure.
    #[test]
    fn an_unreachable_database_is_told_apart_from_other_errors() {
        let io = || std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        for e in [
            StoreError::Db(sqlx::Error::PoolTimedOut),
            StoreError::Db(sqlx::Error::Io(io())),
            StoreError::Pg(store_pg::PgError::Db(sqlx::Error::Io(io()))),
            StoreError::ProbeTimeout(Duration::from_secs(2)),
        ] {
            assert!(e.is_unavailable(), "{e}");
        }
        for e in [
            StoreError::Db(sqlx::Error::RowNotFound),
            StoreError::NotOnPostgres("x"),
            StoreError::Pg(store_pg::PgError::Schema("x".into())),
        ] {
            assert!(!e.is_unavailable(), "{e}");
        }
    }

    /// Processes that open one new data dir at once (two daemons starting, `pxed
    /// migrate` beside a start) all get the same migrated store and the same key:
    /// none finds a half-created file, a half-run migration or a key file being
    /// written.
    #[tokio::test]
    async fn several_opens_of_a_new_data_dir_at_once_all_succeed() {
        for _ in 0..5 {
            let dir = tempfile::tempdir().unwrap();
            let data = dir.path().join("data");
            // One task: sqlx's migrator is not `Send`; the opens still overlap, each
            // on its own SQLite threads.
            let opens = (0..4).map(|_| Store::open_sqlite(&data));
            let stores: Vec<Store> = futures::future::join_all(opens)
                .await
                .into_iter()
                .map(Result::unwrap)
                .collect();
            let sealed = stores[0].key.seal(1, "pw");
            for s in &stores {
                assert_eq!(s.key.open(1, &sealed).unwrap(), "pw");
                assert_eq!(
                    s.schema_version().await.unwrap(),
                    stores[0].schema_version().await.unwrap()
                );
            }
        }
    }

    /// BMC passwords are sealed in the database, open through the store, and rows
    /// stored in plain text by an older pxed are sealed on the next start.
    #[tokio::test]
    async fn bmc_passwords_are_sealed_at_rest() {
        use crate::model::{Driver, Mac, NodeArch, State};
        use crate::store::nodes::{BmcRow, NewNode};
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(dir.path()).await.unwrap();
        let bmc = BmcRow {
            node_id: 0,
            driver: Driver::Redfish,
            address: "https://10.0.0.9".into(),
            username: "root".into(),
            system_id: None,
            tls_pin: None,
            tls_insecure: false,
        };
        let n = NewNode {
            name: None,
            arch: NodeArch::UNKNOWN,
            state: State::Available,
            macs: vec![Mac([0x52, 0x54, 0, 0, 0, 1])],
            boot_mac: None,
            bmc: Some((bmc, "s3cret-pw".into())),
            ssh_authorized_keys: vec![],
        };
        let id = store.create_node(&n, "test").await.unwrap();
        let raw: String = sqlx::query_scalar("SELECT password FROM bmc_secrets")
            .fetch_one(store.pool().unwrap())
            .await
            .unwrap();
        assert!(raw.starts_with("v1:") && !raw.contains("s3cret"), "{raw}");
        assert_eq!(
            store.bmc_secret(id).await.unwrap().as_deref(),
            Some("s3cret-pw")
        );
        // A plaintext row from before: sealed on the next open, still readable.
        store
            .write_one(sqlx::query("UPDATE bmc_secrets SET password = 'old-plain'"))
            .await
            .unwrap();
        store.close().await;
        let store = Store::open_sqlite(dir.path()).await.unwrap();
        let raw: String = sqlx::query_scalar("SELECT password FROM bmc_secrets")
            .fetch_one(store.pool().unwrap())
            .await
            .unwrap();
        assert!(raw.starts_with("v1:"), "{raw}");
        assert_eq!(
            store.bmc_secret(id).await.unwrap().as_deref(),
            Some("old-plain")
        );
        // The database alone, with another key, opens nothing.
        store.close().await;
        std::fs::write(dir.path().join("secret-key"), "00".repeat(32)).unwrap();
        let store = Store::open_sqlite(dir.path()).await.unwrap();
        let e = store.bmc_secret(id).await.unwrap_err().to_string();
        assert!(e.contains("does not open with this secret key"), "{e}");
    }

    #[tokio::test]
    async fn files_are_private_and_damaged_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let store = Store::open_sqlite(&data).await.unwrap();
        store.close().await;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&data), 0o700);
        assert_eq!(mode(&data.join("pxed.sqlite")), 0o600);

        // Truncated to 0 bytes: refused, not taken for a new inventory.
        std::fs::write(data.join("pxed.sqlite"), b"").unwrap();
        let e = Store::open_sqlite(&data).await.unwrap_err();
        assert!(matches!(e, StoreError::EmptyFile { .. }), "{e}");
        assert!(e.to_string().contains("delete it to start a new"), "{e}");

        // Not a database at all.
        std::fs::write(data.join("pxed.sqlite"), vec![0x5a; 8192]).unwrap();
        let e = Store::open_sqlite(&data).await.unwrap_err();
        assert!(e.to_string().contains("not a database"), "{e}");
    }
}

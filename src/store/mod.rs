//! SQLite store (WAL) through sqlx; migrations are embedded in the binary.
//!
//! Queries are checked at compile time against the committed `.sqlx/` cache.

pub mod images;
pub mod leases;
pub mod nodes;

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

/// Store errors.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot create data dir {path}: {source}")]
    DataDir {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error("migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

/// Connections in the pool (SQLite has one writer; readers run beside it in WAL).
const POOL_SIZE: u32 = 8;

/// The shared store handle (cheap to clone).
#[derive(Debug, Clone)]
pub struct Store {
    /// Private: every query lives in this module's files, so callers never see SQL
    /// and a second backend changes nothing outside `store`.
    pool: SqlitePool,
}

impl Store {
    /// Opens (creating if needed) `pxed.sqlite` under `data_dir` and runs migrations.
    pub async fn open(data_dir: &Path) -> Result<Store, StoreError> {
        std::fs::create_dir_all(data_dir).map_err(|source| StoreError::DataDir {
            path: data_dir.to_owned(),
            source,
        })?;
        let url = format!("sqlite://{}", data_dir.join("pxed.sqlite").display());
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
        let pool = SqlitePoolOptions::new()
            .max_connections(POOL_SIZE)
            .test_before_acquire(false)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_with(opts)
            .await?;
        sqlx::migrate!("./migrations").run(&pool).await?;
        // Open the rest now that the file is in WAL mode (switching a new file to WAL
        // from several connections at once can fail with "database is locked").
        let mut held = Vec::new();
        for _ in 0..POOL_SIZE {
            held.push(pool.acquire().await?);
        }
        drop(held);
        Ok(Store { pool })
    }

    /// Closes the pool (last step of shutdown).
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

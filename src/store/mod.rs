//! SQLite store (WAL) through sqlx; migrations are embedded in the binary.
//!
//! Queries are checked at compile time against the committed `.sqlx/` cache.

pub mod leases;

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

/// The shared store handle (cheap to clone).
#[derive(Debug, Clone)]
pub struct Store {
    pub pool: SqlitePool,
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
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .connect_with(opts)
            .await?;
        sqlx::migrate!("./migrations").run(&pool).await?;
        Ok(Store { pool })
    }

    /// Closes the pool (last step of shutdown).
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

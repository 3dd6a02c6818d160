//! pxed's PostgreSQL store: the schema in PostgreSQL's dialect (`migrations/`, one file
//! per file of the SQLite schema, same numbers and names), the connection, and what the
//! store says about the server it is connected to.
//!
//! The query macros of this crate are checked against PostgreSQL (`sqlx.toml`,
//! `STORE_PG_DATABASE_URL`; offline from this crate's `.sqlx/`), the pxed package's
//! against SQLite. [`cluster`] starts a private PostgreSQL for tests and benches.

pub mod board;
pub mod cluster;
pub mod coord;
pub mod dump;
pub mod hardware;
pub mod install_log;
pub mod leases;
pub mod nodes;
pub mod stages;
pub mod steps;
pub mod webhooks;

use std::str::FromStr;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// The schema, embedded in the binary.
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// The last migration this binary has: the schema version a served database must be at.
pub fn latest_version() -> i64 {
    MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0)
}

/// Errors of the PostgreSQL store. None of them carries the URL's password.
#[derive(Debug, thiserror::Error)]
pub enum PgError {
    #[error("database URL: {0} (expected postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE)")]
    Url(String),
    /// The reason is in the message (not a `source`): sqlx's own chain repeats it.
    #[error("cannot connect to {server}: {reason}")]
    Connect { server: String, reason: sqlx::Error },
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error("migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("schema: {0}")]
    Schema(String),
    #[error(
        "{0} is a read-only replica (a hot standby): point database_url at the primary (or at what routes to it)"
    )]
    Replica(String),
}

/// Whether the server takes writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Primary,
    /// A hot standby (`pg_is_in_recovery()`): reads only.
    Replica,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Primary => "primary",
            Role::Replica => "replica (read-only)",
        })
    }
}

/// What the store says about its server (`/healthz`, `pxed migrate`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Description {
    /// `postgres://user@host:port/database`: never the password.
    pub server: String,
    /// `server_version`, e.g. `15.14 (Debian 15.14-0+deb12u1)`.
    pub version: String,
    pub role: Role,
    /// The last migration applied (0 on an empty database).
    pub schema: i64,
}

impl std::fmt::Display for Description {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "postgresql {} {}, {}, schema version {}",
            self.version, self.server, self.role, self.schema
        )
    }
}

/// A connection pool to one PostgreSQL database.
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    server: String,
    /// The server process ids of this pool's connections: a change this store made is
    /// announced back to its own listener too, and is told apart by them.
    own: OwnSessions,
}

/// The backend process ids of one pool's connections (`pg_backend_pid()`).
pub(crate) type OwnSessions = std::sync::Arc<std::sync::Mutex<std::collections::HashSet<u32>>>;

/// How long a connection attempt may take before it counts as failed.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// `postgres://user@host:port/database` (with `?host=DIR` for a Unix socket) for
/// `opts`: what logs and pages may show. Never the password.
pub fn redacted(opts: &PgConnectOptions) -> String {
    let url = format!(
        "postgres://{}@{}:{}/{}",
        opts.get_username(),
        opts.get_host(),
        opts.get_port(),
        opts.get_database().unwrap_or(opts.get_username())
    );
    match opts.get_socket() {
        Some(dir) => format!("{url}?host={}", dir.display()),
        None => url,
    }
}

/// Parses a `postgres://` URL (or a libpq key=value string is refused: pxed's config
/// takes URLs only). The error names what is wrong, never the password.
pub fn parse_url(url: &str) -> Result<PgConnectOptions, PgError> {
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(PgError::Url("it does not start with postgres://".into()));
    }
    PgConnectOptions::from_str(url)
        .map(|o| o.application_name("pxed"))
        .map_err(|e| PgError::Url(redact_error(&e.to_string(), url)))
}

/// An error text with the URL's password, if any, cut out.
fn redact_error(text: &str, url: &str) -> String {
    let password = url
        .split_once("://")
        .and_then(|(_, rest)| rest.split_once('@'))
        .and_then(|(userinfo, _)| userinfo.split_once(':'))
        .map(|(_, p)| p)
        .filter(|p| !p.is_empty());
    match password {
        Some(p) => text.replace(p, "***"),
        None => text.to_owned(),
    }
}

impl PgStore {
    /// Connects (one connection at first, up to `max_connections`).
    pub async fn connect(url: &str, max_connections: u32) -> Result<PgStore, PgError> {
        let opts = parse_url(url)?;
        let server = redacted(&opts);
        let own = OwnSessions::default();
        let mine = own.clone();
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(CONNECT_TIMEOUT)
            .after_connect(move |conn, _| {
                let mine = mine.clone();
                Box::pin(async move {
                    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                        .fetch_one(&mut *conn)
                        .await?;
                    mine.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(pid.unsigned_abs());
                    Ok(())
                })
            })
            .connect_with(opts)
            .await
            .map_err(|reason| PgError::Connect {
                server: server.clone(),
                reason,
            })?;
        Ok(PgStore { pool, server, own })
    }

    /// Applies the migrations this binary has and the database lacks. Safe from
    /// several processes at once: sqlx's PostgreSQL migrator holds an advisory lock.
    pub async fn migrate(&self) -> Result<i64, PgError> {
        if self.describe_server().await?.1 == Role::Replica {
            return Err(PgError::Replica(self.server.clone()));
        }
        MIGRATOR.run(&self.pool).await?;
        self.schema_version().await
    }

    /// The last migration applied (0 before any).
    pub async fn schema_version(&self) -> Result<i64, PgError> {
        let exists = sqlx::query_scalar!(
            r#"SELECT to_regclass('_sqlx_migrations') IS NOT NULL AS "exists!""#
        )
        .fetch_one(&self.pool)
        .await?;
        if !exists {
            return Ok(0);
        }
        // Not a macro: `_sqlx_migrations` is sqlx's table, not in the checked schema.
        Ok(sqlx::query_scalar::<_, i64>(
            "SELECT COALESCE(MAX(version), 0) FROM _sqlx_migrations WHERE success",
        )
        .fetch_one(&self.pool)
        .await?)
    }

    /// The server, its version, whether it takes writes and the schema version.
    pub async fn describe(&self) -> Result<Description, PgError> {
        let (version, role) = self.describe_server().await?;
        Ok(Description {
            server: self.server.clone(),
            version,
            role,
            schema: self.schema_version().await?,
        })
    }

    /// The server's version and whether it takes writes.
    async fn describe_server(&self) -> Result<(String, Role), PgError> {
        let row = sqlx::query!(
            r#"SELECT current_setting('server_version') AS "version!",
                      pg_is_in_recovery() AS "replica!""#
        )
        .fetch_one(&self.pool)
        .await?;
        let role = if row.replica {
            Role::Replica
        } else {
            Role::Primary
        };
        Ok((row.version, role))
    }

    /// The tables of the schema with their columns, in order: what the schema-parity
    /// test compares with SQLite's.
    pub async fn columns(&self) -> Result<Vec<Column>, PgError> {
        let rows = sqlx::query!(
            r#"SELECT c.table_name AS "table!", c.column_name AS "column!",
                      c.data_type AS "data_type!", c.is_nullable = 'YES' AS "nullable!",
                      EXISTS (SELECT 1 FROM information_schema.table_constraints t
                              JOIN information_schema.key_column_usage k
                                ON k.constraint_name = t.constraint_name
                               AND k.table_name = t.table_name
                             WHERE t.table_name = c.table_name
                               AND t.constraint_type = 'PRIMARY KEY'
                               AND k.column_name = c.column_name) AS "primary_key!"
                 FROM information_schema.columns c
                WHERE c.table_schema = current_schema()
                  AND c.table_name <> '_sqlx_migrations'
                ORDER BY c.table_name, c.ordinal_position"#
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| Column {
                table: r.table,
                name: r.column,
                data_type: r.data_type,
                nullable: r.nullable,
                primary_key: r.primary_key,
            })
            .collect())
    }

    /// The indexes created by name in the migrations (not those PostgreSQL makes for
    /// primary keys and UNIQUE constraints), sorted.
    pub async fn indexes(&self) -> Result<Vec<String>, PgError> {
        Ok(sqlx::query_scalar!(
            r#"SELECT i.indexname AS "name!" FROM pg_indexes i
                WHERE i.schemaname = current_schema()
                  AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conname = i.indexname)
                ORDER BY 1"#
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// Commits one tiny row at `at`: whether the database takes writes right now.
    pub async fn probe_write(&self, at: &str) -> Result<(), PgError> {
        sqlx::query!(
            "INSERT INTO store_probe (id, at) VALUES (1, $1)
             ON CONFLICT (id) DO UPDATE SET at = EXCLUDED.at",
            at
        )
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Closes the pool (waits for connections in use).
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

/// A session-level advisory lock on a connection of its own, released when dropped,
/// when the process dies, or when the server drops the connection.
#[derive(Debug)]
pub struct AdvisoryLock {
    conn: sqlx::PgConnection,
}

impl PgStore {
    /// Takes the session advisory lock `key` on a connection of its own, or `None`
    /// while another session holds it.
    pub async fn try_lock(&self, key: i64) -> Result<Option<AdvisoryLock>, PgError> {
        use sqlx::Connection;
        let opts = self.pool.connect_options();
        let mut conn = sqlx::PgConnection::connect_with(&opts)
            .await
            .map_err(|reason| PgError::Connect {
                server: self.server.clone(),
                reason,
            })?;
        let got = sqlx::query_scalar!(r#"SELECT pg_try_advisory_lock($1) AS "got!""#, key)
            .fetch_one(&mut conn)
            .await?;
        Ok(got.then_some(AdvisoryLock { conn }))
    }
}

impl AdvisoryLock {
    /// False once the lock's connection no longer answers: the server has released
    /// the lock (or will), so the holder must stop acting on it.
    pub async fn alive(&mut self) -> bool {
        use sqlx::Connection;
        tokio::time::timeout(std::time::Duration::from_secs(2), self.conn.ping())
            .await
            .is_ok_and(|r| r.is_ok())
    }
}

/// One column of the schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    pub table: String,
    pub name: String,
    /// PostgreSQL's type name (`text`, `bigint`, `boolean`).
    pub data_type: String,
    pub nullable: bool,
    pub primary_key: bool,
}

//! Export and import: the whole store as one JSON document (`pxed export`,
//! `pxed import`), to move a deployment to another host or another backend, or to keep
//! a copy that does not depend on SQLite's file format.
//!
//! Every table the migrations made is written, column by column, in a stable order:
//! nodes, interfaces, BMCs, leases, reservations, the audit log, webhooks' queue,
//! idempotency keys. Only `_sqlx_migrations` (the schema version is recorded instead)
//! and the write probe's scratch row are left out. The queries are built from the
//! schema at run time (`pragma_table_info`), not checked at compile time: a table
//! added by a later migration is exported without a change here, which a per-table
//! list would silently miss.
//!
//! BMC passwords stay sealed in the export, under the key of the pxed that wrote it.
//! Import keeps them when the target has the same key, re-seals them under the
//! target's key when given the source's key file, and refuses otherwise: an import
//! never holds a password it cannot open.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::sqlite::SqliteRow;
use sqlx::{Row, SqliteConnection, TypeInfo, ValueRef};

use super::secrets::{SecretError, SecretKey};
use super::{Store, StoreError};

/// The export format this pxed writes and reads.
pub const FORMAT: u32 = 1;

/// Tables not exported: sqlx's bookkeeping, the write probe's scratch row, SQLite's
/// own.
const SKIP: &[&str] = &["_sqlx_migrations", "store_probe"];

/// Export and import errors.
#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Secret(#[from] SecretError),
    #[error("not a pxed export of a format this pxed reads (format {0}; this pxed reads {FORMAT})")]
    Format(u32),
    #[error(
        "the export is of schema {export} and this pxed's is {ours}: import it with the pxed version that wrote it (then upgrade), or export again from an upgraded one"
    )]
    Schema { export: i64, ours: i64 },
    #[error(
        "import needs an empty store: table {table} has {rows} rows (point --data-dir at a new directory, or --database at a new PostgreSQL database)"
    )]
    NotEmpty { table: String, rows: i64 },
    #[error("the export has table {0}, which this store does not have")]
    UnknownTable(String),
    #[error("table {table}: the export's columns {export:?} are not this store's {ours:?}")]
    Columns {
        table: String,
        export: Vec<String>,
        ours: Vec<String>,
    },
    #[error("table {table}, row {row}: {reason}")]
    Value {
        table: String,
        row: usize,
        reason: String,
    },
    #[error(transparent)]
    Pg(#[from] store_pg::PgError),
    #[error(
        "the BMC password of node {node} was sealed with another secret key: pass the exporting pxed's key with --secret-key (its <data_dir>/secret-key, or its pxed-secret-key credential)"
    )]
    OtherKey { node: i64 },
}

impl From<sqlx::Error> for DumpError {
    fn from(e: sqlx::Error) -> Self {
        DumpError::Store(StoreError::Db(e))
    }
}

/// One export.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Export {
    /// Always [`FORMAT`] when written by this pxed.
    pub pxed_export: u32,
    /// The last migration applied to the exported store.
    pub schema: i64,
    pub exported_at: String,
    pub tables: BTreeMap<String, Table>,
}

/// One table: the same type for both backends, so an export moves between them as is.
pub use store_pg::dump::Table;

/// What an import wrote.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Imported {
    /// Rows per table.
    pub rows: BTreeMap<String, usize>,
    /// BMC passwords sealed anew under this store's key.
    pub resealed: usize,
}

impl Store {
    /// The schema version: the last migration applied.
    pub async fn schema_version(&self) -> Result<i64, StoreError> {
        if let super::Db::Postgres(pg) = &self.db {
            return Ok(pg.schema_version().await?);
        }
        let mut conn = self.pool()?.acquire().await?;
        Ok(schema_version(&mut conn).await?)
    }

    /// The whole store, read in one transaction (a consistent snapshot while pxed
    /// serves: WAL readers do not stop writers).
    pub async fn export(&self) -> Result<Export, DumpError> {
        if let super::Db::Postgres(pg) = &self.db {
            return export_pg(pg).await;
        }
        let mut tx = self.pool()?.begin().await?;
        let schema = schema_version(&mut tx).await?;
        let mut tables = BTreeMap::new();
        for name in table_names(&mut tx).await? {
            let columns = columns(&mut tx, &name).await?;
            let list = quoted_list(&columns);
            let order = (1..=columns.len())
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(", ");
            let sql = format!("SELECT {list} FROM \"{name}\" ORDER BY {order}");
            // Names from this database's own schema, quoted.
            let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
                .fetch_all(&mut *tx)
                .await?
                .iter()
                .map(|r| (0..columns.len()).map(|i| to_json(r, i)).collect())
                .collect::<Result<Vec<Vec<Value>>, sqlx::Error>>()?;
            tables.insert(name, Table { columns, rows });
        }
        tx.rollback().await?;
        Ok(Export {
            pxed_export: FORMAT,
            schema,
            exported_at: super::nodes::now(),
            tables,
        })
    }

    /// Loads `export` into this store, which must be empty, in one write: all of it
    /// or (on any error) none of it. `source_key` is the exporting pxed's key, needed
    /// only when it differs from this store's.
    pub async fn import(
        &self,
        export: &Export,
        source_key: Option<&SecretKey>,
    ) -> Result<Imported, DumpError> {
        if let super::Db::Postgres(pg) = &self.db {
            return import_pg(pg, &self.key, export, source_key).await;
        }
        if export.pxed_export != FORMAT {
            return Err(DumpError::Format(export.pxed_export));
        }
        let ours = self.schema_version().await?;
        if export.schema != ours {
            return Err(DumpError::Schema {
                export: export.schema,
                ours,
            });
        }
        let mut w = self.write().await?;
        // Foreign keys are checked at COMMIT, so tables load in any order.
        sqlx::query("PRAGMA defer_foreign_keys = ON")
            .execute(&mut *w)
            .await?;
        for name in table_names(&mut w).await? {
            let rows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT COUNT(*) FROM \"{name}\""
            )))
            .fetch_one(&mut *w)
            .await?;
            if rows > 0 {
                return Err(DumpError::NotEmpty { table: name, rows });
            }
        }
        let known = table_names(&mut w).await?;
        let mut done = Imported::default();
        for (name, table) in &export.tables {
            if !known.contains(name) {
                return Err(DumpError::UnknownTable(name.clone()));
            }
            let ours = columns(&mut w, name).await?;
            if ours != table.columns {
                return Err(DumpError::Columns {
                    table: name.clone(),
                    export: table.columns.clone(),
                    ours,
                });
            }
            let marks = vec!["?"; ours.len()].join(", ");
            // The table is one of ours and its columns equal ours (checked above).
            let sql = format!(
                "INSERT INTO \"{name}\" ({}) VALUES ({marks})",
                quoted_list(&ours)
            );
            for (i, row) in table.rows.iter().enumerate() {
                let bad = |reason: String| DumpError::Value {
                    table: name.clone(),
                    row: i,
                    reason,
                };
                if row.len() != ours.len() {
                    return Err(bad(format!(
                        "{} values for {} columns",
                        row.len(),
                        ours.len()
                    )));
                }
                let mut q = sqlx::query(sqlx::AssertSqlSafe(sql.as_str()));
                for v in row {
                    q = bind(q, v).map_err(&bad)?;
                }
                q.execute(&mut *w).await.map_err(|e| bad(e.to_string()))?;
            }
            done.rows.insert(name.clone(), table.rows.len());
        }
        done.resealed = self.reseal(&mut w, source_key).await?;
        w.commit().await?;
        Ok(done)
    }

    /// Makes every imported BMC password open with this store's key.
    async fn reseal(
        &self,
        conn: &mut SqliteConnection,
        source_key: Option<&SecretKey>,
    ) -> Result<usize, DumpError> {
        let rows: Vec<(i64, String)> =
            sqlx::query_as("SELECT node_id, password FROM bmc_secrets ORDER BY node_id")
                .fetch_all(&mut *conn)
                .await?;
        let mut resealed = 0;
        for (node, stored) in rows {
            let Some(sealed) = resealed_password(&self.key, source_key, node, &stored)? else {
                continue;
            };
            sqlx::query("UPDATE bmc_secrets SET password = ? WHERE node_id = ?")
                .bind(sealed)
                .bind(node)
                .execute(&mut *conn)
                .await?;
            resealed += 1;
        }
        Ok(resealed)
    }
}

/// A stored BMC password sealed under `ours`: `None` if it already opens with it,
/// else sealed anew from what `source` opens (refused without a key that does).
fn resealed_password(
    ours: &SecretKey,
    source: Option<&SecretKey>,
    node: i64,
    stored: &str,
) -> Result<Option<String>, DumpError> {
    if ours.open(node, stored).is_ok() {
        return Ok(None);
    }
    match source.map(|k| k.open(node, stored)) {
        Some(Ok(plain)) => Ok(Some(ours.seal(node, &plain))),
        Some(Err(_)) | None => Err(DumpError::OtherKey { node }),
    }
}

/// The whole PostgreSQL store as an export, in the SQLite store's shape and order (see
/// `store_pg::dump`), read in one snapshot.
pub async fn export_pg(pg: &store_pg::PgStore) -> Result<Export, DumpError> {
    let (schema, tables) = pg.export_tables().await?;
    Ok(Export {
        pxed_export: FORMAT,
        schema,
        exported_at: super::nodes::now(),
        tables,
    })
}

/// Loads `export` (from either backend) into an empty PostgreSQL store in one
/// transaction, its BMC passwords sealed under `ours` (the key every instance on that
/// database uses), with the same checks and refusals as [`Store::import`].
pub async fn import_pg(
    pg: &store_pg::PgStore,
    ours: &SecretKey,
    export: &Export,
    source_key: Option<&SecretKey>,
) -> Result<Imported, DumpError> {
    use store_pg::dump::ImportError;
    if export.pxed_export != FORMAT {
        return Err(DumpError::Format(export.pxed_export));
    }
    let schema = pg.schema_version().await?;
    if export.schema != schema {
        return Err(DumpError::Schema {
            export: export.schema,
            ours: schema,
        });
    }
    let mut tables = export.tables.clone();
    let mut resealed = 0;
    if let Some(t) = tables.get_mut("bmc_secrets") {
        let col = |name: &str| t.columns.iter().position(|c| c == name);
        let (Some(node_col), Some(pw_col)) = (col("node_id"), col("password")) else {
            return Err(DumpError::Columns {
                table: "bmc_secrets".into(),
                export: t.columns.clone(),
                ours: vec!["node_id".into(), "password".into()],
            });
        };
        for (i, row) in t.rows.iter_mut().enumerate() {
            let (Some(node), Some(stored)) = (
                row.get(node_col).and_then(Value::as_i64),
                row.get(pw_col).and_then(Value::as_str),
            ) else {
                return Err(DumpError::Value {
                    table: "bmc_secrets".into(),
                    row: i,
                    reason: "node_id and password must be an integer and a string".into(),
                });
            };
            if let Some(sealed) = resealed_password(ours, source_key, node, stored)? {
                row[pw_col] = Value::String(sealed);
                resealed += 1;
            }
        }
    }
    let rows = pg.import_tables(&tables).await.map_err(|e| match e {
        ImportError::Pg(e) => DumpError::Pg(e),
        ImportError::NotEmpty { table, rows } => DumpError::NotEmpty { table, rows },
        ImportError::UnknownTable(t) => DumpError::UnknownTable(t),
        ImportError::Columns {
            table,
            export,
            ours,
        } => DumpError::Columns {
            table,
            export,
            ours,
        },
        ImportError::Value { table, row, reason } => DumpError::Value { table, row, reason },
    })?;
    Ok(Imported { rows, resealed })
}

/// The last migration applied.
async fn schema_version(conn: &mut SqliteConnection) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT COALESCE(MAX(version), 0) FROM _sqlx_migrations WHERE success")
        .fetch_one(conn)
        .await
}

/// The tables to export, by name.
async fn table_names(conn: &mut SqliteConnection) -> Result<Vec<String>, sqlx::Error> {
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name",
    )
    .fetch_all(conn)
    .await?;
    Ok(names
        .into_iter()
        .filter(|n| !SKIP.contains(&n.as_str()))
        .collect())
}

/// A table's columns in declaration order.
async fn columns(conn: &mut SqliteConnection, table: &str) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT name FROM pragma_table_info(?) ORDER BY cid")
        .bind(table)
        .fetch_all(conn)
        .await
}

fn quoted_list(columns: &[String]) -> String {
    columns
        .iter()
        .map(|c| format!("\"{c}\""))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One stored value as JSON, by its storage class.
fn to_json(row: &SqliteRow, i: usize) -> Result<Value, sqlx::Error> {
    let raw = row.try_get_raw(i)?;
    if raw.is_null() {
        return Ok(Value::Null);
    }
    let class = raw.type_info().name().to_string();
    Ok(match class.as_str() {
        "INTEGER" => Value::from(row.try_get_unchecked::<i64, _>(i)?),
        "REAL" => serde_json::Number::from_f64(row.try_get_unchecked::<f64, _>(i)?)
            .map_or(Value::Null, Value::Number),
        "BLOB" => {
            serde_json::json!({ "blob": hex::encode(row.try_get_unchecked::<Vec<u8>, _>(i)?) })
        }
        _ => Value::String(row.try_get_unchecked::<String, _>(i)?),
    })
}

type Query<'q> = sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments>;

/// Binds one exported value with the storage class it had.
fn bind<'q>(q: Query<'q>, v: &Value) -> Result<Query<'q>, String> {
    Ok(match v {
        Value::Null => q.bind(None::<String>),
        Value::Bool(b) => q.bind(i64::from(*b)),
        Value::Number(n) => match n.as_i64() {
            Some(i) => q.bind(i),
            None => q.bind(
                n.as_f64()
                    .ok_or_else(|| format!("number {n} out of range"))?,
            ),
        },
        Value::String(s) => q.bind(s.clone()),
        Value::Object(o) => match o.get("blob").and_then(Value::as_str) {
            Some(h) if o.len() == 1 => {
                q.bind(hex::decode(h).map_err(|e| format!("blob is not hex: {e}"))?)
            }
            _ => return Err(format!("unexpected value {v}")),
        },
        Value::Array(_) => return Err(format!("unexpected value {v}")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lifecycle::State;
    use crate::model::{Driver, Mac, NodeArch};
    use crate::store::leases::{LeaseRow, LeaseWrite};
    use crate::store::nodes::{BmcRow, NewNode};

    async fn populated(dir: &std::path::Path) -> (Store, i64) {
        let store = Store::open(dir).await.unwrap();
        let bmc = BmcRow {
            node_id: 0,
            driver: Driver::Redfish,
            address: "https://10.0.0.9".into(),
            username: "root".into(),
            system_id: Some("/redfish/v1/Systems/1".into()),
            tls_pin: None,
            tls_insecure: false,
        };
        let node = |mac: u8, bmc: Option<(BmcRow, String)>| NewNode {
            name: Some(format!("rack1-{mac}")),
            arch: NodeArch::UNKNOWN,
            state: State::Available,
            macs: vec![Mac([0x52, 0x54, 0, 0, 0, mac])],
            boot_mac: None,
            bmc,
            ssh_authorized_keys: vec!["ssh-ed25519 AAAA test".into()],
        };
        let id = store
            .create_node(&node(1, Some((bmc, "s3cret-pw".into()))), "test")
            .await
            .unwrap();
        store.create_node(&node(2, None), "test").await.unwrap();
        store
            .commit_leases(&[LeaseWrite::Upsert(LeaseRow {
                ip: "10.0.0.50".parse().unwrap(),
                mac: "52:54:00:00:00:01".into(),
                client_id: Some("01525400000001".into()),
                hostname: Some("node-000001".into()),
                state: "bound".into(),
                expires_at: 1_900_000_000,
            })])
            .await
            .unwrap();
        (store, id)
    }

    fn rows(e: &Export, table: &str) -> usize {
        e.tables.get(table).map_or(0, |t| t.rows.len())
    }

    /// Export, import into a new store with another key, export again: every table
    /// is the same but for the re-sealed passwords, which open to the same text.
    #[tokio::test]
    async fn an_export_imports_into_an_empty_store_and_exports_the_same() {
        let (a_dir, b_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (a, id) = populated(a_dir.path()).await;
        let first = a.export().await.unwrap();
        assert_eq!(first.schema, a.schema_version().await.unwrap());
        assert!(first.schema >= 13, "{}", first.schema);
        assert_eq!(rows(&first, "nodes"), 2);
        assert_eq!(rows(&first, "leases"), 1);
        assert_eq!(rows(&first, "bmc_secrets"), 1);
        assert!(rows(&first, "node_events") >= 2);
        assert!(!first.tables.contains_key("_sqlx_migrations"));
        // Through its JSON text, as the CLI writes and reads it.
        let text = serde_json::to_string(&first).unwrap();
        assert!(
            !text.contains("s3cret"),
            "a password in clear in the export"
        );
        let parsed: Export = serde_json::from_str(&text).unwrap();

        let b = Store::open(b_dir.path()).await.unwrap();
        // b made its own key: without a's, the passwords cannot be carried over, and
        // nothing is written.
        let e = b.import(&parsed, None).await.unwrap_err();
        assert!(
            matches!(e, DumpError::OtherKey { node } if node == id),
            "{e}"
        );
        assert!(b.nodes().await.unwrap().is_empty());
        let key = SecretKey::read(&a_dir.path().join("secret-key")).unwrap();
        let done = b.import(&parsed, Some(&key)).await.unwrap();
        assert_eq!((done.rows["nodes"], done.resealed), (2, 1));
        assert_eq!(
            b.bmc_secret(id).await.unwrap().as_deref(),
            Some("s3cret-pw")
        );
        assert_eq!(b.nodes().await.unwrap(), a.nodes().await.unwrap());

        let mut second = b.export().await.unwrap();
        let mut first = first;
        for e in [&mut first, &mut second] {
            e.exported_at.clear();
            e.tables.remove("bmc_secrets");
        }
        assert_eq!(first, second);

        // A second import finds the store in use.
        let e = b.import(&parsed, Some(&key)).await.unwrap_err();
        assert!(matches!(e, DumpError::NotEmpty { .. }), "{e}");
    }

    /// SQLite → PostgreSQL → SQLite: the export from PostgreSQL is the SQLite one, value
    /// for value and in the same order; the passwords are sealed under the PostgreSQL
    /// instances' key and open to the same text; identities continue after the
    /// imported ids; and an import into a database in use, or one that fails half-way,
    /// writes nothing.
    #[tokio::test]
    async fn a_sqlite_export_moves_to_postgresql_and_back_unchanged() {
        let (a_dir, b_dir, c_dir) = (
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
        );
        let (a, id) = populated(a_dir.path()).await;
        let first = a.export().await.unwrap();
        let a_key = SecretKey::read(&a_dir.path().join("secret-key")).unwrap();
        let pg_key = SecretKey::load(b_dir.path()).unwrap();
        let (db, url) = crate::store::test_pg_database();
        let pg = store_pg::PgStore::connect(&url, 2).await.unwrap();
        pg.migrate().await.unwrap();

        // Without the source's key the passwords cannot be carried: nothing written.
        let e = import_pg(&pg, &pg_key, &first, None).await.unwrap_err();
        assert!(
            matches!(e, DumpError::OtherKey { node } if node == id),
            "{e}"
        );
        // A bad value in the last table loaded: the whole import is undone.
        let mut bad = first.clone();
        let t = bad.tables.get_mut("webhook_cursors").unwrap();
        t.rows
            .push(vec![Value::from("http://x"), Value::from("not a number")]);
        let e = import_pg(&pg, &pg_key, &bad, Some(&a_key))
            .await
            .unwrap_err();
        assert!(
            matches!(&e, DumpError::Value { table, .. } if table == "webhook_cursors"),
            "{e}"
        );
        let (_, empty) = pg.export_tables().await.unwrap();
        assert!(empty.values().all(|t| t.rows.is_empty()), "{empty:?}");

        let done = import_pg(&pg, &pg_key, &first, Some(&a_key)).await.unwrap();
        assert_eq!((done.rows["nodes"], done.resealed), (2, 1));
        let from_pg = export_pg(&pg).await.unwrap();
        assert_eq!(from_pg.schema, first.schema);
        let sealed = |e: &Export| {
            let t = &e.tables["bmc_secrets"];
            t.rows[0][1].as_str().unwrap().to_owned()
        };
        assert_eq!(pg_key.open(id, &sealed(&from_pg)).unwrap(), "s3cret-pw");
        let strip = |e: &Export| {
            let mut e = e.clone();
            e.exported_at.clear();
            e.tables.remove("bmc_secrets");
            e
        };
        assert_eq!(strip(&from_pg), strip(&first));

        // A second import finds the database in use.
        let e = import_pg(&pg, &pg_key, &first, Some(&a_key))
            .await
            .unwrap_err();
        assert!(matches!(e, DumpError::NotEmpty { .. }), "{e}");

        // New rows get ids after the imported ones.
        let max_event = first.tables["node_events"]
            .rows
            .iter()
            .filter_map(|r| r[0].as_i64())
            .max()
            .unwrap();
        let next = store_pg::cluster::Cluster::shared()
            .psql(&db, "INSERT INTO node_events (node_id, generation, event, to_state, at, actor) VALUES (1, 0, 'x', 'available', 'now', 't') RETURNING id")
            .unwrap();
        assert_eq!(next, (max_event + 1).to_string());

        // And back into a new SQLite store, under its own key.
        let c = Store::open(c_dir.path()).await.unwrap();
        let back = c.import(&from_pg, Some(&pg_key)).await.unwrap();
        assert_eq!(back.resealed, 1);
        assert_eq!(
            c.bmc_secret(id).await.unwrap().as_deref(),
            Some("s3cret-pw")
        );
        let from_c = c.export().await.unwrap();
        // The row inserted into PostgreSQL above.
        let mut from_pg_now = export_pg(&pg).await.unwrap();
        from_pg_now
            .tables
            .get_mut("node_events")
            .unwrap()
            .rows
            .pop();
        assert_eq!(strip(&from_c), strip(&from_pg_now));
        pg.close().await;
    }

    /// Exports this pxed cannot load exactly are refused with the reason, and leave
    /// the store empty.
    #[tokio::test]
    async fn other_schemas_formats_and_columns_are_refused() {
        let (a_dir, b_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (a, _) = populated(a_dir.path()).await;
        let good = a.export().await.unwrap();
        let key = SecretKey::read(&a_dir.path().join("secret-key")).unwrap();
        let b = Store::open(b_dir.path()).await.unwrap();

        let mut e = good.clone();
        e.schema += 1;
        let err = b.import(&e, Some(&key)).await.unwrap_err();
        assert!(matches!(err, DumpError::Schema { .. }), "{err}");

        let mut e = good.clone();
        e.pxed_export = 2;
        assert!(matches!(
            b.import(&e, Some(&key)).await.unwrap_err(),
            DumpError::Format(2)
        ));

        let mut e = good.clone();
        e.tables.get_mut("leases").unwrap().columns.swap(0, 1);
        let err = b.import(&e, Some(&key)).await.unwrap_err();
        assert!(matches!(err, DumpError::Columns { .. }), "{err}");

        // An interface of a node that is not in the export: the foreign key is checked at
        // the end, and the whole import is undone.
        let mut e = good.clone();
        let t = e.tables.get_mut("interfaces").unwrap();
        let col = t.columns.iter().position(|c| c == "node_id").unwrap();
        t.rows[0][col] = Value::from(999);
        let err = b.import(&e, Some(&key)).await.unwrap_err();
        assert!(
            err.to_string().to_lowercase().contains("foreign key"),
            "{err}"
        );

        assert!(b.nodes().await.unwrap().is_empty());
        let empty = b.export().await.unwrap();
        assert!(
            empty.tables.values().all(|t| t.rows.is_empty()),
            "{empty:?}"
        );
        // And then the good one loads.
        b.import(&good, Some(&key)).await.unwrap();
        assert_eq!(b.nodes().await.unwrap().len(), 2);
    }
}

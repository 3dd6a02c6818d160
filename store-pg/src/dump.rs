//! The PostgreSQL side of `pxed export` and `pxed import`: every table as columns
//! and rows of JSON values, in the same shape and order as the SQLite store writes
//! them, so an export moves between the backends unchanged.
//!
//! Values: `bigint` is a JSON integer, `text` a string, and `boolean` the integer 0 or
//! 1, as SQLite stores it. Rows are ordered by every column in turn, text compared
//! byte-wise (`COLLATE "C"`, as SQLite compares), so both backends list a table in the
//! same order whatever the database's collation.
//!
//! As in the SQLite store, the statements are built from the database's own schema
//! (`information_schema`) at run time: a table added by a later migration is carried
//! without a change here. Names are quoted; the values are bound.

use std::collections::BTreeMap;

use serde_json::Value;
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::{PgConnection, Row};

use super::{PgError, PgStore};

/// Tables not exported: sqlx's bookkeeping, the write probe's scratch row.
const SKIP: &[&str] = &["_sqlx_migrations", "store_probe"];

/// One table of an export, from either backend: its columns in order, and its rows as
/// values in that order. Integers, reals and text are JSON numbers and strings; a BLOB
/// (SQLite) is `{"blob": "<hex>"}`.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Table {
    pub columns: Vec<String>,
    pub rows: Vec<Vec<Value>>,
}

/// Why an import was refused (nothing was written).
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error(transparent)]
    Pg(#[from] PgError),
    #[error("table {table} has {rows} rows")]
    NotEmpty { table: String, rows: i64 },
    #[error("table {0} is not in this database")]
    UnknownTable(String),
    #[error("table {table}: columns {export:?} are not this database's {ours:?}")]
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
}

impl From<sqlx::Error> for ImportError {
    fn from(e: sqlx::Error) -> Self {
        ImportError::Pg(PgError::Db(e))
    }
}

/// A column's type, as the export carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Int,
    Bool,
    Text,
}

struct Col {
    name: String,
    kind: Kind,
    identity: bool,
}

impl PgStore {
    /// Every table, read in one read-only snapshot (REPEATABLE READ): a consistent
    /// export while instances write. Returns the schema version too.
    pub async fn export_tables(&self) -> Result<(i64, BTreeMap<String, Table>), PgError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .execute(&mut *tx)
            .await?;
        let schema = schema_version(&mut tx).await?;
        let mut out = BTreeMap::new();
        for (table, cols) in schema_tables(&mut tx).await? {
            let list = quoted_list(&cols);
            let order = cols
                .iter()
                .map(|c| match c.kind {
                    Kind::Text => format!("\"{}\" COLLATE \"C\"", c.name),
                    _ => format!("\"{}\"", c.name),
                })
                .collect::<Vec<_>>()
                .join(", ");
            let sql = format!("SELECT {list} FROM \"{table}\" ORDER BY {order}");
            // Names from this database's own schema, quoted.
            let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
                .fetch_all(&mut *tx)
                .await?
                .iter()
                .map(|r| {
                    cols.iter()
                        .enumerate()
                        .map(|(i, c)| to_json(r, i, c.kind))
                        .collect()
                })
                .collect::<Result<Vec<Vec<Value>>, sqlx::Error>>()?;
            let columns = cols.into_iter().map(|c| c.name).collect();
            out.insert(table, Table { columns, rows });
        }
        tx.rollback().await?;
        Ok((schema, out))
    }

    /// Loads `tables` into this database, which must be empty, in one transaction: all
    /// of it or none. Identity columns continue after the highest imported value.
    pub async fn import_tables(
        &self,
        tables: &BTreeMap<String, Table>,
    ) -> Result<BTreeMap<String, usize>, ImportError> {
        let mut tx = self.pool.begin().await?;
        let ours = schema_tables(&mut tx).await?;
        for table in ours.keys() {
            let rows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT COUNT(*) FROM \"{table}\""
            )))
            .fetch_one(&mut *tx)
            .await?;
            if rows > 0 {
                return Err(ImportError::NotEmpty {
                    table: table.clone(),
                    rows,
                });
            }
        }
        // Every foreign key points at nodes: load it first.
        let mut order: Vec<&String> = tables.keys().collect();
        order.sort_by_key(|t| (t.as_str() != "nodes", t.as_str()));
        let mut done = BTreeMap::new();
        for table in order {
            let data = &tables[table];
            let cols = ours
                .get(table)
                .ok_or_else(|| ImportError::UnknownTable(table.clone()))?;
            let names: Vec<String> = cols.iter().map(|c| c.name.clone()).collect();
            if names != data.columns {
                return Err(ImportError::Columns {
                    table: table.clone(),
                    export: data.columns.clone(),
                    ours: names,
                });
            }
            let marks = (1..=cols.len())
                .map(|i| format!("${i}"))
                .collect::<Vec<_>>()
                .join(", ");
            // The table is one of ours and its columns equal ours (checked above).
            let sql = format!(
                "INSERT INTO \"{table}\" ({}) VALUES ({marks})",
                quoted_list(cols)
            );
            for (i, row) in data.rows.iter().enumerate() {
                let bad = |reason: String| ImportError::Value {
                    table: table.clone(),
                    row: i,
                    reason,
                };
                if row.len() != cols.len() {
                    return Err(bad(format!(
                        "{} values for {} columns",
                        row.len(),
                        cols.len()
                    )));
                }
                let mut q = sqlx::query(sqlx::AssertSqlSafe(sql.as_str()));
                for (v, c) in row.iter().zip(cols) {
                    q = bind(q, v, c).map_err(&bad)?;
                }
                q.execute(&mut *tx).await.map_err(|e| bad(e.to_string()))?;
            }
            for c in cols.iter().filter(|c| c.identity) {
                // Next value after the highest imported one (or 1 on an empty table).
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SELECT setval(pg_get_serial_sequence('\"{table}\"', '{name}'), \
                     COALESCE(MAX(\"{name}\"), 0) + 1, false) FROM \"{table}\"",
                    name = c.name
                )))
                .execute(&mut *tx)
                .await?;
            }
            done.insert(table.clone(), data.rows.len());
        }
        tx.commit().await?;
        Ok(done)
    }
}

async fn schema_version(conn: &mut PgConnection) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT COALESCE(MAX(version), 0) FROM _sqlx_migrations WHERE success")
        .fetch_one(conn)
        .await
}

/// The tables to export and their columns in order.
async fn schema_tables(conn: &mut PgConnection) -> Result<BTreeMap<String, Vec<Col>>, PgError> {
    let rows = sqlx::query!(
        r#"SELECT c.table_name AS "table!", c.column_name AS "column!",
                  c.data_type AS "data_type!", c.is_identity = 'YES' AS "identity!"
             FROM information_schema.columns c
             JOIN information_schema.tables t
               ON t.table_schema = c.table_schema AND t.table_name = c.table_name
            WHERE c.table_schema = current_schema() AND t.table_type = 'BASE TABLE'
            ORDER BY c.table_name, c.ordinal_position"#
    )
    .fetch_all(&mut *conn)
    .await?;
    let mut out: BTreeMap<String, Vec<Col>> = BTreeMap::new();
    for r in rows {
        if SKIP.contains(&r.table.as_str()) {
            continue;
        }
        let kind = match r.data_type.as_str() {
            "bigint" => Kind::Int,
            "boolean" => Kind::Bool,
            "text" => Kind::Text,
            other => {
                return Err(PgError::Schema(format!(
                    "{}.{} has type {other}, which exports do not carry",
                    r.table, r.column
                )));
            }
        };
        out.entry(r.table).or_default().push(Col {
            name: r.column,
            kind,
            identity: r.identity,
        });
    }
    Ok(out)
}

fn quoted_list(cols: &[Col]) -> String {
    cols.iter()
        .map(|c| format!("\"{}\"", c.name))
        .collect::<Vec<_>>()
        .join(", ")
}

fn to_json(row: &PgRow, i: usize, kind: Kind) -> Result<Value, sqlx::Error> {
    Ok(match kind {
        Kind::Int => row
            .try_get::<Option<i64>, _>(i)?
            .map_or(Value::Null, Value::from),
        Kind::Bool => row
            .try_get::<Option<bool>, _>(i)?
            .map_or(Value::Null, |b| Value::from(i64::from(b))),
        Kind::Text => row
            .try_get::<Option<String>, _>(i)?
            .map_or(Value::Null, Value::String),
    })
}

type Query<'q> = sqlx::query::Query<'q, sqlx::Postgres, PgArguments>;

/// Binds one exported value as its column's type.
fn bind<'q>(q: Query<'q>, v: &Value, c: &Col) -> Result<Query<'q>, String> {
    let wrong = || format!("column {}: {v} is not a {:?} value", c.name, c.kind);
    Ok(match (c.kind, v) {
        (Kind::Int, Value::Null) => q.bind(None::<i64>),
        (Kind::Bool, Value::Null) => q.bind(None::<bool>),
        (Kind::Text, Value::Null) => q.bind(None::<String>),
        (Kind::Int, Value::Number(n)) => q.bind(n.as_i64().ok_or_else(wrong)?),
        (Kind::Bool, Value::Bool(b)) => q.bind(*b),
        (Kind::Bool, Value::Number(n)) => match n.as_i64() {
            Some(0) => q.bind(false),
            Some(1) => q.bind(true),
            _ => return Err(wrong()),
        },
        (Kind::Text, Value::String(s)) => q.bind(s.clone()),
        _ => return Err(wrong()),
    })
}

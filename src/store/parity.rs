//! The two schemas agree: `migrations/` (SQLite) and `store-pg/migrations/`
//! (PostgreSQL) have the same migrations, and after them the same tables, columns,
//! nullability, primary keys and named indexes, with each SQLite type mapped to its
//! PostgreSQL one (TEXT → text; INTEGER → bigint, or boolean where SQLite checks
//! `IN (0, 1)`). Run against a real PostgreSQL (a private cluster).

use std::collections::BTreeSet;

use store_pg::PgStore;

use super::Store;

/// One column as both sides describe it.
type Col = (String, String, &'static str, bool, bool);

async fn sqlite_columns(store: &Store) -> Vec<Col> {
    let rows: Vec<(String, String, String, bool, i64, String)> = sqlx::query_as(
        r#"SELECT m.name, p.name, p.type, p."notnull", p.pk, m.sql
             FROM sqlite_master m JOIN pragma_table_info(m.name) p
            WHERE m.type = 'table' AND m.name NOT LIKE 'sqlite_%'
              AND m.name <> '_sqlx_migrations'
            ORDER BY m.name, p.cid"#,
    )
    .fetch_all(store.pool().unwrap())
    .await
    .unwrap();
    rows.into_iter()
        .map(|(table, name, ty, notnull, pk, sql)| {
            let ty = match ty.as_str() {
                "TEXT" => "text",
                "INTEGER" if sql.contains(&format!("({name} IN (0, 1))")) => "boolean",
                "INTEGER" => "bigint",
                other => panic!("{table}.{name}: SQLite type {other} has no PostgreSQL mapping"),
            };
            let primary_key = pk > 0;
            (table, name, ty, !notnull && !primary_key, primary_key)
        })
        .collect()
}

async fn pg_columns(pg: &PgStore) -> Vec<Col> {
    pg.columns()
        .await
        .unwrap()
        .into_iter()
        .map(|c| {
            let ty = match c.data_type.as_str() {
                "text" => "text",
                "bigint" => "bigint",
                "boolean" => "boolean",
                other => panic!(
                    "{}.{}: type {other} is not used by the schema",
                    c.table, c.name
                ),
            };
            (c.table, c.name, ty, c.nullable, c.primary_key)
        })
        .collect()
}

#[tokio::test]
async fn the_sqlite_and_postgresql_schemas_agree() {
    let sqlite: Vec<(i64, String)> = sqlx::migrate!("./migrations")
        .iter()
        .map(|m| (m.version, m.description.to_string()))
        .collect();
    let pg: Vec<(i64, String)> = store_pg::MIGRATOR
        .iter()
        .map(|m| (m.version, m.description.to_string()))
        .collect();
    assert_eq!(sqlite, pg, "the same migrations, by number and name");

    let dir = tempfile::tempdir().unwrap();
    let store = Store::open_sqlite(dir.path()).await.unwrap();
    let (_, url) = super::test_pg_database();
    let pgs = PgStore::connect(&url, 1).await.unwrap();
    pgs.migrate().await.unwrap();

    let (a, b) = (sqlite_columns(&store).await, pg_columns(&pgs).await);
    let only_sqlite: Vec<_> = a.iter().filter(|c| !b.contains(c)).collect();
    let only_pg: Vec<_> = b.iter().filter(|c| !a.contains(c)).collect();
    assert!(
        only_sqlite.is_empty() && only_pg.is_empty(),
        "columns (table, name, type, nullable, primary key) differ:\n only SQLite: {only_sqlite:?}\n only PostgreSQL: {only_pg:?}"
    );
    assert!(
        a.len() > 50,
        "{} columns: the query found the schema",
        a.len()
    );

    let sqlite_indexes: BTreeSet<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL",
    )
    .fetch_all(store.pool().unwrap())
    .await
    .unwrap()
    .into_iter()
    .collect();
    let pg_indexes: BTreeSet<String> = pgs.indexes().await.unwrap().into_iter().collect();
    assert_eq!(sqlite_indexes, pg_indexes, "named indexes");
    pgs.close().await;
    store.close().await;
}

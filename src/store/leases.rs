//! DHCP lease and reservation persistence. The DHCP server keeps its table in
//! memory; this module loads it at start and writes changes in batches.

use std::collections::HashMap;
use std::net::Ipv4Addr;

use super::{Db, Store, StoreError};
use crate::config::Reservation;

/// One row of `leases`, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRow {
    pub ip: Ipv4Addr,
    /// Normalized MAC (`aa:bb:cc:dd:ee:ff`).
    pub mac: String,
    /// Client identifier (option 61), hex.
    pub client_id: Option<String>,
    pub hostname: Option<String>,
    /// `bound` or `declined`.
    pub state: String,
    /// Unix seconds.
    pub expires_at: i64,
}

/// One write in a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseWrite {
    Upsert(LeaseRow),
    Delete(Ipv4Addr),
}

impl Store {
    /// Leases that have not expired at `now` (Unix seconds). Rows with an unparsable
    /// address are skipped with a warning.
    pub async fn load_leases(&self, now: i64) -> Result<Vec<LeaseRow>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            let rows = pg.load_leases(now).await?;
            return Ok(rows
                .into_iter()
                .filter_map(|r| {
                    lease_row(r.ip, r.mac, r.client_id, r.hostname, r.state, r.expires_at)
                })
                .collect());
        }
        let pool = self.pool()?;
        let rows = sqlx::query!(
        r#"SELECT ip, mac, client_id, hostname, state, expires_at FROM leases WHERE expires_at > ?"#,
        now
    )
    .fetch_all(pool)
    .await?;
        Ok(rows
            .into_iter()
            .filter_map(|r| lease_row(r.ip, r.mac, r.client_id, r.hostname, r.state, r.expires_at))
            .collect())
    }

    /// The addresses bound at `now` (Unix seconds) to any MAC of node `node_id`. A lease
    /// row is written before its ACK goes out, so this is what the node was told.
    pub async fn leased_ips(&self, node_id: i64, now: i64) -> Result<Vec<String>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.leased_ips(node_id, now).await?);
        }
        Ok(sqlx::query_scalar!(
            r#"SELECT ip FROM leases
               WHERE state = 'bound' AND expires_at > ?
                 AND mac IN (SELECT mac FROM interfaces WHERE node_id = ?)"#,
            now,
            node_id
        )
        .fetch_all(self.pool()?)
        .await?)
    }

    /// Bound leases at `now` (Unix seconds) whose MAC is no node's (a leftover of a
    /// deleted node): (address, MAC).
    pub async fn stale_leases(&self, now: i64) -> Result<Vec<(String, String)>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.stale_leases(now).await?);
        }
        let rows = sqlx::query!(
            r#"SELECT ip, mac FROM leases
               WHERE state = 'bound' AND expires_at > ?
                 AND mac NOT IN (SELECT mac FROM interfaces) ORDER BY ip"#,
            now
        )
        .fetch_all(self.pool()?)
        .await?;
        Ok(rows.into_iter().map(|r| (r.ip, r.mac)).collect())
    }

    /// Releases the lease of `ip` if its MAC is no node's; false when there is no such
    /// lease.
    pub async fn release_stale_lease(&self, ip: &str) -> Result<bool, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.release_stale_lease(ip).await?);
        }
        let r = self
            .write_one(sqlx::query!(
                "DELETE FROM leases WHERE ip = ? AND mac NOT IN (SELECT mac FROM interfaces)",
                ip
            ))
            .await?;
        Ok(r.rows_affected() == 1)
    }

    /// Writes a batch atomically: durable when this returns `Ok`.
    ///
    /// Writes apply in order; only the last one per address matters, so the batch is
    /// reduced to one write per address, after which deletes and upserts touch
    /// different rows and commute. Each kind is then one statement over a JSON array
    /// (`json_each`), not one statement per lease: sqlx runs SQLite on a worker thread,
    /// and every statement is a round trip to it, which at thousands of leases a second
    /// cost more than the commit itself.
    ///
    /// On PostgreSQL, where other instances bind leases too, an upsert binds its
    /// address only if it is free, already this MAC's or expired: the ones refused come
    /// back with the lease that holds the address (see `store_pg::leases`). SQLite has
    /// one pxed, whose lease table is the truth: nothing is refused there.
    pub async fn commit_leases(
        &self,
        writes: &[LeaseWrite],
    ) -> Result<Vec<RefusedLease>, StoreError> {
        let mut last: HashMap<Ipv4Addr, &LeaseWrite> = HashMap::with_capacity(writes.len());
        for w in writes {
            let ip = match w {
                LeaseWrite::Upsert(l) => l.ip,
                LeaseWrite::Delete(ip) => *ip,
            };
            last.insert(ip, w);
        }
        let mut upserts = Vec::new();
        let mut deletes = Vec::new();
        for (ip, w) in last {
            match w {
                LeaseWrite::Upsert(l) => upserts.push(JsonLease {
                    ip: ip.to_string(),
                    mac: &l.mac,
                    client_id: l.client_id.as_deref(),
                    hostname: l.hostname.as_deref(),
                    state: &l.state,
                    expires_at: l.expires_at,
                }),
                LeaseWrite::Delete(_) => deletes.push(ip.to_string()),
            }
        }
        if let Db::Postgres(pg) = &self.db {
            let rows: Vec<_> = upserts
                .iter()
                .map(|l| store_pg::leases::LeaseRow {
                    ip: l.ip.clone(),
                    mac: l.mac.to_owned(),
                    client_id: l.client_id.map(str::to_owned),
                    hostname: l.hostname.map(str::to_owned),
                    state: l.state.to_owned(),
                    expires_at: l.expires_at,
                })
                .collect();
            let now = chrono::Utc::now().timestamp();
            let refused = pg.commit_leases(&rows, &deletes, now).await?;
            return Ok(refused
                .into_iter()
                .filter_map(|r| {
                    Some(RefusedLease {
                        ip: r.ip.parse().ok()?,
                        holder: r.holder.and_then(|h| {
                            lease_row(h.ip, h.mac, h.client_id, h.hostname, h.state, h.expires_at)
                        }),
                    })
                })
                .collect());
        }
        let upserts = (!upserts.is_empty()).then(|| json(&upserts));
        let deletes = (!deletes.is_empty()).then(|| json(&deletes));
        if upserts.is_none() && deletes.is_none() {
            return Ok(Vec::new());
        }
        let mut tx = self.write().await?;
        if let Some(d) = deletes {
            delete_json(&mut *tx, &d).await?;
        }
        if let Some(u) = upserts {
            upsert_json(&mut *tx, &u).await?;
        }
        tx.commit().await?;
        Ok(Vec::new())
    }
}

/// An upsert [`Store::commit_leases`] refused: another MAC holds the address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedLease {
    pub ip: Ipv4Addr,
    /// The lease that holds it, when the database could say.
    pub holder: Option<LeaseRow>,
}

/// A stored lease row, or `None` (with a warning) if its address does not parse.
pub(super) fn lease_row(
    ip: String,
    mac: String,
    client_id: Option<String>,
    hostname: Option<String>,
    state: String,
    expires_at: i64,
) -> Option<LeaseRow> {
    match ip.parse() {
        Ok(ip) => Some(LeaseRow {
            ip,
            mac,
            client_id,
            hostname,
            state,
            expires_at,
        }),
        Err(_) => {
            tracing::warn!(%ip, "skipping a lease row with a bad address");
            None
        }
    }
}

/// A lease as one element of the JSON array `upsert_json` reads.
#[derive(serde::Serialize)]
struct JsonLease<'a> {
    ip: String,
    mac: &'a str,
    client_id: Option<&'a str>,
    hostname: Option<&'a str>,
    state: &'a str,
    expires_at: i64,
}

fn json<T: serde::Serialize>(v: &T) -> String {
    // Strings, integers and options only: serialization cannot fail.
    serde_json::to_string(v).expect("lease batch serializes")
}

async fn upsert_json<'c>(
    db: impl sqlx::Executor<'c, Database = sqlx::Sqlite>,
    rows: &str,
) -> Result<(), StoreError> {
    // `WHERE true`: without it SQLite would parse ON CONFLICT as part of the SELECT.
    sqlx::query!(
        r#"INSERT INTO leases (ip, mac, client_id, hostname, state, expires_at)
           SELECT value ->> '$.ip', value ->> '$.mac', value ->> '$.client_id',
                  value ->> '$.hostname', value ->> '$.state', value ->> '$.expires_at'
           FROM json_each(?) WHERE true
           ON CONFLICT (ip) DO UPDATE SET mac = excluded.mac,
               client_id = excluded.client_id, hostname = excluded.hostname,
               state = excluded.state, expires_at = excluded.expires_at"#,
        rows
    )
    .execute(db)
    .await?;
    Ok(())
}

async fn delete_json<'c>(
    db: impl sqlx::Executor<'c, Database = sqlx::Sqlite>,
    ips: &str,
) -> Result<(), StoreError> {
    sqlx::query!(
        "DELETE FROM leases WHERE ip IN (SELECT value FROM json_each(?))",
        ips
    )
    .execute(db)
    .await?;
    Ok(())
}

impl Store {
    /// Deletes leases that expired at or before `now`; returns how many.
    pub async fn purge_expired_leases(&self, now: i64) -> Result<u64, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.purge_expired_leases(now).await?);
        }
        let r = self
            .write_one(sqlx::query!(
                "DELETE FROM leases WHERE expires_at <= ?",
                now
            ))
            .await?;
        Ok(r.rows_affected())
    }

    /// Makes the `reservations` table equal to the configured reservations.
    pub async fn sync_reservations(&self, reservations: &[Reservation]) -> Result<(), StoreError> {
        if let Db::Postgres(pg) = &self.db {
            let rows: Vec<_> = reservations
                .iter()
                .map(|r| store_pg::leases::ReservationRow {
                    mac: r.mac.clone(),
                    ip: r.ip.to_string(),
                    hostname: r.hostname.clone(),
                })
                .collect();
            return Ok(pg.sync_reservations(&rows).await?);
        }
        let mut tx = self.write().await?;
        sqlx::query!("DELETE FROM reservations")
            .execute(&mut *tx)
            .await?;
        for r in reservations {
            let ip = r.ip.to_string();
            sqlx::query!(
                "INSERT INTO reservations (mac, ip, hostname) VALUES (?, ?, ?)",
                r.mac,
                ip,
                r.hostname
            )
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The stored reservations (MAC, IP, hostname).
    pub async fn reservations(&self) -> Result<Vec<Reservation>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            let rows = pg.reservations().await?;
            return Ok(rows
                .into_iter()
                .filter_map(|r| {
                    Some(Reservation {
                        mac: r.mac,
                        ip: r.ip.parse().ok()?,
                        hostname: r.hostname,
                    })
                })
                .collect());
        }
        let pool = self.pool()?;
        let rows = sqlx::query!("SELECT mac, ip, hostname FROM reservations ORDER BY mac")
            .fetch_all(pool)
            .await?;
        Ok(rows
            .into_iter()
            .filter_map(|r| {
                Some(Reservation {
                    mac: r.mac,
                    ip: r.ip.parse().ok()?,
                    hostname: r.hostname,
                })
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(ip: &str, mac: &str, exp: i64) -> LeaseRow {
        LeaseRow {
            ip: ip.parse().unwrap(),
            mac: mac.into(),
            client_id: Some("01aabb".into()),
            hostname: None,
            state: "bound".into(),
            expires_at: exp,
        }
    }

    #[tokio::test]
    async fn leases_round_trip_and_expire() {
        let dir = tempfile::tempdir().unwrap();
        for s in crate::store::test_stores(dir.path()).await {
            let a = row("10.0.0.10", "52:54:00:00:00:01", 100);
            let b = row("10.0.0.11", "52:54:00:00:00:02", 50);
            s.commit_leases(&[LeaseWrite::Upsert(a.clone()), LeaseWrite::Upsert(b)])
                .await
                .unwrap();
            let mut a2 = a.clone();
            a2.expires_at = 200;
            s.commit_leases(&[LeaseWrite::Upsert(a2.clone())])
                .await
                .unwrap();
            assert_eq!(s.load_leases(60).await.unwrap(), vec![a2]);
            assert_eq!(s.purge_expired_leases(60).await.unwrap(), 1);
            s.commit_leases(&[LeaseWrite::Delete(a.ip)]).await.unwrap();
            assert!(s.load_leases(0).await.unwrap().is_empty());
        }
    }

    #[tokio::test]
    async fn a_batch_applies_in_order() {
        let dir = tempfile::tempdir().unwrap();
        for s in crate::store::test_stores(dir.path()).await {
            let a = row("10.0.0.10", "52:54:00:00:00:01", 100);
            let mut b = row("10.0.0.11", "52:54:00:00:00:02", 100);
            b.client_id = None;
            b.hostname = Some("node-b".into());
            let c = row("10.0.0.12", "52:54:00:00:00:03", 100);
            s.commit_leases(&[LeaseWrite::Upsert(c.clone())])
                .await
                .unwrap();
            let mut a2 = a.clone();
            a2.state = "declined".into();
            // a: bound then declined; b: released then bound again; c: released.
            s.commit_leases(&[
                LeaseWrite::Upsert(a.clone()),
                LeaseWrite::Delete(b.ip),
                LeaseWrite::Upsert(b.clone()),
                LeaseWrite::Delete(c.ip),
                LeaseWrite::Upsert(a2.clone()),
            ])
            .await
            .unwrap();
            let mut got = s.load_leases(0).await.unwrap();
            got.sort_by_key(|l| l.ip);
            assert_eq!(got, vec![a2, b.clone()]);
            // Bound, then released in the same batch: gone.
            s.commit_leases(&[LeaseWrite::Upsert(c.clone()), LeaseWrite::Delete(c.ip)])
                .await
                .unwrap();
            s.commit_leases(&[]).await.unwrap();
            assert_eq!(s.load_leases(0).await.unwrap().len(), 2);
        }
    }

    #[tokio::test]
    async fn reservations_are_replaced() {
        let dir = tempfile::tempdir().unwrap();
        for s in crate::store::test_stores(dir.path()).await {
            let r = |mac: &str, ip: &str| Reservation {
                mac: mac.into(),
                ip: ip.parse().unwrap(),
                hostname: None,
            };
            s.sync_reservations(&[r("52:54:00:00:00:01", "10.0.0.5")])
                .await
                .unwrap();
            s.sync_reservations(&[r("52:54:00:00:00:02", "10.0.0.5")])
                .await
                .unwrap();
            assert_eq!(
                s.reservations().await.unwrap(),
                vec![r("52:54:00:00:00:02", "10.0.0.5")]
            );
        }
    }
}

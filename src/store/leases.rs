//! DHCP lease and reservation persistence. The DHCP server keeps its table in
//! memory; this module loads it at start and writes changes in batches.

use std::net::Ipv4Addr;

use super::StoreError;
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

/// Leases that have not expired at `now` (Unix seconds). Rows with an unparsable
/// address are skipped with a warning.
pub async fn load(pool: &sqlx::SqlitePool, now: i64) -> Result<Vec<LeaseRow>, StoreError> {
    let rows = sqlx::query!(
        r#"SELECT ip, mac, client_id, hostname, state, expires_at FROM leases WHERE expires_at > ?"#,
        now
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|r| match r.ip.parse() {
            Ok(ip) => Some(LeaseRow {
                ip,
                mac: r.mac,
                client_id: r.client_id,
                hostname: r.hostname,
                state: r.state,
                expires_at: r.expires_at,
            }),
            Err(_) => {
                tracing::warn!(ip = %r.ip, "skipping a lease row with a bad address");
                None
            }
        })
        .collect())
}

/// Writes a batch in one transaction: durable when this returns `Ok`.
pub async fn commit(pool: &sqlx::SqlitePool, writes: &[LeaseWrite]) -> Result<(), StoreError> {
    let mut tx = pool.begin().await?;
    for w in writes {
        match w {
            LeaseWrite::Upsert(l) => {
                let ip = l.ip.to_string();
                sqlx::query!(
                    r#"INSERT INTO leases (ip, mac, client_id, hostname, state, expires_at)
                       VALUES (?, ?, ?, ?, ?, ?)
                       ON CONFLICT (ip) DO UPDATE SET mac = excluded.mac,
                           client_id = excluded.client_id, hostname = excluded.hostname,
                           state = excluded.state, expires_at = excluded.expires_at"#,
                    ip,
                    l.mac,
                    l.client_id,
                    l.hostname,
                    l.state,
                    l.expires_at
                )
                .execute(&mut *tx)
                .await?;
            }
            LeaseWrite::Delete(ip) => {
                let ip = ip.to_string();
                sqlx::query!("DELETE FROM leases WHERE ip = ?", ip)
                    .execute(&mut *tx)
                    .await?;
            }
        }
    }
    tx.commit().await?;
    Ok(())
}

/// Deletes leases that expired at or before `now`; returns how many.
pub async fn purge_expired(pool: &sqlx::SqlitePool, now: i64) -> Result<u64, StoreError> {
    let r = sqlx::query!("DELETE FROM leases WHERE expires_at <= ?", now)
        .execute(pool)
        .await?;
    Ok(r.rows_affected())
}

/// Makes the `reservations` table equal to the configured reservations.
pub async fn sync_reservations(
    pool: &sqlx::SqlitePool,
    reservations: &[Reservation],
) -> Result<(), StoreError> {
    let mut tx = pool.begin().await?;
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
pub async fn reservations(pool: &sqlx::SqlitePool) -> Result<Vec<Reservation>, StoreError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Store;

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
        let s = Store::open(dir.path()).await.unwrap();
        let a = row("10.0.0.10", "52:54:00:00:00:01", 100);
        let b = row("10.0.0.11", "52:54:00:00:00:02", 50);
        commit(
            &s.pool,
            &[LeaseWrite::Upsert(a.clone()), LeaseWrite::Upsert(b)],
        )
        .await
        .unwrap();
        let mut a2 = a.clone();
        a2.expires_at = 200;
        commit(&s.pool, &[LeaseWrite::Upsert(a2.clone())])
            .await
            .unwrap();
        assert_eq!(load(&s.pool, 60).await.unwrap(), vec![a2]);
        assert_eq!(purge_expired(&s.pool, 60).await.unwrap(), 1);
        commit(&s.pool, &[LeaseWrite::Delete(a.ip)]).await.unwrap();
        assert!(load(&s.pool, 0).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn reservations_are_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(dir.path()).await.unwrap();
        let r = |mac: &str, ip: &str| Reservation {
            mac: mac.into(),
            ip: ip.parse().unwrap(),
            hostname: None,
        };
        sync_reservations(&s.pool, &[r("52:54:00:00:00:01", "10.0.0.5")])
            .await
            .unwrap();
        sync_reservations(&s.pool, &[r("52:54:00:00:00:02", "10.0.0.5")])
            .await
            .unwrap();
        assert_eq!(
            reservations(&s.pool).await.unwrap(),
            vec![r("52:54:00:00:00:02", "10.0.0.5")]
        );
    }
}

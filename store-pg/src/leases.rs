//! DHCP leases and reservations on PostgreSQL: the queries behind pxed's
//! `store::leases` when its database is PostgreSQL. Rows are plain (text addresses,
//! seconds since the epoch); pxed's store turns them into its own types.

use super::{PgError, PgStore};

/// One row of `leases`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRow {
    pub ip: String,
    pub mac: String,
    pub client_id: Option<String>,
    pub hostname: Option<String>,
    /// `bound` or `declined`.
    pub state: String,
    pub expires_at: i64,
}

/// An upsert [`PgStore::commit_leases`] refused: the address is another MAC's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedLease {
    pub ip: String,
    /// The lease that holds it, when the statement could see it.
    pub holder: Option<LeaseRow>,
}

/// One row of `reservations`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservationRow {
    pub mac: String,
    pub ip: String,
    pub hostname: Option<String>,
}

impl PgStore {
    /// Leases that have not expired at `now`.
    pub async fn load_leases(&self, now: i64) -> Result<Vec<LeaseRow>, PgError> {
        Ok(sqlx::query_as!(
            LeaseRow,
            "SELECT ip, mac, client_id, hostname, state, expires_at FROM leases
              WHERE expires_at > $1",
            now
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// The lease rows of `ips` (those that have one).
    pub async fn leases_at(&self, ips: &[String]) -> Result<Vec<LeaseRow>, PgError> {
        Ok(sqlx::query_as!(
            LeaseRow,
            "SELECT ip, mac, client_id, hostname, state, expires_at FROM leases
              WHERE ip = ANY($1)",
            ips
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// Addresses bound at `now` to any MAC of node `node_id`.
    pub async fn leased_ips(&self, node_id: i64, now: i64) -> Result<Vec<String>, PgError> {
        Ok(sqlx::query_scalar!(
            "SELECT ip FROM leases
              WHERE state = 'bound' AND expires_at > $1
                AND mac IN (SELECT mac FROM interfaces WHERE node_id = $2)",
            now,
            node_id
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// Bound leases at `now` whose MAC is no node's: (address, MAC), by address.
    pub async fn stale_leases(&self, now: i64) -> Result<Vec<(String, String)>, PgError> {
        let rows = sqlx::query!(
            r#"SELECT ip, mac FROM leases
                WHERE state = 'bound' AND expires_at > $1
                  AND mac NOT IN (SELECT mac FROM interfaces)
                ORDER BY ip COLLATE "C""#,
            now
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(|r| (r.ip, r.mac)).collect())
    }

    /// Deletes the lease of `ip` if its MAC is no node's; false when there is none.
    pub async fn release_stale_lease(&self, ip: &str) -> Result<bool, PgError> {
        let r = sqlx::query!(
            "DELETE FROM leases WHERE ip = $1 AND mac NOT IN (SELECT mac FROM interfaces)",
            ip
        )
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected() == 1)
    }

    /// Deletes `deletes` and binds `upserts` in one transaction: two statements over
    /// arrays (`UNNEST`), whatever the batch size. The caller gives each address once.
    ///
    /// An upsert binds its address only if the address is free, already this MAC's,
    /// or expired at `now`: the database, not an instance's lease cache, decides who
    /// holds an address, so two instances answering at once can never bind one
    /// address to two MACs. The upserts it refused come back with the lease that
    /// holds the address (`None` when the holder committed after this statement's
    /// snapshot: refused all the same).
    pub async fn commit_leases(
        &self,
        upserts: &[LeaseRow],
        deletes: &[String],
        now: i64,
    ) -> Result<Vec<RefusedLease>, PgError> {
        let mut tx = self.pool.begin().await?;
        if !deletes.is_empty() {
            sqlx::query!("DELETE FROM leases WHERE ip = ANY($1)", deletes)
                .execute(&mut *tx)
                .await?;
        }
        let mut refused = Vec::new();
        if !upserts.is_empty() {
            let col = |f: fn(&LeaseRow) -> String| upserts.iter().map(f).collect::<Vec<_>>();
            let opt =
                |f: fn(&LeaseRow) -> Option<String>| upserts.iter().map(f).collect::<Vec<_>>();
            let expires: Vec<i64> = upserts.iter().map(|l| l.expires_at).collect();
            // A conflicting row is locked by ON CONFLICT even when the WHERE refuses
            // the update; the final SELECT reads the holder from the statement's
            // snapshot.
            let rows = sqlx::query!(
                r#"WITH incoming AS (
                     SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[],
                                          $5::text[], $6::bigint[])
                       AS t(ip, mac, client_id, hostname, state, expires_at)),
                   bound AS (
                     INSERT INTO leases (ip, mac, client_id, hostname, state, expires_at)
                     SELECT * FROM incoming
                     ON CONFLICT (ip) DO UPDATE SET mac = EXCLUDED.mac,
                         client_id = EXCLUDED.client_id, hostname = EXCLUDED.hostname,
                         state = EXCLUDED.state, expires_at = EXCLUDED.expires_at
                      WHERE leases.mac = EXCLUDED.mac OR leases.expires_at <= $7
                     RETURNING ip)
                   SELECT i.ip AS "ip!", l.mac AS "mac?", l.client_id AS "client_id?",
                          l.hostname AS "hostname?", l.state AS "state?",
                          l.expires_at AS "expires_at?"
                     FROM incoming i LEFT JOIN leases l ON l.ip = i.ip
                    WHERE i.ip NOT IN (SELECT ip FROM bound)"#,
                &col(|l| l.ip.clone()),
                &col(|l| l.mac.clone()),
                &opt(|l| l.client_id.clone()) as &[Option<String>],
                &opt(|l| l.hostname.clone()) as &[Option<String>],
                &col(|l| l.state.clone()),
                &expires,
                now
            )
            .fetch_all(&mut *tx)
            .await?;
            refused = rows
                .into_iter()
                .map(|r| RefusedLease {
                    holder: match (r.mac, r.state, r.expires_at) {
                        (Some(mac), Some(state), Some(expires_at)) => Some(LeaseRow {
                            ip: r.ip.clone(),
                            mac,
                            client_id: r.client_id,
                            hostname: r.hostname,
                            state,
                            expires_at,
                        }),
                        _ => None,
                    },
                    ip: r.ip,
                })
                .collect();
        }
        tx.commit().await?;
        Ok(refused)
    }

    /// Deletes leases that expired at or before `now`; how many.
    pub async fn purge_expired_leases(&self, now: i64) -> Result<u64, PgError> {
        let r = sqlx::query!("DELETE FROM leases WHERE expires_at <= $1", now)
            .execute(&self.pool)
            .await?;
        Ok(r.rows_affected())
    }

    /// Makes `reservations` equal to `rows`, in one transaction.
    pub async fn sync_reservations(&self, rows: &[ReservationRow]) -> Result<(), PgError> {
        let mut tx = self.pool.begin().await?;
        // `WHERE TRUE`: the text must differ from the SQLite store's identical
        // statement, or both would have one hash in the offline caches.
        sqlx::query!("DELETE FROM reservations WHERE TRUE")
            .execute(&mut *tx)
            .await?;
        let macs: Vec<String> = rows.iter().map(|r| r.mac.clone()).collect();
        let ips: Vec<String> = rows.iter().map(|r| r.ip.clone()).collect();
        let names: Vec<Option<String>> = rows.iter().map(|r| r.hostname.clone()).collect();
        sqlx::query!(
            "INSERT INTO reservations (mac, ip, hostname)
             SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[])",
            &macs,
            &ips,
            &names as &[Option<String>]
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// The reservations, by MAC.
    pub async fn reservations(&self) -> Result<Vec<ReservationRow>, PgError> {
        Ok(sqlx::query_as!(
            ReservationRow,
            r#"SELECT mac, ip, hostname FROM reservations ORDER BY mac COLLATE "C""#
        )
        .fetch_all(&self.pool)
        .await?)
    }
}

//! The webhook outbox: one row per node state change, written by the lifecycle in the
//! transaction of the change, and a delivery cursor per configured URL.

use std::collections::BTreeMap;

use super::nodes::{NodeTx, Tx, now};
use super::{Db, Store, StoreError};
use crate::model::{Mac, State};

/// One queued event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRow {
    /// The event id receivers see (monotonic).
    pub id: i64,
    pub node_id: i64,
    pub to_state: State,
    /// The exact body that is signed and sent.
    pub body: String,
}

/// A URL as the pruner sees it.
#[derive(Debug, Clone)]
pub struct CursorTarget<'a> {
    pub url: &'a str,
    /// Empty: every state.
    pub states: &'a [State],
}

/// What one prune did, per URL (in the order given).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pruned {
    /// Events this URL wanted that were dropped to keep the queue under its cap.
    pub dropped: Vec<u64>,
    /// Events waiting for this URL (after the prune).
    pub depth: Vec<u64>,
}

impl NodeTx {
    /// Queues a state-change event; `body` gets the event id and returns the JSON text.
    pub async fn enqueue_webhook(
        &mut self,
        node_id: i64,
        to_state: State,
        body: impl FnOnce(i64) -> String,
    ) -> Result<i64, StoreError> {
        let at = now();
        if let Tx::Pg(p) = &mut self.tx {
            return Ok(p.enqueue_webhook(node_id, to_state, &at, body).await?);
        }
        let id = sqlx::query_scalar!(
            r#"INSERT INTO webhook_outbox (node_id, to_state, body, created_at)
               VALUES (?, ?, '', ?) RETURNING id"#,
            node_id,
            to_state,
            at
        )
        .fetch_one(self.lite("this lifecycle step")?)
        .await?;
        let text = body(id);
        sqlx::query!("UPDATE webhook_outbox SET body = ? WHERE id = ?", text, id)
            .execute(self.lite("this lifecycle step")?)
            .await?;
        Ok(id)
    }

    /// Every MAC of the node, the boot NIC first.
    pub async fn macs(&mut self, node_id: i64) -> Result<Vec<Mac>, StoreError> {
        if let Tx::Pg(p) = &mut self.tx {
            return Ok(p.macs(node_id).await?);
        }
        Ok(sqlx::query_scalar!(
            r#"SELECT mac AS "mac: Mac" FROM interfaces WHERE node_id = ? ORDER BY is_boot DESC, mac"#,
            node_id
        )
        .fetch_all(self.lite("this lifecycle step")?)
        .await?)
    }
}

impl Store {
    /// Makes the cursors match the configured URLs: a new URL starts after the newest
    /// queued event (it gets changes from now on), a URL no longer configured loses its
    /// cursor (so it holds nothing back).
    pub async fn webhook_sync_cursors(&self, urls: &[&str]) -> Result<(), StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.webhook_sync_cursors(urls).await?);
        }
        let mut tx = self.write().await?;
        let known = sqlx::query_scalar!("SELECT url FROM webhook_cursors")
            .fetch_all(&mut *tx)
            .await?;
        for url in known.iter().filter(|u| !urls.contains(&u.as_str())) {
            sqlx::query!("DELETE FROM webhook_cursors WHERE url = ?", url)
                .execute(&mut *tx)
                .await?;
        }
        for url in urls {
            sqlx::query!(
                r#"INSERT INTO webhook_cursors (url, last_id)
                   VALUES (?, (SELECT COALESCE(MAX(id), 0) FROM webhook_outbox))
                   ON CONFLICT (url) DO NOTHING"#,
                url
            )
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The last event id done (delivered, filtered out or dropped) for `url`.
    pub async fn webhook_cursor(&self, url: &str) -> Result<i64, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.webhook_cursor(url).await?);
        }
        Ok(
            sqlx::query_scalar!("SELECT last_id FROM webhook_cursors WHERE url = ?", url)
                .fetch_optional(self.pool()?)
                .await?
                .unwrap_or(0),
        )
    }

    /// The oldest queued event after `after`.
    pub async fn webhook_next(&self, after: i64) -> Result<Option<OutboxRow>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg
                .webhook_next(after)
                .await?
                .map(|(id, node_id, to_state, body)| OutboxRow {
                    id,
                    node_id,
                    to_state,
                    body,
                }));
        }
        Ok(sqlx::query_as!(
            OutboxRow,
            r#"SELECT id, node_id, to_state AS "to_state: State", body
               FROM webhook_outbox WHERE id > ? ORDER BY id LIMIT 1"#,
            after
        )
        .fetch_optional(self.pool()?)
        .await?)
    }

    /// Marks every event up to `id` done for `url` (never moves a cursor back).
    pub async fn webhook_advance(&self, url: &str, id: i64) -> Result<(), StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.webhook_advance(url, id).await?);
        }
        self.write_one(sqlx::query!(
            "UPDATE webhook_cursors SET last_id = MAX(last_id, ?) WHERE url = ?",
            id,
            url
        ))
        .await?;
        Ok(())
    }

    /// Deletes the events every URL is done with, then, past `cap` rows, the oldest
    /// (moving the cursors of URLs still waiting for them past them and counting what
    /// each one wanted). With no URL configured nothing is kept.
    pub async fn webhook_prune(
        &self,
        targets: &[CursorTarget<'_>],
        cap: u32,
    ) -> Result<Pruned, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            let urls: Vec<&str> = targets.iter().map(|t| t.url).collect();
            let per_url = pg.webhook_prune(&urls, i64::from(cap)).await?;
            let mut out = Pruned::default();
            for (t, (by_state, depth)) in targets.iter().zip(per_url) {
                out.dropped
                    .push(wanted(t, by_state.iter().map(|(s, n)| (s.as_str(), *n))));
                out.depth.push(u64::try_from(depth).unwrap_or(0));
            }
            return Ok(out);
        }
        let mut tx = self.write().await?;
        let mut cursors = Vec::with_capacity(targets.len());
        for t in targets {
            let c = sqlx::query_scalar!("SELECT last_id FROM webhook_cursors WHERE url = ?", t.url)
                .fetch_optional(&mut *tx)
                .await?
                .unwrap_or(0);
            cursors.push(c);
        }
        let done = cursors.iter().copied().min().unwrap_or(i64::MAX);
        sqlx::query!("DELETE FROM webhook_outbox WHERE id <= ?", done)
            .execute(&mut *tx)
            .await?;
        let rows = sqlx::query_scalar!("SELECT COUNT(*) FROM webhook_outbox")
            .fetch_one(&mut *tx)
            .await?;
        let mut out = Pruned {
            dropped: vec![0; targets.len()],
            depth: vec![0; targets.len()],
        };
        let excess = rows - i64::from(cap);
        if excess > 0 {
            let cutoff = sqlx::query_scalar!(
                "SELECT id FROM webhook_outbox ORDER BY id LIMIT 1 OFFSET ?",
                excess - 1
            )
            .fetch_one(&mut *tx)
            .await?;
            for (i, t) in targets.iter().enumerate() {
                if cursors[i] >= cutoff {
                    continue;
                }
                let by_state: BTreeMap<String, i64> = sqlx::query!(
                    r#"SELECT to_state, COUNT(*) AS "n!: i64" FROM webhook_outbox
                       WHERE id > ? AND id <= ? GROUP BY to_state"#,
                    cursors[i],
                    cutoff
                )
                .fetch_all(&mut *tx)
                .await?
                .into_iter()
                .map(|r| (r.to_state, r.n))
                .collect();
                out.dropped[i] = wanted(t, by_state.iter().map(|(s, n)| (s.as_str(), *n)));
                sqlx::query!(
                    "UPDATE webhook_cursors SET last_id = MAX(last_id, ?) WHERE url = ?",
                    cutoff,
                    t.url
                )
                .execute(&mut *tx)
                .await?;
                cursors[i] = cursors[i].max(cutoff);
            }
            sqlx::query!("DELETE FROM webhook_outbox WHERE id <= ?", cutoff)
                .execute(&mut *tx)
                .await?;
        }
        for (i, c) in cursors.iter().enumerate() {
            let n = sqlx::query_scalar!("SELECT COUNT(*) FROM webhook_outbox WHERE id > ?", c)
                .fetch_one(&mut *tx)
                .await?;
            out.depth[i] = u64::try_from(n).unwrap_or(0);
        }
        tx.commit().await?;
        Ok(out)
    }
}

/// How many of the dropped events (counts per state) `t` wanted.
fn wanted<'s>(t: &CursorTarget<'_>, by_state: impl Iterator<Item = (&'s str, i64)>) -> u64 {
    by_state
        .filter(|(s, _)| t.states.is_empty() || t.states.iter().any(|w| w.as_str() == *s))
        .map(|(_, n)| u64::try_from(n).unwrap_or(0))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn queue(store: &Store, states: &[State]) -> Vec<i64> {
        let mut ids = Vec::new();
        for s in states {
            let mut tx = store.begin_node_tx().await.unwrap();
            ids.push(
                tx.enqueue_webhook(1, *s, |id| format!("{{\"id\":{id}}}"))
                    .await
                    .unwrap(),
            );
            tx.commit().await.unwrap();
        }
        ids
    }

    /// Past the cap the oldest events go; each URL counts only the dropped events it
    /// had not received and wanted, and its cursor moves past them. Rows every URL is
    /// done with are deleted; with no URL nothing is kept.
    #[tokio::test]
    async fn the_queue_is_bounded_and_drops_are_counted_per_url() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).await.unwrap();
        store
            .webhook_sync_cursors(&["http://a/", "http://b/"])
            .await
            .unwrap();
        use State::*;
        let ids = queue(
            &store,
            &[
                Reclaiming, Netbooting, Installing, FirstBoot, Available, Failed,
            ],
        )
        .await;
        assert!(ids.windows(2).all(|w| w[1] > w[0]), "monotonic: {ids:?}");
        // `a` got the first two; `b` nothing.
        store.webhook_advance("http://a/", ids[1]).await.unwrap();
        let failed_only = [Failed];
        let targets = [
            CursorTarget {
                url: "http://a/",
                states: &[],
            },
            CursorTarget {
                url: "http://b/",
                states: &failed_only,
            },
        ];
        let p = store.webhook_prune(&targets, 10).await.unwrap();
        assert_eq!(
            p,
            Pruned {
                dropped: vec![0, 0],
                depth: vec![4, 6]
            }
        );
        // Cap 3: ids[0..3] go. `a` had ids[2] still to get; `b` wanted none of them.
        let p = store.webhook_prune(&targets, 3).await.unwrap();
        assert_eq!(
            p,
            Pruned {
                dropped: vec![1, 0],
                depth: vec![3, 3]
            }
        );
        assert_eq!(store.webhook_cursor("http://a/").await.unwrap(), ids[2]);
        assert_eq!(store.webhook_next(0).await.unwrap().unwrap().id, ids[3]);
        // Both done with everything: the table empties.
        store.webhook_advance("http://a/", ids[5]).await.unwrap();
        store.webhook_advance("http://b/", ids[5]).await.unwrap();
        let p = store.webhook_prune(&targets, 3).await.unwrap();
        assert_eq!(p.depth, vec![0, 0]);
        assert!(store.webhook_next(0).await.unwrap().is_none());
        // A new URL starts after the newest event; with no URL nothing is kept.
        let more = queue(&store, &[Reclaiming]).await;
        store.webhook_sync_cursors(&["http://c/"]).await.unwrap();
        assert_eq!(store.webhook_cursor("http://c/").await.unwrap(), more[0]);
        store.webhook_sync_cursors(&[]).await.unwrap();
        store.webhook_prune(&[], 3).await.unwrap();
        assert!(store.webhook_next(0).await.unwrap().is_none());
        // Ids are never reused after deletion.
        assert!(queue(&store, &[Reclaiming]).await[0] > more[0]);
    }
}

//! The webhook outbox's delivery cursors and imported images on PostgreSQL: the
//! queries behind pxed's `store::{webhooks, images}`.

use pxed_model::State;
use pxed_model::rows::ImageRow;

use super::{PgError, PgStore};

/// One queued event: (id, node, state, body).
pub type Outbox = (i64, i64, State, String);

impl PgStore {
    /// Makes the cursors match `urls` (a new one starts after the newest event).
    pub async fn webhook_sync_cursors(&self, urls: &[&str]) -> Result<(), PgError> {
        let urls: Vec<String> = urls.iter().map(|u| (*u).to_owned()).collect();
        let mut tx = self.pool.begin().await?;
        sqlx::query!("DELETE FROM webhook_cursors WHERE url <> ALL($1)", &urls)
            .execute(&mut *tx)
            .await?;
        sqlx::query!(
            "INSERT INTO webhook_cursors (url, last_id)
             SELECT u, (SELECT COALESCE(MAX(id), 0) FROM webhook_outbox) FROM UNNEST($1::text[]) AS u
             ON CONFLICT (url) DO NOTHING",
            &urls
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// The last event id done for `url` (0 if none).
    pub async fn webhook_cursor(&self, url: &str) -> Result<i64, PgError> {
        Ok(
            sqlx::query_scalar!("SELECT last_id FROM webhook_cursors WHERE url = $1", url)
                .fetch_optional(&self.pool)
                .await?
                .unwrap_or(0),
        )
    }

    /// The oldest queued event after `after`.
    pub async fn webhook_next(&self, after: i64) -> Result<Option<Outbox>, PgError> {
        Ok(sqlx::query!(
            r#"SELECT id, node_id, to_state AS "to_state: State", body
                 FROM webhook_outbox WHERE id > $1 ORDER BY id LIMIT 1"#,
            after
        )
        .fetch_optional(&self.pool)
        .await?
        .map(|r| (r.id, r.node_id, r.to_state, r.body)))
    }

    /// Moves `url`'s cursor to `id` (never back).
    pub async fn webhook_advance(&self, url: &str, id: i64) -> Result<(), PgError> {
        sqlx::query!(
            "UPDATE webhook_cursors SET last_id = GREATEST(last_id, $1) WHERE url = $2",
            id,
            url
        )
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Deletes the events every cursor in `urls` is past, then, past `cap` rows, the
    /// oldest, moving the cursors still before them past them. For each URL: the
    /// count per state of the events dropped before it read them, and the events
    /// still waiting for it.
    pub async fn webhook_prune(
        &self,
        urls: &[&str],
        cap: i64,
    ) -> Result<Vec<(Vec<(String, i64)>, i64)>, PgError> {
        let mut tx = self.pool.begin().await?;
        // Taken in turn with any other pruner (another instance): the counts of what
        // was dropped are then each URL's own.
        sqlx::query!("LOCK TABLE webhook_cursors IN EXCLUSIVE MODE")
            .execute(&mut *tx)
            .await?;
        let mut cursors = Vec::with_capacity(urls.len());
        for url in urls {
            let c = sqlx::query_scalar!("SELECT last_id FROM webhook_cursors WHERE url = $1", url)
                .fetch_optional(&mut *tx)
                .await?
                .unwrap_or(0);
            cursors.push(c);
        }
        let done = cursors.iter().copied().min().unwrap_or(i64::MAX);
        sqlx::query!("DELETE FROM webhook_outbox WHERE id <= $1", done)
            .execute(&mut *tx)
            .await?;
        let rows = sqlx::query_scalar!(r#"SELECT COUNT(*) AS "n!" FROM webhook_outbox"#)
            .fetch_one(&mut *tx)
            .await?;
        let mut dropped = vec![Vec::new(); urls.len()];
        let excess = rows - cap;
        if excess > 0 {
            let cutoff = sqlx::query_scalar!(
                "SELECT id FROM webhook_outbox ORDER BY id LIMIT 1 OFFSET $1",
                excess - 1
            )
            .fetch_one(&mut *tx)
            .await?;
            for (i, url) in urls.iter().enumerate() {
                if cursors[i] >= cutoff {
                    continue;
                }
                dropped[i] = sqlx::query!(
                    r#"SELECT to_state, COUNT(*) AS "n!" FROM webhook_outbox
                        WHERE id > $1 AND id <= $2 GROUP BY to_state"#,
                    cursors[i],
                    cutoff
                )
                .fetch_all(&mut *tx)
                .await?
                .into_iter()
                .map(|r| (r.to_state, r.n))
                .collect();
                sqlx::query!(
                    "UPDATE webhook_cursors SET last_id = GREATEST(last_id, $1) WHERE url = $2",
                    cutoff,
                    url
                )
                .execute(&mut *tx)
                .await?;
                cursors[i] = cursors[i].max(cutoff);
            }
            sqlx::query!("DELETE FROM webhook_outbox WHERE id <= $1", cutoff)
                .execute(&mut *tx)
                .await?;
        }
        let mut out = Vec::with_capacity(urls.len());
        for (c, d) in cursors.iter().zip(dropped) {
            let n = sqlx::query_scalar!(
                r#"SELECT COUNT(*) AS "n!" FROM webhook_outbox WHERE id > $1"#,
                c
            )
            .fetch_one(&mut *tx)
            .await?;
            out.push((d, n));
        }
        tx.commit().await?;
        Ok(out)
    }

    /// All imported images, by name.
    pub async fn images(&self) -> Result<Vec<ImageRow>, PgError> {
        Ok(sqlx::query_as!(
            ImageRow,
            r#"SELECT name, family, definition, imported_at FROM images ORDER BY name COLLATE "C""#
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// One image.
    pub async fn image(&self, name: &str) -> Result<Option<ImageRow>, PgError> {
        Ok(sqlx::query_as!(
            ImageRow,
            "SELECT name, family, definition, imported_at FROM images WHERE name = $1",
            name
        )
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Inserts or replaces an image (imported at `at`).
    pub async fn put_image(
        &self,
        name: &str,
        family: &str,
        definition: &str,
        at: &str,
    ) -> Result<(), PgError> {
        sqlx::query!(
            "INSERT INTO images (name, family, definition, imported_at) VALUES ($1, $2, $3, $4)
             ON CONFLICT (name) DO UPDATE SET family = EXCLUDED.family,
               definition = EXCLUDED.definition, imported_at = EXCLUDED.imported_at",
            name,
            family,
            definition,
            at
        )
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Removes an image; false when there was none.
    pub async fn delete_image(&self, name: &str) -> Result<bool, PgError> {
        let r = sqlx::query!("DELETE FROM images WHERE name = $1", name)
            .execute(&self.pool)
            .await?;
        Ok(r.rows_affected() == 1)
    }
}

//! Imported images: the catalog definition plus what import verified (JSON).

use super::{Db, Store, StoreError};

pub use crate::model::rows::ImageRow;

impl Store {
    /// All imported images.
    pub async fn images(&self) -> Result<Vec<ImageRow>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.images().await?);
        }
        Ok(
            sqlx::query_as!(ImageRow, "SELECT * FROM images ORDER BY name")
                .fetch_all(self.pool()?)
                .await?,
        )
    }

    /// One image.
    pub async fn image(&self, name: &str) -> Result<Option<ImageRow>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.image(name).await?);
        }
        Ok(
            sqlx::query_as!(ImageRow, "SELECT * FROM images WHERE name = ?", name)
                .fetch_optional(self.pool()?)
                .await?,
        )
    }

    /// Inserts or replaces an image.
    pub async fn put_image(
        &self,
        name: &str,
        family: &str,
        definition: &str,
    ) -> Result<(), StoreError> {
        let at = super::nodes::now();
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.put_image(name, family, definition, &at).await?);
        }
        self.write_one(sqlx::query!(
            r#"INSERT INTO images (name, family, definition, imported_at) VALUES (?, ?, ?, ?)
               ON CONFLICT (name) DO UPDATE SET family = excluded.family,
                 definition = excluded.definition, imported_at = excluded.imported_at"#,
            name,
            family,
            definition,
            at
        ))
        .await?;
        Ok(())
    }

    /// Removes an image; false when there was none.
    pub async fn delete_image(&self, name: &str) -> Result<bool, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.delete_image(name).await?);
        }
        let r = self
            .write_one(sqlx::query!("DELETE FROM images WHERE name = ?", name))
            .await?;
        Ok(r.rows_affected() == 1)
    }
}

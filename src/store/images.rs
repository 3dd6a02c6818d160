//! Imported images: the catalog definition plus what import verified (JSON).

use serde::{Deserialize, Serialize};

use super::{Store, StoreError};

/// An imported image as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow)]
pub struct ImageRow {
    pub name: String,
    pub family: String,
    pub definition: String,
    pub imported_at: String,
}

impl Store {
    /// All imported images.
    pub async fn images(&self) -> Result<Vec<ImageRow>, StoreError> {
        Ok(
            sqlx::query_as!(ImageRow, "SELECT * FROM images ORDER BY name")
                .fetch_all(self.pool()?)
                .await?,
        )
    }

    /// One image.
    pub async fn image(&self, name: &str) -> Result<Option<ImageRow>, StoreError> {
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
        let r = self
            .write_one(sqlx::query!("DELETE FROM images WHERE name = ?", name))
            .await?;
        Ok(r.rows_affected() == 1)
    }
}

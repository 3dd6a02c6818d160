//! `GET /api/v1/leftovers` and `POST /api/v1/leftovers/{kind}/{subject}/resolve`: what
//! the periodic leftovers check found, and the one action that resolves each (see
//! [`crate::leftovers`]). Under the API's bearer token.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use serde::Serialize;

use super::error::ApiError;
use crate::leftovers::{Kind, Leftover, ResolveError};
use crate::state::AppState;

/// The answer of `GET /api/v1/leftovers`.
#[derive(Debug, Serialize)]
pub struct LeftoverList {
    /// When the check that found these ran (none before the first).
    pub checked_at: Option<String>,
    /// How many of each kind (every kind listed).
    pub counts: BTreeMap<&'static str, usize>,
    pub leftovers: Vec<Leftover>,
}

/// `GET /api/v1/leftovers`.
pub async fn list(State(st): State<Arc<AppState>>) -> Json<LeftoverList> {
    let (leftovers, checked_at) = st.leftovers.list();
    let counts = Kind::ALL
        .into_iter()
        .map(|k| (k.as_str(), leftovers.iter().filter(|l| l.kind == k).count()))
        .collect();
    Json(LeftoverList {
        checked_at,
        counts,
        leftovers,
    })
}

/// The answer of a resolve.
#[derive(Debug, Serialize)]
pub struct Resolved {
    pub kind: Kind,
    pub subject: String,
    /// What was done, in words.
    pub done: String,
}

/// `POST /api/v1/leftovers/{kind}/{subject}/resolve`.
pub async fn resolve(
    State(st): State<Arc<AppState>>,
    Path((kind, subject)): Path<(String, String)>,
) -> Result<Json<Resolved>, ApiError> {
    let k = Kind::parse(&kind).ok_or_else(|| {
        let kinds: Vec<&str> = Kind::ALL.iter().map(|k| k.as_str()).collect();
        ApiError::not_found(format!("leftover kind {kind} ({})", kinds.join(", ")))
    })?;
    match st.leftovers.resolve(&st, k, &subject, "api").await {
        Ok(done) => Ok(Json(Resolved {
            kind: k,
            subject,
            done,
        })),
        Err(e @ ResolveError::NotFound { .. }) => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("{e} (in the last check; GET /api/v1/leftovers)"),
        )),
        Err(ResolveError::Store(e)) => Err(e.into()),
        Err(e @ ResolveError::Bmc(_)) => Err(ApiError::new(
            StatusCode::BAD_GATEWAY,
            "bmc_failed",
            e.to_string(),
        )),
    }
}

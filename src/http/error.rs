//! JSON errors `{error, detail}` with the right status, and a JSON body extractor whose
//! rejections are JSON too.

use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;

use crate::lifecycle::apply::ApplyError;
use crate::lifecycle::transition::{TransitionError, a_node_in, operator_actions, operator_verb};
use crate::store::StoreError;

/// An API error: a status, a short machine-readable code and a human reason.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub error: &'static str,
    pub detail: String,
}

impl ApiError {
    /// A new error.
    pub fn new(status: StatusCode, error: &'static str, detail: impl Into<String>) -> Self {
        ApiError {
            status,
            error,
            detail: detail.into(),
        }
    }
    /// 404.
    pub fn not_found(what: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("{what} not found"),
        )
    }
    /// 400.
    pub fn bad_request(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", detail)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "error": self.error, "detail": self.detail });
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            // The database away, a shutdown: installers, agents and hooks that honour
            // it come back when pxed (or another instance) may answer.
            let retry = [(axum::http::header::RETRY_AFTER, "5")];
            return (self.status, retry, axum::Json(body)).into_response();
        }
        (self.status, axum::Json(body)).into_response()
    }
}

impl From<crate::provision::ProvisionError> for ApiError {
    fn from(e: crate::provision::ProvisionError) -> Self {
        match e {
            crate::provision::ProvisionError::Store(s) => s.into(),
            e if e.is_not_found() => {
                ApiError::new(StatusCode::NOT_FOUND, "not_found", e.to_string())
            }
            e => {
                tracing::error!(error = %e, "provisioning");
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "provision",
                    e.to_string(),
                )
            }
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        if let StoreError::Db(sqlx::Error::Database(d)) = &e
            && d.is_unique_violation()
        {
            return ApiError::new(StatusCode::CONFLICT, "conflict", d.message().to_string());
        }
        if e.is_unavailable() {
            tracing::warn!(error = %e, "store unavailable: request refused");
            return ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store_unavailable",
                "the database is unreachable (see /healthz): nothing was stored; send the request again",
            );
        }
        tracing::error!(error = %e, "store error");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "database error (see the server log)",
        )
    }
}

impl From<ApplyError> for ApiError {
    fn from(e: ApplyError) -> Self {
        match e {
            ApplyError::NotFound(id) => ApiError::not_found(format!("node {id}")),
            ApplyError::Conflict(_) => {
                ApiError::new(StatusCode::CONFLICT, "conflict", e.to_string())
            }
            ApplyError::Transition(t) => t.into(),
            ApplyError::Store(s) => s.into(),
        }
    }
}

impl From<TransitionError> for ApiError {
    fn from(t: TransitionError) -> Self {
        match t {
            TransitionError::StaleGeneration { .. } => {
                ApiError::new(StatusCode::FORBIDDEN, "stale_token", t.to_string())
            }
            // The API fills in `default_image` before the transition sees the
            // request, so reaching here means none is set either: say what to do.
            TransitionError::NoImage => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "no_image",
                format!(
                    "{t}, and no default_image is configured: name one with `image` \
                     (the CLI's --image; `pxed image list` shows the imported ones)"
                ),
            ),
            // An operator's action the state refuses: say what the state allows.
            TransitionError::NotAllowed { state, event } => {
                let detail = match operator_verb(event) {
                    Some(verb) => {
                        let node = a_node_in(state);
                        format!(
                            "cannot {verb} {node} ({node} can: {})",
                            operator_actions(state).join(", ")
                        )
                    }
                    None => t.to_string(),
                };
                ApiError::new(StatusCode::CONFLICT, "invalid_state", detail)
            }
            _ => ApiError::new(StatusCode::CONFLICT, "invalid_state", t.to_string()),
        }
    }
}

/// `Json<T>` whose failures (bad syntax, wrong fields, wrong content type, too large)
/// are JSON errors.
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match axum::Json::<T>::from_request(req, state).await {
            Ok(axum::Json(v)) => Ok(JsonBody(v)),
            Err(r) => {
                let status = r.status();
                let code = if status == StatusCode::PAYLOAD_TOO_LARGE {
                    "too_large"
                } else {
                    "bad_request"
                };
                Err(ApiError::new(status, code, r.body_text()))
            }
        }
    }
}

/// `Query<T>` whose failures (unknown parameter, bad value) are JSON errors (400).
pub struct QueryParams<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for QueryParams<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(v)) => Ok(QueryParams(v)),
            Err(r) => Err(ApiError::new(r.status(), "bad_request", r.body_text())),
        }
    }
}

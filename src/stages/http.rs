//! HTTP transfers as stages: iPXE binaries (first stage over HTTP), an image's kernel
//! and initrd. A response body is wrapped to count its bytes; the sighting is queued
//! when the whole body has been sent.

use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use hyper::body::{Frame, SizeHint};

use super::{Sighting, Stages, Who, http_stage};
use crate::model::Stage;
use crate::state::AppState;

/// Middleware: tracks successful GETs of the files [`http_stage`] names.
pub async fn track(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    // Inside `nest_service` the URI has lost its prefix; the original has it.
    let path = req
        .extensions()
        .get::<axum::extract::OriginalUri>()
        .map_or_else(|| req.uri().path().to_string(), |u| u.path().to_string());
    let Some(stage) = http_stage(&path) else {
        return next.run(req).await;
    };
    let client = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| crate::credential::canonical(c.0.ip()));
    let is_get = req.method() == axum::http::Method::GET;
    let file = path;
    let began = Instant::now();
    let resp = next.run(req).await;
    let (Some(client), true, true) = (client, is_get, resp.status().is_success()) else {
        return resp;
    };
    let (parts, body) = resp.into_parts();
    // hyper stops polling a body once Content-Length bytes are out: the length says
    // when it was sent whole.
    let exact = hyper::body::Body::size_hint(&body).exact().or_else(|| {
        parts
            .headers
            .get(axum::http::header::CONTENT_LENGTH)?
            .to_str()
            .ok()?
            .parse()
            .ok()
    });
    let body = Tracked {
        inner: body,
        bytes: 0,
        exact,
        ended: false,
        report: Some(Report {
            stages: st.stages.clone(),
            client,
            stage,
            file,
            began,
        }),
    };
    Response::from_parts(parts, Body::new(body))
}

struct Report {
    stages: Arc<Stages>,
    client: IpAddr,
    stage: Stage,
    file: String,
    began: Instant,
}

/// A response body that reports itself once sent whole.
struct Tracked {
    inner: Body,
    bytes: u64,
    exact: Option<u64>,
    ended: bool,
    report: Option<Report>,
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        match &r {
            Poll::Ready(Some(Ok(f))) => {
                if let Some(d) = f.data_ref() {
                    this.bytes += d.len() as u64;
                }
            }
            Poll::Ready(None) => this.ended = true,
            _ => {}
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let whole = self.ended || self.exact == Some(self.bytes);
        if let (true, Some(r)) = (whole, self.report.take()) {
            sighting(&r.stages, r.client, r.stage, &r.file, self.bytes, r.began);
        }
    }
}

fn sighting(stages: &Stages, client: IpAddr, stage: Stage, file: &str, bytes: u64, began: Instant) {
    let mut s = Sighting::now(Who::Ip(client), stage).detail(format!("http {file}"));
    s.bytes = Some(bytes);
    s.took = Some(began.elapsed());
    stages.saw(s);
}

/// Records a file sent whole outside hyper (`http::sendfile`), if `path` is a stage.
pub fn saw_file(stages: &Stages, client: IpAddr, path: &str, bytes: u64, began: Instant) {
    if let Some(stage) = http_stage(path) {
        sighting(stages, client, stage, path, bytes, began);
    }
}

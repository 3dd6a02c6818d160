//! The status page in a real browser (headless Chromium) and its live event stream.

use std::process::Command;
use std::time::Duration;

use serde_json::json;

use crate::common::{Daemon, run};

const TOKEN: &str = "status-token";

fn api(d: &Daemon, method: &str, path: &str, body: serde_json::Value) -> serde_json::Value {
    let (ok, out, err) = run(Command::new("curl").args([
        "-sSf",
        "-X",
        method,
        "-H",
        &format!("Authorization: Bearer {TOKEN}"),
        "-H",
        "Content-Type: application/json",
        "-d",
        &body.to_string(),
        &d.url(path),
    ]));
    assert!(ok, "{method} {path}: {out}{err}");
    serde_json::from_str(&out).unwrap_or_default()
}

/// The page as served, before any script runs: the board is complete without
/// JavaScript (the browser tests in board.rs cover what the scripts add).
fn fetch_html(url: &str) -> String {
    let (ok, out, err) = run(Command::new("curl").args(["-sSf", url]));
    assert!(ok, "curl {url}: {err}");
    out
}

#[test]
fn status_page_shows_where_each_node_is_and_why_it_failed() {
    let d = Daemon::start_in(
        tempfile::tempdir().unwrap(),
        &[],
        &[("PXED_API_TOKEN", TOKEN)],
    );
    api(
        &d,
        "POST",
        "/api/v1/nodes",
        json!({"macs": ["52:54:00:00:30:01"], "name": "gh200-a", "arch": "arm64",
               "labels": {"rack": "r7"},
               "bmc": {"driver": "redfish", "address": "http://127.0.0.1:9", "username": "u", "password": "bmc-pw-never-shown"}}),
    );
    let b = api(
        &d,
        "POST",
        "/api/v1/nodes",
        json!({"macs": ["52:54:00:00:30:02"], "name": "x86-b"}),
    );
    api(
        &d,
        "POST",
        &format!("/api/v1/nodes/{}/actions/fail", b["id"]),
        json!({"reason": "disk 2 SMART errors"}),
    );

    let dom = fetch_html(&d.url("/"));
    let row_b = dom
        .split("<tr ")
        .find(|r| r.contains("x86-b"))
        .expect("row for x86-b");
    assert!(row_b.contains("data-state=\"failed\""), "{row_b}");
    assert!(
        row_b.contains("while available: disk 2 SMART errors"),
        "{row_b}"
    );
    assert!(row_b.contains(" s</span>"), "time in stage: {row_b}");
    let row_a = dom.split("<tr ").find(|r| r.contains("gh200-a")).unwrap();
    assert!(
        row_a.contains("data-state=\"available\"")
            && row_a.contains("arm64")
            && row_a.contains("rack=r7"),
        "{row_a}"
    );
    assert!(!dom.contains("bmc-pw-never-shown"));

    // Filtered by state (the counts link there), by label, and paged.
    let dom = fetch_html(&d.url("/?state=failed"));
    assert!(dom.contains("x86-b") && !dom.contains("gh200-a"), "{dom}");
    assert!(dom.contains("in state failed"), "{dom}");
    assert!(dom.contains("href=\"/?state=available\""), "{dom}");
    let dom = fetch_html(&d.url("/?label=rack%3Dr7"));
    assert!(dom.contains("gh200-a") && !dom.contains(">x86-b<"), "{dom}");
    let dom = fetch_html(&d.url("/?limit=1"));
    assert!(dom.contains("gh200-a") && !dom.contains(">x86-b<"), "{dom}");
    assert!(
        dom.contains("href=\"/?after=1&#38;limit=1\">next page"),
        "{dom}"
    );
    // A filter's next page keeps the filter.
    let dom = fetch_html(&d.url("/?limit=1&q=52%3A54"));
    assert!(
        dom.contains("href=\"/?after=1&#38;limit=1&#38;q=52%3A54\">next page"),
        "{dom}"
    );
    // The same filters on the API.
    let (ok, out, _) = run(Command::new("curl").args([
        "-sSf",
        "-H",
        &format!("Authorization: Bearer {TOKEN}"),
        &d.url("/api/v1/nodes?arch=arm64&q=gh200"),
    ]));
    assert!(ok);
    let listed: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(listed[0]["name"], "gh200-a");

    // The node timeline.
    let dom = fetch_html(&d.url(&format!("/nodes/{}", b["id"])));
    assert!(dom.contains("<title>pxed: x86-b</title>"), "{dom}");
    assert!(dom.contains("marked_failed"), "{dom}");
    assert!(
        dom.contains("failed — while available: disk 2 SMART errors"),
        "{dom}"
    );
    // No image yet and no default_image: the page says a reinstall must name one.
    assert!(
        dom.contains("none yet <span class=\"muted\">(a reinstall must name an image: no default_image is configured)"),
        "{dom}"
    );
    // What the wire saw words the failure the same way (the stage recorder writes it
    // a moment after the transition).
    let wire = crate::common::wait_for(
        "the failed stage on the node page",
        std::time::Duration::from_secs(10),
        || {
            let (_, page, _) =
                run(Command::new("curl").args(["-sS", &d.url(&format!("/nodes/{}", b["id"]))]));
            let wire = &page[page.find("seen on the wire").expect("wire section")..];
            let wire = &wire[..wire.find("<h2>").unwrap_or(wire.len())];
            wire.contains("<td>failed</td>").then(|| wire.to_string())
        },
    );
    assert!(
        wire.contains("while available: disk 2 SMART errors"),
        "{wire}"
    );
    // The same page by name and by MAC (what a technician reads off the machine).
    for by in ["x86-b", "52-54-00-00-30-02"] {
        let page = fetch_html(&d.url(&format!("/nodes/{by}")));
        assert!(page.contains("<title>pxed: x86-b</title>"), "{by}: {page}");
    }
    // No such node: a 404 page for the browser, not a parser's message.
    let (ok, out, _) = run(Command::new("curl").args([
        "-s",
        "-w",
        "%{http_code} %{content_type}",
        &d.url("/nodes/nosuch"),
    ]));
    assert!(ok);
    assert!(out.ends_with("404 text/html; charset=utf-8"), "{out}");
    assert!(
        out.contains("No node has that id, name, hostname or MAC"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn events_stream_every_change() {
    let d = Daemon::start_in(
        tempfile::tempdir().unwrap(),
        &[],
        &[("PXED_API_TOKEN", TOKEN)],
    );
    let n = api(
        &d,
        "POST",
        "/api/v1/nodes",
        json!({"macs": ["52:54:00:00:30:03"]}),
    );
    pxed::net::install_crypto_provider();
    let resp = reqwest::get(d.url("/events")).await.unwrap();
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    let mut resp = resp;
    api(
        &d,
        "POST",
        &format!("/api/v1/nodes/{}/actions/quarantine", n["id"]),
        json!({"reason": "GPU fell off the bus"}),
    );
    let mut seen = String::new();
    let got = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(chunk) = resp.chunk().await.unwrap() {
            seen.push_str(&String::from_utf8_lossy(&chunk));
            if seen.contains("quarantined") {
                return;
            }
        }
    })
    .await;
    assert!(got.is_ok(), "no event: {seen}");
    assert!(seen.contains("event: node"), "{seen}");
    assert!(seen.contains(&format!("\"node_id\":{}", n["id"])), "{seen}");
}

/// Outside the demo the board lists nothing without a credential: the API token as a
/// bearer token, or once in the URL, which trades it for a read-only viewer cookie
/// (it used to serve every node's MACs and state to anyone on the VLAN).
#[tokio::test]
async fn the_board_needs_a_credential_unless_opened() {
    let d = Daemon::start_in(
        tempfile::tempdir().unwrap(),
        &[],
        &[("PXED_API_TOKEN", TOKEN), ("PXED_STATUS_PUBLIC", "false")],
    );
    pxed::net::install_crypto_provider();
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    for path in ["/", "/status.json", "/events", "/nodes/1"] {
        let r = http.get(d.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 401, "{path}");
        let body = r.text().await.unwrap();
        assert!(body.contains("needs the API token"), "{path}: {body}");
    }
    let r = http
        .get(d.url("/status.json"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = http.get(d.url("/?token=wrong")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = http
        .get(d.url(&format!("/?token={TOKEN}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 303);
    assert_eq!(r.headers()["location"], "/");
    let cookie = r.headers()["set-cookie"].to_str().unwrap().to_string();
    assert!(
        cookie.contains("HttpOnly") && !cookie.contains(TOKEN),
        "{cookie}"
    );
    let pair = cookie.split(';').next().unwrap().to_string();
    let r = http
        .get(d.url("/status.json"))
        .header("cookie", &pair)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // The viewer cookie is not an API credential.
    let value = pair.split('=').nth(1).unwrap();
    let r = http
        .get(d.url("/api/v1/nodes"))
        .bearer_auth(value)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
}

/// Status-page streams are bounded: beyond the cap a new one gets a JSON 503 while
/// the snapshot still answers, and a closed stream frees its slot.
#[tokio::test]
async fn event_streams_are_bounded() {
    use std::io::{Read, Write};
    let d = Daemon::start(&[]);
    let open = || {
        let mut c = std::net::TcpStream::connect(&d.http).unwrap();
        c.write_all(b"GET /events HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n")
            .unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut head = [0u8; 64];
        let n = c.read(&mut head).unwrap();
        (c, String::from_utf8_lossy(&head[..n]).to_string())
    };
    let mut streams = Vec::new();
    for _ in 0..pxed::http::status::MAX_SUBSCRIBERS {
        let (c, head) = open();
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        streams.push(c);
    }
    let (_, head) = open();
    assert!(head.starts_with("HTTP/1.1 503"), "{head}");
    let (ok, body, _) =
        crate::common::run(Command::new("curl").args(["-sf", &d.url("/status.json")]));
    assert!(ok && body.contains("\"nodes\""), "{body}");
    drop(streams.pop());
    let freed = crate::common::poll_blocking(Duration::from_secs(5), || {
        let (c, head) = open();
        head.starts_with("HTTP/1.1 200").then_some(c)
    });
    assert!(freed.is_some(), "a closed stream did not free its slot");
}

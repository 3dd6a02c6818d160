//! Redfish driver: hand-written calls over reqwest + rustls (ring), serde_json bodies.
//!
//! Only fields the system advertises are written: BMCs differ in what they require and
//! what they reject, and many answer 2xx to a PATCH they then ignore, so every write is
//! read back.

use std::collections::BTreeSet;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use reqwest::{Method, StatusCode};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct as Signed, SignatureScheme};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::inventory::Inventory;
use crate::inventory::redfish::{Resources, from_resources};

use super::{
    BmcEndpoint, BmcError, BootMode, BootOverride, BootTarget, CallPolicy, CheckReport,
    Credentials, Driver, NextBoot, OverrideEnabled, PowerState, ReadBack, Secret, Step, TlsPolicy,
    await_power, observe_restart, set_until_read_back, with_retries,
};

const D: Driver = Driver::Redfish;

/// Normalizes a certificate fingerprint to lowercase hex without separators.
pub fn normalize_fingerprint(s: &str) -> String {
    s.chars()
        .filter(|c| c.is_ascii_hexdigit())
        .collect::<String>()
        .to_ascii_lowercase()
}

/// SHA-256 of a DER certificate, lowercase hex.
pub fn fingerprint(der: &[u8]) -> String {
    hex::encode(Sha256::digest(der))
}

/// Records the leaf certificate's fingerprint and enforces the pin. The handshake
/// signature is still verified against the presented key, so a pinned certificate
/// proves the peer holds its private key.
#[derive(Debug)]
struct PinVerifier {
    pinned: Option<String>,
    seen: Arc<Mutex<Option<String>>>,
    algs: WebPkiSupportedAlgorithms,
}

type Verified = Result<HandshakeSignatureValid, rustls::Error>;

impl ServerCertVerifier for PinVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let fp = fingerprint(end_entity.as_ref());
        *self.seen.lock().unwrap_or_else(|e| e.into_inner()) = Some(fp.clone());
        match &self.pinned {
            Some(p) if *p != fp => Err(rustls::Error::General(
                "BMC certificate does not match the pinned fingerprint".into(),
            )),
            _ => Ok(ServerCertVerified::assertion()),
        }
    }

    fn verify_tls12_signature(&self, m: &[u8], c: &CertificateDer<'_>, d: &Signed) -> Verified {
        rustls::crypto::verify_tls12_signature(m, c, d, &self.algs)
    }

    fn verify_tls13_signature(&self, m: &[u8], c: &CertificateDer<'_>, d: &Signed) -> Verified {
        rustls::crypto::verify_tls13_signature(m, c, d, &self.algs)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algs.supported_schemes()
    }
}

#[derive(Clone)]
enum Auth {
    Basic,
    Session {
        token: Secret,
        location: Option<String>,
    },
}

struct Resp {
    etag: Option<String>,
    body: Value,
}

/// One Redfish request, before authentication is added.
struct Req<'a> {
    step: Step,
    method: Method,
    path: &'a str,
    body: Option<&'a Value>,
    if_match: Option<&'a str>,
}

impl<'a> Req<'a> {
    fn new(step: Step, method: Method, path: &'a str) -> Self {
        Req {
            step,
            method,
            path,
            body: None,
            if_match: None,
        }
    }
}

/// Redfish BMC driver. Build it with [`super::connect`].
pub struct RedfishBmc {
    base: String,
    username: String,
    password: Secret,
    system_id: Option<String>,
    match_mac: Option<String>,
    match_uuid: Option<String>,
    pinned: Option<String>,
    insecure: bool,
    policy: CallPolicy,
    client: reqwest::Client,
    seen_fp: Arc<Mutex<Option<String>>>,
    auth: tokio::sync::Mutex<Option<Auth>>,
    system: tokio::sync::OnceCell<String>,
    /// The system as `find_system` read it to check the configured id: the next read
    /// of that path takes it instead of asking the BMC again; any other request in
    /// between drops it (see [`RedfishBmc::get`]).
    fresh: Mutex<Option<Resp>>,
    /// `Manufacturer Model, BIOS BiosVersion`, from the read that checked the system or
    /// the first `model` call (none of the three changes while pxed talks to the BMC).
    model: Mutex<Option<String>>,
    /// Kept by a [`super::pool::Pool`]: `close` ends the step, not the session (the
    /// pool logs out when the driver goes idle).
    pooled: bool,
}

impl fmt::Debug for RedfishBmc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedfishBmc")
            .field("base", &self.base)
            .field("username", &self.username)
            .field("password", &self.password)
            .field("system", &self.system.get())
            .field("pinned", &self.pinned)
            .field("insecure", &self.insecure)
            .finish_non_exhaustive()
    }
}

/// `redfish: Manufacturer Model, BIOS BiosVersion` of a ComputerSystem resource.
fn model_of(sys: &Value) -> String {
    let field = |k: &str| sys[k].as_str().unwrap_or("?").trim().to_string();
    format!(
        "redfish: {} {}, BIOS {}",
        field("Manufacturer"),
        field("Model"),
        field("BiosVersion")
    )
}

/// The BMC's own message from a Redfish error body, else the raw text (truncated).
fn bmc_message(body: &str) -> String {
    if let Ok(v) = serde_json::from_str::<Value>(body) {
        let e = &v["error"];
        let mut parts = vec![];
        if let Some(m) = e["message"].as_str() {
            parts.push(m.to_string());
        }
        if let Some(list) = e["@Message.ExtendedInfo"].as_array() {
            for i in list {
                if let Some(m) = i["Message"].as_str() {
                    parts.push(m.to_string());
                }
            }
        }
        if !parts.is_empty() {
            return parts.join("; ");
        }
    }
    body.chars().take(300).collect()
}

fn strings(v: &Value) -> Option<Vec<String>> {
    v.as_array().map(|a| {
        a.iter()
            .filter_map(|x| x.as_str().map(String::from))
            .collect()
    })
}

/// A field Redfish did not send, in the place of its value.
const NOT_REPORTED: &str = "(not reported)";

fn parse_power(v: &Value) -> PowerState {
    PowerState::from_name(v["PowerState"].as_str().unwrap_or(NOT_REPORTED))
}

fn parse_boot(v: &Value) -> BootOverride {
    let b = &v["Boot"];
    BootOverride {
        target: b["BootSourceOverrideTarget"]
            .as_str()
            .unwrap_or(NOT_REPORTED)
            .into(),
        enabled: OverrideEnabled::from_name(
            b["BootSourceOverrideEnabled"]
                .as_str()
                .unwrap_or(NOT_REPORTED),
        ),
        mode: match b["BootSourceOverrideMode"].as_str() {
            Some("UEFI") => Some(BootMode::Uefi),
            Some("Legacy") => Some(BootMode::Legacy),
            _ => None,
        },
        http_uri: b["HttpBootUri"].as_str().map(String::from),
    }
}

fn mode_name(m: BootMode) -> &'static str {
    match m {
        BootMode::Uefi => "UEFI",
        BootMode::Legacy => "Legacy",
    }
}

/// Builds the PATCH body from what the system advertises. Pure, so it is unit-tested.
fn boot_patch(system: &Value, next: &NextBoot) -> Result<(Value, Vec<String>), BmcError> {
    boot_patch_with(system, next, false)
}

/// [`boot_patch`]; `force_mode` writes `BootSourceOverrideMode` even where the system
/// does not show the field (firmware that boots legacy or the disk unless told).
fn boot_patch_with(
    system: &Value,
    next: &NextBoot,
    force_mode: bool,
) -> Result<(Value, Vec<String>), BmcError> {
    let boot = system
        .get("Boot")
        .filter(|b| b.is_object())
        .ok_or(BmcError::NotSupported {
            driver: D,
            step: Step::SetBoot,
            what: "boot override (the system has no Boot object)".into(),
        })?;
    let mut notes = vec![];
    let target = match next.target {
        BootTarget::Pxe => "Pxe",
        BootTarget::UefiHttp { .. } => "UefiHttp",
    };
    match strings(&boot["BootSourceOverrideTarget@Redfish.AllowableValues"]) {
        Some(allowed) if !allowed.iter().any(|a| a == target) => {
            return Err(BmcError::NotSupported {
                driver: D,
                step: Step::SetBoot,
                what: format!("boot target {target} (offers: {})", allowed.join(", ")),
            });
        }
        Some(_) => {}
        None => notes.push("BootSourceOverrideTarget allowable values not advertised".into()),
    }
    let mut b = serde_json::Map::new();
    b.insert("BootSourceOverrideTarget".into(), json!(target));
    b.insert(
        "BootSourceOverrideEnabled".into(),
        json!(if next.once { "Once" } else { "Continuous" }),
    );
    if boot.get("BootSourceOverrideMode").is_some() {
        let mode = mode_name(next.mode);
        if let Some(allowed) = strings(&boot["BootSourceOverrideMode@Redfish.AllowableValues"])
            && !allowed.iter().any(|a| a == mode)
        {
            return Err(BmcError::NotSupported {
                driver: D,
                step: Step::SetBoot,
                what: format!("boot mode {mode} (offers: {})", allowed.join(", ")),
            });
        }
        b.insert("BootSourceOverrideMode".into(), json!(mode));
    } else if force_mode {
        b.insert("BootSourceOverrideMode".into(), json!(mode_name(next.mode)));
        notes.push("BootSourceOverrideMode not shown: written anyway".into());
    } else {
        notes.push("no BootSourceOverrideMode: firmware picks the mode".into());
    }
    if let BootTarget::UefiHttp { url } = &next.target {
        if boot.get("HttpBootUri").is_some() {
            b.insert("HttpBootUri".into(), json!(url));
        } else {
            notes.push("no HttpBootUri: the firmware takes the URL from DHCP".into());
        }
    }
    Ok((json!({ "Boot": Value::Object(b) }), notes))
}

/// The PATCH bodies that clear a network boot override, in the order tried.
fn clear_patches() -> [Value; 2] {
    [
        json!({ "Boot": { "BootSourceOverrideEnabled": "Disabled" } }),
        json!({ "Boot": { "BootSourceOverrideEnabled": "Disabled", "BootSourceOverrideTarget": "Hdd" } }),
    ]
}

/// Whether the read-back matches what was written (see `set_next_boot`).
fn override_matches(patch: &Value, got: &BootOverride) -> bool {
    let b = &patch["Boot"];
    if b["BootSourceOverrideTarget"].as_str() != Some(got.target.as_str()) {
        return false;
    }
    // sushy (and some vendors) report Once as Continuous: anything but Disabled counts.
    if got.enabled == OverrideEnabled::Disabled {
        return false;
    }
    if let Some(m) = b["BootSourceOverrideMode"].as_str()
        && got.mode.map(mode_name) != Some(m)
    {
        return false;
    }
    if let Some(u) = b["HttpBootUri"].as_str()
        && got.http_uri.as_deref() != Some(u)
    {
        return false;
    }
    true
}

impl RedfishBmc {
    /// Builds the HTTP client; no I/O.
    pub fn new(ep: &BmcEndpoint) -> Result<Self, BmcError> {
        let base = if ep.address.contains("://") {
            ep.address.trim_end_matches('/').to_string()
        } else {
            format!("https://{}", ep.address.trim_end_matches('/'))
        };
        let (pinned, insecure) = match &ep.tls {
            TlsPolicy::Pinned(p) => (p.as_deref().map(normalize_fingerprint), false),
            TlsPolicy::Insecure => (None, true),
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let seen_fp = Arc::new(Mutex::new(None));
        let verifier = PinVerifier {
            pinned: pinned.clone(),
            seen: seen_fp.clone(),
            algs: provider.signature_verification_algorithms,
        };
        let proto_err = |m: String| BmcError::Protocol {
            driver: D,
            step: Step::Connect,
            status: None,
            message: m,
        };
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| proto_err(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth();
        let client = reqwest::Client::builder()
            .connect_timeout(ep.policy.request_timeout)
            .timeout(ep.policy.request_timeout)
            .no_proxy()
            .tls_backend_preconfigured(tls)
            .build()
            .map_err(|e| proto_err(crate::error_chain(&e)))?;
        if insecure && base.starts_with("https://") {
            tracing::warn!(bmc = %base, "TLS verification disabled for this BMC (insecure opt-out)");
        }
        Ok(RedfishBmc {
            base,
            username: ep.username.clone(),
            password: ep.password.clone(),
            system_id: ep.system_id.clone(),
            match_mac: ep.match_mac.clone(),
            match_uuid: ep.match_uuid.clone(),
            pinned,
            insecure,
            policy: ep.policy.clone(),
            client,
            seen_fp,
            auth: tokio::sync::Mutex::new(None),
            system: tokio::sync::OnceCell::new(),
            fresh: Mutex::new(None),
            model: Mutex::new(None),
            pooled: false,
        })
    }

    /// This driver as a [`super::pool::Pool`] keeps it.
    pub(crate) fn pooled(mut self) -> Self {
        self.pooled = true;
        self
    }

    fn seen(&self) -> Option<String> {
        self.seen_fp
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn send_error(&self, step: Step, e: reqwest::Error) -> BmcError {
        if let (Some(p), Some(s)) = (&self.pinned, self.seen())
            && *p != s
        {
            return BmcError::CertificateMismatch {
                driver: D,
                pinned: p.clone(),
                presented: s,
            };
        }
        if e.is_timeout() {
            BmcError::Timeout {
                driver: D,
                step,
                after: self.policy.request_timeout,
            }
        } else if e.is_connect() {
            BmcError::Unreachable {
                driver: D,
                step,
                address: self.base.clone(),
                message: crate::error_chain(&e),
            }
        } else {
            BmcError::Protocol {
                driver: D,
                step,
                status: None,
                message: crate::error_chain(&e),
            }
        }
    }

    fn url(&self, path: &str) -> String {
        if path.starts_with("http://") || path.starts_with("https://") {
            path.to_string()
        } else {
            format!("{}{}", self.base, path)
        }
    }

    /// One raw exchange with the given auth; non-2xx becomes a typed error.
    async fn exchange(&self, req: &Req<'_>, auth: &Auth) -> Result<Resp, BmcError> {
        let step = req.step;
        let mut rb = self
            .client
            .request(req.method.clone(), self.url(req.path))
            .header("Accept", "application/json");
        rb = match auth {
            Auth::Basic => rb.basic_auth(&self.username, Some(self.password.expose())),
            Auth::Session { token, .. } => rb.header("X-Auth-Token", token.expose()),
        };
        if let Some(b) = req.body {
            rb = rb.json(b);
        }
        if let Some(t) = req.if_match {
            rb = rb.header("If-Match", t);
        }
        let resp = rb.send().await.map_err(|e| self.send_error(step, e))?;
        let status = resp.status();
        let headers = resp.headers().clone();
        let text = resp.text().await.map_err(|e| self.send_error(step, e))?;
        if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
            return Err(BmcError::AuthRefused {
                driver: D,
                step,
                message: format!("HTTP {}: {}", status.as_u16(), bmc_message(&text)),
            });
        }
        if !status.is_success() {
            return Err(BmcError::Protocol {
                driver: D,
                step,
                status: Some(status.as_u16()),
                message: bmc_message(&text),
            });
        }
        let body = if text.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).map_err(|e| BmcError::Protocol {
                driver: D,
                step,
                status: Some(status.as_u16()),
                message: format!("response is not JSON: {e}"),
            })?
        };
        let etag = headers
            .get("ETag")
            .and_then(|v| v.to_str().ok())
            .map(String::from);
        Ok(Resp { etag, body })
    }

    /// Opens a session where the service has a SessionService, else uses basic auth.
    async fn login(&self) -> Result<Auth, BmcError> {
        // The service root is readable without credentials on conforming BMCs; basic
        // auth is sent anyway for those (like sushy with an auth file) that protect it.
        let root = self
            .exchange(
                &Req::new(Step::Login, Method::GET, "/redfish/v1/"),
                &Auth::Basic,
            )
            .await?
            .body;
        let sessions = root["Links"]["Sessions"]["@odata.id"]
            .as_str()
            .map(String::from)
            .or_else(|| {
                root["SessionService"]["@odata.id"]
                    .as_str()
                    .map(|s| format!("{}/Sessions", s.trim_end_matches('/')))
            });
        let Some(sessions) = sessions else {
            tracing::debug!(bmc = %self.base, "no SessionService, using basic auth");
            return Ok(Auth::Basic);
        };
        let body = json!({"UserName": self.username, "Password": self.password.expose()});
        let resp = self
            .client
            .post(self.url(&sessions))
            .json(&body)
            .send()
            .await
            .map_err(|e| self.send_error(Step::Login, e))?;
        let status = resp.status();
        if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
            let text = resp.text().await.unwrap_or_default();
            return Err(BmcError::AuthRefused {
                driver: D,
                step: Step::Login,
                message: format!("HTTP {}: {}", status.as_u16(), bmc_message(&text)),
            });
        }
        if !status.is_success() {
            tracing::warn!(bmc = %self.base, status = status.as_u16(), "session login refused, falling back to basic auth");
            return Ok(Auth::Basic);
        }
        let token = resp
            .headers()
            .get("X-Auth-Token")
            .and_then(|v| v.to_str().ok())
            .map(String::from);
        let location = resp
            .headers()
            .get("Location")
            .and_then(|v| v.to_str().ok())
            .map(String::from);
        match token {
            Some(t) => Ok(Auth::Session {
                token: Secret::new(t),
                location,
            }),
            None => Err(BmcError::Protocol {
                driver: D,
                step: Step::Login,
                status: Some(status.as_u16()),
                message: "session created without an X-Auth-Token header".into(),
            }),
        }
    }

    async fn auth(&self) -> Result<Auth, BmcError> {
        let mut g = self.auth.lock().await;
        if let Some(a) = &*g {
            return Ok(a.clone());
        }
        let a = self.login().await?;
        *g = Some(a.clone());
        Ok(a)
    }

    /// One request, retried per the call policy; on each attempt an expired session is
    /// re-opened once.
    async fn call(&self, req: Req<'_>) -> Result<Resp, BmcError> {
        if req.method != Method::GET {
            // What was read before a change is not what a read after it would find.
            self.fresh.lock().unwrap_or_else(|e| e.into_inner()).take();
        }
        let req = &req;
        with_retries(&self.policy, D, req.step, || async move {
            let auth = self.auth().await?;
            match self.exchange(req, &auth).await {
                Err(BmcError::AuthRefused { .. }) if matches!(auth, Auth::Session { .. }) => {
                    *self.auth.lock().await = None;
                    self.exchange(req, &self.auth().await?).await
                }
                r => r,
            }
        })
        .await
    }

    /// A GET. Of the system's path, it takes what `find_system` has just read there
    /// (once).
    async fn get(&self, step: Step, path: &str) -> Result<Resp, BmcError> {
        if self.system.get().is_some_and(|s| s == path)
            && let Some(r) = self.fresh.lock().unwrap_or_else(|e| e.into_inner()).take()
        {
            return Ok(r);
        }
        self.call(Req::new(step, Method::GET, path)).await
    }

    /// The ComputerSystem path, found once per driver.
    async fn system(&self) -> Result<&str, BmcError> {
        self.system
            .get_or_try_init(|| self.find_system())
            .await
            .map(String::as_str)
    }

    async fn find_system(&self) -> Result<String, BmcError> {
        if let Some(id) = &self.system_id {
            let path = if id.starts_with('/') {
                id.clone()
            } else {
                format!("/redfish/v1/Systems/{id}")
            };
            return match self.get(Step::FindSystem, &path).await {
                Ok(r) => {
                    *self.model.lock().unwrap_or_else(|e| e.into_inner()) = Some(model_of(&r.body));
                    *self.fresh.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
                    Ok(path)
                }
                Err(BmcError::Protocol {
                    status: Some(404), ..
                }) => Err(BmcError::SystemNotFound {
                    driver: D,
                    wanted: format!("id {id}"),
                    found: self.list_systems().await?.join(", "),
                }),
                Err(e) => Err(e),
            };
        }
        let members = self.list_systems().await?;
        let want_mac = self
            .match_mac
            .as_deref()
            .map(|m| crate::model::normalize_mac(m).unwrap_or_else(|| m.to_ascii_lowercase()));
        let want_uuid = self.match_uuid.as_deref().map(str::to_ascii_lowercase);
        if want_mac.is_none() && want_uuid.is_none() {
            return match members.as_slice() {
                [only] => Ok(only.clone()),
                [] => Err(BmcError::SystemNotFound {
                    driver: D,
                    wanted: "any id".into(),
                    found: "no systems".into(),
                }),
                _ => Err(BmcError::SystemAmbiguous {
                    driver: D,
                    count: members.len(),
                    found: members.join(", "),
                }),
            };
        }
        for m in &members {
            let sys = self.get(Step::FindSystem, m).await?.body;
            if let Some(u) = &want_uuid
                && sys["UUID"].as_str().map(str::to_ascii_lowercase).as_ref() != Some(u)
            {
                continue;
            }
            if let Some(mac) = &want_mac
                && !self.has_mac(&sys, mac).await?
            {
                continue;
            }
            return Ok(m.clone());
        }
        let mut wanted = vec![];
        if let Some(m) = &want_mac {
            wanted.push(format!("MAC {m}"));
        }
        if let Some(u) = &want_uuid {
            wanted.push(format!("UUID {u}"));
        }
        Err(BmcError::SystemNotFound {
            driver: D,
            wanted: wanted.join(" and "),
            found: members.join(", "),
        })
    }

    async fn list_systems(&self) -> Result<Vec<String>, BmcError> {
        let c = self
            .get(Step::FindSystem, "/redfish/v1/Systems")
            .await?
            .body;
        Ok(c["Members"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|m| m["@odata.id"].as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default())
    }

    async fn has_mac(&self, sys: &Value, mac: &str) -> Result<bool, BmcError> {
        let Some(path) = sys["EthernetInterfaces"]["@odata.id"].as_str() else {
            return Ok(false);
        };
        let c = self.get(Step::FindSystem, path).await?.body;
        for m in c["Members"].as_array().into_iter().flatten() {
            let Some(p) = m["@odata.id"].as_str() else {
                continue;
            };
            let nic = self.get(Step::FindSystem, p).await?.body;
            for k in ["MACAddress", "PermanentMACAddress"] {
                if let Some(v) = nic[k].as_str()
                    && crate::model::normalize_mac(v).as_deref() == Some(mac)
                {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    async fn read_system(&self, step: Step) -> Result<Resp, BmcError> {
        let path = self.system().await?.to_string();
        self.get(step, &path).await
    }

    async fn read_override(&self) -> Result<BootOverride, BmcError> {
        Ok(parse_boot(&self.read_system(Step::ReadBoot).await?.body))
    }

    async fn read_power(&self) -> Result<PowerState, BmcError> {
        Ok(parse_power(&self.read_system(Step::PowerState).await?.body))
    }

    fn reset_target(&self, sys: &Value, path: &str) -> String {
        sys["Actions"]["#ComputerSystem.Reset"]["target"]
            .as_str()
            .map(String::from)
            .unwrap_or_else(|| format!("{path}/Actions/ComputerSystem.Reset"))
    }

    async fn reset(&self, target: &str, kind: &str) -> Result<(), BmcError> {
        let body = json!({ "ResetType": kind });
        self.call(Req {
            body: Some(&body),
            ..Req::new(Step::Power, Method::POST, target)
        })
        .await
        .map(|_| ())
    }

    /// Reset types offered (None when not advertised).
    fn allowed_resets(sys: &Value) -> Option<Vec<String>> {
        strings(&sys["Actions"]["#ComputerSystem.Reset"]["ResetType@Redfish.AllowableValues"])
    }

    fn pick(allowed: &Option<Vec<String>>, prefs: &[&'static str]) -> Option<&'static str> {
        prefs.iter().copied().find(|p| match allowed {
            Some(a) => a.iter().any(|x| x == p),
            None => true,
        })
    }

    async fn do_power(&self, want: PowerState) -> Result<(), BmcError> {
        let path = self.system().await?.to_string();
        let sys = self.get(Step::Power, &path).await?.body;
        if parse_power(&sys) == want {
            return Ok(());
        }
        self.power_from(&sys, &path, want).await
    }

    /// Sends the reset that moves the system to `want`, deciding from `sys` as already
    /// read (no second read: the state may change in between on asynchronous BMCs).
    async fn power_from(
        &self,
        sys: &serde_json::Value,
        path: &str,
        want: PowerState,
    ) -> Result<(), BmcError> {
        let allowed = Self::allowed_resets(sys);
        let prefs: &[&str] = if want == PowerState::On {
            &["On", "ForceOn"]
        } else {
            &["ForceOff", "GracefulShutdown"]
        };
        let kind = Self::pick(&allowed, prefs).ok_or_else(|| BmcError::NotSupported {
            driver: D,
            step: Step::Power,
            what: format!(
                "any of {} (offers: {})",
                prefs.join("/"),
                allowed.clone().unwrap_or_default().join(", ")
            ),
        })?;
        let target = self.reset_target(sys, path);
        self.reset(&target, kind).await?;
        await_power(&self.policy, D, kind, want, || self.read_power()).await
    }

    /// The order `power_cycle` tries resets in, given what is advertised.
    fn cycle_plan(allowed: &Option<Vec<String>>) -> Vec<&'static str> {
        ["PowerCycle", "ForceRestart"]
            .into_iter()
            .filter(|p| allowed.as_ref().is_none_or(|a| a.iter().any(|x| x == p)))
            .collect()
    }

    async fn do_cycle(&self) -> Result<(), BmcError> {
        let path = self.system().await?.to_string();
        let mut sys = self.get(Step::Power, &path).await?.body;
        if parse_power(&sys) == PowerState::Off {
            tracing::info!(bmc = %self.base, "node is off: powering on instead of cycling");
            match self.power_from(&sys, &path, PowerState::On).await {
                // Refused because it came on meanwhile (an earlier asynchronous power
                // action landing): it may be booting with the old boot order, so
                // restart it below rather than report success without a reset.
                Err(BmcError::Protocol {
                    status: Some(400 | 409),
                    ..
                }) => {
                    sys = self.get(Step::Power, &path).await?.body;
                    if parse_power(&sys) != PowerState::On {
                        return self.power_from(&sys, &path, PowerState::On).await;
                    }
                }
                other => return other,
            }
        }
        let allowed = Self::allowed_resets(&sys);
        let target = self.reset_target(&sys, &path);
        for kind in Self::cycle_plan(&allowed) {
            match self.reset(&target, kind).await {
                Ok(()) => {
                    return observe_restart(&self.policy, D, kind, || self.read_power()).await;
                }
                Err(BmcError::Protocol {
                    status: Some(s @ (400 | 405 | 501)),
                    message,
                    ..
                }) => {
                    tracing::warn!(bmc = %self.base, kind, status = s, %message, "reset type refused, trying the next");
                }
                Err(e) => return Err(e),
            }
        }
        self.do_power(PowerState::Off).await?;
        self.do_power(PowerState::On).await
    }

    async fn do_set_boot(&self, next: NextBoot) -> Result<BootOverride, BmcError> {
        self.set_boot(next, false).await
    }

    async fn do_set_boot_with_mode(&self, next: NextBoot) -> Result<BootOverride, BmcError> {
        self.set_boot(next, true).await
    }

    /// `Manufacturer Model, BIOS BiosVersion` of the system, read once per driver (the
    /// read that checked the system id serves when there was one).
    async fn do_model(&self) -> Result<Option<String>, BmcError> {
        let path = self.system().await?.to_string();
        if let Some(m) = self.model.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            return Ok(Some(m));
        }
        let m = model_of(&self.get(Step::Check, &path).await?.body);
        *self.model.lock().unwrap_or_else(|e| e.into_inner()) = Some(m.clone());
        Ok(Some(m))
    }

    async fn set_boot(&self, next: NextBoot, force_mode: bool) -> Result<BootOverride, BmcError> {
        let path = &self.system().await?.to_string();
        let next = &next;
        set_until_read_back(&self.policy, D, &self.base, |more| async move {
            let cur = self.get(Step::SetBoot, path).await?;
            let (mut patch, notes) = boot_patch_with(&cur.body, next, force_mode)?;
            for n in &notes {
                tracing::info!(bmc = %self.base, note = %n, "boot override");
            }
            let req = Req {
                body: Some(&patch),
                if_match: cur.etag.as_deref(),
                ..Req::new(Step::SetBoot, Method::PATCH, path)
            };
            match self.call(req).await {
                Ok(_) => {}
                Err(BmcError::Protocol {
                    status: Some(412), ..
                }) if more => {
                    tracing::warn!(bmc = %self.base, "ETag changed under us, re-reading");
                    return Ok(ReadBack::Again);
                }
                Err(e) => return Err(e),
            }
            let got = parse_boot(&self.get(Step::ReadBoot, path).await?.body);
            // A mode written to a BMC that shows none cannot be read back.
            if force_mode
                && cur.body["Boot"].get("BootSourceOverrideMode").is_none()
                && let Some(b) = patch["Boot"].as_object_mut()
            {
                b.remove("BootSourceOverrideMode");
            }
            if !override_matches(&patch, &got) {
                let wanted = patch["Boot"].to_string();
                return Ok(ReadBack::Differs { wanted, got });
            }
            if next.once && got.enabled != OverrideEnabled::Once {
                tracing::warn!(bmc = %self.base, enabled = ?got.enabled, "BMC reads a one-time override back as not Once; accepting");
            }
            Ok(ReadBack::Landed(got))
        })
        .await
    }

    /// `clear_boot_override`: `Enabled: Disabled` first (the Redfish way); a BMC that
    /// refuses that alone or ignores it (sushy-tools keeps every override continuous
    /// and needs a target) gets the disk as target with it.
    async fn do_clear_boot(&self) -> Result<BootOverride, BmcError> {
        let path = &self.system().await?.to_string();
        let cur = self.get(Step::ReadBoot, path).await?;
        let mut got = parse_boot(&cur.body);
        if !got.boots_network() {
            return Ok(got);
        }
        let mut etag = cur.etag;
        let patches = clear_patches();
        for (i, patch) in patches.iter().enumerate() {
            let req = Req {
                body: Some(patch),
                if_match: etag.as_deref(),
                ..Req::new(Step::SetBoot, Method::PATCH, path)
            };
            match self.call(req).await {
                Ok(_) => {}
                Err(BmcError::Protocol {
                    status: Some(s),
                    message,
                    ..
                }) if (400..500).contains(&s) && i + 1 < patches.len() => {
                    tracing::info!(bmc = %self.base, status = s, %message, "override clear refused; trying with a disk target");
                }
                Err(e) => return Err(e),
            }
            let r = self.get(Step::ReadBoot, path).await?;
            got = parse_boot(&r.body);
            etag = r.etag;
            if !got.boots_network() {
                return Ok(got);
            }
        }
        Err(BmcError::OverrideNotApplied {
            driver: D,
            wanted: "no network boot override".into(),
            got: got.to_string(),
            attempts: u32::try_from(patches.len()).unwrap_or(u32::MAX),
        })
    }

    async fn do_check(&self) -> Result<CheckReport, BmcError> {
        let mut r = CheckReport::new(D, &self.base, String::new());
        if self.insecure && self.base.starts_with("https://") {
            r.notes
                .push("TLS verification disabled for this BMC (insecure opt-out)".into());
        }
        let path = match self.system().await {
            Ok(p) => p.to_string(),
            Err(BmcError::AuthRefused { message, .. }) => {
                r.credentials = Credentials::Refused { message };
                r.tls_fingerprint = self.seen();
                return Ok(r);
            }
            Err(e) => return Err(e),
        };
        r.tls_fingerprint = self.seen();
        r.credentials = Credentials::Accepted {
            how: match self.auth.lock().await.as_ref() {
                Some(Auth::Session { .. }) => "session, X-Auth-Token".into(),
                _ => "basic auth; no SessionService".into(),
            },
        };
        let root = self.get(Step::Check, "/redfish/v1/").await?.body;
        let sys = self.get(Step::Check, &path).await?.body;
        let ident: Vec<&str> = [
            &root["Vendor"],
            &root["Product"],
            &sys["Manufacturer"],
            &sys["Model"],
        ]
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
        r.identity = Some(format!(
            "{} (Redfish {})",
            if ident.is_empty() {
                "unknown".to_string()
            } else {
                ident.join(" ")
            },
            root["RedfishVersion"].as_str().unwrap_or("?")
        ));
        r.system = Some(format!(
            "{path} name={} uuid={}",
            sys["Name"].as_str().unwrap_or("?"),
            sys["UUID"].as_str().unwrap_or("?")
        ));
        r.power = Some(parse_power(&sys));
        let allowed = Self::allowed_resets(&sys);
        match &allowed {
            Some(a) => r.reset_types = a.clone(),
            None => r
                .notes
                .push("ResetType allowable values not advertised: will probe".into()),
        }
        let plan = Self::cycle_plan(&allowed);
        r.cycle_plan = Some(if plan.is_empty() {
            "ForceOff, then On (no restart reset offered)".into()
        } else {
            format!("{} (fallback: ForceOff, then On)", plan.join(", else "))
        });
        let boot = &sys["Boot"];
        if boot.is_object() {
            match strings(&boot["BootSourceOverrideTarget@Redfish.AllowableValues"]) {
                Some(t) => r.boot_targets = t,
                None => r
                    .notes
                    .push("boot targets not advertised (BootSourceOverrideTarget@Redfish.AllowableValues)".into()),
            }
            if !r.boot_targets.is_empty() && !r.boot_targets.iter().any(|t| t == "Pxe") {
                r.notes.push("Pxe is not an offered boot target".into());
            }
            match (
                boot.get("BootSourceOverrideMode"),
                strings(&boot["BootSourceOverrideMode@Redfish.AllowableValues"]),
            ) {
                (_, Some(m)) => r.boot_modes = m,
                (Some(cur), None) => r.notes.push(format!(
                    "BootSourceOverrideMode present ({}) but its values are not advertised",
                    cur.as_str().unwrap_or("?")
                )),
                (None, None) => r
                    .notes
                    .push("no BootSourceOverrideMode: the mode cannot be set".into()),
            }
            if boot.get("HttpBootUri").is_none() {
                r.notes
                    .push("no HttpBootUri: UEFI HTTP boot takes its URL from DHCP".into());
            }
            r.boot_override = Some(parse_boot(&sys));
        } else {
            r.notes
                .push("no Boot object: one-time boot override impossible".into());
        }
        if !plan.contains(&"PowerCycle") {
            r.notes.push("PowerCycle not offered".into());
        }
        Ok(r)
    }

    /// The end of a step. A pooled driver keeps its session and connections for the
    /// next step, but not a read of the system no one took (the next step reads anew).
    async fn do_close(&self) {
        if self.pooled {
            self.fresh.lock().unwrap_or_else(|e| e.into_inner()).take();
        } else {
            self.logout().await;
        }
    }

    /// Ends the session, if one was opened.
    pub(crate) async fn logout(&self) {
        let auth = self.auth.lock().await.take();
        if let Some(
            a @ Auth::Session {
                location: Some(_), ..
            },
        ) = &auth
        {
            let Auth::Session {
                location: Some(loc),
                ..
            } = a
            else {
                return;
            };
            if let Err(e) = self
                .exchange(&Req::new(Step::Login, Method::DELETE, loc), a)
                .await
            {
                tracing::debug!(bmc = %self.base, error = %e, "session logout failed");
            }
        }
    }
}

/// Most GETs one inventory walk makes; what lies beyond is left out (and logged).
pub const INVENTORY_MAX_GETS: usize = 256;

/// The inventory walk over any source of Redfish bodies: `get(path)` answers the body,
/// or `None` for a resource that is not there. Pure apart from `get`, so it runs on
/// captures in the unit tests exactly as on a BMC.
struct Walk<G> {
    get: G,
    cap: usize,
    gets: usize,
    seen: BTreeSet<String>,
    truncated: bool,
}

impl<G, Fut> Walk<G>
where
    G: Fn(String) -> Fut,
    Fut: Future<Output = Result<Option<Value>, BmcError>>,
{
    fn new(cap: usize, get: G) -> Self {
        Walk {
            get,
            cap,
            gets: 0,
            seen: BTreeSet::new(),
            truncated: false,
        }
    }

    /// One resource, each path at most once per walk (BMCs list the same function
    /// under the system and under its device, the same device under the system and
    /// the chassis), and no more than `cap` GETs.
    async fn fetch(&mut self, path: &str) -> Result<Option<Value>, BmcError> {
        let path = path.split('#').next().unwrap_or(path).trim_end_matches('/');
        if path.is_empty() || !self.seen.insert(path.to_string()) {
            return Ok(None);
        }
        if self.gets >= self.cap {
            self.truncated = true;
            return Ok(None);
        }
        self.gets += 1;
        (self.get)(path.to_string()).await
    }

    /// The members behind a link: an array of references, or a reference to a
    /// collection whose `Members` are read in turn.
    async fn members(&mut self, link: Option<&Value>) -> Result<Vec<Value>, BmcError> {
        let paths: Vec<String> = match link {
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|m| m["@odata.id"].as_str().map(String::from))
                .collect(),
            Some(v @ Value::Object(_)) => match v["@odata.id"].as_str() {
                Some(c) => match self.fetch(c).await? {
                    Some(coll) => coll["Members"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|m| m["@odata.id"].as_str().map(String::from))
                        .collect(),
                    None => vec![],
                },
                None => vec![],
            },
            _ => vec![],
        };
        let mut out = Vec::with_capacity(paths.len());
        for p in paths {
            if let Some(v) = self.fetch(&p).await? {
                out.push(v);
            }
        }
        Ok(out)
    }

    /// PCIe devices and their functions behind `holder` (a system or a chassis).
    async fn pcie(&mut self, holder: &Value, r: &mut Resources) -> Result<(), BmcError> {
        r.pcie_functions
            .extend(self.members(holder.get("PCIeFunctions")).await?);
        let devices = self.members(holder.get("PCIeDevices")).await?;
        for d in &devices {
            let f = match d.get("PCIeFunctions") {
                Some(link) => self.members(Some(link)).await?,
                None => self.members(d.pointer("/Links/PCIeFunctions")).await?,
            };
            r.pcie_functions.extend(f);
        }
        r.pcie_devices.extend(devices);
        Ok(())
    }

    /// Walks from the system at `system_path`: its processors, memory (only when the
    /// summary has no total), PCIe devices, Ethernet interfaces, storage and drives;
    /// its first chassis (PCIe devices and drives where the system lists none, network
    /// adapter ports); and `UpdateService/FirmwareInventory`.
    async fn run(mut self, system_path: &str) -> Result<Resources, BmcError> {
        let system = self.fetch(system_path).await?.ok_or(BmcError::Protocol {
            driver: D,
            step: Step::Inventory,
            status: Some(404),
            message: format!("system {system_path} not found"),
        })?;
        let mut r = Resources {
            processors: self.members(system.get("Processors")).await?,
            ..Resources::default()
        };
        self.pcie(&system, &mut r).await?;
        r.ethernet = self.members(system.get("EthernetInterfaces")).await?;
        r.storage = self.members(system.get("Storage")).await?;
        for s in r.storage.clone() {
            r.drives.extend(self.members(s.get("Drives")).await?);
        }
        r.firmware = self
            .members(Some(
                &json!({"@odata.id": "/redfish/v1/UpdateService/FirmwareInventory"}),
            ))
            .await?;
        if let Some(c) = system
            .pointer("/Links/Chassis/0/@odata.id")
            .and_then(Value::as_str)
        {
            r.chassis = self.fetch(c).await?;
        }
        if let Some(chassis) = r.chassis.clone() {
            if r.pcie_devices.is_empty() {
                self.pcie(&chassis, &mut r).await?;
            }
            if r.drives.is_empty() {
                r.drives = self.members(chassis.get("Drives")).await?;
            }
            for a in self.members(chassis.get("NetworkAdapters")).await? {
                for k in ["NetworkPorts", "Ports"] {
                    r.network_ports.extend(self.members(a.get(k)).await?);
                }
            }
        }
        let summary = system.pointer("/MemorySummary/TotalSystemMemoryGiB");
        if !summary.and_then(Value::as_f64).is_some_and(|g| g > 0.0) {
            r.memory = self.members(system.get("Memory")).await?;
        }
        r.system = system;
        if self.truncated {
            tracing::warn!(
                system = system_path,
                gets = self.gets,
                "Redfish inventory walk hit its GET cap; the rest is not reported"
            );
        }
        Ok(r)
    }
}

impl RedfishBmc {
    /// One GET for the inventory walk: a resource the BMC does not have (404, 405,
    /// 501) or will not serve (any other HTTP error, after the policy's retries) is
    /// `None`, so one broken collection does not lose the rest; transport, auth and
    /// TLS failures end the walk.
    async fn get_optional(&self, path: String) -> Result<Option<Value>, BmcError> {
        match self.get(Step::Inventory, &path).await {
            Ok(r) => Ok(Some(r.body)),
            Err(BmcError::Protocol {
                status: Some(s @ (404 | 405 | 501)),
                ..
            }) => {
                tracing::debug!(bmc = %self.base, %path, status = s, "not on this BMC");
                Ok(None)
            }
            Err(BmcError::Protocol {
                status: Some(s),
                message,
                ..
            }) => {
                tracing::warn!(bmc = %self.base, %path, status = s, %message, "inventory resource skipped");
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// The Redfish resources of the selected system, walked with at most
    /// [`INVENTORY_MAX_GETS`] GETs.
    pub async fn inventory_resources(&self) -> Result<Resources, BmcError> {
        let path = self.system().await?.to_string();
        Walk::new(INVENTORY_MAX_GETS, |p| self.get_optional(p))
            .run(&path)
            .await
    }

    async fn do_inventory(&self) -> Result<Option<Inventory>, BmcError> {
        Ok(Some(from_resources(&self.inventory_resources().await?)))
    }
}

impl_bmc!(
    RedfishBmc,
    fn tls_fingerprint(&self) -> Option<String> {
        self.seen()
    },
    fn set_next_boot_with_mode(
        &self,
        next: NextBoot,
    ) -> BoxFuture<'_, Result<BootOverride, BmcError>> {
        Box::pin(self.do_set_boot_with_mode(next))
    },
    fn model(&self) -> BoxFuture<'_, Result<Option<String>, BmcError>> {
        Box::pin(self.do_model())
    },
    fn inventory(&self) -> BoxFuture<'_, Result<Option<Inventory>, BmcError>> {
        Box::pin(self.do_inventory())
    },
);

/// The pure readers of Redfish bodies, for the fuzz targets in `fuzz/` only: thin
/// wrappers so the readers themselves stay private.
#[doc(hidden)]
pub mod fuzzing {
    use serde_json::Value;

    use super::{BmcError, BootOverride, NextBoot, PowerState, RedfishBmc};

    /// `bmc_message`: the BMC's own message from an error body.
    pub fn bmc_message(body: &str) -> String {
        super::bmc_message(body)
    }
    /// `parse_power`: `PowerState` of a ComputerSystem.
    pub fn parse_power(system: &Value) -> PowerState {
        super::parse_power(system)
    }
    /// `parse_boot`: the boot override of a ComputerSystem as read back.
    pub fn parse_boot(system: &Value) -> BootOverride {
        super::parse_boot(system)
    }
    /// `boot_patch`: the PATCH body for `next`, from what `system` advertises.
    pub fn boot_patch(system: &Value, next: &NextBoot) -> Result<(Value, Vec<String>), BmcError> {
        super::boot_patch(system, next)
    }
    /// `override_matches`: whether a read-back override is what `patch` wrote.
    pub fn override_matches(patch: &Value, got: &BootOverride) -> bool {
        super::override_matches(patch, got)
    }
    /// The reset types a system offers and the power-cycle plan made from them.
    pub fn resets(system: &Value) -> (Option<Vec<String>>, Vec<&'static str>) {
        let allowed = RedfishBmc::allowed_resets(system);
        let plan = RedfishBmc::cycle_plan(&allowed);
        (allowed, plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sushy_like() -> Value {
        json!({"PowerState": "On", "Boot": {
            "BootSourceOverrideEnabled": "Continuous",
            "BootSourceOverrideTarget": "Hdd",
            "BootSourceOverrideTarget@Redfish.AllowableValues": ["Pxe", "Cd", "Hdd", "UefiHttp"],
            "BootSourceOverrideMode": "UEFI",
            "HttpBootUri": "None"}})
    }

    #[test]
    fn patch_has_only_advertised_fields() {
        let (p, _) = boot_patch(&sushy_like(), &NextBoot::pxe_once()).unwrap();
        assert_eq!(
            p,
            json!({"Boot": {"BootSourceOverrideTarget": "Pxe", "BootSourceOverrideEnabled": "Once", "BootSourceOverrideMode": "UEFI"}})
        );
        let minimal = json!({"Boot": {"BootSourceOverrideTarget": "None"}});
        let (p, notes) = boot_patch(&minimal, &NextBoot::pxe_once()).unwrap();
        assert!(p["Boot"].get("BootSourceOverrideMode").is_none());
        assert_eq!(notes.len(), 2, "{notes:?}");
        let http = NextBoot {
            target: BootTarget::UefiHttp {
                url: "http://x/ipxe.efi".into(),
            },
            mode: BootMode::Uefi,
            once: true,
        };
        let (p, _) = boot_patch(&sushy_like(), &http).unwrap();
        assert_eq!(p["Boot"]["HttpBootUri"], "http://x/ipxe.efi");
        let (p, _) = boot_patch(&minimal, &http).unwrap();
        assert!(p["Boot"].get("HttpBootUri").is_none());
    }

    #[test]
    fn unadvertised_target_is_not_supported() {
        let sys =
            json!({"Boot": {"BootSourceOverrideTarget@Redfish.AllowableValues": ["Hdd", "Cd"]}});
        let e = boot_patch(&sys, &NextBoot::pxe_once()).unwrap_err();
        assert!(matches!(e, BmcError::NotSupported { ref what, .. } if what.contains("Hdd, Cd")));
        assert!(boot_patch(&json!({}), &NextBoot::pxe_once()).is_err());
    }

    #[test]
    fn readback_rules() {
        let (p, _) = boot_patch(&sushy_like(), &NextBoot::pxe_once()).unwrap();
        let mut got = parse_boot(&sushy_like());
        assert!(!override_matches(&p, &got), "Hdd must not match Pxe");
        got.target = "Pxe".into();
        assert!(override_matches(&p, &got), "Continuous accepted for Once");
        got.enabled = OverrideEnabled::Disabled;
        assert!(!override_matches(&p, &got));
        got.enabled = OverrideEnabled::Once;
        got.mode = Some(BootMode::Legacy);
        assert!(!override_matches(&p, &got));
    }

    #[test]
    fn cycle_plan_follows_allowable_values() {
        let a = Some(vec![
            "On".to_string(),
            "ForceOff".into(),
            "ForceRestart".into(),
        ]);
        assert_eq!(RedfishBmc::cycle_plan(&a), vec!["ForceRestart"]);
        assert_eq!(
            RedfishBmc::cycle_plan(&None),
            vec!["PowerCycle", "ForceRestart"]
        );
        assert!(RedfishBmc::cycle_plan(&Some(vec!["On".into()])).is_empty());
    }

    #[test]
    fn bmc_message_extracts_redfish_error() {
        let b = r#"{"error":{"code":"Base.1.0.GeneralError","message":"boom","@Message.ExtendedInfo":[{"Message":"detail"}]}}"#;
        assert_eq!(bmc_message(b), "boom; detail");
        assert_eq!(bmc_message("plain"), "plain");
    }

    /// A Redfish double on loopback for one system `s1` (no SessionService): answers
    /// GET and PATCH of the system and logs every request as `METHOD path`.
    async fn double() -> (String, Arc<Mutex<Vec<String>>>) {
        let (base, log, _) = double_with(false).await;
        (base, log)
    }

    /// [`double`], with a SessionService when `sessions` (POST opens one, DELETE ends
    /// it; the system wants the token then), and the client ports it was reached from.
    async fn double_with(
        sessions: bool,
    ) -> (
        String,
        Arc<Mutex<Vec<String>>>,
        Arc<Mutex<BTreeSet<std::net::SocketAddr>>>,
    ) {
        use axum::extract::{ConnectInfo, State};
        use axum::http::Method as M;
        #[derive(Clone)]
        struct D {
            log: Arc<Mutex<Vec<String>>>,
            peers: Arc<Mutex<BTreeSet<std::net::SocketAddr>>>,
            sys: Arc<Mutex<Value>>,
            sessions: bool,
        }
        async fn any(
            State(d): State<D>,
            ConnectInfo(peer): ConnectInfo<std::net::SocketAddr>,
            method: M,
            headers: axum::http::HeaderMap,
            uri: axum::http::Uri,
            body: axum::body::Bytes,
        ) -> axum::response::Response {
            use axum::http::StatusCode as S;
            use axum::response::IntoResponse;
            d.peers.lock().unwrap().insert(peer);
            d.log
                .lock()
                .unwrap()
                .push(format!("{method} {}", uri.path()));
            const SESSIONS: &str = "/redfish/v1/SessionService/Sessions";
            if d.sessions
                && uri.path().starts_with("/redfish/v1/Systems")
                && headers.get("X-Auth-Token").is_none()
            {
                return S::UNAUTHORIZED.into_response();
            }
            match (method, uri.path()) {
                (M::GET, "/redfish/v1/") if d.sessions => axum::Json(json!({
                    "Systems": {"@odata.id": "/redfish/v1/Systems"},
                    "SessionService": {"@odata.id": "/redfish/v1/SessionService"},
                }))
                .into_response(),
                (M::GET, "/redfish/v1/") => {
                    axum::Json(json!({"Systems": {"@odata.id": "/redfish/v1/Systems"}}))
                        .into_response()
                }
                (M::POST, SESSIONS) if d.sessions => (
                    S::CREATED,
                    [
                        ("X-Auth-Token", "t1"),
                        ("Location", "/redfish/v1/SessionService/Sessions/1"),
                    ],
                )
                    .into_response(),
                (M::DELETE, p) if d.sessions && p.starts_with(SESSIONS) => {
                    S::NO_CONTENT.into_response()
                }
                (M::GET, "/redfish/v1/Systems/s1") => {
                    axum::Json(d.sys.lock().unwrap().clone()).into_response()
                }
                (M::PATCH, "/redfish/v1/Systems/s1") => {
                    let patch: Value = serde_json::from_slice(&body).unwrap();
                    let mut sys = d.sys.lock().unwrap();
                    for (k, v) in patch["Boot"].as_object().unwrap() {
                        sys["Boot"][k] = v.clone();
                    }
                    S::NO_CONTENT.into_response()
                }
                _ => S::NOT_FOUND.into_response(),
            }
        }
        let mut sys = sushy_like();
        sys["Manufacturer"] = json!("Acme");
        sys["Model"] = json!("R1");
        sys["BiosVersion"] = json!("2.1");
        let d = D {
            log: Arc::new(Mutex::new(Vec::new())),
            peers: Arc::new(Mutex::new(BTreeSet::new())),
            sys: Arc::new(Mutex::new(sys)),
            sessions,
        };
        let (log, peers) = (d.log.clone(), d.peers.clone());
        let app = axum::Router::new().fallback(any).with_state(d);
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            axum::serve(
                l,
                app.into_make_service_with_connect_info::<std::net::SocketAddr>(),
            )
            .await
        });
        (format!("http://{addr}"), log, peers)
    }

    /// The endpoint of the double's system `s1` at `base`.
    fn double_endpoint(base: String) -> BmcEndpoint {
        BmcEndpoint {
            driver: Driver::Redfish,
            address: base,
            username: "u".into(),
            password: Secret::new("p"),
            system_id: Some("s1".into()),
            match_mac: None,
            match_uuid: None,
            tls: TlsPolicy::Pinned(None),
            policy: CallPolicy::default(),
        }
    }

    /// A driver takes the read that checked the configured system id as its first look
    /// at the system, and its model from what it read: setting netboot and naming the
    /// model cost the root, two reads of the system (the check, the read-back) and the
    /// PATCH, where each used to read the system once more.
    #[tokio::test]
    async fn a_driver_reads_the_system_no_more_than_it_must() {
        let (base, log) = double().await;
        let ep = double_endpoint(base);
        let b = RedfishBmc::new(&ep).unwrap();
        let got = b.do_set_boot(NextBoot::pxe_once()).await.unwrap();
        assert_eq!(got.target, "Pxe");
        assert_eq!(
            b.do_model().await.unwrap().as_deref(),
            Some("redfish: Acme R1, BIOS 2.1")
        );
        let sys = "/redfish/v1/Systems/s1";
        assert_eq!(
            *log.lock().unwrap(),
            [
                "GET /redfish/v1/".to_string(),
                format!("GET {sys}"),
                format!("PATCH {sys}"),
                format!("GET {sys}"),
            ]
        );
        // The next read after a change asks the BMC (nothing kept from before it).
        log.lock().unwrap().clear();
        assert_eq!(b.read_override().await.unwrap().target, "Pxe");
        assert_eq!(*log.lock().unwrap(), [format!("GET {sys}")]);
    }

    /// Whether the double's log has a session logout.
    fn logged_out(log: &Mutex<Vec<String>>) -> bool {
        log.lock()
            .unwrap()
            .iter()
            .any(|l| l.starts_with("DELETE /redfish/v1/SessionService/Sessions/"))
    }

    /// Whether `f` comes to hold within 5 s (looked at every 100 ms).
    async fn within_5s(f: impl Fn() -> bool) -> bool {
        for _ in 0..50 {
            if f() {
                return true;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        f()
    }

    /// A pooled driver carries its connection, session and system over from one step
    /// to the next: the second step costs one read of the system, where a new driver
    /// would open a connection, read the root, log in, check the system and log out.
    /// Another password is another driver; the pool logs its drivers out at the end.
    #[tokio::test]
    async fn a_pooled_driver_carries_its_session_across_steps() {
        let (base, log, peers) = double_with(true).await;
        let ep = double_endpoint(base);
        let pool = super::super::pool::Pool::default();
        let sys = "/redfish/v1/Systems/s1";
        let sessions = "/redfish/v1/SessionService/Sessions";
        // Step 1: set the network boot.
        let b = pool.connect(&ep).unwrap();
        b.set_next_boot(NextBoot::pxe_once()).await.unwrap();
        b.close().await;
        drop(b);
        assert_eq!(
            *log.lock().unwrap(),
            [
                "GET /redfish/v1/".to_string(),
                format!("POST {sessions}"),
                format!("GET {sys}"),
                format!("PATCH {sys}"),
                format!("GET {sys}"),
            ]
        );
        // Step 2: read the override, on the same session and connection.
        log.lock().unwrap().clear();
        let b = pool.connect(&ep).unwrap();
        assert_eq!(b.boot_override().await.unwrap().target, "Pxe");
        b.close().await;
        drop(b);
        assert_eq!(*log.lock().unwrap(), [format!("GET {sys}")]);
        assert_eq!(
            peers.lock().unwrap().len(),
            1,
            "one connection for both steps"
        );
        assert_eq!(pool.len(), 1);
        // Another password: another driver, its own session.
        log.lock().unwrap().clear();
        let mut other = ep.clone();
        other.password = Secret::new("q");
        let b = pool.connect(&other).unwrap();
        b.power_state().await.unwrap();
        drop(b);
        assert_eq!(log.lock().unwrap()[1], format!("POST {sessions}"));
        assert_eq!(pool.len(), 2);
        // Shutdown: both sessions end.
        log.lock().unwrap().clear();
        pool.close_all().await;
        assert!(pool.is_empty());
        let deletes = log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.starts_with(&format!("DELETE {sessions}/")))
            .count();
        assert_eq!(deletes, 2, "{:?}", log.lock().unwrap());
    }

    /// A driver a step failed with leaves the pool: the retry logs in anew on a new
    /// driver, and the old session is ended once no step holds it.
    #[tokio::test]
    async fn a_discarded_driver_is_logged_out_and_not_reused() {
        let (base, log, _) = double_with(true).await;
        let ep = double_endpoint(base);
        let pool = super::super::pool::Pool::default();
        let sessions = "/redfish/v1/SessionService/Sessions";
        let b = pool.connect(&ep).unwrap();
        b.power_state().await.unwrap();
        b.close().await;
        pool.discard(&b);
        assert!(pool.is_empty());
        // Still held by this step: no logout under its feet.
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        assert!(!logged_out(&log), "{:?}", log.lock().unwrap());
        let again = pool.connect(&ep).unwrap();
        assert!(!Arc::ptr_eq(&b, &again));
        drop(b);
        assert!(
            within_5s(|| logged_out(&log)).await,
            "{:?}",
            log.lock().unwrap()
        );
        log.lock().unwrap().clear();
        again.power_state().await.unwrap();
        assert_eq!(log.lock().unwrap()[1], format!("POST {sessions}"));
    }

    /// A pooled driver left unused for the idle time is logged out and dropped; one a
    /// step still holds is kept however long the step takes.
    #[tokio::test]
    async fn an_idle_pooled_driver_is_logged_out() {
        let (base, log, _) = double_with(true).await;
        let ep = double_endpoint(base);
        let pool = super::super::pool::Pool::with_idle(std::time::Duration::from_millis(200));
        let b = pool.connect(&ep).unwrap();
        b.power_state().await.unwrap();
        b.close().await;
        // Held by a step well past the idle time: kept, session open.
        tokio::time::sleep(std::time::Duration::from_millis(600)).await;
        assert_eq!(pool.len(), 1);
        assert!(!logged_out(&log));
        drop(b);
        assert!(within_5s(|| pool.is_empty()).await);
        // The logout follows the removal: wait for it, bounded.
        assert!(
            within_5s(|| logged_out(&log)).await,
            "{:?}",
            log.lock().unwrap()
        );
        // The sweeper ended with the pool empty; a new driver starts another.
        let b = pool.connect(&ep).unwrap();
        b.power_state().await.unwrap();
        drop(b);
        assert!(within_5s(|| pool.is_empty()).await);
    }

    /// Runs the walk on a stored capture (path -> body), counting GETs.
    async fn walk_capture(name: &str, system: &str, cap: usize) -> (Resources, usize) {
        let c = crate::inventory::redfish::tests::capture(name);
        let gets = std::cell::Cell::new(0);
        let r = Walk::new(cap, |p: String| {
            gets.set(gets.get() + 1);
            let v = c.get(&p).cloned();
            async move { Ok(v) }
        })
        .run(system)
        .await
        .unwrap();
        (r, gets.get())
    }

    #[tokio::test]
    async fn walk_finds_what_the_captures_hold_once() {
        use crate::inventory::redfish::tests::{capture, resources};
        for (name, system) in [
            ("cisco-ucsc-c225-m6s", "/redfish/v1/Systems/WZP262207W0"),
            ("hpe-proliant-dl360-gen10-plus", "/redfish/v1/Systems/1"),
        ] {
            let (walked, gets) = walk_capture(name, system, INVENTORY_MAX_GETS).await;
            assert!(gets < INVENTORY_MAX_GETS, "{name}: {gets} GETs");
            let by_path = resources(&capture(name), system);
            let sorted = |mut i: Inventory| {
                i.pci.sort_by(|a, b| a.address.cmp(&b.address));
                i.nics.sort_by(|a, b| a.mac.cmp(&b.mac));
                i.disks.sort_by(|a, b| a.serial.cmp(&b.serial));
                i
            };
            let mut want = sorted(from_resources(&by_path));
            let got = sorted(from_resources(&walked));
            // The walk reads DIMMs only when the summary has no total; both have one.
            assert!(walked.memory.is_empty(), "{name}");
            assert_eq!(
                walked.pcie_functions.len(),
                by_path.pcie_functions.len(),
                "{name}"
            );
            if name.starts_with("cisco") {
                // The capture stored no body for the Storage collection: the walk
                // cannot reach the drives the path picker finds.
                assert!(walked.drives.is_empty() && want.disks.len() == 6);
                want.disks.clear();
            } else {
                assert_eq!(walked.drives.len(), by_path.drives.len(), "{name}");
            }
            assert_eq!(got, want, "{name}");
        }
        let (cisco, _) = walk_capture(
            "cisco-ucsc-c225-m6s",
            "/redfish/v1/Systems/WZP262207W0",
            INVENTORY_MAX_GETS,
        )
        .await;
        // Listed under the system and under the chassis: walked once.
        assert_eq!(cisco.pcie_devices.len(), 5);
        assert_eq!(cisco.firmware.len(), 5);
    }

    #[tokio::test]
    async fn walk_stops_at_its_get_cap() {
        let (r, gets) =
            walk_capture("hpe-proliant-dl360-gen10-plus", "/redfish/v1/Systems/1", 6).await;
        assert_eq!(gets, 6);
        assert_eq!(r.system["SerialNumber"], "VYRBX9UJ4S");
        assert!(r.firmware.is_empty());
        let missing = Walk::new(8, |_p: String| async { Ok(None) })
            .run("/redfish/v1/Systems/x")
            .await;
        assert!(matches!(
            missing,
            Err(BmcError::Protocol {
                status: Some(404),
                ..
            })
        ));
    }

    #[test]
    fn fingerprints_normalize() {
        assert_eq!(normalize_fingerprint("AB:cd:01"), "abcd01");
        assert_eq!(fingerprint(b"").len(), 64);
    }
}

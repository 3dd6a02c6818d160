//! IPMI 2.0 over LAN (RMCP+ "lanplus") via ipmi-rs 0.6, which is blocking: every call
//! runs on `spawn_blocking` and holds the one session of this driver.
//!
//! Cipher suite: ipmi-rs 0.6 always opens the session with cipher suite 3
//! (RAKP-HMAC-SHA1 / HMAC-SHA1-96 / AES-CBC-128); suite 17 (RAKP-HMAC-SHA256 /
//! HMAC-SHA256-128 / AES-CBC-128) cannot be added from outside the crate:
//! - `rmcp::v2_0::State::activate` hard-codes the three algorithms of the Open Session
//!   Request; there is no parameter, and `Rmcp::activate` offers none either.
//! - `CryptoState::calculate_rakp3_data` and `verify` reach a `todo!` placeholder for
//!   `RakpHmacSha256` (a panic, not an error), `SubState::{write,validate}_trailer`
//!   reach one for `HmacSha256_128`, and `Keys::from_sik` derives K1/K2 with
//!   HMAC-SHA1 into 20-byte arrays (suite 17 needs HMAC-SHA256, 32-byte SIK/K1/K2, and a
//!   16-byte truncated ICV in RAKP 4 and the session trailer).
//! - All of these types are private (`mod crypto`, `pub(super)` state), so the fix is a
//!   patch to ipmi-rs: an algorithm choice on `Rmcp::activate`, SHA-256 arms in
//!   `CryptoState`/`SubState`/`Keys`, and `[patch.crates-io]` until upstream takes it.
//!   ipmi_sim (our test peer) does not offer suite 17 either, so it could not be tested
//!   here.
//!
//! Two more ipmi-rs hazards are contained here: it `unwrap()`s the RAKP 4 read and the
//! session socket send, so a BMC that vanishes mid-call panics the blocking task; the
//! panic becomes a typed error and the session is dropped. And when the BMC offers no
//! IPMI 2.0, ipmi-rs falls back to an IPMI 1.5 session.

mod chassis;
pub mod fru;

use std::fmt;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use ipmi_rs::connection::IpmiCommand;
use ipmi_rs::rmcp::{
    ActivationError, Rmcp, RmcpIpmiError, RmcpIpmiReceiveError, V2_0ActivationError,
};
use ipmi_rs::{Ipmi, IpmiError};

pub use chassis::{BootDevice, BootFlags, ChassisControl, ChassisStatus};
use chassis::{GetBootFlags, GetChassisStatus, PRIVILEGE_ADMIN, SetBootFlags, SetSessionPrivilege};
use fru::{GetFruAreaInfo, ReadFruData};

use crate::inventory::Inventory;

use super::{
    BmcEndpoint, BmcError, BootMode, BootOverride, BootTarget, CallPolicy, CheckReport,
    Credentials, Driver, NextBoot, OverrideEnabled, PowerState, ReadBack, Secret, Step,
    await_power, observe_restart, set_until_read_back,
};

const D: Driver = Driver::Ipmi;
const CIPHER: &str = "RMCP+ cipher suite 3 (RAKP-HMAC-SHA1, HMAC-SHA1-96, AES-CBC-128)";

type Session = Ipmi<Rmcp>;

/// What went wrong with one command, deciding retransmit / reconnect / give up.
enum Fail {
    /// No answer: retransmit on the same session.
    NoAnswer,
    /// Transport broke: reopen the session.
    Broken(BmcError),
    /// The BMC answered no.
    Fatal(BmcError),
}

#[derive(Clone)]
struct Link {
    address: String,
    username: String,
    password: Secret,
    policy: CallPolicy,
}

/// IPMI-over-LAN BMC driver. Build it with [`super::connect`].
pub struct IpmiBmc {
    link: Link,
    session: Arc<Mutex<Option<Session>>>,
}

impl fmt::Debug for IpmiBmc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpmiBmc")
            .field("address", &self.link.address)
            .field("username", &self.link.username)
            .field("password", &self.link.password)
            .finish_non_exhaustive()
    }
}

fn io_kind(e: &std::io::Error) -> Option<bool> {
    use std::io::ErrorKind::*;
    match e.kind() {
        WouldBlock | TimedOut => Some(true),
        ConnectionRefused | HostUnreachable | NetworkUnreachable => Some(false),
        _ => None,
    }
}

impl Link {
    fn unreachable(&self, step: Step, message: String) -> BmcError {
        BmcError::Unreachable {
            driver: D,
            step,
            address: self.address.clone(),
            message,
        }
    }

    fn activate(&self) -> Result<Session, BmcError> {
        let mut rmcp = Rmcp::new(self.address.as_str(), self.policy.request_timeout)
            .map_err(|e| self.unreachable(Step::Connect, e.to_string()))?;
        let r = rmcp.activate(
            true,
            Some(&self.username),
            Some(self.password.expose().as_bytes()),
        );
        if let Err(e) = r {
            return Err(self.activation_error(e));
        }
        let mut s = Ipmi::new(rmcp);
        let mut tries = 0;
        loop {
            match self.cmd(&mut s, Step::Login, SetSessionPrivilege(PRIVILEGE_ADMIN)) {
                Ok(_) => return Ok(s),
                Err(Fail::NoAnswer) if tries < self.policy.retries => tries += 1,
                Err(Fail::NoAnswer) => {
                    return Err(BmcError::Timeout {
                        driver: D,
                        step: Step::Login,
                        after: self.policy.request_timeout,
                    });
                }
                Err(Fail::Broken(e)) => return Err(e),
                Err(Fail::Fatal(e)) => {
                    return Err(BmcError::AuthRefused {
                        driver: D,
                        step: Step::Login,
                        message: format!("administrator privilege refused: {e}"),
                    });
                }
            }
        }
    }

    fn activation_error(&self, e: ActivationError) -> BmcError {
        let io = |step, e: std::io::Error| match io_kind(&e) {
            Some(true) => BmcError::Timeout {
                driver: D,
                step,
                after: self.policy.request_timeout,
            },
            _ => self.unreachable(step, e.to_string()),
        };
        match e {
            ActivationError::BindSocket(e) | ActivationError::PingSend(e) => io(Step::Connect, e),
            ActivationError::PongReceive(e) => io(Step::Connect, e),
            ActivationError::V2_0(V2_0ActivationError::ServerAuthenticationFailed) => {
                BmcError::AuthRefused {
                    driver: D,
                    step: Step::Login,
                    message: "RAKP message 2 integrity check failed: wrong password".into(),
                }
            }
            ActivationError::V2_0(V2_0ActivationError::RakpMessage2Parse(p)) => {
                BmcError::AuthRefused {
                    driver: D,
                    step: Step::Login,
                    message: format!("RAKP message 2: {p:?}"),
                }
            }
            ActivationError::V2_0(V2_0ActivationError::RakpMessage4Parse(p)) => {
                BmcError::AuthRefused {
                    driver: D,
                    step: Step::Login,
                    message: format!("RAKP message 4: {p:?}"),
                }
            }
            ActivationError::V2_0(V2_0ActivationError::OpenSessionResponseReceive(
                RmcpIpmiReceiveError::Io(e),
            ))
            | ActivationError::V2_0(V2_0ActivationError::RakpMessage2Receive(
                RmcpIpmiReceiveError::Io(e),
            ))
            | ActivationError::V2_0(V2_0ActivationError::RakpMessage4Receive(
                RmcpIpmiReceiveError::Io(e),
            )) => io(Step::Login, e),
            ActivationError::V2_0(V2_0ActivationError::OpenSessionResponseParse(p)) => {
                BmcError::NotSupported {
                    driver: D,
                    step: Step::Login,
                    what: format!("{CIPHER}: open session refused: {p:?}"),
                }
            }
            other => BmcError::Protocol {
                driver: D,
                step: Step::Login,
                status: None,
                message: format!("session activation failed: {other:?}"),
            },
        }
    }

    /// Runs `f` on the session, opening it if needed; retransmits on silence, reopens
    /// on transport errors, with doubling backoff, `policy.retries` extra attempts.
    fn with_session<T>(
        &self,
        slot: &mut Option<Session>,
        step: Step,
        mut f: impl FnMut(&mut Session) -> Result<T, Fail>,
    ) -> Result<T, BmcError> {
        let mut delay = self.policy.backoff;
        let mut last = BmcError::Timeout {
            driver: D,
            step,
            after: self.policy.request_timeout,
        };
        for attempt in 0..=self.policy.retries {
            if attempt > 0 {
                std::thread::sleep(delay);
                delay = delay.saturating_mul(2);
            }
            if slot.is_none() {
                match self.activate() {
                    Ok(s) => *slot = Some(s),
                    Err(e) if e.is_retryable() => {
                        tracing::debug!(bmc = %self.address, attempt, error = %e, "IPMI session failed, retrying");
                        last = e;
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            }
            let Some(s) = slot.as_mut() else { continue };
            match f(s) {
                Ok(v) => return Ok(v),
                Err(Fail::NoAnswer) => {
                    tracing::debug!(bmc = %self.address, attempt, %step, "no IPMI answer, retransmitting");
                    last = BmcError::Timeout {
                        driver: D,
                        step,
                        after: self.policy.request_timeout,
                    };
                }
                Err(Fail::Broken(e)) => {
                    *slot = None;
                    last = e;
                }
                Err(Fail::Fatal(e)) => return Err(e),
            }
        }
        Err(last)
    }

    fn cmd<C>(&self, s: &mut Session, step: Step, c: C) -> Result<C::Output, Fail>
    where
        C: IpmiCommand + fmt::Debug + Copy,
        C::Error: fmt::Debug,
    {
        match s.send_recv(c) {
            Ok(v) => Ok(v),
            Err(IpmiError::Connection(RmcpIpmiError::Receive(RmcpIpmiReceiveError::Io(e)))) => {
                match io_kind(&e) {
                    Some(true) => Err(Fail::NoAnswer),
                    _ => Err(Fail::Broken(self.unreachable(step, e.to_string()))),
                }
            }
            Err(IpmiError::Connection(e)) => Err(Fail::Broken(BmcError::Protocol {
                driver: D,
                step,
                status: None,
                message: format!("{c:?}: {e:?}"),
            })),
            // A late answer to an earlier transmission: ask again.
            Err(IpmiError::UnexpectedResponse { .. }) => Err(Fail::NoAnswer),
            Err(IpmiError::Failed {
                completion_code,
                data,
                ..
            }) => Err(Fail::Fatal(BmcError::Protocol {
                driver: D,
                step,
                status: None,
                message: format!("{c:?}: completion code {completion_code:?} data {data:02x?}"),
            })),
            Err(IpmiError::Command {
                error,
                completion_code,
                ..
            }) => Err(Fail::Fatal(BmcError::Protocol {
                driver: D,
                step,
                status: None,
                message: format!("{c:?}: {error:?} (completion code {completion_code:?})"),
            })),
            Err(e) => Err(Fail::Fatal(BmcError::Protocol {
                driver: D,
                step,
                status: None,
                message: format!("{c:?}: {e:?}"),
            })),
        }
    }
}

fn to_override(f: BootFlags) -> BootOverride {
    BootOverride {
        target: f.device.name(),
        enabled: match (f.valid, f.persistent) {
            (false, _) => OverrideEnabled::Disabled,
            (true, false) => OverrideEnabled::Once,
            (true, true) => OverrideEnabled::Continuous,
        },
        mode: Some(if f.efi {
            BootMode::Uefi
        } else {
            BootMode::Legacy
        }),
        http_uri: None,
    }
}

impl IpmiBmc {
    /// Builds the driver; no I/O (the session opens on first use).
    pub fn new(ep: &BmcEndpoint) -> Result<Self, BmcError> {
        let address = if ep.address.contains(':') && !ep.address.starts_with('[') {
            ep.address.clone()
        } else {
            format!("{}:623", ep.address)
        };
        Ok(IpmiBmc {
            link: Link {
                address,
                username: ep.username.clone(),
                password: ep.password.clone(),
                policy: ep.policy.clone(),
            },
            session: Arc::new(Mutex::new(None)),
        })
    }

    /// Runs blocking IPMI work on the blocking pool with an overall deadline.
    async fn run<T: Send + 'static>(
        &self,
        step: Step,
        f: impl FnOnce(&Link, &mut Option<Session>) -> Result<T, BmcError> + Send + 'static,
    ) -> Result<T, BmcError> {
        let link = self.link.clone();
        let session = self.session.clone();
        let p = &self.link.policy;
        // Each attempt waits at most one request timeout per exchange; the guard covers
        // all attempts and backoffs so a wedged thread never wedges the caller.
        let attempts = p.retries + 1;
        let guard = p.request_timeout.saturating_mul(attempts * 2)
            + p.backoff.saturating_mul(1 << attempts.min(16));
        let task = tokio::task::spawn_blocking(move || {
            let mut slot = session.lock().unwrap_or_else(|e| {
                // A panic inside ipmi-rs poisoned the lock: the session is suspect.
                session.clear_poison();
                let mut g = e.into_inner();
                *g = None;
                g
            });
            f(&link, &mut slot)
        });
        match tokio::time::timeout(guard, task).await {
            Ok(Ok(r)) => r,
            Ok(Err(join)) => Err(BmcError::Protocol {
                driver: D,
                step,
                status: None,
                message: format!("ipmi-rs panicked (BMC went away mid-exchange?): {join}"),
            }),
            Err(_) => Err(BmcError::Timeout {
                driver: D,
                step,
                after: guard,
            }),
        }
    }

    async fn read_power(&self) -> Result<PowerState, BmcError> {
        self.run(Step::PowerState, |l, s| {
            l.with_session(s, Step::PowerState, |x| {
                l.cmd(x, Step::PowerState, GetChassisStatus)
            })
        })
        .await
        .map(|st| {
            if st.power_on {
                PowerState::On
            } else {
                PowerState::Off
            }
        })
    }

    async fn control(&self, c: ChassisControl) -> Result<(), BmcError> {
        self.run(Step::Power, move |l, s| {
            l.with_session(s, Step::Power, |x| l.cmd(x, Step::Power, c))
        })
        .await
    }

    async fn read_boot(&self) -> Result<BootFlags, BmcError> {
        self.run(Step::ReadBoot, |l, s| {
            l.with_session(s, Step::ReadBoot, |x| {
                l.cmd(x, Step::ReadBoot, GetBootFlags)
            })
        })
        .await
    }

    async fn read_override(&self) -> Result<BootOverride, BmcError> {
        self.read_boot().await.map(to_override)
    }

    async fn do_close(&self) {
        // ipmi-rs 0.6 has no Close Session; dropping the socket lets the BMC time it out.
        let session = self.session.clone();
        let _ = tokio::task::spawn_blocking(move || {
            *session.lock().unwrap_or_else(|e| e.into_inner()) = None;
        })
        .await;
    }

    async fn do_power(&self, want: PowerState) -> Result<(), BmcError> {
        if self.read_power().await? == want {
            return Ok(());
        }
        let c = if want == PowerState::On {
            ChassisControl::PowerUp
        } else {
            ChassisControl::PowerDown
        };
        self.control(c).await?;
        await_power(&self.link.policy, D, &format!("{c:?}"), want, || {
            self.read_power()
        })
        .await
    }

    async fn do_cycle(&self) -> Result<(), BmcError> {
        if self.read_power().await? == PowerState::Off {
            tracing::info!(bmc = %self.link.address, "node is off: powering on instead of cycling");
            return self.do_power(PowerState::On).await;
        }
        match self.control(ChassisControl::PowerCycle).await {
            Ok(()) => {
                observe_restart(&self.link.policy, D, "PowerCycle", || self.read_power()).await
            }
            Err(BmcError::Protocol { message, .. }) => {
                tracing::warn!(bmc = %self.link.address, %message, "power cycle refused, doing off then on");
                self.do_power(PowerState::Off).await?;
                self.do_power(PowerState::On).await
            }
            Err(e) => Err(e),
        }
    }

    async fn do_set_boot(&self, next: NextBoot) -> Result<BootOverride, BmcError> {
        if let BootTarget::UefiHttp { .. } = next.target {
            return Err(BmcError::NotSupported {
                driver: D,
                step: Step::SetBoot,
                what: "UEFI HTTP boot (IPMI has no HTTP boot device; use Pxe with UEFI mode and let DHCP hand out the URL)".into(),
            });
        }
        let want = BootFlags {
            valid: true,
            persistent: !next.once,
            efi: next.mode == BootMode::Uefi,
            device: BootDevice::Pxe,
        };
        set_until_read_back(&self.link.policy, D, &self.link.address, |_| async move {
            self.run(Step::SetBoot, move |l, s| {
                l.with_session(s, Step::SetBoot, |x| {
                    l.cmd(x, Step::SetBoot, SetBootFlags(want))
                })
            })
            .await?;
            let got = self.read_boot().await?;
            // The device selector is the one field every BMC keeps: BMCs clear the valid
            // bit on their own (60 s timer, or on read as ipmi_sim does) and some drop the
            // EFI/persistent bits. Those differences are logged, not fatal.
            if got.device == want.device {
                if got != want {
                    tracing::warn!(bmc = %self.link.address, ?want, ?got, "boot flags read back differ outside the device selector; accepting");
                }
                return Ok(ReadBack::Landed(to_override(got)));
            }
            Ok(ReadBack::Differs {
                wanted: to_override(want).to_string(),
                got: to_override(got),
            })
        })
        .await
    }

    /// `clear_boot_override`: boot flags with the valid bit off and no device.
    async fn do_clear_boot(&self) -> Result<BootOverride, BmcError> {
        let cur = self.read_override().await?;
        if !cur.boots_network() {
            return Ok(cur);
        }
        let want = BootFlags {
            valid: false,
            persistent: false,
            efi: cur.mode == Some(BootMode::Uefi),
            device: BootDevice::NoOverride,
        };
        self.run(Step::SetBoot, move |l, s| {
            l.with_session(s, Step::SetBoot, |x| {
                l.cmd(x, Step::SetBoot, SetBootFlags(want))
            })
        })
        .await?;
        let got = self.read_override().await?;
        if got.boots_network() {
            return Err(BmcError::OverrideNotApplied {
                driver: D,
                wanted: "no network boot override".into(),
                got: got.to_string(),
                attempts: 1,
            });
        }
        Ok(got)
    }

    async fn do_check(&self) -> Result<CheckReport, BmcError> {
        let mut r = CheckReport::new(D, &self.link.address, CIPHER.into());
        let id = self
            .run(Step::Check, |l, s| {
                l.with_session(s, Step::Check, |x| {
                    match x.send_recv(ipmi_rs::app::GetDeviceId) {
                        Ok(d) => Ok(d),
                        Err(e) => Err(Fail::Fatal(BmcError::Protocol {
                            driver: D,
                            step: Step::Check,
                            status: None,
                            message: format!("Get Device ID: {e:?}"),
                        })),
                    }
                })
            })
            .await;
        let id = match id {
            Ok(id) => id,
            Err(BmcError::AuthRefused { message, .. }) => {
                r.credentials = Credentials::Refused { message };
                return Ok(r);
            }
            Err(e) => return Err(e),
        };
        r.identity = Some(format!(
            "IPMI {}.{}, manufacturer {:#x}, product {:#x}, firmware {}.{:02x}, chassis device: {}",
            id.major_version,
            id.minor_version,
            id.manufacturer_id,
            id.product_id,
            id.major_fw_revision,
            id.minor_fw_revision,
            if id.chassis_support { "yes" } else { "no" }
        ));
        if !id.chassis_support {
            r.notes
                .push("BMC does not claim chassis device support".into());
        }
        r.power = Some(self.read_power().await?);
        r.reset_types = [
            "PowerUp",
            "PowerDown",
            "PowerCycle",
            "HardReset",
            "SoftShutdown",
        ]
        .map(String::from)
        .to_vec();
        r.cycle_plan = Some("PowerCycle (fallback: PowerDown, then PowerUp)".into());
        r.boot_targets = vec!["Pxe".into()];
        r.boot_modes = vec!["UEFI".into(), "Legacy".into()];
        match self.read_boot().await {
            Ok(f) => r.boot_override = Some(to_override(f)),
            Err(e) => r.notes.push(format!("boot flags unreadable: {e}")),
        }
        r.notes.push(
            "IPMI advertises neither reset types nor boot devices: listed from the IPMI 2.0 chassis command set"
                .into(),
        );
        r.notes.push(
            "cipher suite 17 (SHA-256) not available: ipmi-rs 0.6 supports suite 3 only".into(),
        );
        Ok(r)
    }
}

impl IpmiBmc {
    /// The system's vendor, model and serial from FRU device 0 (board and product
    /// areas); everything else stays "not reported". `None` when the BMC has no FRU
    /// data there (it answers the FRU commands with an error completion code) or the
    /// data is not FRU data.
    async fn do_inventory(&self) -> Result<Option<Inventory>, BmcError> {
        let image = self
            .run(Step::Inventory, |l, s| {
                l.with_session(s, Step::Inventory, |x| {
                    let size = match l.cmd(x, Step::Inventory, GetFruAreaInfo(0)) {
                        Ok(n) => n,
                        Err(Fail::Fatal(e)) => return Ok(Err(e.to_string())),
                        Err(f) => return Err(f),
                    };
                    let read = fru::read_image(size, |offset, count| {
                        l.cmd(
                            x,
                            Step::Inventory,
                            ReadFruData {
                                device: 0,
                                offset,
                                count,
                            },
                        )
                    });
                    match read {
                        Ok(r) => Ok(r.map_err(|e| e.to_string())),
                        Err(Fail::Fatal(e)) => Ok(Err(e.to_string())),
                        Err(f) => Err(f),
                    }
                })
            })
            .await?;
        let parsed = image.and_then(|i| fru::parse(&i).map_err(|e| e.to_string()));
        match parsed {
            Ok(f) => {
                if !f.bad_checksums.is_empty() {
                    tracing::warn!(bmc = %self.link.address, areas = ?f.bad_checksums, "FRU area checksum wrong; read anyway");
                }
                Ok(Some(Inventory {
                    system: f.system(),
                    ..Inventory::default()
                }))
            }
            Err(message) => {
                tracing::warn!(bmc = %self.link.address, %message, "no FRU inventory");
                Ok(None)
            }
        }
    }
}

impl_bmc!(
    IpmiBmc,
    fn inventory(&self) -> BoxFuture<'_, Result<Option<Inventory>, BmcError>> {
        Box::pin(self.do_inventory())
    },
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn override_mapping() {
        let f = BootFlags {
            valid: true,
            persistent: false,
            efi: true,
            device: BootDevice::Pxe,
        };
        let o = to_override(f);
        assert_eq!(o.target, "Pxe");
        assert_eq!(o.enabled, OverrideEnabled::Once);
        assert_eq!(o.mode, Some(BootMode::Uefi));
        assert_eq!(
            to_override(BootFlags { valid: false, ..f }).enabled,
            OverrideEnabled::Disabled
        );
    }

    #[test]
    fn default_port() {
        let ep = BmcEndpoint {
            driver: Driver::Ipmi,
            address: "10.0.0.5".into(),
            username: "u".into(),
            password: Secret::new("p"),
            system_id: None,
            match_mac: None,
            match_uuid: None,
            tls: super::super::TlsPolicy::Insecure,
            policy: CallPolicy::default(),
        };
        assert_eq!(IpmiBmc::new(&ep).unwrap().link.address, "10.0.0.5:623");
    }

    #[test]
    fn io_kinds() {
        use std::io::{Error, ErrorKind};
        assert_eq!(io_kind(&Error::from(ErrorKind::WouldBlock)), Some(true));
        assert_eq!(
            io_kind(&Error::from(ErrorKind::ConnectionRefused)),
            Some(false)
        );
    }
}

//! The node lifecycle as one pure function: `transition(node, event, policy)`.
//!
//! Nothing here touches the store, the network or a clock. Everything impure comes in
//! through the [`Event`] (a fresh boot token, a BMC's answer, a deadline that fired) or
//! the current [`Node`] record, and goes out as the next record plus a list of
//! [`Effect`]s that the worker runs after the store has committed the change.
//!
//! Retry accounting: `attempt` counts the retries used in the current reinstall round.
//! It starts at 0 when a reinstall is requested and is *not* reset when the node moves
//! on from `reclaiming` to `netbooting` or `installing`, because a deadline in those
//! states re-runs the reclaim; resetting it there would let a node that never boots
//! loop forever. It is reset when the node comes to rest (`available`, `allocated`,
//! `quarantined`) and kept in `failed` to show how many retries were spent. Moving on to
//! the next netboot method (`netboot_not_observed`) is a new attempt too, but not a
//! retry: [`Policy::may_retry`] allows `max_attempts` retries besides the fallbacks.
//!
//! Deadlines: a node has at most one deadline. [`Effect::ArmDeadline`] replaces any
//! previous one; [`Effect::ClearDeadline`] drops it. A deadline is armed whenever the node
//! enters (or re-enters, on retry) a state that has one, and cleared when it leaves
//! for a state that has none. The deadline event echoes `(state, generation, attempt)`
//! so a deadline that fires after the node moved on is recognised and ignored.
//! `first_boot` expiry fails the node straight away: the installer has finished, so a
//! new reclaim would reinstall, and a power cycle rarely fixes an image whose agent
//! never reports; the operator decides with a fresh reinstall.

use std::fmt;
use std::time::Duration;

use crate::config::LifecycleConfig;

pub use crate::model::{BmcStep, BootToken, State, Step};

/// What a deadline failure says: what never happened, in the stage that timed out.
/// It starts with `deadline:` so alerts can match it.
fn deadline_reason(node: &Node, policy: &Policy) -> String {
    let within = policy
        .deadline(node.state)
        .map(|d| format!(" within {}s", d.as_secs()))
        .unwrap_or_default();
    let tries = node.attempt + 1;
    match node.state {
        State::Reclaiming => format!(
            "deadline: the BMC did not set network boot and power-cycle{within} ({tries} tries)"
        ),
        State::Netbooting => format!(
            "deadline: never netbooted: no boot script fetched{within} of the power cycle \
             ({tries} tries); the machine booted something else (boot override not applied?) \
             or cannot reach pxed"
        ),
        State::Installing => format!(
            "deadline: the install did not report installed or failed{within} ({tries} tries)"
        ),
        State::FirstBoot => {
            format!("deadline: the installed system did not report first boot and health{within}")
        }
        other => format!("deadline in {other}"),
    }
}

/// What a node fails with when no netboot method made it netboot. It starts with
/// `netboot_not_observed:` so alerts can match it, and names what was tried.
fn not_observed_reason(node: &Node, policy: &Policy) -> String {
    let within = policy
        .observe_window
        .map(|d| format!(" within {}s", d.as_secs()))
        .unwrap_or_default();
    format!(
        "netboot_not_observed: no DHCP from a boot MAC{within} of the power action after \
         every netboot method (tried: {}); the BMC accepts the boot override but the \
         machine boots something else",
        node.netboot.tried_text()
    )
}

/// Why a node is `failed` or `quarantined` (`nodes.failed_step`, `nodes.failed_reason`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// What failed, or the state the node was in when an operator acted.
    pub step: Step,
    /// Human-readable reason: the BMC's error, `deadline`, the health detail, the operator's text.
    pub reason: String,
}

/// How a reclaim makes a machine netboot. A BMC that accepts a one-time override and
/// boots the disk anyway is caught by the observe window (no DHCP from a boot MAC
/// after the power action) and the node is retried with the next method of its plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NetbootMethod {
    /// The one-time override with the fields the BMC advertises, then its restart reset
    /// (`PowerCycle`, else `ForceRestart`).
    Standard,
    /// The override with `BootSourceOverrideMode: UEFI` spelled out even where the BMC
    /// does not advertise the field (firmware that otherwise picks legacy or the disk).
    UefiOverride,
    /// The override with the mode spelled out, then a reset of the other kind:
    /// `ForceOff`, wait for Off, `On` (BMCs that apply an override only at a cold boot).
    OffOn,
}

impl NetbootMethod {
    /// Every method, in the default order of a plan.
    pub const ALL: [NetbootMethod; 3] = [
        NetbootMethod::Standard,
        NetbootMethod::UefiOverride,
        NetbootMethod::OffOn,
    ];

    /// Snake-case name (store, audit, metrics).
    pub fn as_str(self) -> &'static str {
        match self {
            NetbootMethod::Standard => "standard",
            NetbootMethod::UefiOverride => "uefi_override",
            NetbootMethod::OffOn => "off_on",
        }
    }

    /// The method named `s` (see [`NetbootMethod::as_str`]).
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.as_str() == s)
    }

    /// The default order with `preferred` (methods that worked for this BMC model,
    /// best first) moved to the front.
    pub fn plan(preferred: &[NetbootMethod]) -> Vec<NetbootMethod> {
        let mut plan: Vec<NetbootMethod> = Vec::with_capacity(Self::ALL.len());
        for m in preferred.iter().copied().chain(Self::ALL) {
            if !plan.contains(&m) {
                plan.push(m);
            }
        }
        plan
    }
}

impl fmt::Display for NetbootMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where the current reinstall is in its plan of netboot methods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Netboot {
    /// The method the current reclaim attempt uses.
    pub method: NetbootMethod,
    /// Methods used in this generation, in order (the current one last).
    pub tried: Vec<NetbootMethod>,
    /// A DHCP packet from a boot MAC arrived since the last power action.
    pub observed: bool,
}

impl Default for Netboot {
    fn default() -> Self {
        Netboot {
            method: NetbootMethod::Standard,
            tried: Vec::new(),
            observed: false,
        }
    }
}

impl Netboot {
    /// Starts a plan with `method`.
    fn start(method: NetbootMethod) -> Self {
        Netboot {
            method,
            tried: vec![method],
            observed: false,
        }
    }

    /// The methods tried, as `a, b, c`.
    pub fn tried_text(&self) -> String {
        self.tried
            .iter()
            .map(|m| m.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The lifecycle fields of a node record: what `transition` reads and what it returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// `nodes.state`.
    pub state: State,
    /// `nodes.generation`: bumped by every reinstall; callbacks and BMC answers carry it.
    pub generation: i64,
    /// `nodes.attempt`: retries used in the current reinstall round.
    pub attempt: u32,
    /// `nodes.image`: what the next (or current) install puts on the disk.
    pub image: Option<String>,
    /// `nodes.boot_token`: set only while a reinstall is in progress.
    pub token: Option<BootToken>,
    /// `nodes.failed_step` + `nodes.failed_reason`: set in `failed` and `quarantined`.
    pub failure: Option<Failure>,
    /// The first-boot agent has reported in the current generation (health needs it).
    /// Not a column: derive it from the audit log, i.e. a `node_events` row with this
    /// generation and event `first_boot_reported`.
    pub first_boot_reported: bool,
    /// The netboot method in use, those tried and whether the netboot was observed
    /// (`netboot_progress`, migration 0010).
    pub netboot: Netboot,
    /// Input only: the order to try netboot methods in for this node's BMC model (the
    /// one that worked last for the model first; see [`NetbootMethod::plan`]). Empty
    /// means the default order.
    pub plan: Vec<NetbootMethod>,
}

impl Node {
    /// A freshly seen machine.
    pub fn discovered() -> Self {
        Node {
            state: State::Discovered,
            generation: 0,
            attempt: 0,
            image: None,
            token: None,
            failure: None,
            first_boot_reported: false,
            netboot: Netboot::default(),
            plan: Vec::new(),
        }
    }

    /// The plan in force: [`Node::plan`], or the default order when it is empty.
    fn plan(&self) -> Vec<NetbootMethod> {
        if self.plan.is_empty() {
            NetbootMethod::ALL.to_vec()
        } else {
            self.plan.clone()
        }
    }
}

/// Something that happened to a node (past tense). Names go to `node_events.event`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// An operator accepted a discovered machine.
    Enrolled,
    /// The node was handed to a user.
    Allocated,
    /// The user gave the node back (without a reinstall).
    Released,
    /// `POST /api/v1/nodes/{id}/reinstall`. `image: None` keeps the node's image;
    /// `token` is the fresh one-time boot token for the new generation.
    ReinstallRequested {
        image: Option<String>,
        token: BootToken,
    },
    /// The BMC accepted one-time network boot and reading it back confirmed it.
    NetbootSet { generation: i64, attempt: u32 },
    /// The BMC power-cycled the machine.
    PowerCycled { generation: i64, attempt: u32 },
    /// A BMC operation failed (this try).
    BmcStepFailed {
        step: BmcStep,
        generation: i64,
        attempt: u32,
        reason: String,
    },
    /// A DHCP packet from one of the node's boot MACs arrived while it was
    /// `netbooting` (or `reclaiming` with `after_reset`: the power cycle of the current
    /// attempt was already sent; firmware may DHCP before the BMC reports the reset
    /// done): the power action made the machine netboot.
    NetbootObserved { generation: i64, after_reset: bool },
    /// The observe window armed by [`Effect::ArmObserveWindow`] passed without a DHCP
    /// packet from a boot MAC: the BMC took the override and booted something else.
    NetbootNotObserved {
        generation: i64,
        attempt: u32,
        method: NetbootMethod,
    },
    /// The per-node iPXE script served the installer for this generation.
    InstallerServed { generation: i64 },
    /// Callback `installed`.
    InstallFinished { generation: i64 },
    /// Callback `failed`: the installer or deploy agent gave up at `stage` (its own
    /// name for the step) with `reason` in its own words. Not retried: the same media
    /// would fail the same way.
    InstallFailed {
        generation: i64,
        stage: String,
        reason: String,
    },
    /// Callback `first-boot`: hostname and hardware facts (JSON text).
    FirstBootReported {
        generation: i64,
        hostname: String,
        facts: String,
    },
    /// Callback `health`: pass.
    HealthPassed { generation: i64 },
    /// Callback `health`: fail.
    HealthFailed { generation: i64, detail: String },
    /// Callback `health` passed, but the hardware the agents reported in this generation
    /// fails the acceptance gate ([`crate::inventory::gate`]): `reason` names the failed
    /// profile rules and what was lost since the baseline.
    InventoryRejected { generation: i64, reason: String },
    /// The deadline armed by [`Effect::ArmDeadline`] with these fields fired.
    DeadlineExpired {
        state: State,
        generation: i64,
        attempt: u32,
    },
    /// Taken out of service.
    Quarantined { reason: String },
    /// Quarantine lifted.
    Restored,
    /// An operator declared the node failed.
    MarkedFailed { reason: String },
}

impl Event {
    /// Snake-case name for `node_events.event`.
    pub fn name(&self) -> &'static str {
        match self {
            Event::Enrolled => "enrolled",
            Event::Allocated => "allocated",
            Event::Released => "released",
            Event::ReinstallRequested { .. } => "reinstall_requested",
            Event::NetbootSet { .. } => "netboot_set",
            Event::PowerCycled { .. } => "power_cycled",
            Event::BmcStepFailed { .. } => "bmc_step_failed",
            Event::NetbootObserved { .. } => "netboot_observed",
            Event::NetbootNotObserved { .. } => "netboot_not_observed",
            Event::InstallerServed { .. } => "installer_served",
            Event::InstallFinished { .. } => "install_finished",
            Event::InstallFailed { .. } => "install_failed",
            Event::FirstBootReported { .. } => "first_boot_reported",
            Event::HealthPassed { .. } => "health_passed",
            Event::HealthFailed { .. } => "health_failed",
            Event::InventoryRejected { .. } => "inventory_rejected",
            Event::DeadlineExpired { .. } => "deadline_expired",
            Event::Quarantined { .. } => "quarantined",
            Event::Restored => "restored",
            Event::MarkedFailed { .. } => "marked_failed",
        }
    }

    /// Text for `node_events.detail`. Never contains the boot token.
    pub fn detail(&self) -> Option<String> {
        match self {
            Event::ReinstallRequested { image, .. } => image.as_ref().map(|i| format!("image {i}")),
            Event::BmcStepFailed {
                step,
                attempt,
                reason,
                ..
            } => Some(format!("{step} (attempt {attempt}): {reason}")),
            Event::FirstBootReported { hostname, .. } => Some(format!("hostname {hostname}")),
            Event::HealthFailed { detail, .. } => Some(detail.clone()),
            Event::InventoryRejected { reason, .. } => Some(reason.clone()),
            Event::InstallFailed { stage, reason, .. } => Some(format!("{stage}: {reason}")),
            Event::DeadlineExpired { state, attempt, .. } => {
                Some(format!("{state} (attempt {attempt})"))
            }
            Event::NetbootNotObserved {
                attempt, method, ..
            } => Some(format!(
                "no DHCP from a boot MAC after the power action (method {method}, attempt {attempt})"
            )),
            Event::Quarantined { reason } | Event::MarkedFailed { reason } => Some(reason.clone()),
            Event::Enrolled
            | Event::Allocated
            | Event::Released
            | Event::NetbootSet { .. }
            | Event::PowerCycled { .. }
            | Event::NetbootObserved { .. }
            | Event::InstallerServed { .. }
            | Event::InstallFinished { .. }
            | Event::HealthPassed { .. }
            | Event::Restored => None,
        }
    }

    /// The generation an agent callback (or the boot script) claims; `None` for events
    /// that do not come from the node itself.
    fn callback_generation(&self) -> Option<i64> {
        match self {
            Event::InstallerServed { generation }
            | Event::NetbootObserved { generation, .. }
            | Event::InstallFinished { generation }
            | Event::InstallFailed { generation, .. }
            | Event::FirstBootReported { generation, .. }
            | Event::HealthPassed { generation }
            | Event::HealthFailed { generation, .. }
            | Event::InventoryRejected { generation, .. } => Some(*generation),
            Event::Enrolled
            | Event::Allocated
            | Event::Released
            | Event::ReinstallRequested { .. }
            | Event::NetbootSet { .. }
            | Event::PowerCycled { .. }
            | Event::BmcStepFailed { .. }
            | Event::NetbootNotObserved { .. }
            | Event::DeadlineExpired { .. }
            | Event::Quarantined { .. }
            | Event::Restored
            | Event::MarkedFailed { .. } => None,
        }
    }
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Something the worker must do after the change is committed (imperative).
/// Effects run in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Set one-time network boot, then read it back; answer with `NetbootSet` or
    /// `BmcStepFailed { step: SetNetboot }` echoing `generation` and `attempt`.
    /// Wait `delay` first (retry backoff); skip it if [`Effect::is_current`] turns false.
    /// `method` says how (see [`NetbootMethod`]).
    SetNetboot {
        generation: i64,
        attempt: u32,
        delay: Duration,
        method: NetbootMethod,
    },
    /// Power-cycle (the reset `method` asks for); answer with `PowerCycled` or
    /// `BmcStepFailed { step: PowerCycle }`.
    PowerCycle {
        generation: i64,
        attempt: u32,
        delay: Duration,
        method: NetbootMethod,
    },
    /// Replace the node's deadline: after `after`, send
    /// `DeadlineExpired { state, generation, attempt }`.
    ArmDeadline {
        state: State,
        generation: i64,
        attempt: u32,
        after: Duration,
    },
    /// Drop the node's deadline.
    ClearDeadline,
    /// Replace the node's deadline with the netboot observe window: after `after`, send
    /// `NetbootNotObserved { generation, attempt, method }`.
    ArmObserveWindow {
        generation: i64,
        attempt: u32,
        method: NetbootMethod,
        after: Duration,
    },
    /// The node netbooted with `method`: record that it works for its BMC's model, so
    /// the next reinstall of a node of that model tries it first. Best effort.
    RecordNetbootMethod {
        generation: i64,
        method: NetbootMethod,
    },
    /// The node netbooted for `generation`: read its BMC's boot override and take it
    /// away if it still boots the network (a BMC that keeps a one-time override as
    /// `Continuous` would otherwise netboot the installed system again). Best effort: a
    /// failure is counted and logged, and the node goes on.
    ClearBootOverride { generation: i64 },
}

impl Effect {
    /// Snake-case name, for logs.
    pub fn name(&self) -> &'static str {
        match self {
            Effect::SetNetboot { .. } => BmcStep::SetNetboot.as_str(),
            Effect::PowerCycle { .. } => BmcStep::PowerCycle.as_str(),
            Effect::ArmDeadline { .. } => "arm_deadline",
            Effect::ClearDeadline => "clear_deadline",
            Effect::ArmObserveWindow { .. } => "arm_observe_window",
            Effect::RecordNetbootMethod { .. } => "record_netboot_method",
            Effect::ClearBootOverride { .. } => "clear_boot_override",
        }
    }

    /// Whether a (possibly delayed) effect still applies to `node` as it is now. The
    /// worker checks this after a backoff delay so that a node quarantined or retried
    /// meanwhile is not power-cycled by a stale plan.
    pub fn is_current(&self, node: &Node) -> bool {
        match self {
            Effect::SetNetboot {
                generation,
                attempt,
                ..
            }
            | Effect::PowerCycle {
                generation,
                attempt,
                ..
            } => {
                node.state == State::Reclaiming
                    && node.generation == *generation
                    && node.attempt == *attempt
            }
            Effect::ArmDeadline {
                state,
                generation,
                attempt,
                ..
            } => node.state == *state && node.generation == *generation && node.attempt == *attempt,
            Effect::ClearDeadline => true,
            Effect::ArmObserveWindow {
                generation,
                attempt,
                ..
            } => {
                node.state == State::Netbooting
                    && !node.netboot.observed
                    && node.generation == *generation
                    && node.attempt == *attempt
            }
            Effect::RecordNetbootMethod { generation, .. } => node.generation == *generation,
            Effect::ClearBootOverride { generation } => {
                node.generation == *generation
                    && matches!(node.state, State::Installing | State::FirstBoot)
            }
        }
    }
}

/// Deadlines, retries and backoff.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Deadline per state, indexed like [`State::ALL`]. Only in-progress states
    /// ([`State::in_progress`]) are ever armed: a resting state has nothing to retry.
    pub deadlines: [Option<Duration>; 9],
    /// Retries per reinstall round: a failure or expiry at `attempt < max_attempts`
    /// retries with `attempt + 1`; otherwise the node fails. So a round makes at most
    /// `max_attempts + 1` tries.
    pub max_attempts: u32,
    /// Delay before retry `n` (1-based) is `backoff * 2^(n-1)`, capped at `backoff_max`.
    pub backoff: Duration,
    /// Cap of the exponential backoff.
    pub backoff_max: Duration,
    /// How long after the power action a DHCP packet from a boot MAC must arrive
    /// before the next netboot method is tried (`lifecycle.netboot_observe`); `None`
    /// waits for the `netbooting` deadline only.
    pub observe_window: Option<Duration>,
}

/// Default of `lifecycle.netboot_observe`.
pub const DEFAULT_NETBOOT_OBSERVE: Duration = Duration::from_secs(180);

/// Cap on the retry delay when the configuration gives none.
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(600);

impl Policy {
    /// The policy the configuration asks for. Unknown state names (config validates
    /// them already) and deadlines of resting states are ignored.
    pub fn from_config(c: &LifecycleConfig) -> Self {
        let mut deadlines = [None; 9];
        for s in State::ALL {
            deadlines[s.index()] = c.deadlines.get(&s).copied();
        }
        Policy {
            deadlines,
            max_attempts: c.max_attempts,
            backoff: c.backoff,
            backoff_max: DEFAULT_BACKOFF_MAX.max(c.backoff),
            observe_window: Some(c.netboot_observe),
        }
    }

    /// The timer armed for `node` as it is: the observe window while it is
    /// `netbooting` and no DHCP from a boot MAC was seen, else its state's deadline.
    /// (The worker re-arms from this on restart.)
    pub fn timer_for(&self, node: &Node) -> Option<Effect> {
        // A `netbooting` deadline shorter than the window is the tighter watch.
        if node.state == State::Netbooting
            && !node.netboot.observed
            && let Some(after) = self.observe_window
            && self.deadline(State::Netbooting).is_none_or(|d| after < d)
        {
            return Some(Effect::ArmObserveWindow {
                generation: node.generation,
                attempt: node.attempt,
                method: node.netboot.method,
                after,
            });
        }
        self.deadline(node.state).map(|after| Effect::ArmDeadline {
            state: node.state,
            generation: node.generation,
            attempt: node.attempt,
            after,
        })
    }

    /// The deadline armed on entering `state`, if any.
    pub fn deadline(&self, state: State) -> Option<Duration> {
        if !state.in_progress() {
            return None;
        }
        self.deadlines[state.index()]
    }

    /// Whether the current round has a retry left: `max_attempts` retries besides the
    /// attempts that moved on to the next netboot method (a fallback is not a retry).
    pub fn may_retry(&self, node: &Node) -> bool {
        let fallbacks = u32::try_from(node.netboot.tried.len().saturating_sub(1)).unwrap_or(0);
        node.attempt < self.max_attempts.saturating_add(fallbacks)
    }

    /// Delay before the retry that moves the node to `attempt` (1-based).
    pub fn backoff_for(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(31);
        self.backoff
            .checked_mul(1u32 << exp)
            .unwrap_or(self.backoff_max)
            .min(self.backoff_max)
    }
}

impl Default for Policy {
    /// The same values as the configuration defaults.
    fn default() -> Self {
        let mut deadlines = [None; 9];
        for (s, secs) in [
            (State::Reclaiming, 300),
            (State::Netbooting, 900),
            (State::Installing, 3600),
            (State::FirstBoot, 1200),
        ] {
            deadlines[s.index()] = Some(Duration::from_secs(secs));
        }
        Policy {
            deadlines,
            max_attempts: 3,
            backoff: Duration::from_secs(10),
            backoff_max: DEFAULT_BACKOFF_MAX,
            observe_window: Some(DEFAULT_NETBOOT_OBSERVE),
        }
    }
}

/// The first-boot report to store with the change (`nodes.hostname`, `nodes.facts`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FirstBoot {
    /// Hostname the node reported.
    pub hostname: String,
    /// Hardware facts, JSON text.
    pub facts: String,
}

/// An accepted change: write `node`, append the audit row, then run `effects`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    /// The node record after the event.
    pub node: Node,
    /// What the worker must do once the change is committed, in order.
    pub effects: Vec<Effect>,
    /// A first-boot report to write in the same update.
    pub report: Option<FirstBoot>,
    /// The node (re)entered its state (new state, generation or retry): set
    /// `state_since = now`, the base from which deadlines are re-armed on restart.
    pub entered: bool,
}

/// Why an event changed nothing without being an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ignored {
    /// A deadline for a state, generation or attempt the node has left.
    StaleDeadline,
    /// A BMC answer for a step the node is no longer waiting on.
    StaleBmcResult,
    /// A repeat of what already happened (agent or script retried, already quarantined).
    Repeated,
    /// Something the node did that the lifecycle is not waiting for in its state (a
    /// DHCP packet from a node that is not netbooting: see the leftovers check).
    NotAwaited,
}

/// What `transition` decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The node changes; see [`Transition`] (boxed: it carries two node records' worth).
    Changed(Box<Transition>),
    /// A reinstall was requested while one is running: nothing changes; answer with
    /// the running operation.
    InProgress { state: State, generation: i64 },
    /// Nothing changes and nothing is wrong; nothing to write (the caller may log it).
    Ignored(Ignored),
}

/// Why an event was refused. The caller changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    /// The event makes no sense in this state (API: 409).
    #[error("event {event} is not allowed in state {state}")]
    NotAllowed { state: State, event: &'static str },
    /// A callback from another generation, e.g. an old install's token (API: 403).
    #[error("stale generation {got} (current {current})")]
    StaleGeneration { current: i64, got: i64 },
    /// A reinstall without an image, and the node has none.
    #[error("no image: the request names none and the node has none")]
    NoImage,
    /// Health reported before the first-boot report of this generation.
    #[error("health reported before first boot")]
    FirstBootNotReported,
}

/// The installer went out: `installing`, and the one-time network boot is cleared.
fn installer_served(node: &Node, policy: &Policy) -> Outcome {
    let next = Node {
        state: State::Installing,
        ..node.clone()
    };
    let clear = Effect::ClearBootOverride {
        generation: node.generation,
    };
    changed(node, next, policy, Duration::ZERO, vec![clear], None)
}

/// The operator's verbs (the API's actions and the CLI's subcommands) that change a
/// node in `state`, as [`transition`] decides them (a test holds the two together): a
/// refused action names what the operator can do instead, e.g. that a failed node
/// leaves `failed` by a reinstall (its disk is in an unknown state), not a release.
pub fn operator_actions(state: State) -> &'static [&'static str] {
    match state {
        State::Discovered => &["enroll", "quarantine"],
        State::Available => &["allocate", "reinstall", "quarantine", "fail"],
        State::Allocated => &["release", "reinstall", "quarantine", "fail"],
        State::Reclaiming | State::Netbooting | State::Installing | State::FirstBoot => {
            &["quarantine", "fail"]
        }
        State::Failed => &["reinstall", "quarantine"],
        State::Quarantined => &["restore"],
    }
}

/// "an installing node", "a failed node": for messages about a node in `state`.
pub fn a_node_in(state: State) -> String {
    let s = state.as_str();
    let a = if s.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    };
    format!("{a} {s} node")
}

/// The operator's verb an event comes from, if it comes from one.
pub fn operator_verb(event: &str) -> Option<&'static str> {
    Some(match event {
        "enrolled" => "enroll",
        "allocated" => "allocate",
        "released" => "release",
        "reinstall_requested" => "reinstall",
        "quarantined" => "quarantine",
        "restored" => "restore",
        "marked_failed" => "fail",
        _ => return None,
    })
}

/// Whether [`Event::NetbootObserved`] (its `after_reset` as given) can change a node in
/// `state` whose current generation's netboot was `observed` already, as
/// [`transition`] decides it: DHCP sightings that cannot are not sent through the
/// store's writer at all (a machine's firmware and iPXE each send a DISCOVER and a
/// REQUEST; only the first counts).
pub fn netboot_sighting_matters(state: State, after_reset: bool, observed: bool) -> bool {
    match state {
        State::Reclaiming => after_reset && !observed,
        State::Netbooting => !observed,
        _ => false,
    }
}

/// Decide what `event` does to `node` under `policy`. Pure.
pub fn transition(node: &Node, event: &Event, policy: &Policy) -> Result<Outcome, TransitionError> {
    use Event as E;
    use State as S;

    if let Some(got) = event.callback_generation()
        && got != node.generation
    {
        return Err(TransitionError::StaleGeneration {
            current: node.generation,
            got,
        });
    }
    let not_allowed = || {
        Err(TransitionError::NotAllowed {
            state: node.state,
            event: event.name(),
        })
    };
    let bmc_current = |generation: i64, attempt: u32| {
        node.state == S::Reclaiming && node.generation == generation && node.attempt == attempt
    };
    let stale_bmc = Ok(Outcome::Ignored(Ignored::StaleBmcResult));

    match (node.state, event) {
        (S::Discovered, E::Enrolled) => Ok(rest(node, policy, S::Available)),
        (
            S::Available
            | S::Allocated
            | S::Reclaiming
            | S::Netbooting
            | S::Installing
            | S::FirstBoot
            | S::Failed
            | S::Quarantined,
            E::Enrolled,
        ) => not_allowed(),

        (S::Available, E::Allocated) => Ok(rest(node, policy, S::Allocated)),
        (
            S::Discovered
            | S::Allocated
            | S::Reclaiming
            | S::Netbooting
            | S::Installing
            | S::FirstBoot
            | S::Failed
            | S::Quarantined,
            E::Allocated,
        ) => not_allowed(),

        (S::Allocated, E::Released) => Ok(rest(node, policy, S::Available)),
        (
            S::Discovered
            | S::Available
            | S::Reclaiming
            | S::Netbooting
            | S::Installing
            | S::FirstBoot
            | S::Failed
            | S::Quarantined,
            E::Released,
        ) => not_allowed(),

        (S::Available | S::Allocated | S::Failed, E::ReinstallRequested { image, token }) => {
            let image = image.clone().or_else(|| node.image.clone());
            if image.is_none() {
                return Err(TransitionError::NoImage);
            }
            let method = node.plan()[0];
            let next = Node {
                state: S::Reclaiming,
                generation: node.generation + 1,
                attempt: 0,
                image,
                token: Some(token.clone()),
                failure: None,
                first_boot_reported: false,
                netboot: Netboot::start(method),
                plan: node.plan.clone(),
            };
            let set = Effect::SetNetboot {
                generation: next.generation,
                attempt: 0,
                delay: Duration::ZERO,
                method,
            };
            Ok(changed(node, next, policy, Duration::ZERO, vec![set], None))
        }
        (
            S::Reclaiming | S::Netbooting | S::Installing | S::FirstBoot,
            E::ReinstallRequested { .. },
        ) => Ok(Outcome::InProgress {
            state: node.state,
            generation: node.generation,
        }),
        (S::Discovered | S::Quarantined, E::ReinstallRequested { .. }) => not_allowed(),

        (
            S::Reclaiming,
            E::NetbootSet {
                generation,
                attempt,
            },
        ) => {
            if !bmc_current(*generation, *attempt) {
                return stale_bmc;
            }
            let cycle = Effect::PowerCycle {
                generation: node.generation,
                attempt: node.attempt,
                delay: Duration::ZERO,
                method: node.netboot.method,
            };
            Ok(changed(
                node,
                node.clone(),
                policy,
                Duration::ZERO,
                vec![cycle],
                None,
            ))
        }
        (
            S::Reclaiming,
            E::PowerCycled {
                generation,
                attempt,
            },
        ) => {
            if !bmc_current(*generation, *attempt) {
                return stale_bmc;
            }
            // `observed` stays: the netboot may have been seen before this answer.
            let next = Node {
                state: S::Netbooting,
                ..node.clone()
            };
            Ok(changed(node, next, policy, Duration::ZERO, vec![], None))
        }
        (
            S::Reclaiming,
            E::BmcStepFailed {
                step,
                generation,
                attempt,
                reason,
            },
        ) => {
            if !bmc_current(*generation, *attempt) {
                return stale_bmc;
            }
            if policy.may_retry(node) {
                let attempt = node.attempt + 1;
                let delay = policy.backoff_for(attempt);
                let next = Node {
                    attempt,
                    ..node.clone()
                };
                let method = node.netboot.method;
                let mut next = next;
                next.netboot.observed = false;
                let again = match step {
                    BmcStep::SetNetboot => Effect::SetNetboot {
                        generation: node.generation,
                        attempt,
                        delay,
                        method,
                    },
                    BmcStep::PowerCycle => Effect::PowerCycle {
                        generation: node.generation,
                        attempt,
                        delay,
                        method,
                    },
                };
                Ok(changed(node, next, policy, delay, vec![again], None))
            } else {
                Ok(fail(node, policy, Step::Bmc(*step), reason.clone()))
            }
        }
        // BMC answers are only awaited in `reclaiming`; anywhere else they are late.
        (
            S::Discovered
            | S::Available
            | S::Allocated
            | S::Netbooting
            | S::Installing
            | S::FirstBoot
            | S::Failed
            | S::Quarantined,
            E::NetbootSet { .. } | E::PowerCycled { .. } | E::BmcStepFailed { .. },
        ) => stale_bmc,

        // Before the reset was sent, a DHCP is the machine's previous boot, not ours.
        (S::Reclaiming, E::NetbootObserved { after_reset, .. }) => {
            if !after_reset {
                return Ok(Outcome::Ignored(Ignored::NotAwaited));
            }
            if node.netboot.observed {
                return Ok(Outcome::Ignored(Ignored::Repeated));
            }
            let mut next = node.clone();
            next.netboot.observed = true;
            let record = Effect::RecordNetbootMethod {
                generation: node.generation,
                method: node.netboot.method,
            };
            Ok(changed(
                node,
                next,
                policy,
                Duration::ZERO,
                vec![record],
                None,
            ))
        }
        (S::Netbooting, E::NetbootObserved { .. }) => {
            if node.netboot.observed {
                return Ok(Outcome::Ignored(Ignored::Repeated));
            }
            let mut next = node.clone();
            next.netboot.observed = true;
            // The observe window is replaced by the rest of the `netbooting` deadline.
            let mut effects = Vec::new();
            if let Some(after) = policy.deadline(S::Netbooting) {
                effects.push(Effect::ArmDeadline {
                    state: S::Netbooting,
                    generation: node.generation,
                    attempt: node.attempt,
                    after,
                });
            }
            effects.push(Effect::RecordNetbootMethod {
                generation: node.generation,
                method: node.netboot.method,
            });
            Ok(changed(node, next, policy, Duration::ZERO, effects, None))
        }
        (
            S::Discovered
            | S::Available
            | S::Allocated
            | S::Installing
            | S::FirstBoot
            | S::Failed
            | S::Quarantined,
            E::NetbootObserved { .. },
        ) => Ok(Outcome::Ignored(Ignored::NotAwaited)),

        (
            S::Netbooting,
            E::NetbootNotObserved {
                generation,
                attempt,
                ..
            },
        ) if !node.netboot.observed
            && (*generation, *attempt) == (node.generation, node.attempt) =>
        {
            let plan = node.plan();
            match plan.iter().find(|m| !node.netboot.tried.contains(m)) {
                Some(&method) => {
                    let mut netboot = node.netboot.clone();
                    netboot.method = method;
                    netboot.tried.push(method);
                    netboot.observed = false;
                    let next = Node {
                        state: S::Reclaiming,
                        attempt: node.attempt + 1,
                        netboot,
                        ..node.clone()
                    };
                    let set = Effect::SetNetboot {
                        generation: node.generation,
                        attempt: next.attempt,
                        delay: Duration::ZERO,
                        method,
                    };
                    Ok(changed(node, next, policy, Duration::ZERO, vec![set], None))
                }
                None => Ok(fail(
                    node,
                    policy,
                    Step::Stage(S::Netbooting),
                    not_observed_reason(node, policy),
                )),
            }
        }
        // A window for another attempt, or the netboot was seen meanwhile.
        (_, E::NetbootNotObserved { .. }) => Ok(Outcome::Ignored(Ignored::StaleDeadline)),

        (S::Netbooting, E::InstallerServed { .. }) => Ok(installer_served(node, policy)),
        // From `reclaiming` too once a DHCP from the node arrived after its reset was
        // sent: the machine netbooted into iPXE before the power cycle's result was
        // recorded (fast firmware, or a BMC slow to show the restart; seen in the
        // 1,000-node storm). Refusing would send it to its old disk and leave the
        // reinstall waiting for a deadline. The power cycle's result, when it comes,
        // finds the node past `reclaiming` and is ignored as stale.
        (S::Reclaiming, E::InstallerServed { .. }) if node.netboot.observed => {
            Ok(installer_served(node, policy))
        }
        // The installer was served a second time in this attempt: the machine rebooted
        // into the netboot again instead of installing (an override the BMC keeps, an
        // installer that crashes and reboots). Serving it again would loop forever.
        (S::Installing, E::InstallerServed { generation }) => Ok(fail(
            node,
            policy,
            Step::Stage(S::Installing),
            format!(
                "boot_loop: the installer was served twice in generation {generation}; \
                 the machine netbooted again instead of installing"
            ),
        )),
        (
            S::Discovered
            | S::Available
            | S::Allocated
            | S::Reclaiming
            | S::FirstBoot
            | S::Failed
            | S::Quarantined,
            E::InstallerServed { .. },
        ) => not_allowed(),

        // From `netbooting` too: the script fetch may have been missed (e.g. served
        // from a cache or a manual boot), yet the install ran for this generation.
        (S::Netbooting | S::Installing, E::InstallFinished { .. }) => {
            let next = Node {
                state: S::FirstBoot,
                ..node.clone()
            };
            Ok(changed(node, next, policy, Duration::ZERO, vec![], None))
        }
        // The installer retried its callback.
        (S::FirstBoot, E::InstallFinished { .. }) => Ok(Outcome::Ignored(Ignored::Repeated)),
        (S::Netbooting | S::Installing, E::InstallFailed { stage, reason, .. }) => Ok(fail(
            node,
            policy,
            Step::Stage(S::Installing),
            format!("{stage}: {reason}"),
        )),
        (
            S::Discovered
            | S::Available
            | S::Allocated
            | S::Reclaiming
            | S::FirstBoot
            | S::Failed
            | S::Quarantined,
            E::InstallFailed { .. },
        ) => not_allowed(),
        (
            S::Discovered
            | S::Available
            | S::Allocated
            | S::Reclaiming
            | S::Failed
            | S::Quarantined,
            E::InstallFinished { .. },
        ) => not_allowed(),

        // From `installing` too: the installed system is up and reporting, so the
        // install finished even if the installer's own callback was lost. Waiting for
        // it would let the installing deadline reinstall a good node.
        (
            S::FirstBoot | S::Installing,
            E::FirstBootReported {
                hostname, facts, ..
            },
        ) => {
            let next = Node {
                state: S::FirstBoot,
                first_boot_reported: true,
                ..node.clone()
            };
            let report = FirstBoot {
                hostname: hostname.clone(),
                facts: facts.clone(),
            };
            Ok(changed(
                node,
                next,
                policy,
                Duration::ZERO,
                vec![],
                Some(report),
            ))
        }
        (
            S::Discovered
            | S::Available
            | S::Allocated
            | S::Reclaiming
            | S::Netbooting
            | S::Failed
            | S::Quarantined,
            E::FirstBootReported { .. },
        ) => not_allowed(),

        (S::FirstBoot, E::HealthPassed { .. }) => {
            if !node.first_boot_reported {
                return Err(TransitionError::FirstBootNotReported);
            }
            Ok(rest(node, policy, S::Available))
        }
        (S::FirstBoot, E::HealthFailed { detail, .. }) => Ok(fail(
            node,
            policy,
            Step::Stage(S::FirstBoot),
            detail.clone(),
        )),
        // Healthy but not the machine it was: held out of the pool, not failed, so a
        // reinstall cannot put it back by accident; an operator re-baselines or repairs.
        (S::FirstBoot, E::InventoryRejected { reason, .. }) => {
            if !node.first_boot_reported {
                return Err(TransitionError::FirstBootNotReported);
            }
            let mut next = rest_node(node, S::Quarantined);
            next.failure = Some(Failure {
                step: Step::Stage(S::FirstBoot),
                reason: reason.clone(),
            });
            Ok(changed(node, next, policy, Duration::ZERO, vec![], None))
        }
        (
            S::Discovered
            | S::Available
            | S::Allocated
            | S::Reclaiming
            | S::Netbooting
            | S::Installing
            | S::Failed
            | S::Quarantined,
            E::HealthPassed { .. } | E::HealthFailed { .. } | E::InventoryRejected { .. },
        ) => not_allowed(),

        (
            _,
            E::DeadlineExpired {
                state,
                generation,
                attempt,
            },
        ) if (*state, *generation, *attempt) != (node.state, node.generation, node.attempt) => {
            Ok(Outcome::Ignored(Ignored::StaleDeadline))
        }
        (S::Reclaiming | S::Netbooting | S::Installing, E::DeadlineExpired { .. }) => {
            if policy.may_retry(node) {
                // Whatever stage hung, the cure is the same: netboot and power-cycle again.
                let attempt = node.attempt + 1;
                let delay = policy.backoff_for(attempt);
                let mut next = Node {
                    state: S::Reclaiming,
                    attempt,
                    ..node.clone()
                };
                next.netboot.observed = false;
                let set = Effect::SetNetboot {
                    generation: node.generation,
                    attempt,
                    delay,
                    method: node.netboot.method,
                };
                Ok(changed(node, next, policy, delay, vec![set], None))
            } else {
                Ok(fail(
                    node,
                    policy,
                    Step::Stage(node.state),
                    deadline_reason(node, policy),
                ))
            }
        }
        (S::FirstBoot, E::DeadlineExpired { .. }) => Ok(fail(
            node,
            policy,
            Step::Stage(S::FirstBoot),
            deadline_reason(node, policy),
        )),
        // Resting states are never armed; a matching deadline here is a bug upstream.
        (
            S::Discovered | S::Available | S::Allocated | S::Failed | S::Quarantined,
            E::DeadlineExpired { .. },
        ) => not_allowed(),

        (
            S::Discovered
            | S::Available
            | S::Allocated
            | S::Reclaiming
            | S::Netbooting
            | S::Installing
            | S::FirstBoot
            | S::Failed,
            E::Quarantined { reason },
        ) => {
            let mut next = rest_node(node, S::Quarantined);
            next.failure = Some(Failure {
                step: Step::Stage(node.state),
                reason: reason.clone(),
            });
            Ok(changed(node, next, policy, Duration::ZERO, vec![], None))
        }
        (S::Quarantined, E::Quarantined { .. }) => Ok(Outcome::Ignored(Ignored::Repeated)),

        (S::Quarantined, E::Restored) => Ok(rest(node, policy, S::Available)),
        (
            S::Discovered
            | S::Available
            | S::Allocated
            | S::Reclaiming
            | S::Netbooting
            | S::Installing
            | S::FirstBoot
            | S::Failed,
            E::Restored,
        ) => not_allowed(),

        (
            S::Available
            | S::Allocated
            | S::Reclaiming
            | S::Netbooting
            | S::Installing
            | S::FirstBoot,
            E::MarkedFailed { reason },
        ) => Ok(fail(node, policy, Step::Stage(node.state), reason.clone())),
        // A discovered machine was never accepted; failing it would let a reinstall
        // skip enrolment. Quarantine outranks failure.
        (S::Discovered | S::Failed | S::Quarantined, E::MarkedFailed { .. }) => not_allowed(),
    }
}

/// The record of a node coming to rest in `state`: no token, no retries, no failure.
fn rest_node(node: &Node, state: State) -> Node {
    Node {
        state,
        attempt: 0,
        token: None,
        failure: None,
        ..node.clone()
    }
}

fn rest(node: &Node, policy: &Policy, state: State) -> Outcome {
    changed(
        node,
        rest_node(node, state),
        policy,
        Duration::ZERO,
        vec![],
        None,
    )
}

/// Into `failed`; `attempt` is kept to show the retries spent.
fn fail(node: &Node, policy: &Policy, step: Step, reason: String) -> Outcome {
    let next = Node {
        state: State::Failed,
        token: None,
        failure: Some(Failure { step, reason }),
        ..node.clone()
    };
    changed(node, next, policy, Duration::ZERO, vec![], None)
}

/// Build the outcome, deriving the deadline effect so every path treats deadlines alike:
/// (re)entering a state with a deadline arms it (extended by `delay`, the backoff before
/// the retry starts); leaving for a state without one clears it.
fn changed(
    before: &Node,
    next: Node,
    policy: &Policy,
    delay: Duration,
    actions: Vec<Effect>,
    report: Option<FirstBoot>,
) -> Outcome {
    let entered = next.state != before.state
        || next.generation != before.generation
        || next.attempt != before.attempt;
    let mut effects = Vec::with_capacity(actions.len() + 1);
    match (policy.deadline(before.state), policy.timer_for(&next)) {
        (_, Some(mut timer)) if entered => {
            if let Effect::ArmDeadline { after, .. } | Effect::ArmObserveWindow { after, .. } =
                &mut timer
            {
                *after = after.saturating_add(delay);
            }
            effects.push(timer);
        }
        (Some(_), None) => effects.push(Effect::ClearDeadline),
        _ => {}
    }
    effects.extend(actions);
    Outcome::Changed(Box::new(Transition {
        node: next,
        effects,
        report,
        entered,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use State as S;

    const SECS: fn(u64) -> Duration = Duration::from_secs;

    fn policy() -> Policy {
        Policy {
            max_attempts: 3,
            backoff: SECS(10),
            backoff_max: SECS(25),
            // The observe window has its own tests (`observe_window_*`).
            observe_window: None,
            ..Policy::default()
        }
    }

    /// [`policy`] with a 60 s observe window (the `netbooting` deadline is 900 s).
    fn observing() -> Policy {
        Policy {
            observe_window: Some(SECS(60)),
            ..policy()
        }
    }

    fn token(s: &str) -> BootToken {
        BootToken(s.to_string())
    }

    /// The shortcut the DHCP sightings take agrees with the transition, for every
    /// state, with and without the reset sent, observed or not.
    #[test]
    fn netboot_sighting_shortcut_agrees_with_the_transition() {
        for state in State::ALL {
            for after_reset in [false, true] {
                for observed in [false, true] {
                    let mut node = node_in(state);
                    node.netboot.observed = observed;
                    let ev = Event::NetbootObserved {
                        generation: node.generation,
                        after_reset,
                    };
                    let out = transition(&node, &ev, &policy());
                    let changes = matches!(out, Ok(Outcome::Changed(_)));
                    assert_eq!(
                        netboot_sighting_matters(state, after_reset, observed),
                        changes,
                        "{state} after_reset={after_reset} observed={observed}: {out:?}"
                    );
                }
            }
        }
    }

    /// `operator_actions` lists exactly the operator events that change a node in each
    /// state, and `operator_verb` names each of them.
    #[test]
    fn operator_actions_agree_with_the_transition() {
        for state in State::ALL {
            let node = node_in(state);
            let changing: Vec<&str> = events_for(&node)
                .iter()
                .filter(|e| matches!(transition(&node, e, &policy()), Ok(Outcome::Changed(_))))
                .filter_map(|e| operator_verb(e.name()))
                .collect();
            assert_eq!(operator_actions(state), changing.as_slice(), "{state}");
        }
        assert_eq!(operator_verb("installed"), None);
        assert_eq!(a_node_in(State::Installing), "an installing node");
        assert_eq!(a_node_in(State::FirstBoot), "a first_boot node");
    }

    /// A plausible record for a node sitting in `state`, one retry already spent.
    fn node_in(state: State) -> Node {
        Node {
            state,
            generation: 4,
            attempt: 1,
            image: Some("debian-13".into()),
            token: state.in_progress().then(|| token("tok-4")),
            failure: matches!(state, S::Failed | S::Quarantined).then(|| Failure {
                step: Step::Stage(S::Installing),
                reason: "earlier".into(),
            }),
            first_boot_reported: state == S::FirstBoot,
            netboot: if state.in_progress() {
                Netboot::start(NetbootMethod::Standard)
            } else {
                Netboot::default()
            },
            plan: Vec::new(),
        }
    }

    /// One instance of every event variant, echoing the node where a real one would.
    fn events_for(n: &Node) -> Vec<Event> {
        let (generation, attempt) = (n.generation, n.attempt);
        vec![
            Event::Enrolled,
            Event::Allocated,
            Event::Released,
            Event::ReinstallRequested {
                image: None,
                token: token("tok-5"),
            },
            Event::NetbootSet {
                generation,
                attempt,
            },
            Event::PowerCycled {
                generation,
                attempt,
            },
            Event::BmcStepFailed {
                step: BmcStep::SetNetboot,
                generation,
                attempt,
                reason: "connection refused".into(),
            },
            Event::InstallerServed { generation },
            Event::InstallFinished { generation },
            Event::NetbootObserved {
                generation,
                after_reset: true,
            },
            Event::NetbootNotObserved {
                generation,
                attempt,
                method: n.netboot.method,
            },
            Event::InstallFailed {
                generation,
                stage: "verify".into(),
                reason: "sha256 mismatch".into(),
            },
            Event::FirstBootReported {
                generation,
                hostname: "node-0a1b2c".into(),
                facts: "{\"cpus\":8}".into(),
            },
            Event::HealthPassed { generation },
            Event::HealthFailed {
                generation,
                detail: "disk smart failed".into(),
            },
            Event::InventoryRejected {
                generation,
                reason: "inventory: lost: pci 0000:18:00.0 removed".into(),
            },
            Event::DeadlineExpired {
                state: n.state,
                generation,
                attempt,
            },
            Event::Quarantined {
                reason: "memory shrank".into(),
            },
            Event::Restored,
            Event::MarkedFailed {
                reason: "operator".into(),
            },
        ]
    }

    /// Exhaustive on purpose: a new variant fails to compile here until the table
    /// and `events_for` cover it.
    fn variant_index(e: &Event) -> usize {
        match e {
            Event::Enrolled => 0,
            Event::Allocated => 1,
            Event::Released => 2,
            Event::ReinstallRequested { .. } => 3,
            Event::NetbootSet { .. } => 4,
            Event::PowerCycled { .. } => 5,
            Event::BmcStepFailed { .. } => 6,
            Event::InstallerServed { .. } => 7,
            Event::InstallFinished { .. } => 8,
            Event::FirstBootReported { .. } => 9,
            Event::HealthPassed { .. } => 10,
            Event::HealthFailed { .. } => 11,
            Event::DeadlineExpired { .. } => 12,
            Event::Quarantined { .. } => 13,
            Event::Restored => 14,
            Event::MarkedFailed { .. } => 15,
            Event::InstallFailed { .. } => 16,
            Event::NetbootObserved { .. } => 17,
            Event::NetbootNotObserved { .. } => 18,
            Event::InventoryRejected { .. } => 19,
        }
    }

    #[derive(Debug, PartialEq)]
    enum Exp {
        To(State, &'static [&'static str]),
        InProgress,
        Ignored(Ignored),
        NotAllowed,
    }

    /// The allowed cells of the state × event table; every other cell is `NotAllowed`.
    fn expected(state: State, event: &str) -> Exp {
        use Exp::*;
        const ARM: &[&str] = &["arm_deadline"];
        const CLEAR: &[&str] = &["clear_deadline"];
        const RECLAIM: &[&str] = &["arm_deadline", "set_netboot"];
        match (state, event) {
            (_, "netboot_set" | "power_cycled" | "bmc_step_failed") if state != S::Reclaiming => {
                Ignored(super::Ignored::StaleBmcResult)
            }
            (S::Discovered, "enrolled") => To(S::Available, &[]),
            (S::Available, "allocated") => To(S::Allocated, &[]),
            (S::Allocated, "released") => To(S::Available, &[]),
            (S::Available | S::Allocated | S::Failed, "reinstall_requested") => {
                To(S::Reclaiming, RECLAIM)
            }
            (s, "reinstall_requested") if s.in_progress() => InProgress,
            (S::Reclaiming, "netboot_set") => To(S::Reclaiming, &["power_cycle"]),
            (S::Reclaiming, "power_cycled") => To(S::Netbooting, ARM),
            (S::Reclaiming, "bmc_step_failed") => To(S::Reclaiming, RECLAIM),
            (S::Netbooting, "installer_served") => {
                To(S::Installing, &["arm_deadline", "clear_boot_override"])
            }
            (S::Installing, "installer_served") => To(S::Failed, CLEAR),
            (S::Netbooting, "netboot_observed") => {
                To(S::Netbooting, &["arm_deadline", "record_netboot_method"])
            }
            (S::Reclaiming, "netboot_observed") => To(S::Reclaiming, &["record_netboot_method"]),
            (_, "netboot_observed") => Ignored(super::Ignored::NotAwaited),
            (S::Netbooting, "netboot_not_observed") => To(S::Reclaiming, RECLAIM),
            (_, "netboot_not_observed") => Ignored(super::Ignored::StaleDeadline),
            (S::Netbooting | S::Installing, "install_finished") => To(S::FirstBoot, ARM),
            (S::FirstBoot, "install_finished") => Ignored(super::Ignored::Repeated),
            (S::Netbooting | S::Installing, "install_failed") => To(S::Failed, CLEAR),
            (S::FirstBoot, "first_boot_reported") => To(S::FirstBoot, &[]),
            (S::Installing, "first_boot_reported") => To(S::FirstBoot, ARM),
            (S::FirstBoot, "health_passed") => To(S::Available, CLEAR),
            (S::FirstBoot, "health_failed") => To(S::Failed, CLEAR),
            (S::FirstBoot, "inventory_rejected") => To(S::Quarantined, CLEAR),
            (S::Reclaiming | S::Netbooting | S::Installing, "deadline_expired") => {
                To(S::Reclaiming, RECLAIM)
            }
            (S::FirstBoot, "deadline_expired") => To(S::Failed, CLEAR),
            (S::Quarantined, "quarantined") => Ignored(super::Ignored::Repeated),
            (s, "quarantined") if s.in_progress() => To(S::Quarantined, CLEAR),
            (_, "quarantined") => To(S::Quarantined, &[]),
            (S::Quarantined, "restored") => To(S::Available, &[]),
            (s, "marked_failed") if s.in_progress() => To(S::Failed, CLEAR),
            (S::Available | S::Allocated, "marked_failed") => To(S::Failed, &[]),
            _ => NotAllowed,
        }
    }

    #[test]
    fn table_over_every_state_and_event() {
        let p = policy();
        let mut cells = 0;
        let mut allowed = 0;
        for state in State::ALL {
            let node = node_in(state);
            let events = events_for(&node);
            let mut seen: Vec<usize> = events.iter().map(variant_index).collect();
            seen.sort_unstable();
            assert_eq!(
                seen,
                (0..20).collect::<Vec<_>>(),
                "one event of each variant"
            );
            for event in &events {
                cells += 1;
                let want = expected(state, event.name());
                let got = transition(&node, event, &p);
                let ctx = format!("{state} × {}: {got:?}", event.name());
                match (want, got) {
                    (Exp::To(to, names), Ok(Outcome::Changed(t))) => {
                        allowed += 1;
                        assert_eq!(t.node.state, to, "{ctx}");
                        let got_names: Vec<_> = t.effects.iter().map(Effect::name).collect();
                        assert_eq!(got_names, names, "{ctx}");
                        // Invariants of every accepted change.
                        assert_eq!(t.node.token.is_some(), to.in_progress(), "token {ctx}");
                        assert_eq!(
                            t.node.failure.is_some(),
                            matches!(to, S::Failed | S::Quarantined),
                            "failure {ctx}"
                        );
                        assert_eq!(
                            t.entered,
                            (t.node.state, t.node.generation, t.node.attempt)
                                != (node.state, node.generation, node.attempt),
                            "entered {ctx}"
                        );
                        for e in &t.effects {
                            assert!(e.is_current(&t.node), "effect for the new record {ctx}");
                        }
                    }
                    (
                        Exp::InProgress,
                        Ok(Outcome::InProgress {
                            state: s,
                            generation,
                        }),
                    ) => {
                        assert_eq!((s, generation), (node.state, node.generation), "{ctx}");
                    }
                    (Exp::Ignored(w), Ok(Outcome::Ignored(g))) => assert_eq!(w, g, "{ctx}"),
                    (Exp::NotAllowed, Err(TransitionError::NotAllowed { state: s, event: e })) => {
                        assert_eq!((s, e), (state, event.name()), "{ctx}");
                    }
                    (want, _) => panic!("want {want:?}, got {ctx}"),
                }
            }
        }
        assert_eq!(cells, 9 * 20);
        assert_eq!(allowed, 42, "allowed cells");
    }

    /// Apply an event that must change the node; return the new record and effects.
    fn step(n: &Node, e: Event, p: &Policy) -> (Node, Vec<Effect>) {
        match transition(n, &e, p) {
            Ok(Outcome::Changed(t)) => (t.node, t.effects),
            other => panic!("{} in {}: {other:?}", e.name(), n.state),
        }
    }

    fn fresh_available() -> Node {
        Node {
            image: Some("debian-13".into()),
            ..rest_node(&Node::discovered(), S::Available)
        }
    }

    /// A node that netbooted into iPXE before its power cycle's result was recorded
    /// (seen in the boot storm): after a DHCP that followed the reset, its script fetch
    /// serves the installer; before one, it does not. The late power-cycle result is
    /// then stale.
    #[test]
    fn installer_served_while_reclaiming_only_after_a_netboot_was_seen() {
        let p = policy();
        let (n, _) = step(
            &fresh_available(),
            Event::ReinstallRequested {
                image: None,
                token: token("tok-r"),
            },
            &p,
        );
        let (n, _) = step(
            &n,
            Event::NetbootSet {
                generation: 1,
                attempt: 0,
            },
            &p,
        );
        assert_eq!(n.state, S::Reclaiming);
        let served = Event::InstallerServed { generation: 1 };
        assert!(
            transition(&n, &served, &p).is_err(),
            "no DHCP after the reset yet: the machine's earlier boot"
        );
        let (n, _) = step(
            &n,
            Event::NetbootObserved {
                generation: 1,
                after_reset: true,
            },
            &p,
        );
        assert_eq!((n.state, n.netboot.observed), (S::Reclaiming, true));
        let (n, fx) = step(&n, served, &p);
        assert_eq!(n.state, S::Installing);
        assert!(
            fx.contains(&Effect::ClearBootOverride { generation: 1 }),
            "{fx:?}"
        );
        let late = Event::PowerCycled {
            generation: 1,
            attempt: 0,
        };
        assert!(
            matches!(
                transition(&n, &late, &p),
                Ok(Outcome::Ignored(Ignored::StaleBmcResult))
            ),
            "{:?}",
            transition(&n, &late, &p)
        );
    }

    #[test]
    fn happy_path_reinstall_to_available() {
        let p = policy();
        let n0 = fresh_available();
        let (n, fx) = step(
            &n0,
            Event::ReinstallRequested {
                image: Some("rocky-10".into()),
                token: token("tok-1"),
            },
            &p,
        );
        assert_eq!((n.state, n.generation, n.attempt), (S::Reclaiming, 1, 0));
        assert_eq!(n.image.as_deref(), Some("rocky-10"));
        assert_eq!(n.token, Some(token("tok-1")));
        assert_eq!(
            fx,
            vec![
                Effect::ArmDeadline {
                    state: S::Reclaiming,
                    generation: 1,
                    attempt: 0,
                    after: SECS(300)
                },
                Effect::SetNetboot {
                    generation: 1,
                    attempt: 0,
                    delay: Duration::ZERO,
                    method: NetbootMethod::Standard,
                }
            ]
        );
        let (n, fx) = step(
            &n,
            Event::NetbootSet {
                generation: 1,
                attempt: 0,
            },
            &p,
        );
        assert_eq!(n.state, S::Reclaiming);
        assert_eq!(
            fx,
            vec![Effect::PowerCycle {
                generation: 1,
                attempt: 0,
                delay: Duration::ZERO,
                method: NetbootMethod::Standard,
            }]
        );
        let (n, fx) = step(
            &n,
            Event::PowerCycled {
                generation: 1,
                attempt: 0,
            },
            &p,
        );
        assert_eq!(n.state, S::Netbooting);
        assert_eq!(
            fx,
            vec![Effect::ArmDeadline {
                state: S::Netbooting,
                generation: 1,
                attempt: 0,
                after: SECS(900)
            }]
        );
        let (n, _) = step(&n, Event::InstallerServed { generation: 1 }, &p);
        assert_eq!(n.state, S::Installing);
        let (n, fx) = step(&n, Event::InstallFinished { generation: 1 }, &p);
        assert_eq!(n.state, S::FirstBoot);
        assert_eq!(
            fx,
            vec![Effect::ArmDeadline {
                state: S::FirstBoot,
                generation: 1,
                attempt: 0,
                after: SECS(1200)
            }]
        );
        let report = Event::FirstBootReported {
            generation: 1,
            hostname: "n-0a1b2c".into(),
            facts: "{}".into(),
        };
        let Ok(Outcome::Changed(t)) = transition(&n, &report, &p) else {
            panic!("first boot report refused");
        };
        assert!(!t.entered && t.effects.is_empty());
        assert_eq!(
            t.report,
            Some(FirstBoot {
                hostname: "n-0a1b2c".into(),
                facts: "{}".into()
            })
        );
        let (n, fx) = step(&t.node, Event::HealthPassed { generation: 1 }, &p);
        assert_eq!(fx, vec![Effect::ClearDeadline]);
        assert_eq!(
            n,
            Node {
                state: S::Available,
                generation: 1,
                attempt: 0,
                image: Some("rocky-10".into()),
                token: None,
                failure: None,
                first_boot_reported: true,
                netboot: Netboot::start(NetbootMethod::Standard),
                plan: Vec::new(),
            }
        );
    }

    #[test]
    fn bmc_retries_count_and_back_off_then_fail() {
        let p = policy();
        let mut n = node_in(S::Reclaiming);
        n.attempt = 0;
        let mut delays = Vec::new();
        for want_attempt in 1..=3 {
            let failed = Event::BmcStepFailed {
                step: BmcStep::PowerCycle,
                generation: n.generation,
                attempt: n.attempt,
                reason: "timeout".into(),
            };
            let (next, fx) = step(&n, failed, &p);
            assert_eq!((next.state, next.attempt), (S::Reclaiming, want_attempt));
            let Effect::PowerCycle { delay, attempt, .. } = fx[1] else {
                panic!("retry must re-run the failed step: {fx:?}");
            };
            assert_eq!(attempt, want_attempt);
            // The deadline covers the backoff before the retry starts.
            assert_eq!(
                fx[0],
                Effect::ArmDeadline {
                    state: S::Reclaiming,
                    generation: n.generation,
                    attempt: want_attempt,
                    after: SECS(300) + delay
                }
            );
            delays.push(delay);
            n = next;
        }
        assert_eq!(
            delays,
            vec![SECS(10), SECS(20), SECS(25)],
            "doubling, capped"
        );
        let last = Event::BmcStepFailed {
            step: BmcStep::PowerCycle,
            generation: n.generation,
            attempt: 3,
            reason: "timeout".into(),
        };
        let (n, fx) = step(&n, last, &p);
        assert_eq!(n.state, S::Failed);
        assert_eq!(n.attempt, 3, "failed keeps the retries spent");
        assert_eq!(
            n.failure,
            Some(Failure {
                step: Step::Bmc(BmcStep::PowerCycle),
                reason: "timeout".into()
            })
        );
        assert_eq!(n.token, None);
        assert_eq!(fx, vec![Effect::ClearDeadline]);
    }

    #[test]
    fn backoff_saturates_instead_of_overflowing() {
        let p = Policy {
            backoff: SECS(1),
            backoff_max: SECS(3600),
            ..policy()
        };
        assert_eq!(p.backoff_for(1), SECS(1));
        assert_eq!(p.backoff_for(2), SECS(2));
        assert_eq!(p.backoff_for(5), SECS(16));
        assert_eq!(p.backoff_for(40), SECS(3600));
        assert_eq!(p.backoff_for(u32::MAX), SECS(3600));
    }

    #[test]
    fn deadline_reruns_reclaim_then_fails_with_the_stage() {
        let p = policy();
        let mut n = node_in(S::Installing);
        n.attempt = 0;
        // installing expires -> reclaim again; let it get as far as netbooting each time.
        for want in 1..=3 {
            let (r, fx) = step(
                &n,
                Event::DeadlineExpired {
                    state: n.state,
                    generation: n.generation,
                    attempt: n.attempt,
                },
                &p,
            );
            assert_eq!((r.state, r.attempt), (S::Reclaiming, want));
            assert!(matches!(fx[1], Effect::SetNetboot { attempt, .. } if attempt == want));
            let (r, _) = step(
                &r,
                Event::NetbootSet {
                    generation: r.generation,
                    attempt: want,
                },
                &p,
            );
            let (r, _) = step(
                &r,
                Event::PowerCycled {
                    generation: r.generation,
                    attempt: want,
                },
                &p,
            );
            assert_eq!(
                (r.state, r.attempt),
                (S::Netbooting, want),
                "attempt survives"
            );
            n = r;
        }
        let (n, fx) = step(
            &n,
            Event::DeadlineExpired {
                state: S::Netbooting,
                generation: n.generation,
                attempt: 3,
            },
            &p,
        );
        assert_eq!(n.state, S::Failed);
        let f = n.failure.clone().expect("failure");
        assert_eq!(f.step, Step::Stage(S::Netbooting));
        assert!(
            f.reason.starts_with("deadline: never netbooted") && f.reason.contains("(4 tries)"),
            "{}",
            f.reason
        );
        assert_eq!(fx, vec![Effect::ClearDeadline]);
    }

    #[test]
    fn first_boot_deadline_fails_at_once() {
        let mut n = node_in(S::FirstBoot);
        n.attempt = 0;
        let (n, _) = step(
            &n,
            Event::DeadlineExpired {
                state: S::FirstBoot,
                generation: n.generation,
                attempt: 0,
            },
            &policy(),
        );
        assert_eq!(n.state, S::Failed);
        assert_eq!(n.failure.map(|f| f.step), Some(Step::Stage(S::FirstBoot)));
    }

    #[test]
    fn stale_generation_callbacks_are_refused() {
        let p = policy();
        for (state, got) in [
            (S::Installing, 3),
            (S::Installing, 5),
            (S::FirstBoot, 3),
            (S::Available, 3),
        ] {
            let n = node_in(state);
            for e in [
                Event::InstallerServed { generation: got },
                Event::InstallFinished { generation: got },
                Event::HealthPassed { generation: got },
                Event::HealthFailed {
                    generation: got,
                    detail: "x".into(),
                },
                Event::FirstBootReported {
                    generation: got,
                    hostname: "h".into(),
                    facts: "{}".into(),
                },
            ] {
                assert_eq!(
                    transition(&n, &e, &p),
                    Err(TransitionError::StaleGeneration { current: 4, got }),
                    "{state} {}",
                    e.name()
                );
            }
        }
    }

    #[test]
    fn stale_deadlines_and_bmc_answers_are_ignored() {
        let p = policy();
        let n = node_in(S::Netbooting);
        for (state, generation, attempt) in [
            (S::Reclaiming, 4, 1), // the node moved on
            (S::Netbooting, 3, 1), // an older reinstall
            (S::Netbooting, 4, 0), // before a retry
        ] {
            let e = Event::DeadlineExpired {
                state,
                generation,
                attempt,
            };
            assert_eq!(
                transition(&n, &e, &p),
                Ok(Outcome::Ignored(Ignored::StaleDeadline))
            );
        }
        // A BMC answer from before a retry must not advance the node.
        let r = node_in(S::Reclaiming);
        for e in [
            Event::PowerCycled {
                generation: 4,
                attempt: 0,
            },
            Event::NetbootSet {
                generation: 3,
                attempt: 1,
            },
            Event::BmcStepFailed {
                step: BmcStep::SetNetboot,
                generation: 4,
                attempt: 2,
                reason: "late".into(),
            },
        ] {
            assert_eq!(
                transition(&r, &e, &p),
                Ok(Outcome::Ignored(Ignored::StaleBmcResult)),
                "{e:?}"
            );
        }
    }

    #[test]
    fn reinstall_during_reinstall_is_in_progress() {
        let n = node_in(S::Reclaiming);
        let e = Event::ReinstallRequested {
            image: Some("other".into()),
            token: token("tok-new"),
        };
        assert_eq!(
            transition(&n, &e, &policy()),
            Ok(Outcome::InProgress {
                state: S::Reclaiming,
                generation: 4
            })
        );
    }

    #[test]
    fn reinstall_needs_an_image_and_keeps_the_old_one() {
        let p = policy();
        let mut n = node_in(S::Failed);
        let e = Event::ReinstallRequested {
            image: None,
            token: token("t"),
        };
        let (r, _) = step(&n, e.clone(), &p);
        assert_eq!(r.image.as_deref(), Some("debian-13"));
        assert_eq!(r.failure, None, "a reinstall clears the failure");
        n.image = None;
        assert_eq!(transition(&n, &e, &p), Err(TransitionError::NoImage));
    }

    #[test]
    fn health_needs_the_first_boot_report() {
        let mut n = node_in(S::FirstBoot);
        n.first_boot_reported = false;
        assert_eq!(
            transition(&n, &Event::HealthPassed { generation: 4 }, &policy()),
            Err(TransitionError::FirstBootNotReported)
        );
    }

    #[test]
    fn quarantine_records_where_and_why() {
        let (n, _) = step(
            &node_in(S::Installing),
            Event::Quarantined {
                reason: "64 GiB, size says 128".into(),
            },
            &policy(),
        );
        assert_eq!(
            n.failure,
            Some(Failure {
                step: Step::Stage(S::Installing),
                reason: "64 GiB, size says 128".into()
            })
        );
        assert_eq!((n.attempt, &n.token), (0, &None));
        let (n, _) = step(&n, Event::Restored, &policy());
        assert_eq!((n.state, n.failure), (S::Available, None));
    }

    #[test]
    fn delayed_effects_go_stale_when_the_node_moves() {
        let n = node_in(S::Reclaiming);
        let cycle = Effect::PowerCycle {
            generation: 4,
            attempt: 1,
            delay: SECS(10),
            method: NetbootMethod::OffOn,
        };
        assert!(cycle.is_current(&n));
        assert!(!cycle.is_current(&Node {
            attempt: 2,
            ..n.clone()
        }));
        assert!(!cycle.is_current(&node_in(S::Quarantined)));
    }

    #[test]
    fn names_round_trip() {
        for s in State::ALL {
            assert_eq!(s.as_str().parse::<State>(), Ok(s));
            assert_eq!(s.to_string(), s.as_str());
            assert_eq!(s.as_str().parse::<Step>(), Ok(Step::Stage(s)));
            assert_eq!(State::ALL[s.index()], s);
        }
        for b in [BmcStep::SetNetboot, BmcStep::PowerCycle] {
            assert_eq!(b.as_str().parse::<Step>(), Ok(Step::Bmc(b)));
        }
        assert!("booting".parse::<State>().is_err());
        assert!("reboot".parse::<Step>().is_err());
        // Audit names are unique and snake_case.
        let names: Vec<_> = events_for(&node_in(S::Available))
            .iter()
            .map(Event::name)
            .collect();
        let mut dedup = names.clone();
        dedup.sort_unstable();
        dedup.dedup();
        assert_eq!(dedup.len(), names.len());
        assert!(
            names
                .iter()
                .all(|n| n.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        );
    }

    #[test]
    fn tokens_stay_out_of_logs_and_audit() {
        let e = Event::ReinstallRequested {
            image: Some("img".into()),
            token: token("s3cr3t"),
        };
        assert!(!format!("{e:?}").contains("s3cr3t"));
        assert!(!e.detail().unwrap_or_default().contains("s3cr3t"));
        assert!(!format!("{:?}", node_in(S::Installing)).contains("tok-4"));
    }

    /// Reinstall, netboot set, power cycled: the node waits in `netbooting` with the
    /// observe window armed. Returns the node and the effects of the power cycle.
    fn cycled(n: &Node, p: &Policy) -> (Node, Vec<Effect>) {
        let (g, a) = (n.generation, n.attempt);
        let (n, fx) = step(
            n,
            Event::NetbootSet {
                generation: g,
                attempt: a,
            },
            p,
        );
        let Effect::PowerCycle { method, .. } = fx[0] else {
            panic!("{fx:?}");
        };
        assert_eq!(method, n.netboot.method, "the cycle uses the plan's method");
        step(
            &n,
            Event::PowerCycled {
                generation: g,
                attempt: a,
            },
            p,
        )
    }

    fn not_observed(n: &Node) -> Event {
        Event::NetbootNotObserved {
            generation: n.generation,
            attempt: n.attempt,
            method: n.netboot.method,
        }
    }

    fn reinstall(n: &Node, p: &Policy) -> (Node, Vec<Effect>) {
        step(
            n,
            Event::ReinstallRequested {
                image: None,
                token: token("tok-9"),
            },
            p,
        )
    }

    #[test]
    fn observe_window_is_armed_after_the_power_cycle_and_replaced_by_the_netboot() {
        let p = observing();
        let (n, fx) = reinstall(&fresh_available(), &p);
        assert!(matches!(
            fx[1],
            Effect::SetNetboot {
                method: NetbootMethod::Standard,
                ..
            }
        ));
        let (n, fx) = cycled(&n, &p);
        assert_eq!(n.state, S::Netbooting);
        assert_eq!(
            fx,
            vec![Effect::ArmObserveWindow {
                generation: 1,
                attempt: 0,
                method: NetbootMethod::Standard,
                after: SECS(60),
            }]
        );
        assert!(fx[0].is_current(&n));
        // DHCP from a boot MAC: the window gives way to the rest of the deadline, and
        // the method is recorded for the BMC model.
        let (seen, fx) = step(
            &n,
            Event::NetbootObserved {
                generation: 1,
                after_reset: false,
            },
            &p,
        );
        assert_eq!(seen.state, S::Netbooting);
        assert!(seen.netboot.observed);
        assert_eq!(
            fx,
            vec![
                Effect::ArmDeadline {
                    state: S::Netbooting,
                    generation: 1,
                    attempt: 0,
                    after: SECS(900),
                },
                Effect::RecordNetbootMethod {
                    generation: 1,
                    method: NetbootMethod::Standard,
                },
            ]
        );
        // A second DHCP packet (iPXE's own) changes nothing.
        assert_eq!(
            transition(
                &seen,
                &Event::NetbootObserved {
                    generation: 1,
                    after_reset: false,
                },
                &p
            ),
            Ok(Outcome::Ignored(Ignored::Repeated))
        );
        // A window that fires after the netboot was seen is stale.
        assert_eq!(
            transition(&seen, &not_observed(&n), &p),
            Ok(Outcome::Ignored(Ignored::StaleDeadline))
        );
        // A deadline shorter than the window is the tighter watch: plain deadline.
        let mut short = p.clone();
        short.deadlines[S::Netbooting.index()] = Some(SECS(30));
        let (_, fx) = cycled(&reinstall(&fresh_available(), &short).0, &short);
        assert!(matches!(fx[..], [Effect::ArmDeadline { after, .. }] if after == SECS(30)));
    }

    #[test]
    fn netboot_not_observed_falls_back_through_every_method_then_fails() {
        let p = observing();
        let (mut n, _) = reinstall(&fresh_available(), &p);
        let mut used = vec![];
        for (i, want) in NetbootMethod::ALL.into_iter().enumerate() {
            assert_eq!(n.netboot.method, want);
            assert_eq!(n.attempt, u32::try_from(i).unwrap());
            used.push(want);
            assert_eq!(n.netboot.tried, used);
            let (w, _) = cycled(&n, &p);
            let out = transition(&w, &not_observed(&w), &p).unwrap();
            let Outcome::Changed(t) = out else {
                panic!("{out:?}")
            };
            n = t.node;
            if i + 1 < NetbootMethod::ALL.len() {
                // The next method, as a new attempt from `reclaiming` (no backoff).
                assert_eq!(n.state, S::Reclaiming);
                let next = NetbootMethod::ALL[i + 1];
                assert_eq!(
                    t.effects[1],
                    Effect::SetNetboot {
                        generation: 1,
                        attempt: n.attempt,
                        delay: Duration::ZERO,
                        method: next,
                    }
                );
                assert!(t.effects.iter().all(|e| e.is_current(&n)));
            }
        }
        assert_eq!(n.state, S::Failed);
        let f = n.failure.expect("failure");
        assert_eq!(f.step, Step::Stage(S::Netbooting));
        assert!(
            f.reason.starts_with("netboot_not_observed:")
                && f.reason.contains("within 60s")
                && f.reason.contains("tried: standard, uefi_override, off_on"),
            "{}",
            f.reason
        );
        assert_eq!(n.token, None);
    }

    #[test]
    fn the_method_that_worked_for_the_model_is_tried_first() {
        assert_eq!(
            NetbootMethod::plan(&[NetbootMethod::OffOn]),
            vec![
                NetbootMethod::OffOn,
                NetbootMethod::Standard,
                NetbootMethod::UefiOverride
            ]
        );
        assert_eq!(NetbootMethod::plan(&[]), NetbootMethod::ALL.to_vec());
        let p = observing();
        let mut n0 = fresh_available();
        n0.plan = NetbootMethod::plan(&[NetbootMethod::OffOn, NetbootMethod::OffOn]);
        let (n, fx) = reinstall(&n0, &p);
        assert!(matches!(
            fx[1],
            Effect::SetNetboot {
                method: NetbootMethod::OffOn,
                ..
            }
        ));
        // Its fallback is the rest of the default order.
        let (w, _) = cycled(&n, &p);
        let (n, _) = step(&w, not_observed(&w), &p);
        assert_eq!(n.netboot.method, NetbootMethod::Standard);
        assert_eq!(
            n.netboot.tried,
            vec![NetbootMethod::OffOn, NetbootMethod::Standard]
        );
        // A BMC step that fails is retried with the same method.
        let (n, fx) = step(
            &n,
            Event::BmcStepFailed {
                step: BmcStep::SetNetboot,
                generation: n.generation,
                attempt: n.attempt,
                reason: "timeout".into(),
            },
            &p,
        );
        assert!(matches!(
            fx[1],
            Effect::SetNetboot {
                method: NetbootMethod::Standard,
                ..
            }
        ));
        // A new generation starts the plan over.
        let mut done = n.clone();
        done.state = S::Failed;
        let (n, _) = reinstall(&done, &p);
        assert_eq!(n.netboot, Netboot::start(NetbootMethod::OffOn));
        // Names round-trip for the store.
        for m in NetbootMethod::ALL {
            assert_eq!(NetbootMethod::parse(m.as_str()), Some(m));
        }
        assert_eq!(NetbootMethod::parse("bogus"), None);
    }

    #[test]
    fn netboot_not_observed_for_another_attempt_is_stale() {
        let p = observing();
        let (n, _) = cycled(&reinstall(&fresh_available(), &p).0, &p);
        for ev in [
            Event::NetbootNotObserved {
                generation: n.generation,
                attempt: n.attempt + 1,
                method: n.netboot.method,
            },
            Event::NetbootNotObserved {
                generation: n.generation - 1,
                attempt: n.attempt,
                method: n.netboot.method,
            },
        ] {
            assert_eq!(
                transition(&n, &ev, &p),
                Ok(Outcome::Ignored(Ignored::StaleDeadline))
            );
        }
        // DHCP of an older generation is refused like any stale callback.
        assert!(matches!(
            transition(
                &n,
                &Event::NetbootObserved {
                    generation: 0,
                    after_reset: false,
                },
                &p
            ),
            Err(TransitionError::StaleGeneration { .. })
        ));
    }

    #[test]
    fn a_second_installer_fetch_in_one_attempt_is_a_boot_loop() {
        let p = observing();
        let (n, _) = cycled(&reinstall(&fresh_available(), &p).0, &p);
        let (n, _) = step(
            &n,
            Event::NetbootObserved {
                generation: 1,
                after_reset: false,
            },
            &p,
        );
        let (n, _) = step(&n, Event::InstallerServed { generation: 1 }, &p);
        assert_eq!(n.state, S::Installing);
        let (n, fx) = step(&n, Event::InstallerServed { generation: 1 }, &p);
        assert_eq!(n.state, S::Failed);
        assert_eq!(fx, vec![Effect::ClearDeadline]);
        let f = n.failure.expect("failure");
        assert_eq!(f.step, Step::Stage(S::Installing));
        assert!(
            f.reason.starts_with("boot_loop:") && f.reason.contains("generation 1"),
            "{}",
            f.reason
        );
        // A retry after a deadline serves the installer again legitimately: it passes
        // through `reclaiming` and `netbooting` first.
        let mut i = node_in(S::Installing);
        i.attempt = 0;
        let (r, _) = step(
            &i,
            Event::DeadlineExpired {
                state: S::Installing,
                generation: 4,
                attempt: 0,
            },
            &p,
        );
        let (w, _) = cycled(&r, &p);
        let (w, _) = step(&w, Event::InstallerServed { generation: 4 }, &p);
        assert_eq!(w.state, S::Installing);
    }

    #[test]
    fn a_netboot_seen_before_the_reset_is_reported_done_counts() {
        let p = observing();
        let (n, _) = reinstall(&fresh_available(), &p);
        let (n, _) = step(
            &n,
            Event::NetbootSet {
                generation: 1,
                attempt: 0,
            },
            &p,
        );
        // Before the reset was sent: the machine's previous boot, not ours.
        let early = Event::NetbootObserved {
            generation: 1,
            after_reset: false,
        };
        assert_eq!(
            transition(&n, &early, &p),
            Ok(Outcome::Ignored(Ignored::NotAwaited))
        );
        // After it was sent, while the BMC still reports the reset: it counts.
        let (n, fx) = step(
            &n,
            Event::NetbootObserved {
                generation: 1,
                after_reset: true,
            },
            &p,
        );
        assert_eq!((n.state, n.netboot.observed), (S::Reclaiming, true));
        assert_eq!(
            fx,
            vec![Effect::RecordNetbootMethod {
                generation: 1,
                method: NetbootMethod::Standard
            }]
        );
        // The reset's answer then arms the deadline, not the observe window.
        let (n, fx) = step(
            &n,
            Event::PowerCycled {
                generation: 1,
                attempt: 0,
            },
            &p,
        );
        assert_eq!(n.state, S::Netbooting);
        assert!(matches!(fx[..], [Effect::ArmDeadline { after, .. }] if after == SECS(900)));
        // A retry forgets it: the next reset must be seen anew.
        let (r, _) = step(
            &n,
            Event::DeadlineExpired {
                state: S::Netbooting,
                generation: 1,
                attempt: 0,
            },
            &p,
        );
        assert!(!r.netboot.observed);
    }

    #[test]
    fn a_fallback_does_not_use_up_the_retries() {
        let p = Policy {
            max_attempts: 1,
            ..observing()
        };
        let (n, _) = cycled(&reinstall(&fresh_available(), &p).0, &p);
        let (n, _) = step(&n, not_observed(&n), &p);
        assert_eq!((n.state, n.attempt), (S::Reclaiming, 1));
        let fail = |n: &Node| Event::BmcStepFailed {
            step: BmcStep::PowerCycle,
            generation: n.generation,
            attempt: n.attempt,
            reason: "power stayed Off".into(),
        };
        // One retry left after the fallback...
        let (n, _) = step(&n, fail(&n), &p);
        assert_eq!((n.state, n.attempt), (S::Reclaiming, 2));
        // ...and then none.
        let (n, _) = step(&n, fail(&n), &p);
        assert_eq!(n.state, S::Failed);
    }

    #[test]
    fn policy_from_config_ignores_resting_states() {
        let mut deadlines = std::collections::BTreeMap::new();
        deadlines.insert(S::Installing, SECS(60));
        deadlines.insert(S::Available, SECS(5));
        let p = Policy::from_config(&LifecycleConfig {
            deadlines,
            max_attempts: 2,
            backoff: SECS(3),
            netboot_observe: SECS(90),
            leftovers_interval: SECS(60),
            owner_ttl: SECS(10),
        });
        assert_eq!(p.observe_window, Some(SECS(90)));
        assert_eq!(p.deadline(S::Installing), Some(SECS(60)));
        assert_eq!(p.deadline(S::Reclaiming), None);
        assert_eq!(p.deadline(S::Available), None);
        assert_eq!((p.max_attempts, p.backoff), (2, SECS(3)));
    }
}

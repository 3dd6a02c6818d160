//! What an installer's log line means: a milestone, a fatal error in the installer's
//! own words, or nothing. Pure: one line in, at most one [`Signal`] out; the recorder
//! decides what to do with it.
//!
//! Lines are as a syslog daemon prints them after the timestamp and host: `tag: message`
//! with `tag` the program, maybe with `[pid]` (`anna[1234]: DEBUG: retrieving foo 1.2`).
//! Curtin and subiquity reporting events are turned into the same shape by
//! [`super::event_line`]: `curtin: finish <name>: <RESULT>: <description>`.
//!
//! Where the patterns come from:
//! - debian-installer: libdebian-installer's syslog handler writes `prog[pid]: LEVEL: msg`
//!   with ` **` after alert levels (`WARNING **:`, `ERROR **:`); anna logs `retrieving
//!   <pkg> <version>` (DEBUG) and `package retrieval failed`, `bad md5sum`, `bad d-i
//!   Packages file`, `no packages matching running kernel ...` (WARNING) before it shows a
//!   critical dialog; main-menu logs `Menu item '<pkg>' selected`, `Configuring '<pkg>'
//!   failed with error code N` and `Menu item '<pkg>' failed.`; preseed logs
//!   `successfully loaded preseed file from <url>`. A dialog itself is not logged unless
//!   cdebconf runs with `DEBCONF_DEBUG=developer` (pxed sets it): then
//!   `debconf: --> INPUT critical <template>` names the dialog that stops the install.
//! - Anaconda: log lines forwarded by `inst.syslog=` (`anaconda[pid]: ...`), its progress
//!   messages (`Installing software`, `Installing boot loader`, ...), kickstart errors
//!   (`The following problem occurred on line N of the kickstart file`), the fatal error
//!   dialog (`The following error occurred while installing. This is a fatal error ...`)
//!   and the last line of a Python traceback (`SomeError: text`).
//! - curtin (and subiquity, which uses curtin's reporting): events have `event_type`
//!   `start`/`finish`, and a finish has `result` `SUCCESS`, `WARN` (not fatal) or `FAIL`
//!   (fatal).

use std::fmt;

/// Which installer wrote the line (from the node's image family).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// debian-installer (`preseed` images).
    DebianInstaller,
    /// Anaconda (`kickstart` images).
    Anaconda,
    /// Subiquity / curtin (`autoinstall` images).
    Curtin,
}

impl Family {
    /// The installer that an image family runs; `None` for `disk` (pxed's own agent
    /// reports through its own callbacks).
    pub fn of(f: crate::images::Family) -> Option<Family> {
        match f {
            crate::images::Family::Preseed => Some(Family::DebianInstaller),
            crate::images::Family::Kickstart => Some(Family::Anaconda),
            crate::images::Family::Autoinstall => Some(Family::Curtin),
            crate::images::Family::Disk => None,
        }
    }
}

/// A step of an install, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Milestone {
    /// The installer's kernel is up and its syslog (or reporting) reaches pxed.
    KernelBooted,
    /// The installer read pxed's generated config.
    ConfigLoaded,
    /// Disks are being partitioned.
    Partitioning,
    /// The base system and packages are being installed.
    Packages,
    /// The boot loader is being installed.
    Bootloader,
    /// The installer is finishing (the `installed` callback follows).
    Finished,
}

impl Milestone {
    /// Every milestone, in install order.
    pub const ALL: [Milestone; 6] = [
        Milestone::KernelBooted,
        Milestone::ConfigLoaded,
        Milestone::Partitioning,
        Milestone::Packages,
        Milestone::Bootloader,
        Milestone::Finished,
    ];

    /// The event name on the node's timeline (`node_events.event`).
    pub fn event(self) -> &'static str {
        match self {
            Milestone::KernelBooted => "installer_kernel_booted",
            Milestone::ConfigLoaded => "installer_config_loaded",
            Milestone::Partitioning => "installer_partitioning",
            Milestone::Packages => "installer_packages",
            Milestone::Bootloader => "installer_bootloader",
            Milestone::Finished => "installer_finished",
        }
    }
}

impl fmt::Display for Milestone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.event().trim_start_matches("installer_"))
    }
}

/// What a line means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Signal {
    /// The install reached this step.
    Milestone(Milestone),
    /// The install cannot go on; the installer's own text (one line).
    Fatal(String),
}

/// The tag (program, without `[pid]`) and the message of a `tag: message` line.
fn split(line: &str) -> (&str, &str) {
    match line.split_once(": ") {
        Some((tag, msg)) if !tag.contains(' ') => {
            let prog = tag.split('[').next().unwrap_or(tag);
            (prog, msg)
        }
        _ => ("", line),
    }
}

/// What `line` from an installer of `family` means, if anything.
pub fn recognize(family: Family, line: &str) -> Option<Signal> {
    let line = line.trim();
    if line.is_empty() {
        return None;
    }
    match family {
        Family::DebianInstaller => debian_installer(line),
        Family::Anaconda => anaconda(line),
        Family::Curtin => curtin(line),
    }
}

/// Whether `line` is protocol chatter not worth one of the node's stored lines:
/// cdebconf's `DEBCONF_DEBUG=developer` trace (`--> GET ...`, `<-- 0 ...`) that pxed
/// turns on only to see which dialog an install stops at. What the trace says was set
/// (`--> SET netcfg/get_hostname node-1`, the preseed being applied) and asked
/// (`--> INPUT critical ...`) is kept. Every line is still recognised.
pub fn is_noise(family: Family, line: &str) -> bool {
    let (_, msg) = split(line.trim());
    let trace = msg.starts_with("-->") || msg.starts_with("<--") || msg.starts_with("---->");
    let kept = msg.starts_with("--> SET ") || msg.starts_with("--> INPUT ");
    family == Family::DebianInstaller && trace && !kept
}

/// debian-installer error dialogs (critical debconf templates) that stop an automatic
/// install, with their titles as the installer shows them.
const DI_DIALOGS: &[(&str, &str)] = &[
    ("anna/install_failed", "Failed to load installer component"),
    ("anna/no_kernel_modules", "No kernel modules were found"),
    (
        "anna/retriever_failed",
        "Failed to retrieve installer components",
    ),
    ("mirror/bad", "Bad archive mirror"),
    ("mirror/noarch", "Bad archive mirror"),
    ("retriever/net/error", "Downloading a file failed"),
    ("net-retriever/error", "Downloading a file failed"),
    (
        "debian-installer/main-menu/item-failure",
        "Installation step failed",
    ),
    (
        "preseed/retrieve_error",
        "Failed to retrieve the preconfiguration file",
    ),
    (
        "preseed/load_error",
        "Failed to process the preconfiguration file",
    ),
    ("preseed/command_failed", "Failed to run preseeded command"),
    (
        "base-installer/kernel/failed-install",
        "Unable to install the selected kernel",
    ),
    (
        "base-installer/debootstrap/error/exitcode",
        "Debootstrap Error",
    ),
    (
        "grub-installer/grub-install-failed",
        "Unable to install GRUB in the target",
    ),
    ("pkgsel/install-failed", "Software installation failed"),
];

/// The same dialogs by their text, for lines that carry it (a frontend's log, a
/// late command that echoes it).
const DI_DIALOG_TEXTS: &[&str] = &[
    "Failed to load installer component",
    "No kernel modules were found",
    "Bad archive mirror",
    "Failed to retrieve the preconfiguration file",
    "Failed to process the preconfiguration file",
    "An installation step failed",
];

fn debian_installer(line: &str) -> Option<Signal> {
    let (prog, msg) = split(line);
    let fatal = || Some(Signal::Fatal(line.to_string()));
    // A dialog the install stops at (cdebconf with DEBCONF_DEBUG=developer).
    if let Some(rest) = msg.strip_prefix("--> INPUT critical ") {
        let template = rest.split_whitespace().next().unwrap_or("");
        return DI_DIALOGS
            .iter()
            .find(|(t, _)| *t == template)
            .map(|(t, title)| Signal::Fatal(format!("{title} ({t})")));
    }
    if msg.starts_with("-->") || msg.starts_with("<--") {
        // Other debconf protocol traffic: questions, answers, substitutions.
        return None;
    }
    if let Some(text) = msg.strip_prefix("WARNING **: ") {
        let text = text.trim();
        if (text.starts_with("Menu item '") && text.ends_with("' failed."))
            || (text.starts_with("Configuring '") && text.contains("' failed with error code"))
        {
            return fatal();
        }
        if prog == "anna"
            && (text == "package retrieval failed"
                || text == "bad md5sum"
                || text == "bad d-i Packages file"
                || text.starts_with("no packages matching running kernel"))
        {
            return fatal();
        }
        return None;
    }
    if let Some(text) = msg.strip_prefix("ERROR **: ") {
        // anna's "no Filename field for X, ignoring" is an error it survives.
        return (!text.trim_end().ends_with("ignoring")).then(|| Signal::Fatal(line.to_string()));
    }
    if DI_DIALOG_TEXTS.iter().any(|t| msg.contains(t)) {
        return fatal();
    }
    if let Some(item) = menu_item_selected(msg) {
        return match item {
            "partman-base" | "partman-auto" => Some(Signal::Milestone(Milestone::Partitioning)),
            "base-installer" | "pkgsel" => Some(Signal::Milestone(Milestone::Packages)),
            "grub-installer" | "nobootloader" => Some(Signal::Milestone(Milestone::Bootloader)),
            "finish-install" => Some(Signal::Milestone(Milestone::Finished)),
            _ => None,
        };
    }
    if prog == "preseed" && msg.starts_with("successfully loaded preseed file from ") {
        return Some(Signal::Milestone(Milestone::ConfigLoaded));
    }
    if (prog == "kernel" && msg.starts_with("Linux version "))
        || msg.starts_with("syslogd started: BusyBox")
    {
        return Some(Signal::Milestone(Milestone::KernelBooted));
    }
    None
}

/// debian-installer's cdebconf trace across lines (pxed sets `DEBCONF_DEBUG=developer`):
/// the question an `--> INPUT <priority> <template>` names, then cdebconf's answer
/// `<-- 0 question will be asked` (or `<-- 30 question skipped`). In a pxed install
/// (`auto=true priority=critical`, everything else preseeded) a question that will be
/// asked is a dialog nobody will answer: the install waits there until the deadline.
/// One per node generation; the recorder feeds it that installer's lines in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DialogWatch {
    /// The last `INPUT` without its answer yet: (priority, template).
    pending: Option<(String, String)>,
}

impl DialogWatch {
    /// The dialog the install now waits at, if `line` says so.
    pub fn feed(&mut self, line: &str) -> Option<Signal> {
        let (_, msg) = split(line.trim());
        if let Some(rest) = msg.strip_prefix("--> INPUT ") {
            let mut words = rest.split_whitespace();
            self.pending = match (words.next(), words.next()) {
                (Some(p), Some(t)) => Some((p.to_string(), t.to_string())),
                _ => None,
            };
            return None;
        }
        let reply = msg.strip_prefix("<-- ")?;
        let (priority, template) = self.pending.take()?;
        let asked = reply
            .get(.."0 question will be asked".len())
            .is_some_and(|r| r.eq_ignore_ascii_case("0 question will be asked"));
        if !asked {
            return None;
        }
        Some(Signal::Fatal(
            match DI_DIALOGS.iter().find(|(t, _)| *t == template) {
                Some((t, title)) => format!("{title} ({t})"),
                None => format!(
                    "the installer waits for an answer to {template} (priority {priority}): a dialog nobody will answer"
                ),
            },
        ))
    }
}

/// `pkg` of main-menu's `Menu item 'pkg' selected` (logged at INFO or DEBUG).
fn menu_item_selected(msg: &str) -> Option<&str> {
    let (_, rest) = msg.split_once("Menu item '")?;
    let (item, tail) = rest.split_once('\'')?;
    (tail.trim() == "selected").then_some(item)
}

/// Whether `text` is the last line of a Python traceback: `module.SomeError: message`.
fn python_exception(text: &str) -> bool {
    let Some((name, message)) = text.split_once(": ") else {
        return false;
    };
    let class = name.rsplit('.').next().unwrap_or(name);
    !message.trim().is_empty()
        && !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
        && class.starts_with(|c: char| c.is_ascii_uppercase())
        && (class.ends_with("Error") || class.ends_with("Exception"))
}

fn anaconda(line: &str) -> Option<Signal> {
    let (prog, msg) = split(line);
    // Anaconda's handlers write `logger: text` to syslog (AnacondaSyslogHandler's tag),
    // its files `LEVEL logger: text`, some paths `LEVEL:logger:text`; keep the text.
    let mut text = msg.trim();
    for level in [
        "CRITICAL", "CRIT", "ERROR", "ERR", "WARNING", "WARN", "INFO", "DEBUG",
    ] {
        if let Some(t) = text
            .strip_prefix(level)
            .and_then(|t| t.strip_prefix([' ', ':']))
        {
            text = t.trim_start();
            break;
        }
    }
    // A logger name before the text: `anaconda:`, `anaconda.core.kickstart:`, `exception:`.
    if let Some((head, rest)) = text.split_once(':')
        && !head.is_empty()
        && head
            .chars()
            .all(|c| c.is_ascii_lowercase() || c == '.' || c == '_')
    {
        text = rest.trim();
    }
    let fatal = || Some(Signal::Fatal(line.to_string()));
    let lower = text.to_ascii_lowercase();
    if text.contains("The following error occurred")
        || text.contains("This is a fatal error and installation will be aborted")
        || (lower.contains("kickstart file") && lower.contains("problem occurred"))
        || text.contains("KickstartParseError")
        || text.contains("KickstartError")
        || text.starts_with("Kickstart insufficient")
    {
        return fatal();
    }
    let from_anaconda = prog.starts_with("anaconda") || prog.is_empty();
    if from_anaconda && python_exception(text) {
        return fatal();
    }
    let milestone = |m| Some(Signal::Milestone(m));
    if text.starts_with("Parsing kickstart")
        || text.starts_with("parsing kickstart")
        || (text.contains("kickstart") && text.contains("fetched"))
    {
        return milestone(Milestone::ConfigLoaded);
    }
    if text.starts_with("Creating disklabel")
        || text.starts_with("Configuring storage")
        || text.starts_with("Creating partition")
    {
        return milestone(Milestone::Partitioning);
    }
    if text.starts_with("Installing software")
        || text.starts_with("Starting package installation process")
        || text.starts_with("Preparing transaction from installation source")
    {
        return milestone(Milestone::Packages);
    }
    if text.starts_with("Installing boot loader") || text.starts_with("Installing bootloader") {
        return milestone(Milestone::Bootloader);
    }
    if text.starts_with("Installation complete")
        || text.starts_with("Performing post-installation setup tasks")
    {
        return milestone(Milestone::Finished);
    }
    if prog == "kernel" && text.starts_with("Linux version ") {
        return milestone(Milestone::KernelBooted);
    }
    None
}

/// One curtin reporting event as pxed stores it (see [`super::event_line`]):
/// `curtin: <event_type> <name>: <RESULT>: <description>`, or the event's JSON itself.
fn curtin(line: &str) -> Option<Signal> {
    if line.starts_with('{') {
        let ev: super::CurtinEvent = serde_json::from_str(line).ok()?;
        return curtin(&super::event_line(&ev));
    }
    let (prog, msg) = split(line);
    // pxed's event lines (`curtin: finish <name>: ...`) or curtin's own log format
    // (`finish: <name>: SUCCESS: ...`, also under a syslog tag such as subiquity's).
    let (kind, rest) = if matches!(prog, "start" | "finish") {
        (prog, msg)
    } else if let Some(r) = msg.strip_prefix("start: ") {
        ("start", r)
    } else if let Some(r) = msg.strip_prefix("finish: ") {
        ("finish", r)
    } else {
        msg.split_once(' ')?
    };
    let (name, rest) = rest.split_once(": ").unwrap_or((rest, ""));
    let name = name.trim();
    match kind {
        "finish" => {
            let (result, _) = rest.split_once(": ").unwrap_or((rest, ""));
            if result.trim() == "FAIL" {
                return Some(Signal::Fatal(line.to_string()));
            }
            if result.trim() != "SUCCESS" {
                return None;
            }
            // The whole install finished (subiquity's own step, or curtin's command).
            // (MAAS and other curtin consumers key on the same names.)
            let done = matches!(
                name,
                "subiquity/Install/install" | "cmd-install" | "subiquity/Install"
            ) || name.ends_with("/cmd-install")
                || name.ends_with("/command-install");
            done.then_some(Signal::Milestone(Milestone::Finished))
        }
        "start" => {
            let step = name.to_ascii_lowercase();
            let m = if step.contains("autoinstall") && step.contains("load") {
                Milestone::ConfigLoaded
            } else if step.contains("partitioning") || step.ends_with("/block-meta") {
                Milestone::Partitioning
            } else if step.contains("stage-extract")
                || step.ends_with("install/extract")
                || step.contains("install_packages")
                || step.contains("installing-missing-packages")
            {
                Milestone::Packages
            } else if step.contains("grub") || step.contains("bootloader") {
                Milestone::Bootloader
            } else {
                return None;
            };
            Some(Signal::Milestone(m))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Family::*;
    use Milestone::*;

    fn fatal(s: &str) -> Option<Signal> {
        Some(Signal::Fatal(s.to_string()))
    }

    /// Lines as they arrive (after the syslog header), what each means.
    #[test]
    fn debian_installer_lines() {
        let rows: &[(&str, Option<Signal>)] = &[
            // Milestones.
            (
                "syslogd started: BusyBox v1.35.0",
                Some(Signal::Milestone(KernelBooted)),
            ),
            (
                "kernel: Linux version 6.1.0-18-amd64 (debian-kernel@lists.debian.org)",
                Some(Signal::Milestone(KernelBooted)),
            ),
            (
                "preseed: successfully loaded preseed file from http://10.0.0.1/cfg/<redacted>/preseed",
                Some(Signal::Milestone(ConfigLoaded)),
            ),
            (
                "main-menu[278]: INFO: Menu item 'partman-base' selected",
                Some(Signal::Milestone(Partitioning)),
            ),
            (
                "main-menu[278]: DEBUG: Menu item 'base-installer' selected",
                Some(Signal::Milestone(Packages)),
            ),
            (
                "main-menu[278]: INFO: Menu item 'grub-installer' selected",
                Some(Signal::Milestone(Bootloader)),
            ),
            (
                "main-menu[278]: INFO: Menu item 'finish-install' selected",
                Some(Signal::Milestone(Finished)),
            ),
            ("main-menu[278]: INFO: Menu item 'netcfg' selected", None),
            // Fatal: anna's retrieval failures, main-menu's failed steps, dialogs.
            (
                "anna[2143]: WARNING **: package retrieval failed",
                fatal("anna[2143]: WARNING **: package retrieval failed"),
            ),
            (
                "anna[2143]: WARNING **: bad md5sum",
                fatal("anna[2143]: WARNING **: bad md5sum"),
            ),
            (
                "anna[2143]: WARNING **: no packages matching running kernel 6.1.0-18-amd64 in archive",
                fatal(
                    "anna[2143]: WARNING **: no packages matching running kernel 6.1.0-18-amd64 in archive",
                ),
            ),
            (
                "main-menu[278]: WARNING **: Configuring 'download-installer' failed with error code 8",
                fatal(
                    "main-menu[278]: WARNING **: Configuring 'download-installer' failed with error code 8",
                ),
            ),
            (
                "main-menu[278]: WARNING **: Menu item 'download-installer' failed.",
                fatal("main-menu[278]: WARNING **: Menu item 'download-installer' failed."),
            ),
            (
                "main-menu[278]: ERROR **: cannot read the status file",
                fatal("main-menu[278]: ERROR **: cannot read the status file"),
            ),
            (
                "debconf: --> INPUT critical anna/install_failed",
                fatal("Failed to load installer component (anna/install_failed)"),
            ),
            (
                "debconf: --> INPUT critical mirror/bad",
                fatal("Bad archive mirror (mirror/bad)"),
            ),
            (
                "debconf: --> INPUT critical anna/no_kernel_modules",
                fatal("No kernel modules were found (anna/no_kernel_modules)"),
            ),
            (
                "cdebconf: Failed to load installer component: loading finish-install failed",
                fatal(
                    "cdebconf: Failed to load installer component: loading finish-install failed",
                ),
            ),
            // Look-alikes that are not fatal.
            (
                "anna[2143]: DEBUG: retrieving libgpg-error0-udeb 1.46-1",
                None,
            ),
            (
                "anna[2143]: DEBUG: retrieving retriever-error-handler 1.0",
                None,
            ),
            (
                "anna[2143]: ERROR **: no Filename field for foo-udeb, ignoring",
                None,
            ),
            (
                "main-menu[278]: WARNING **: Unable to set title for partman-base.",
                None,
            ),
            ("debconf: --> INPUT critical netcfg/get_hostname", None),
            (
                "debconf: --> SUBST anna/install_failed PACKAGE finish-install",
                None,
            ),
            ("debconf: <-- 0 question will be asked", None),
            (
                "in-target: Unpacking libgpg-error0:amd64 (1.46-1) ...",
                None,
            ),
            ("in-target: Setting up liberror-perl (0.17029-2) ...", None),
            (
                "main-menu[278]: (process:3018): error: no such file (harmless probe)",
                None,
            ),
            ("", None),
        ];
        for (line, want) in rows {
            assert_eq!(recognize(DebianInstaller, line), *want, "{line}");
        }
    }

    /// A question that will be asked stops an unattended install; one skipped does not.
    #[test]
    fn dialog_watch_sees_questions_that_will_be_asked() {
        let rows: &[(&[&str], Option<&str>)] = &[
            (
                &[
                    "debconf: --> INPUT critical partman/choose_partition",
                    "debconf: <-- 0 question will be asked",
                ],
                Some(
                    "the installer waits for an answer to partman/choose_partition (priority critical): a dialog nobody will answer",
                ),
            ),
            (
                &[
                    "debconf: --> INPUT critical anna/install_failed",
                    "debconf: <-- 0 question will be asked",
                ],
                Some("Failed to load installer component (anna/install_failed)"),
            ),
            (
                &[
                    "debconf: --> INPUT medium debian-installer/main-menu",
                    "debconf: <-- 30 question skipped",
                ],
                None,
            ),
            // An answer to another command, or no INPUT before it.
            (&["debconf: <-- 0 question will be asked"], None),
            (
                &[
                    "debconf: --> INPUT high netcfg/get_domain",
                    "debconf: <-- 30 question skipped",
                    "debconf: <-- 0 question will be asked",
                ],
                None,
            ),
            (
                &[
                    "debconf: --> INPUT",
                    "debconf: <-- 0 question will be asked",
                ],
                None,
            ),
        ];
        for (lines, want) in rows {
            let mut w = DialogWatch::default();
            let got: Vec<Signal> = lines.iter().filter_map(|l| w.feed(l)).collect();
            let want: Vec<Signal> = want.iter().map(|s| Signal::Fatal(s.to_string())).collect();
            assert_eq!(got, want, "{lines:?}");
        }
    }

    #[test]
    fn debconf_trace_is_noise_other_lines_are_not() {
        assert!(is_noise(
            DebianInstaller,
            "debconf: --> GET netcfg/get_hostname"
        ));
        assert!(is_noise(DebianInstaller, "frontend: <-- 0 node-1"));
        assert!(!is_noise(DebianInstaller, "anna[1]: DEBUG: retrieving x 1"));
        assert!(!is_noise(
            DebianInstaller,
            "debconf: --> SET netcfg/get_hostname node-1"
        ));
        assert!(!is_noise(
            DebianInstaller,
            "debconf: --> INPUT critical anna/install_failed"
        ));
        assert!(!is_noise(Anaconda, "anaconda[1]: --> not d-i"));
    }

    #[test]
    fn anaconda_lines() {
        let rows: &[(&str, Option<Signal>)] = &[
            (
                "anaconda[1712]: anaconda: Parsing kickstart: /run/install/ks.cfg",
                Some(Signal::Milestone(ConfigLoaded)),
            ),
            (
                "anaconda[1712]: INFO anaconda.core.kickstart: Parsing kickstart: /run/install/ks.cfg",
                Some(Signal::Milestone(ConfigLoaded)),
            ),
            (
                "anaconda[1712]: Parsing kickstart: /run/install/ks.cfg",
                Some(Signal::Milestone(ConfigLoaded)),
            ),
            (
                "anaconda: INFO:anaconda.core.kickstart:Parsing kickstart: /run/install/ks.cfg",
                Some(Signal::Milestone(ConfigLoaded)),
            ),
            (
                "anaconda[1712]: Creating disklabel on /dev/vda",
                Some(Signal::Milestone(Partitioning)),
            ),
            (
                "anaconda[1712]: Installing software 12/356",
                Some(Signal::Milestone(Packages)),
            ),
            (
                "anaconda[1712]: Installing boot loader",
                Some(Signal::Milestone(Bootloader)),
            ),
            (
                "anaconda[1712]: Performing post-installation setup tasks",
                Some(Signal::Milestone(Finished)),
            ),
            (
                "anaconda[1712]: The following error occurred while installing.  This is a fatal error and installation will be aborted.",
                fatal(
                    "anaconda[1712]: The following error occurred while installing.  This is a fatal error and installation will be aborted.",
                ),
            ),
            (
                "anaconda[1712]: The following problem occurred on line 12 of the kickstart file:",
                fatal(
                    "anaconda[1712]: The following problem occurred on line 12 of the kickstart file:",
                ),
            ),
            (
                "anaconda[1712]: pykickstart.errors.KickstartParseError: Unknown command: bogus",
                fatal(
                    "anaconda[1712]: pykickstart.errors.KickstartParseError: Unknown command: bogus",
                ),
            ),
            (
                "anaconda[1712]: CRIT exception:pyanaconda.modules.common.errors.installation.PayloadInstallationError: Failed to install packages",
                fatal(
                    "anaconda[1712]: CRIT exception:pyanaconda.modules.common.errors.installation.PayloadInstallationError: Failed to install packages",
                ),
            ),
            // Look-alikes.
            ("anaconda[1712]: Traceback (most recent call last):", None),
            (
                "anaconda[1712]: Installing libgpg-error-1.42-5.el9.x86_64",
                None,
            ),
            (
                "anaconda[1712]: Installing libcom_err-1.46.5-3.el9.x86_64",
                None,
            ),
            (
                "anaconda[1712]: DEBUG: ignoring error: device vda1 has no filesystem",
                None,
            ),
            (
                "NetworkManager[980]: <warn>  [1701400000.1] dhcp4 (enp1s0): request timed out",
                None,
            ),
            (
                "kernel: ACPI Error: AE_NOT_FOUND, While resolving a named reference",
                None,
            ),
            ("dnf[2000]: ValueError: not really anaconda's", None),
        ];
        for (line, want) in rows {
            assert_eq!(recognize(Anaconda, line), *want, "{line}");
        }
    }

    #[test]
    fn curtin_events() {
        let fail = r#"{"name": "subiquity/Install/install/curthooks", "description": "configuring installed system", "event_type": "finish", "origin": "curtin", "timestamp": 1701400000.5, "level": "INFO", "result": "FAIL"}"#;
        let warn = r#"{"name": "cmd-install/stage-curthooks", "description": "some apt source missing", "event_type": "finish", "origin": "curtin", "timestamp": 1701400000.5, "result": "WARN"}"#;
        let rows: &[(&str, Option<Signal>)] = &[
            (
                fail,
                fatal(
                    "curtin: finish subiquity/Install/install/curthooks: FAIL: configuring installed system",
                ),
            ),
            (warn, None),
            (
                "curtin: finish cmd-install/stage-partitioning/builtin/cmd-block-meta: FAIL: configuring disk: disk-vda",
                fatal(
                    "curtin: finish cmd-install/stage-partitioning/builtin/cmd-block-meta: FAIL: configuring disk: disk-vda",
                ),
            ),
            (
                "curtin: finish cmd-install/stage-partitioning: SUCCESS: configuring storage",
                None,
            ),
            (
                "curtin: start subiquity/Load_autoinstall_config: loading autoinstall",
                Some(Signal::Milestone(ConfigLoaded)),
            ),
            (
                "curtin: start cmd-install/stage-partitioning: configuring storage",
                Some(Signal::Milestone(Partitioning)),
            ),
            (
                "curtin: start cmd-install/stage-extract: writing install sources to disk",
                Some(Signal::Milestone(Packages)),
            ),
            (
                "curtin: start cmd-install/stage-curthooks/builtin/cmd-curthooks/configuring-bootloader/install-grub: installing grub",
                Some(Signal::Milestone(Bootloader)),
            ),
            (
                "curtin: finish subiquity/Install/install: SUCCESS: final system configuration",
                Some(Signal::Milestone(Finished)),
            ),
            // curtin's own log format, bare or under a syslog tag.
            (
                "finish: cmd-install/stage-partitioning/builtin/cmd-block-meta: FAIL: configuring disk: disk-vda",
                fatal(
                    "finish: cmd-install/stage-partitioning/builtin/cmd-block-meta: FAIL: configuring disk: disk-vda",
                ),
            ),
            (
                "subiquity_event.1984[1984]: start: cmd-install/stage-extract/builtin/cmd-extract: writing install sources to disk",
                Some(Signal::Milestone(Packages)),
            ),
            (
                "subiquity_event.1984[1984]: finish: cmd-install/stage-curthooks: WARN: no network config",
                None,
            ),
            (
                "curtin: finish curtin/command-install: SUCCESS: curtin command install",
                Some(Signal::Milestone(Finished)),
            ),
            (
                "curtin: finish cmd-install/stage-curthooks: SUCCESS: configuring target system",
                None,
            ),
            (
                "curtin: log subiquity/Install/install: FAIL is only a word here",
                None,
            ),
            ("not json {", None),
            ("{\"name\": 1}", None),
        ];
        for (line, want) in rows {
            assert_eq!(recognize(Curtin, line), *want, "{line}");
        }
    }

    /// What a real debian-installer sent to pxed in `lab/run.sh --installer`
    /// (bookworm, `debian-installer-12-netboot-amd64` 20230607+deb12u15, from a mirror
    /// built from the archive, which lacks `apt-mirror-setup`), as pxed stored it:
    /// tokens redacted, cdebconf's trace kept to SET and INPUT. Of its 349 lines, the
    /// preseed line is the config milestone and only the last few are fatal: the earlier
    /// `ERROR 404: File not found.` for the contrib and non-free indexes, the critical
    /// `INPUT` of a preseeded question and the DEBUG chatter are not.
    #[test]
    fn a_real_debian_installer_run() {
        let capture = include_str!("testdata/di-bookworm-lab.log");
        let lines: Vec<&str> = capture.lines().collect();
        let signals: Vec<(usize, Signal)> = lines
            .iter()
            .enumerate()
            .filter_map(|(i, l)| recognize(Family::DebianInstaller, l).map(|s| (i, s)))
            .collect();
        assert!(
            signals
                .iter()
                .any(|(i, s)| *s == Signal::Milestone(Milestone::ConfigLoaded)
                    && lines[*i].starts_with("preseed: successfully loaded")),
            "{signals:?}"
        );
        // The first fatal line (the one that fails the node) is anna's; the critical
        // dialog it opens right after is fatal too, and nothing before them is.
        let fatal: Vec<(usize, &Signal)> = signals
            .iter()
            .filter(|(_, s)| matches!(s, Signal::Fatal(_)))
            .map(|(i, s)| (*i, s))
            .collect();
        assert_eq!(
            fatal,
            [
                (
                    lines.len() - 3,
                    &Signal::Fatal("anna[2711]: WARNING **: package retrieval failed".into())
                ),
                (
                    lines.len() - 1,
                    &Signal::Fatal("Downloading a file failed (retriever/net/error)".into())
                ),
            ],
            "{signals:?}"
        );
        // The look-alikes are there.
        assert!(
            lines
                .iter()
                .filter(|l| l.ends_with("ERROR 404: File not found."))
                .count()
                >= 5
        );
        assert!(
            lines
                .iter()
                .any(|l| l.ends_with("--> INPUT critical mirror/http/hostname"))
        );
    }
}

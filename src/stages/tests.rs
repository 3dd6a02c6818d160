use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};

use super::*;
use crate::lifecycle::worker::NodeChange;
use crate::store::stages::{ReinstallRow, StageRow, Tracked};

fn t(secs: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_800_000_000 + secs, 0).unwrap()
}

fn at(secs: i64) -> String {
    t(secs).to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

fn row(stage: Stage, secs: i64) -> StageRow {
    StageRow {
        generation: 3,
        stage,
        at: at(secs),
        bytes: None,
        took_ms: None,
        detail: None,
    }
}

fn expected() -> BTreeMap<Stage, Duration> {
    crate::config::StagesSettings::default().expected
}

/// A successful reinstall passes the stages in declaration order; final stages have
/// no expected duration and every other stage has one.
#[test]
fn stages_are_declared_in_reinstall_order() {
    let names: Vec<&str> = Stage::ALL.iter().map(|s| s.as_str()).collect();
    let pos = |n: &str| names.iter().position(|x| *x == n).unwrap();
    for pair in [
        ("reinstall", "power"),
        ("power", "dhcp_discover"),
        ("dhcp_discover", "lease"),
        ("lease", "first_stage"),
        ("first_stage", "ipxe_dhcp"),
        ("ipxe_dhcp", "script"),
        ("script", "kernel"),
        ("kernel", "initrd"),
        ("initrd", "installer_kernel_booted"),
        ("installer_finished", "installed"),
        ("deploy_reboot", "installed"),
        ("installed", "local_boot"),
        ("local_boot", "first_boot"),
        ("first_boot", "health"),
        ("health", "available"),
    ] {
        assert!(pos(pair.0) < pos(pair.1), "{pair:?}");
    }
    for s in Stage::ALL {
        assert_eq!(s.default_expected().is_none(), s.is_final(), "{s}");
        assert_eq!(s.as_str().parse::<Stage>(), Ok(s));
    }
}

#[test]
fn lifecycle_events_map_to_stages() {
    for (event, stage) in [
        ("reinstall_requested", Some(Stage::Reinstall)),
        ("power_cycled", Some(Stage::Power)),
        ("netboot_set", None),
        ("installer_served", None),
        (
            "installer_kernel_booted",
            Some(Stage::InstallerKernelBooted),
        ),
        ("installer_packages", Some(Stage::InstallerPackages)),
        ("deploy_started", Some(Stage::DeployStarted)),
        ("deploy_facts", Some(Stage::DeployStarted)),
        ("deploy_write", Some(Stage::DeployWrite)),
        ("deploy_nonsense", None),
        ("install_finished", Some(Stage::Installed)),
        ("first_boot_reported", Some(Stage::FirstBoot)),
        ("health_passed", Some(Stage::Health)),
        ("health_failed", None),
        ("deadline_expired", None),
    ] {
        assert_eq!(Stage::of_event(event), stage, "{event}");
    }
    let change = |event: &str, state| NodeChange {
        node_id: 7,
        event: event.into(),
        state,
        at: at(0),
        remote: false,
    };
    let stages = |c: &NodeChange| -> Vec<(Stage, Option<String>)> {
        recorder::of_change(c)
            .into_iter()
            .map(|s| {
                assert_eq!(s.who, Who::Node(7));
                assert_eq!(s.at, at(0));
                (s.stage, s.detail)
            })
            .collect()
    };
    assert_eq!(
        stages(&change("health_passed", State::Available)),
        vec![(Stage::Health, None), (Stage::Available, None)]
    );
    assert_eq!(
        stages(&change("deadline_expired", State::Failed)),
        vec![(Stage::Failed, Some("timeout".into()))]
    );
    assert_eq!(
        stages(&change("reinstall_requested", State::Reclaiming)),
        vec![(Stage::Reinstall, None)]
    );
    assert!(stages(&change("registered", State::Available)).is_empty());
}

#[test]
fn wire_events_map_to_stages() {
    let seen = |ipxe, address| crate::dhcp::DhcpSeen {
        mac: Mac([2, 0, 0, 0, 0, 1]),
        arch: Some(7),
        vendor_class: None,
        user_class_ipxe: ipxe,
        address,
    };
    let a = Some(std::net::Ipv4Addr::new(10, 0, 0, 9));
    assert_eq!(dhcp_stage(&seen(false, None)), Stage::DhcpDiscover);
    assert_eq!(dhcp_stage(&seen(false, a)), Stage::Lease);
    assert_eq!(dhcp_stage(&seen(true, a)), Stage::IpxeDhcp);
    assert_eq!(dhcp_stage(&seen(true, None)), Stage::IpxeDhcp);
    assert_eq!(http_stage("/ipxe/snponly.efi"), Some(Stage::FirstStage));
    assert_eq!(
        http_stage("/images/debian-13/x86_64/kernel"),
        Some(Stage::Kernel)
    );
    assert_eq!(
        http_stage("/images/debian-13/x86_64/initrd"),
        Some(Stage::Initrd)
    );
    assert_eq!(http_stage("/images/debian-13/x86_64/disk.raw.zst"), None);
    assert_eq!(http_stage("/boot/52:54:00:00:00:01.ipxe"), None);
    assert_eq!(http_stage("/kernel"), None);
    use crate::script::{Action, ArchBoot};
    let arch = |cmdline: &str| ArchBoot {
        ipxe_arch: "x86_64",
        label: "x86_64",
        kernel_url: String::new(),
        initrd_url: String::new(),
        cmdline: cmdline.into(),
    };
    let mac = Mac([2, 0, 0, 0, 0, 1]);
    let s = script_sighting(mac, &Action::Install(vec![arch("auto=true url=x")]));
    assert_eq!(
        (s.stage, s.detail.as_deref()),
        (Stage::Script, Some("installer"))
    );
    let s = script_sighting(mac, &Action::Install(vec![arch("pxed.url=x pxed.token=t")]));
    assert_eq!(
        (s.stage, s.detail.as_deref()),
        (Stage::Script, Some("deploy"))
    );
    let s = script_sighting(mac, &Action::LocalBoot);
    assert_eq!(s.stage, Stage::LocalBoot);
    let s = script_sighting(mac, &Action::Discovery);
    assert_eq!(s.detail.as_deref(), Some("discovery"));
}

/// Stages come in by time; equal times fall back to the reinstall order.
#[test]
fn stages_are_ordered_by_time_then_reinstall_order() {
    let rows = ordered(vec![
        row(Stage::Script, 40),
        row(Stage::Lease, 20),
        row(Stage::DhcpDiscover, 20),
        row(Stage::Power, 0),
    ]);
    let got: Vec<Stage> = rows.iter().map(|r| r.stage).collect();
    assert_eq!(
        got,
        vec![
            Stage::Power,
            Stage::DhcpDiscover,
            Stage::Lease,
            Stage::Script
        ]
    );
    let v = views(&rows, &expected());
    assert_eq!(v[0].lasted_ms, Some(20_000));
    assert_eq!(v[1].lasted_ms, Some(0));
    assert_eq!(v[2].lasted_ms, Some(20_000));
    assert_eq!(v[3].lasted_ms, None, "the current stage has not ended");
    assert_eq!(v[0].expected_ms, Some(300_000));
}

/// A node is stuck once it has been in its stage longer than expected, and only
/// while a reinstall is in progress.
#[test]
fn stuck_is_past_the_expected_duration_of_the_current_stage() {
    let mut exp = expected();
    exp.insert(Stage::Kernel, Duration::from_secs(120));
    let rows = ordered(vec![row(Stage::Script, 0), row(Stage::Kernel, 10)]);
    let now = |secs| current(State::Installing, &rows, &exp, t(secs)).unwrap();
    assert_eq!(now(60).stage, Stage::Kernel);
    assert_eq!(now(60).since, at(10));
    assert_eq!(now(60).expected_ms, Some(120_000));
    assert!(!now(60).stuck);
    assert!(!now(130).stuck, "exactly at the expected duration");
    assert!(now(131).stuck);
    // A node at rest is never stuck, whatever its last stage.
    assert!(
        !current(State::Failed, &rows, &exp, t(10_000))
            .unwrap()
            .stuck
    );
    // Final stages are not stuck.
    let done = ordered(vec![row(Stage::Health, 0), row(Stage::Available, 1)]);
    let c = current(State::Installing, &done, &exp, t(99_999)).unwrap();
    assert_eq!(
        (c.stage, c.expected_ms, c.stuck),
        (Stage::Available, None, false)
    );
    assert!(current(State::Installing, &[], &exp, t(0)).is_none());
}

#[test]
fn earlier_generations_summarise_their_durations() {
    let rows = ordered(vec![
        row(Stage::Reinstall, 0),
        row(Stage::Power, 30),
        row(Stage::DhcpDiscover, 90),
        row(Stage::Available, 600),
    ]);
    let g = generation_summary(3, &rows);
    assert_eq!(g.total_ms, Some(600_000));
    assert_eq!(g.last, Some(Stage::Available));
    assert_eq!(
        g.durations,
        vec![
            StageDuration {
                stage: Stage::Reinstall,
                ms: 30_000
            },
            StageDuration {
                stage: Stage::Power,
                ms: 60_000
            },
            StageDuration {
                stage: Stage::DhcpDiscover,
                ms: 510_000
            },
        ]
    );
    let unfinished = generation_summary(2, &rows[..2]);
    assert_eq!(unfinished.total_ms, None);
}

#[test]
fn quantiles_are_nearest_rank() {
    assert_eq!(quantile(&[], 0.5), None);
    assert_eq!(quantile(&[7], 0.95), Some(7));
    let v: Vec<u64> = (1..=100).collect();
    assert_eq!(quantile(&v, 0.5), Some(50));
    assert_eq!(quantile(&v, 0.95), Some(95));
    assert_eq!(quantile(&[1, 2, 3], 0.5), Some(2));
}

#[test]
fn the_report_counts_outcomes_durations_failures_and_leftovers() {
    let r = |node, generation, start: i64, end: Option<(i64, State, &str, &str)>| ReinstallRow {
        node_id: node,
        generation,
        requested_at: at(start),
        ended_at: end.map(|e| at(e.0)),
        outcome: end.map(|e| e.1),
        end_event: end.map(|e| e.2.to_string()),
        end_from: end.map(|_| State::Netbooting),
        end_detail: end.map(|e| e.3.to_string()),
    };
    let rows = vec![
        r(1, 1, 0, Some((600, State::Available, "health_passed", ""))),
        r(
            2,
            1,
            0,
            Some((1200, State::Available, "first_boot_reported", "")),
        ),
        r(
            3,
            1,
            0,
            Some((
                300,
                State::Failed,
                "deadline_expired",
                "netbooting (attempt 3)",
            )),
        ),
        r(
            4,
            1,
            0,
            Some((
                300,
                State::Failed,
                "deadline_expired",
                "netbooting (attempt 3)",
            )),
        ),
        r(
            5,
            1,
            0,
            Some((50, State::Failed, "bmc_step_failed", "power_cycle: refused")),
        ),
        r(6, 1, 0, None),
    ];
    let mut failed_stages = BTreeMap::new();
    failed_stages.insert((3, 1), Stage::Power);
    failed_stages.insert((4, 1), Stage::Power);
    let tracked = vec![
        Tracked {
            node_id: 3,
            name: Some("n3".into()),
            state: State::Failed,
            state_since: at(300),
            failed_reason: Some("netbooting: deadline".into()),
            stages: vec![row(Stage::Power, 10), row(Stage::Failed, 300)],
        },
        Tracked {
            node_id: 6,
            name: None,
            state: State::Netbooting,
            state_since: at(0),
            failed_reason: None,
            stages: vec![row(Stage::Power, 10)],
        },
        Tracked {
            node_id: 7,
            name: None,
            state: State::Installing,
            state_since: at(0),
            failed_reason: None,
            stages: vec![row(Stage::InstallerPackages, 1000)],
        },
    ];
    let rep = report(
        &at(-10),
        t(1200),
        &rows,
        &failed_stages,
        &tracked,
        &expected(),
    );
    assert_eq!(
        (rep.reinstalls, rep.succeeded, rep.failed, rep.unfinished),
        (6, 2, 3, 1)
    );
    assert_eq!(rep.p50_ms, Some(600_000));
    assert_eq!(rep.p95_ms, Some(1_200_000));
    assert_eq!(rep.failures.len(), 2);
    assert_eq!(
        (
            rep.failures[0].stage.as_str(),
            rep.failures[0].reason.as_str(),
            rep.failures[0].count
        ),
        ("power", "timeout", 2)
    );
    assert_eq!(rep.failures[0].examples, vec!["netbooting (attempt 3)"]);
    // No stage recorded: the lifecycle state it failed from.
    assert_eq!(
        (
            rep.failures[1].stage.as_str(),
            rep.failures[1].reason.as_str()
        ),
        ("netbooting", "bmc")
    );
    // Failed node 3 and node 6 (power since 10 s, 1190 s > 300 s); node 7 is within
    // its packages stage.
    let left: Vec<(i64, bool)> = rep.leftovers.iter().map(|l| (l.node_id, l.stuck)).collect();
    assert_eq!(left, vec![(3, false), (6, true)]);
    assert_eq!(rep.leftovers[1].stage, Some(Stage::Power));
}

#[test]
fn expected_durations_are_configurable() {
    let load = |vars: &[(&str, &str)]| {
        crate::config::load(
            None,
            vars.iter().map(|(k, v)| (k.to_string(), v.to_string())),
            &Default::default(),
        )
    };
    let c = load(&[
        ("PXED_STAGES__EXPECTED__POWER", "90s"),
        ("PXED_STAGES__EXPECTED__INSTALLER", "20m"),
        ("PXED_STAGES__EXPECTED__INSTALLER_PACKAGES", "2h"),
        ("PXED_STAGES__KEEP_GENERATIONS", "3"),
    ])
    .unwrap();
    let e = &c.stages.expected;
    assert_eq!(e[&Stage::Power], Duration::from_secs(90));
    assert_eq!(e[&Stage::InstallerPartitioning], Duration::from_secs(1200));
    assert_eq!(e[&Stage::InstallerPackages], Duration::from_secs(7200));
    assert_eq!(e[&Stage::Lease], Stage::Lease.default_expected().unwrap());
    assert!(!e.contains_key(&Stage::Available));
    assert_eq!(c.stages.keep_generations, 3);
    let err = load(&[("PXED_STAGES__EXPECTED__AVAILABLE", "1m")]).unwrap_err();
    assert!(
        err.to_string().contains("not a stage with a duration"),
        "{err}"
    );
    assert!(load(&[("PXED_STAGES__EXPECTED__POWER", "0s")]).is_err());
    assert!(load(&[("PXED_STAGES__KEEP_GENERATIONS", "0")]).is_err());
}

//! The agent against a fake pxed on 127.0.0.1:0 and a temp sysfs tree. Only dry runs and
//! failures before anything is written: the block device is the QEMU lab's to test.

use std::sync::Mutex;

use axum::Router;
use axum::extract::{Path as AxPath, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use super::*;
use crate::wire::{Compression, DiskImageRef, WipePolicy};

const TOKEN: &str = "tok-123";

/// A fake pxed: answers the plan with the queued statuses (then the plan), records posts.
struct Pxed {
    plan: DeployPlan,
    /// Answers to `GET deploy` before the plan is served: (status, body).
    refusals: Mutex<Vec<(StatusCode, String)>>,
    plan_gets: Mutex<u32>,
    posts: Mutex<Vec<(String, serde_json::Value)>>,
}

impl Pxed {
    fn posts_to(&self, path: &str) -> Vec<serde_json::Value> {
        self.posts
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, _)| p == path)
            .map(|(_, v)| v.clone())
            .collect()
    }
}

async fn get_plan(State(s): State<Arc<Pxed>>, AxPath(token): AxPath<String>) -> Response {
    assert_eq!(token, TOKEN);
    *s.plan_gets.lock().unwrap() += 1;
    let refusal = {
        let mut r = s.refusals.lock().unwrap();
        (!r.is_empty()).then(|| r.remove(0))
    };
    match refusal {
        Some((status, body)) => (status, body).into_response(),
        None => axum::Json(s.plan.clone()).into_response(),
    }
}

async fn record(
    State(s): State<Arc<Pxed>>,
    AxPath((token, rest)): AxPath<(String, String)>,
    axum::Json(v): axum::Json<serde_json::Value>,
) -> StatusCode {
    assert_eq!(token, TOKEN);
    s.posts.lock().unwrap().push((rest, v));
    StatusCode::NO_CONTENT
}

fn plan() -> DeployPlan {
    DeployPlan {
        node_id: 1,
        generation: 2,
        hostname: "n1".into(),
        arch: crate::model::Arch::X86_64,
        image: DiskImageRef {
            name: "debian-12".into(),
            url: "http://127.0.0.1:9/img.zst".into(),
            compression: Compression::Zstd,
            size: 1 << 30,
            sha256: "ab".repeat(32),
            root_partition: 2,
        },
        wipe: WipePolicy::Signatures,
        target_disk: None,
        ssh_authorized_keys: vec![],
        files: vec![],
        enable_units: vec![],
    }
}

async fn start(plan: DeployPlan, refusals: Vec<(StatusCode, String)>) -> (String, Arc<Pxed>) {
    let s = Arc::new(Pxed {
        plan,
        refusals: Mutex::new(refusals),
        plan_gets: Mutex::new(0),
        posts: Mutex::new(Vec::new()),
    });
    let app = Router::new()
        .route("/cb/{token}/deploy", get(get_plan))
        .route("/cb/{token}/{*rest}", post(record))
        .with_state(s.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    (format!("http://{addr}"), s)
}

/// A temp root with a kernel command line and a sysfs holding `disks` (name, sectors).
fn node(url: &str, disks: &[(&str, u64)]) -> (tempfile::TempDir, DeployArgs) {
    let t = tempfile::tempdir().unwrap();
    let r = t.path();
    let put = |rel: &str, content: &str| {
        let p = r.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, content).unwrap();
    };
    put(
        "proc/cmdline",
        &format!("console=ttyS0 pxed.url={url} pxed.token={TOKEN}\n"),
    );
    put("proc/meminfo", "MemTotal: 2048000 kB\n");
    put("sys/class/net/eth0/address", "52:54:00:aa:bb:cc\n");
    for (name, sectors) in disks {
        put(&format!("sys/block/{name}/size"), &format!("{sectors}\n"));
        put(&format!("sys/block/{name}/removable"), "0\n");
    }
    let args = DeployArgs {
        cmdline: r.join("proc/cmdline"),
        dry_run: true,
        no_reboot: true,
        force: false,
        sysroot: r.to_path_buf(),
    };
    (t, args)
}

#[tokio::test]
async fn dry_run_fetches_plan_posts_facts_and_writes_nothing() {
    let (url, pxed) = start(plan(), vec![]).await;
    let (_t, args) = node(&url, &[("vdb", 4 << 21), ("vda", 4 << 21), ("sr0", 10)]);
    assert_eq!(deploy(&args).await.unwrap(), Done::Exit);

    let facts = pxed.posts_to("deploy/facts");
    assert_eq!(facts.len(), 1);
    let facts: AgentFacts = serde_json::from_value(facts[0].clone()).unwrap();
    assert_eq!(facts.mem_kb, 2_048_000);
    let names: Vec<&str> = facts.disks.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, vec!["vda", "vdb"]);
    assert_eq!(facts.nics[0].mac, "52:54:00:aa:bb:cc");
    let progress = pxed.posts_to("deploy/progress");
    assert_eq!(progress.len(), 1);
    assert_eq!(progress[0]["stage"], "disk");
    assert!(
        progress[0]["message"]
            .as_str()
            .unwrap()
            .starts_with("target /dev/vda"),
        "{progress:?}"
    );
    assert!(pxed.posts_to("failure").is_empty());
    assert!(pxed.posts_to("installed").is_empty());
}

#[tokio::test]
async fn failures_after_the_plan_are_reported_with_their_stage() {
    // (disks, plan change, stage, words in the reason)
    type Case = (
        &'static [(&'static str, u64)],
        fn(&mut DeployPlan),
        &'static str,
        &'static str,
    );
    let cases: &[Case] = &[
        (&[], |_| {}, "disk", "no disk to deploy to"),
        (
            &[("vda", 4 << 21)],
            |p| p.target_disk = Some("/dev/sdq".into()),
            "disk",
            "/dev/sdq not found",
        ),
        (
            &[("vda", 1000)],
            |_| {},
            "disk",
            "the image needs 1073741824",
        ),
        (
            &[("vda", 4 << 21)],
            |p| {
                p.files.push(crate::wire::PlanFile {
                    path: "etc/x".into(),
                    mode: 0o644,
                    content: String::new(),
                })
            },
            "configure",
            "not absolute",
        ),
    ];
    for (disks, change, stage, words) in cases {
        let mut p = plan();
        change(&mut p);
        let (url, pxed) = start(p, vec![]).await;
        let (_t, args) = node(&url, disks);
        match deploy(&args).await {
            Err(AgentError::Stage { stage: s, reason }) => {
                assert_eq!(s.as_str(), *stage);
                assert!(reason.contains(words), "{reason}");
            }
            other => panic!("{stage}: {other:?}"),
        }
        let failed = pxed.posts_to("failure");
        assert_eq!(failed.len(), 1, "{stage}");
        let f: FailedReport = serde_json::from_value(failed[0].clone()).unwrap();
        assert_eq!(f.stage, *stage);
        assert!(f.reason.contains(words), "{}", f.reason);
    }
}

#[tokio::test]
async fn refused_plan_is_final_and_shows_the_servers_reason() {
    let (url, pxed) = start(
        plan(),
        vec![(
            StatusCode::FORBIDDEN,
            r#"{"error":"stale_token","reason":"this install was superseded"}"#.into(),
        )],
    )
    .await;
    let (_t, args) = node(&url, &[("vda", 4 << 21)]);
    let e = deploy(&args).await.unwrap_err();
    assert!(matches!(e, AgentError::Call { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("403 Forbidden: this install was superseded"),
        "{msg}"
    );
    assert!(!msg.contains(TOKEN), "token on the console: {msg}");
    assert_eq!(*pxed.plan_gets.lock().unwrap(), 1);
    assert!(pxed.posts.lock().unwrap().is_empty());
}

#[tokio::test]
async fn plan_is_retried_through_server_errors() {
    let (url, pxed) = start(
        plan(),
        vec![
            (StatusCode::SERVICE_UNAVAILABLE, "busy".into()),
            (StatusCode::BAD_GATEWAY, String::new()),
        ],
    )
    .await;
    let cmd = cmdline::parse(&format!("pxed.url={url} pxed.token={TOKEN}")).unwrap();
    let fast = RetryPolicy {
        attempts: 3,
        first: Duration::from_millis(5),
        max: Duration::from_millis(10),
    };
    let cb = Callbacks::new(&cmd, fast.clone()).unwrap();
    assert_eq!(cb.plan().await.unwrap(), plan());
    assert_eq!(*pxed.plan_gets.lock().unwrap(), 3);

    // A plan the agent cannot read fails the plan stage.
    let (url, _pxed) = start(plan(), vec![(StatusCode::OK, "{}".into())]).await;
    let cmd = cmdline::parse(&format!("pxed.url={url} pxed.token={TOKEN}")).unwrap();
    let e = Callbacks::new(&cmd, fast)
        .unwrap()
        .plan()
        .await
        .unwrap_err();
    assert!(
        matches!(&e, AgentError::Stage { stage: DeployStage::Plan, reason } if reason.starts_with("plan is not valid")),
        "{e}"
    );
}

#[tokio::test]
async fn missing_cmdline_keys_stop_before_any_call() {
    let (_t, mut args) = node("http://127.0.0.1:9", &[]);
    std::fs::write(&args.cmdline, "console=ttyS0 quiet\n").unwrap();
    let e = deploy(&args).await.unwrap_err();
    assert!(e.to_string().contains("no pxed.url="), "{e}");
    args.cmdline = args.sysroot.join("nonexistent");
    assert!(matches!(
        deploy(&args).await.unwrap_err(),
        AgentError::ReadCmdline { .. }
    ));
}

#[tokio::test]
async fn a_real_deploy_outside_the_ramdisk_is_refused() {
    if root_is_ramdisk() {
        return;
    }
    let (_t, mut args) = node("http://127.0.0.1:9", &[]);
    args.dry_run = false;
    assert!(matches!(
        deploy(&args).await.unwrap_err(),
        AgentError::NotRamdisk
    ));
}

#[test]
fn server_reasons() {
    for (body, want) in [
        (r#"{"reason":"r","detail":"d"}"#, "r"),
        (r#"{"error":"e","detail":"d"}"#, "d"),
        (r#"{"error":"e"}"#, "e"),
        ("plain text\n", "plain text"),
        ("", ""),
    ] {
        assert_eq!(server_reason(body), want);
    }
    assert!(server_reason(&"é".repeat(400)).ends_with("..."));
}

/// Runs `cmd` through `sh -c`, panicking with its output on failure.
fn sh(cmd: &str) -> String {
    let out = std::process::Command::new("sh")
        .args(["-c", cmd])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd}: {text}");
    text.trim().to_string()
}

/// Detaches a loop device when dropped.
struct Loop(String);

impl Loop {
    fn attach(file: &Path) -> Self {
        Loop(sh(&format!("losetup -f --show -P {}", file.display())))
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = std::process::Command::new("losetup")
            .args(["-d", &self.0])
            .status();
    }
}

/// Wipe, write, grow and configure on a real (loop) block device with the real tools.
/// Needs root and loop devices, as the rest of the suite needs root for namespaces
/// (util-linux and e2fsprogs come from .ci/install.sh).
#[test]
fn loop_device_wipe_write_grow_configure() {
    let t = tempfile::tempdir().unwrap();
    let (img, target) = (t.path().join("img"), t.path().join("disk"));
    // The image: GPT, an 8 MiB partition and an ext4 root, 64 MiB in all.
    sh(&format!("truncate -s 64M {}", img.display()));
    sh(&format!(
        "printf 'size=8MiB\\n,\\n' | sfdisk --label gpt {}",
        img.display()
    ));
    {
        let l = Loop::attach(&img);
        // Some kernels (this lab's VMs) parse no partition tables: partx tells them.
        sh(&format!("partx --update {}", l.0));
        disk::wait_for_node(&format!("{}p2", l.0), Duration::from_secs(5)).unwrap();
        sh(&format!("mkfs.ext4 -q -L root {}p2", l.0));
    }
    let raw = std::fs::read(&img).unwrap();
    // The target: 256 MiB, with an old partition table and filesystem to wipe.
    sh(&format!("truncate -s 256M {}", target.display()));
    sh(&format!(
        "printf ',100MiB\\n,\\n' | sfdisk --label gpt {}",
        target.display()
    ));
    let l = Loop::attach(&target);
    let name = l.0.strip_prefix("/dev/").unwrap().to_string();
    sh(&format!("partx --update {}", l.0));
    disk::wait_for_node(&format!("{}p1", l.0), Duration::from_secs(5)).unwrap();
    sh(&format!("mkfs.ext4 -q {}p1", l.0));
    assert!(!sh(&format!("wipefs --noheadings {}p1", l.0)).is_empty());

    disk::wipe(Path::new("/sys"), &name).unwrap();
    assert_eq!(sh(&format!("wipefs --no-act --noheadings {}", l.0)), "");
    assert!(facts::partitions(Path::new("/sys"), &name).is_empty());

    let mut dev = disk::open_target(&l.0, raw.len() as u64).unwrap();
    std::io::Write::write_all(&mut dev, &raw).unwrap();
    dev.sync_all().unwrap();
    drop(dev);

    let part = disk::grow(&l.0, 2).unwrap();
    assert_eq!(part, format!("{}p2", l.0));
    let part_bytes: u64 = sh(&format!("blockdev --getsize64 {part}")).parse().unwrap();
    assert!(part_bytes > 200 << 20, "{part_bytes}");
    let dump = sh(&format!("dumpe2fs -h {part} 2>/dev/null"));
    let blocks: u64 = dump
        .lines()
        .find_map(|l| l.strip_prefix("Block count:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let block_size: u64 = dump
        .lines()
        .find_map(|l| l.strip_prefix("Block size:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        blocks * block_size > 200 << 20,
        "filesystem not grown: {dump}"
    );

    let mut p = plan();
    p.hostname = "loop-node".into();
    p.ssh_authorized_keys = vec!["ssh-ed25519 AAAA k".into()];
    configure_on(&part, &p).unwrap();
    assert_eq!(
        sh(&format!(
            "debugfs -R 'cat /etc/hostname' {part} 2>/dev/null"
        )),
        "loop-node"
    );
    assert_eq!(
        sh(&format!(
            "debugfs -R 'cat /root/.ssh/authorized_keys' {part} 2>/dev/null"
        )),
        "ssh-ed25519 AAAA k"
    );
}

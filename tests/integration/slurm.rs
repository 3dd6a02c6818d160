//! contrib/slurm/pxed-reclaim as EpilogSlurmctld of a real Slurm (munged, slurmctld and
//! slurmd from Debian's slurm-wlm and munge, in a temp dir on free loopback ports) with
//! the real pxed, a Redfish emulator as the node's BMC and the node's netboot and
//! callbacks played by the test: a job ends, Slurm drains the node with reason
//! `reinstall`, pxed reinstalls it and Slurm shows it idle again; a reinstall that fails
//! leaves it drained with pxed's reason.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::json;

use crate::bmc::{NODE1, PASSWORD, Sushy, free_tcp_port};
use crate::common::{Api, Daemon, need, poll_blocking, pxed_bin, repo, run, write_file};

const TOKEN: &str = "slurm-token";
const MAC: &str = "52:54:00:12:34:56";

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// munged, slurmctld and slurmd (node `node1`) in the foreground, killed in Drop.
struct Slurm {
    dir: PathBuf,
    conf: PathBuf,
    _procs: Vec<Proc>,
}

impl Slurm {
    fn start(dir: &Path, epilog: &Path) -> Slurm {
        for t in ["munged", "slurmctld", "slurmd", "scontrol", "sinfo", "srun"] {
            need(t);
        }
        let key = dir.join("munge.key");
        std::fs::write(&key, rand_bytes()).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o400)).unwrap();
        for d in ["state", "spool"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        std::fs::write(dir.join("plugstack.conf"), "").unwrap();
        let sock = dir.join("munge.sock");
        let (ctld_port, d_port) = (free_tcp_port(), free_tcp_port());
        let p = dir.display();
        let conf = dir.join("slurm.conf");
        std::fs::write(
            &conf,
            format!(
                "ClusterName=pxedtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={p}/state
SlurmdSpoolDir={p}/spool
SlurmctldPidFile={p}/slurmctld.pid
SlurmdPidFile={p}/slurmd.pid
SlurmctldLogFile={p}/slurmctld.log
SlurmdLogFile={p}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/linear
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
PlugStackConfig={p}/plugstack.conf
EpilogSlurmctld={epilog}
NodeName=node1 NodeHostname=localhost NodeAddr=127.0.0.1 CPUs=1 RealMemory=100 State=UNKNOWN
PartitionName=debug Nodes=node1 Default=YES MaxTime=INFINITE State=UP
",
                sock = sock.display(),
                epilog = epilog.display(),
            ),
        )
        .unwrap();
        let spawn = |cmd: &mut Command| -> Proc {
            Proc(
                cmd.env("SLURM_CONF", &conf)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .unwrap_or_else(|e| panic!("{cmd:?}: {e}")),
            )
        };
        let mut procs = vec![spawn(
            Command::new("munged")
                .arg("-F")
                .arg("-f")
                .arg(format!("--socket={}", sock.display()))
                .arg(format!("--key-file={}", key.display()))
                .arg(format!("--pid-file={}/munged.pid", p))
                .arg(format!("--log-file={}/munged.log", p))
                .arg(format!("--seed-file={}/munge.seed", p)),
        )];
        let up = poll_blocking(Duration::from_secs(10), || sock.exists().then_some(()));
        assert!(up.is_some(), "munged did not start");
        procs.push(spawn(Command::new("slurmctld").args(["-D", "-c"])));
        procs.push(spawn(Command::new("slurmd").args(["-D", "-N", "node1"])));
        let s = Slurm {
            dir: dir.to_path_buf(),
            conf,
            _procs: procs,
        };
        s.wait_node("node1 idle", Duration::from_secs(30), |st, _| st == "idle");
        s
    }

    fn cmd(&self, prog: &str) -> Command {
        let mut c = Command::new(prog);
        c.env("SLURM_CONF", &self.conf);
        c
    }

    /// node1's (state, reason) as sinfo shows them.
    fn node(&self) -> (String, String) {
        let (_, out, _) = run(self
            .cmd("sinfo")
            .args(["-h", "-N", "-n", "node1", "-o", "%T|%E"]));
        let line = out.lines().next().unwrap_or("").to_string();
        let (st, reason) = line.split_once('|').unwrap_or((&line, ""));
        (st.to_string(), reason.to_string())
    }

    fn logs(&self) -> String {
        ["slurmctld.log", "reclaim.log"]
            .iter()
            .map(|f| {
                format!(
                    "--- {f}\n{}",
                    std::fs::read_to_string(self.dir.join(f)).unwrap_or_default()
                )
            })
            .collect()
    }

    fn wait_node(
        &self,
        what: &str,
        timeout: Duration,
        f: impl Fn(&str, &str) -> bool,
    ) -> (String, String) {
        // sinfo is a client of slurmctld: ask every 200 ms, not every 20.
        let end = std::time::Instant::now() + timeout;
        let got = loop {
            let (st, reason) = self.node();
            if f(&st, &reason) {
                break Some((st, reason));
            }
            if std::time::Instant::now() >= end {
                break None;
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        match got {
            Some(v) => v,
            None => panic!(
                "Slurm never showed {what}: {:?}\n{}",
                self.node(),
                self.logs()
            ),
        }
    }

    /// Runs a one-task job on node1 to its end.
    fn job(&self) {
        let (ok, out, err) = run(self
            .cmd("srun")
            .args(["-N1", "-w", "node1", "-t", "1", "true"]));
        assert!(ok, "srun: {out}{err}\n{}", self.logs());
    }
}

fn rand_bytes() -> Vec<u8> {
    (0..1024).map(|_| rand::random::<u8>()).collect()
}

/// pxed with rocky-9 imported from a directory mirror.
fn pxed(dir: tempfile::TempDir, env: &[(&str, &str)]) -> Daemon {
    let mirror = dir.path().join("mirror");
    crate::image_check::rocky_repo_metadata(&mirror);
    for arch in ["x86_64", "aarch64"] {
        let p = format!("rocky/9/BaseOS/{arch}/os/images/pxeboot");
        write_file(&mirror, &format!("{p}/vmlinuz"), b"kernel");
        write_file(&mirror, &format!("{p}/initrd.img"), b"initrd");
    }
    let mirror_env = format!("{}/", mirror.display());
    let (ok, out, err) = run(crate::common::pxed_on(dir.path())
        .current_dir(repo())
        .args(["image", "add", "rocky-9", "--demo", "--data-dir"])
        .arg(dir.path().join("data"))
        .env("PXED_MIRROR_BASE", &mirror_env));
    assert!(ok, "image add: {out}{err}");
    let mut env = env.to_vec();
    env.push(("PXED_MIRROR_BASE", &mirror_env));
    Daemon::start_in(dir, &[], &env)
}

/// The node's side of a reinstall: netboot (fetch the script), the installer's
/// `installed`, the first-boot agent's report and health.
async fn play_the_node(api: &Api, d: &Daemon, id: i64) {
    api.wait_state(d, id, "netbooting", Duration::from_secs(90))
        .await;
    let script = api.text(d, &format!("/boot/{MAC}.ipxe")).await;
    let i = script.find("/cfg/").expect("an install script") + 5;
    let token = script[i..].split('/').next().unwrap().to_string();
    api.wait_state(d, id, "installing", Duration::from_secs(10))
        .await;
    let agent = crate::common::agent_token_of(&d.data_dir(), id).await;
    let r = api
        .http
        .post(d.url(&format!("/cb/{token}/installed")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    api.first_boot_and_health(d, &agent, "node1").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_finished_job_reinstalls_its_node_and_slurm_gets_it_back() {
    pxed::net::install_crypto_provider();
    let sushy = Sushy::start();
    let work = tempfile::tempdir().unwrap();
    let d = pxed(
        tempfile::tempdir().unwrap(),
        &[
            ("PXED_API_TOKEN", TOKEN),
            ("PXED_LIFECYCLE__MAX_ATTEMPTS", "0"),
            ("PXED_LIFECYCLE__DEADLINES__NETBOOTING", "10s"),
        ],
    );
    let api = Api::new(TOKEN);
    let (s, v) = api
        .call(
            &d,
            reqwest::Method::POST,
            "/api/v1/nodes",
            Some(json!({"macs": [MAC], "name": "node1", "arch": "x86_64",
                "bmc": {"driver": "redfish", "address": sushy.url(), "username": "admin",
                        "password": PASSWORD, "system_id": NODE1}})),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_i64().unwrap();

    // slurmctld runs its epilog with a bare environment: the wrapper is the site's
    // /etc/pxed/reclaim.conf.
    let hook = repo().join("contrib/slurm/pxed-reclaim");
    let conf = write_file(
        work.path(),
        "reclaim.conf",
        format!(
            "PXED_URL={url}\nPXED_API_TOKEN={TOKEN}\nPXED={bin}\nPXED_IMAGE=rocky-9\n\
             PXED_TIMEOUT=3m\nPXED_DRAIN_TIMEOUT=1m\nPXED_RECLAIM_LOG={log}\n\
             PATH=/usr/sbin:/usr/bin:/sbin:/bin\nSLURM_CONF={slurm}\nexport SLURM_CONF\n",
            url = d.url(""),
            bin = pxed_bin(),
            log = work.path().join("slurm/reclaim.log").display(),
            slurm = work.path().join("slurm/slurm.conf").display(),
        )
        .as_bytes(),
    );
    let epilog = write_file(
        work.path(),
        "epilog",
        format!(
            "#!/bin/sh\nPXED_RECLAIM_CONF={} exec {}\n",
            conf.display(),
            hook.display()
        )
        .as_bytes(),
    );
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&epilog, std::fs::Permissions::from_mode(0o755)).unwrap();
    let slurm_dir = work.path().join("slurm");
    std::fs::create_dir_all(&slurm_dir).unwrap();
    let slurm = tokio::task::block_in_place(|| Slurm::start(&slurm_dir, &epilog));

    // A job ends: the epilog drains the node for its reinstall, pxed reinstalls it (the
    // test plays the machine), and Slurm has it idle again.
    tokio::task::block_in_place(|| {
        slurm.job();
        slurm.wait_node(
            "node1 drained for reinstall",
            Duration::from_secs(30),
            |st, r| st.starts_with("drain") && r == "reinstall",
        );
    });
    play_the_node(&api, &d, id).await;
    api.wait_state(&d, id, "available", Duration::from_secs(10))
        .await;
    tokio::task::block_in_place(|| {
        slurm.wait_node("node1 idle again", Duration::from_secs(60), |st, _| {
            st == "idle"
        })
    });
    let n = api.node(&d, id).await;
    assert_eq!(n["generation"], 1, "{n}");

    // The next job ends; this time the machine never netboots: pxed fails the node at
    // its netbooting deadline and Slurm keeps it drained with pxed's reason.
    tokio::task::block_in_place(|| slurm.job());
    api.wait_state(&d, id, "failed", Duration::from_secs(90))
        .await;
    let (st, reason) = tokio::task::block_in_place(|| {
        slurm.wait_node(
            "node1 drained with pxed's reason",
            Duration::from_secs(30),
            |_, r| r.starts_with("pxed: "),
        )
    });
    assert!(st.starts_with("drained"), "{st} {reason}");
    assert!(
        reason.contains("deadline: never netbooted"),
        "{reason}\n{}",
        slurm.logs()
    );
    let n = api.node(&d, id).await;
    assert_eq!(n["generation"], 2, "one reinstall per job: {n}");
    // Each job's reinstall went out with its own Idempotency-Key.
    let log = std::fs::read_to_string(slurm_dir.join("reclaim.log")).unwrap();
    assert!(log.contains("key slurm-pxedtest-job1-node1"), "{log}");
    assert!(log.contains("key slurm-pxedtest-job2-node1"), "{log}");

    // The operator runs the hook by hand once the cause is fixed: exit 0, node idle.
    let by_hand = || {
        let mut c = Command::new(&hook);
        c.arg("node1")
            .env("PXED_RECLAIM_CONF", &conf)
            .env("PXED_IDEMPOTENCY_PREFIX", "ops-1");
        std::thread::spawn(move || run(&mut c))
    };
    let h = by_hand();
    play_the_node(&api, &d, id).await;
    let (ok, out, err) = tokio::task::block_in_place(|| h.join().unwrap());
    assert!(ok, "{out}{err}\n{}", slurm.logs());
    tokio::task::block_in_place(|| {
        slurm.wait_node(
            "node1 idle after the run by hand",
            Duration::from_secs(60),
            |st, _| st == "idle",
        )
    });
    assert_eq!(api.node(&d, id).await["generation"], 3);
    // Run again with the same key: pxed answers with the same reinstall (already
    // done), so the node is back at once without a second install.
    let (ok, out, err) = tokio::task::block_in_place(|| by_hand().join().unwrap());
    assert!(ok, "{out}{err}\n{}", slurm.logs());
    tokio::task::block_in_place(|| {
        slurm.wait_node(
            "node1 idle after the repeat",
            Duration::from_secs(60),
            |st, _| st == "idle",
        )
    });
    assert_eq!(api.node(&d, id).await["generation"], 3, "reinstalled twice");
    eprintln!("{}", slurm.logs());
}

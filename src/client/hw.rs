//! `pxed profile ...`, `pxed node inventory`, `pxed node accept-inventory` and
//! `pxed node query`: hardware profiles and inventories through the API (issue 13).

use clap::{Args, Subcommand};
use reqwest::Method;

use super::{Api, ApiArgs, ClientError, enc, or_dash, print_json, table};
use crate::http::hardware::{Accepted, NodeInventory, Profiles, QueryHit};

/// `pxed profile ...`.
#[derive(Subcommand, Debug)]
pub enum ProfileCmd {
    /// The configured hardware profiles, and the pairs one machine could match both of.
    List(ApiArgs),
    /// Which profiles a node's inventory matches, and for the others which rule failed
    /// and why.
    Match {
        /// Node (id, name, hostname or MAC).
        node: String,
        /// That generation's inventory (default: the newest).
        #[arg(long)]
        generation: Option<i64>,
        #[command(flatten)]
        api: ApiArgs,
    },
}

/// `pxed node query`: nodes whose newest inventory has the hardware asked for.
#[derive(Args, Debug)]
pub struct QueryArgs {
    /// GPUs/accelerators whose identifier matches this glob (`*H100*`).
    #[arg(long)]
    pub gpu: Option<String>,
    /// How many of them: `8`, `8..`, `..4`, `2..4` (default `1..` with --gpu).
    #[arg(long)]
    pub gpus: Option<String>,
    /// Each matched GPU's PCIe link at least this many lanes wide.
    #[arg(long)]
    pub min_link_width: Option<u32>,
    /// Every GPU has a NIC on its NUMA node.
    #[arg(long)]
    pub numa_local: bool,
    /// Held to this profile.
    #[arg(long)]
    pub profile: Option<String>,
    /// Only nodes that lost hardware since their baseline.
    #[arg(long)]
    pub drifted: bool,
    #[command(flatten)]
    pub api: ApiArgs,
}

pub(super) async fn profile(cmd: ProfileCmd) -> Result<(), ClientError> {
    match cmd {
        ProfileCmd::List(a) => {
            let api = Api::new(&a)?;
            let v: Profiles = api.call(Method::GET, "/profiles", None, &[]).await?;
            if a.json {
                print_json(&v);
                return Ok(());
            }
            table(
                &[
                    "NAME",
                    "ARCH",
                    "CORES",
                    "MEMORY_GIB",
                    "GPUS",
                    "NICS",
                    "FIRMWARE",
                    "HEALTH",
                ],
                v.profiles
                    .iter()
                    .map(|p| {
                        let join = |v: Vec<String>| {
                            if v.is_empty() {
                                "-".into()
                            } else {
                                v.join(", ")
                            }
                        };
                        vec![
                            p.name.clone(),
                            or_dash(&p.arch),
                            or_dash(&p.cpu_cores),
                            or_dash(&p.memory_gib),
                            join(
                                p.gpus
                                    .iter()
                                    .map(|g| format!("{} x{}", g.model, g.count))
                                    .collect(),
                            ),
                            join(
                                p.nics
                                    .iter()
                                    .map(|n| format!("{}G x{}", n.min_speed_gbps, n.count))
                                    .collect(),
                            ),
                            join(p.firmware.iter().map(|(k, v)| format!("{k} {v}")).collect()),
                            join(p.health.iter().map(|h| h.name.clone()).collect()),
                        ]
                    })
                    .collect(),
            );
            for o in &v.overlaps {
                println!("overlap: {o}");
            }
        }
        ProfileCmd::Match {
            node,
            generation,
            api: a,
        } => {
            let api = Api::new(&a)?;
            let v = inventory_of(&api, &node, generation).await?;
            if a.json {
                print_json(&v.profiles);
                return Ok(());
            }
            let Some(g) = v.generation else {
                println!("node {}: no inventory reported yet", v.node_id);
                return Ok(());
            };
            println!(
                "node {} generation {g}: held to profile {}",
                v.node_id,
                v.hardware.profile.as_deref().unwrap_or("none")
            );
            if v.profiles.is_empty() {
                println!("no profiles are configured");
            }
            for m in &v.profiles {
                if m.matches {
                    println!("  {}: matches", m.profile);
                } else {
                    println!("  {}: does not match", m.profile);
                    for miss in &m.misses {
                        println!("    {}: {}", miss.rule, miss.why);
                    }
                }
            }
            let p: Profiles = api.call(Method::GET, "/profiles", None, &[]).await?;
            for o in &p.overlaps {
                println!("overlap: {o}");
            }
        }
    }
    Ok(())
}

async fn inventory_of(
    api: &Api,
    node: &str,
    generation: Option<i64>,
) -> Result<NodeInventory, ClientError> {
    let path = match generation {
        Some(g) => format!("/nodes/{}/inventory?generation={g}", enc(node)),
        None => format!("/nodes/{}/inventory", enc(node)),
    };
    api.call(Method::GET, &path, None, &[]).await
}

/// `pxed node inventory`.
pub(super) async fn node_inventory(
    node: &str,
    generation: Option<i64>,
    a: &ApiArgs,
) -> Result<(), ClientError> {
    let api = Api::new(a)?;
    let v = inventory_of(&api, node, generation).await?;
    if a.json {
        print_json(&v);
        return Ok(());
    }
    print_hardware(&v, true);
    Ok(())
}

/// The hardware part of `node show` and `node inventory`.
pub(super) fn print_hardware(v: &NodeInventory, full: bool) {
    let hw = &v.hardware;
    println!(
        "\nHardware: profile {}, baseline generation {}, last gate {}",
        hw.profile.as_deref().unwrap_or("none"),
        or_dash(&hw.baseline_generation),
        match (hw.checked_generation, hw.passed) {
            (Some(g), Some(true)) => format!("passed (generation {g})"),
            (Some(g), Some(false)) => format!(
                "FAILED (generation {g}): {}",
                hw.verdict.as_ref().map(|v| v.reason()).unwrap_or_default()
            ),
            _ => "not run yet".into(),
        }
    );
    let Some(g) = v.generation else {
        println!("no inventory reported yet");
        return;
    };
    let sources: Vec<String> = v
        .reports
        .iter()
        .filter(|r| r.generation == g)
        .map(|r| match r.took_ms {
            Some(ms) => format!("{} ({ms} ms)", r.source),
            None => r.source.to_string(),
        })
        .collect();
    println!("generation {g} reported by {}", sources.join(", "));
    if full && let Some(inv) = &v.inventory {
        for l in crate::inventory::summary(inv) {
            println!("  {l}");
        }
    }
    if v.changes.is_empty() {
        println!("no changes since the baseline");
    } else {
        println!("changes since the baseline:");
        for c in &v.changes {
            println!("  {}{c}", if c.degraded { "LOST " } else { "" });
        }
    }
}

/// `pxed node accept-inventory`.
pub(super) async fn accept(
    node: &str,
    generation: Option<i64>,
    profile: Option<String>,
    no_profile: bool,
    a: &ApiArgs,
) -> Result<(), ClientError> {
    let api = Api::new(a)?;
    let mut body = serde_json::json!({});
    if let Some(g) = generation {
        body["generation"] = g.into();
    }
    if no_profile {
        body["profile"] = "".into();
    } else if let Some(p) = profile {
        body["profile"] = p.into();
    }
    let v: Accepted = api
        .call(
            Method::POST,
            &format!("/nodes/{}/inventory/accept", enc(node)),
            Some(body),
            &[],
        )
        .await?;
    if a.json {
        print_json(&v);
        return Ok(());
    }
    println!(
        "node {}: generation {} is the baseline (profile {}); {} change(s) accepted; now {}",
        v.node.id,
        v.generation,
        v.profile.as_deref().unwrap_or("none"),
        v.changes_accepted.len(),
        v.node.state
    );
    for c in &v.changes_accepted {
        println!("  {c}");
    }
    Ok(())
}

/// `pxed node query`.
pub(super) async fn query(q: QueryArgs) -> Result<(), ClientError> {
    let api = Api::new(&q.api)?;
    let mut params = Vec::new();
    if let Some(g) = &q.gpu {
        params.push(format!("gpu={}", enc(g)));
    }
    if let Some(g) = &q.gpus {
        params.push(format!("gpus={}", enc(g)));
    }
    if let Some(w) = q.min_link_width {
        params.push(format!("min_link_width={w}"));
    }
    if q.numa_local {
        params.push("numa_local=true".into());
    }
    if let Some(p) = &q.profile {
        params.push(format!("profile={}", enc(p)));
    }
    if q.drifted {
        params.push("drifted=true".into());
    }
    let path = format!("/inventory/query?{}", params.join("&"));
    let hits: Vec<QueryHit> = api.call(Method::GET, &path, None, &[]).await?;
    if q.api.json {
        print_json(&hits);
        return Ok(());
    }
    table(
        &[
            "ID", "NAME", "STATE", "PROFILE", "DRIFTED", "GEN", "GPUS", "SYSTEM",
        ],
        hits.iter()
            .map(|h| {
                vec![
                    h.node_id.to_string(),
                    or_dash(&h.name),
                    h.state.to_string(),
                    or_dash(&h.profile),
                    if h.drifted { "yes" } else { "no" }.into(),
                    h.generation.to_string(),
                    h.gpus.to_string(),
                    h.system.clone(),
                ]
            })
            .collect(),
    );
    Ok(())
}

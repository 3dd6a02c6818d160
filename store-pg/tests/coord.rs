//! Node owners and lease claims between instances, against a real PostgreSQL: each
//! "instance" is its own pool, as two pxed processes would be.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::{cluster, migrated};
use store_pg::PgStore;
use store_pg::coord::{LeaseClaim, NewLease};

fn add_nodes(db: &str, n: usize, state: &str) {
    cluster()
        .psql(
            db,
            &format!(
                "INSERT INTO nodes (state, state_since, created_at) \
                 SELECT '{state}', 'now', 'now' FROM generate_series(1, {n})"
            ),
        )
        .unwrap();
}

/// Two instances claim the same 40 nodes at once, over and over: every node has
/// exactly one holder, the other is refused, renewals keep the fence.
#[tokio::test]
async fn of_two_instances_claiming_a_node_at_once_exactly_one_holds_it() {
    let (db, a) = migrated(4).await;
    let b = PgStore::connect(&cluster().url(&db), 4).await.unwrap();
    add_nodes(&db, 40, "reclaiming");
    let ttl = Duration::from_secs(30);
    for round in 0..5 {
        let claims = (1..=40).flat_map(|node| {
            [("a", &a), ("b", &b)].map(|(name, store)| {
                let store = store.clone();
                tokio::spawn(async move { (node, name, store.claim_node(node, name, ttl).await) })
            })
        });
        let mut holders: HashMap<i64, Vec<(&str, i64)>> = HashMap::new();
        for c in claims.collect::<Vec<_>>() {
            let (node, name, claim) = c.await.unwrap();
            if let Some(claim) = claim.unwrap() {
                holders.entry(node).or_default().push((name, claim.fence));
            }
        }
        assert_eq!(holders.len(), 40, "round {round}: every node has a holder");
        for (node, h) in &holders {
            assert_eq!(h.len(), 1, "round {round}: node {node} held by {h:?}");
            // First round: the first claim (fence 1); later rounds: the holder renews
            // (same fence), the other is refused.
            assert_eq!(h[0].1, 1, "round {round}: node {node}: {h:?}");
        }
    }
    assert!(a.unowned_nodes(&["reclaiming"]).await.unwrap().is_empty());
}

/// A holder that stops renewing loses the node when its claim lapses (database
/// clock); the survivor takes it under a higher fence; the old holder is then fenced
/// out of every step and cannot renew; a release frees a node at once.
#[tokio::test]
async fn a_survivor_takes_over_a_dead_instances_nodes_and_fences_it_out() {
    let (db, a) = migrated(2).await;
    let b = PgStore::connect(&cluster().url(&db), 2).await.unwrap();
    add_nodes(&db, 3, "installing");
    add_nodes(&db, 1, "available");
    let short = Duration::from_millis(300);
    let long = Duration::from_secs(30);
    let step = Duration::from_millis(50);
    let mut fences = HashMap::new();
    for node in 1..=3 {
        let c = a
            .claim_node(node, "a-1", short)
            .await
            .unwrap()
            .expect("free");
        assert!(a.holds(node, "a-1", c.fence, step).await.unwrap());
        fences.insert(node, c.fence);
        assert_eq!(b.claim_node(node, "b-1", long).await.unwrap(), None);
    }
    // Not owned, but not in a state with effects either: not listed.
    assert!(b.unowned_nodes(&["installing"]).await.unwrap().is_empty());
    // "a" dies: no more renewals.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        b.unowned_nodes(&["installing"]).await.unwrap(),
        vec![1, 2, 3]
    );
    for node in 1..=3 {
        assert!(!a.holds(node, "a-1", fences[&node], step).await.unwrap());
        let c = b
            .claim_node(node, "b-1", long)
            .await
            .unwrap()
            .expect("lapsed");
        assert_eq!(c.fence, fences[&node] + 1);
        // "a" comes back (it was only paused): fenced out, cannot renew.
        assert!(!a.holds(node, "a-1", fences[&node], step).await.unwrap());
        assert_eq!(a.claim_node(node, "a-1", short).await.unwrap(), None);
        assert!(b.holds(node, "b-1", c.fence, step).await.unwrap());
    }
    // A claim about to lapse is not enough for a step that may outlast it.
    assert!(
        !b.holds(1, "b-1", fences[&1] + 1, Duration::from_secs(60))
            .await
            .unwrap()
    );
    // A clean stop releases: the other instance claims at once.
    assert!(b.release_node(2, "b-1").await.unwrap());
    assert!(!b.release_node(2, "b-1").await.unwrap());
    let c = a
        .claim_node(2, "a-2", long)
        .await
        .unwrap()
        .expect("released");
    assert_eq!(c.fence, 1, "a released node starts a new row");
}

/// Four instances hand out 48 addresses to 64 MACs at once, each picking addresses
/// from its own (stale) view: no address is ever granted to two MACs while live,
/// every MAC that was refused learned who holds the address, and the table ends with
/// exactly the grants.
#[tokio::test]
async fn four_instances_never_give_one_address_to_two_macs() {
    let (db, first) = migrated(4).await;
    let mut instances = vec![first];
    for _ in 0..3 {
        instances.push(PgStore::connect(&cluster().url(&db), 4).await.unwrap());
    }
    let now = 1_900_000_000;
    let ips: Vec<String> = (10..58).map(|i| format!("10.0.0.{i}")).collect();
    let tasks = (0..64).map(|m| {
        let store = instances[m % 4].clone();
        let ips = ips.clone();
        tokio::spawn(async move {
            let mac = format!("52:54:00:00:01:{m:02x}");
            // Each client's instance tries the addresses in its own order, as
            // instances with stale caches would.
            let start = (m * 7) % ips.len();
            let mut refused = Vec::new();
            for k in 0..ips.len() {
                let ip = &ips[(start + k) % ips.len()];
                let lease = NewLease {
                    ip,
                    mac: &mac,
                    client_id: None,
                    hostname: None,
                    expires_at: now + 3600,
                };
                match store.claim_lease(&lease, now).await.unwrap() {
                    LeaseClaim::Granted => return (mac, Some(ip.clone()), refused),
                    LeaseClaim::Held { mac: holder, .. } => {
                        assert_ne!(holder, mac);
                        refused.push(holder);
                    }
                }
            }
            (mac, None, refused)
        })
    });
    let mut granted: HashMap<String, String> = HashMap::new();
    let mut without = 0;
    for t in tasks.collect::<Vec<_>>() {
        let (mac, ip, _) = t.await.unwrap();
        match ip {
            Some(ip) => {
                if let Some(other) = granted.insert(ip.clone(), mac.clone()) {
                    panic!("{ip} granted to {other} and {mac}");
                }
            }
            None => without += 1,
        }
    }
    assert_eq!(granted.len(), 48, "every address went to someone");
    assert_eq!(without, 16, "the pool ran out for the rest");
    let table = cluster()
        .psql(&db, "SELECT ip || '=' || mac FROM leases ORDER BY ip")
        .unwrap();
    let rows: HashSet<&str> = table.lines().collect();
    let want: Vec<String> = granted
        .iter()
        .map(|(ip, mac)| format!("{ip}={mac}"))
        .collect();
    assert_eq!(rows, want.iter().map(String::as_str).collect());

    // The same MAC renews its own address; an expired lease goes to a new MAC.
    let (ip, mac) = granted.iter().next().unwrap();
    let renew = NewLease {
        ip,
        mac,
        client_id: None,
        hostname: None,
        expires_at: now + 7200,
    };
    assert_eq!(
        instances[1].claim_lease(&renew, now).await.unwrap(),
        LeaseClaim::Granted
    );
    let other = NewLease {
        mac: "52:54:00:00:02:00",
        expires_at: now + 9000,
        ..renew.clone()
    };
    assert_eq!(
        instances[2].claim_lease(&other, now + 100).await.unwrap(),
        LeaseClaim::Held {
            mac: mac.clone(),
            expires_at: now + 7200
        }
    );
    assert_eq!(
        instances[2].claim_lease(&other, now + 7200).await.unwrap(),
        LeaseClaim::Granted
    );
}

/// The next change, within 10 s.
async fn next(c: &mut store_pg::coord::Changes) -> store_pg::coord::Change {
    tokio::time::timeout(Duration::from_secs(10), c.next())
        .await
        .expect("a change within 10 s")
        .unwrap()
}

/// One instance's listener hears what another commits, in commit order, and nothing
/// that was rolled back; when its server restarts it says to resync, then hears again.
#[tokio::test]
async fn each_instance_hears_the_lease_and_audit_changes_the_others_commit() {
    use store_pg::cluster::Cluster;
    use store_pg::coord::Change;
    // Its own server: it is restarted below.
    let own = Cluster::start().unwrap();
    let url = own.create_database("site").unwrap();
    let a = PgStore::connect(&url, 4).await.unwrap();
    a.migrate().await.unwrap();
    let b = PgStore::connect(&url, 4).await.unwrap();
    let mut heard = b.changes().await.unwrap();
    let lease = NewLease {
        ip: "10.0.0.20",
        mac: "52:54:00:00:03:01",
        client_id: None,
        hostname: None,
        expires_at: 2_000_000_000,
    };
    assert_eq!(
        a.claim_lease(&lease, 1_900_000_000).await.unwrap(),
        LeaseClaim::Granted
    );
    assert_eq!(next(&mut heard).await, Change::Lease("10.0.0.20".into()));
    own.psql(
        "site",
        "BEGIN; DELETE FROM leases; ROLLBACK; \
         INSERT INTO nodes (state, state_since, created_at) VALUES ('available', 'now', 'now'); \
         INSERT INTO node_events (node_id, generation, event, to_state, at, actor) \
             VALUES (1, 0, 'registered', 'available', 'now', 'test')",
    )
    .unwrap();
    // The rolled-back delete is never announced; the audit row is.
    assert_eq!(next(&mut heard).await, Change::Event { node: 1, id: 1 });

    own.restart().unwrap();
    assert_eq!(next(&mut heard).await, Change::Resync);
    // The pool's connections died with the server: the first use may fail once.
    let renew = NewLease {
        expires_at: 2_000_000_100,
        ..lease.clone()
    };
    let mut granted = a.claim_lease(&renew, 1_900_000_000).await;
    if granted.is_err() {
        granted = a.claim_lease(&renew, 1_900_000_000).await;
    }
    assert_eq!(granted.unwrap(), LeaseClaim::Granted);
    assert_eq!(next(&mut heard).await, Change::Lease("10.0.0.20".into()));
    // What the listening store commits itself is not announced back to it.
    let theirs = NewLease {
        ip: "10.0.0.21",
        ..lease.clone()
    };
    b.claim_lease(&theirs, 1_900_000_000).await.unwrap();
    let ours = NewLease {
        ip: "10.0.0.22",
        ..lease.clone()
    };
    a.claim_lease(&ours, 1_900_000_000).await.unwrap();
    assert_eq!(next(&mut heard).await, Change::Lease("10.0.0.22".into()));
}

/// BMC steps under claims: the holder records and sends; after a takeover the old
/// holder's next step is refused; the new holder finds the old holder's power cycle
/// of the same attempt recorded and checks the machine instead of cycling it again;
/// a node that moved on is skipped.
#[tokio::test]
async fn a_bmc_step_is_sent_only_under_a_live_claim_and_a_cycle_only_once() {
    use store_pg::coord::{StepClaim, StepIntent};
    let (db, a) = migrated(2).await;
    let b = PgStore::connect(&cluster().url(&db), 2).await.unwrap();
    add_nodes(&db, 1, "reclaiming");
    cluster()
        .psql(&db, "UPDATE nodes SET generation = 3, attempt = 1")
        .unwrap();
    let ca = a
        .claim_node(1, "a", Duration::from_millis(400))
        .await
        .unwrap()
        .unwrap();
    let step = |owner, fence, step| StepIntent {
        node: 1,
        owner,
        fence,
        margin: Duration::from_millis(100),
        generation: 3,
        attempt: 1,
        step,
        sent_at: "2026-12-02T13:00:00.000Z",
    };
    assert_eq!(
        a.claim_bmc_step(&step("a", ca.fence, "set_netboot"))
            .await
            .unwrap(),
        StepClaim::Send
    );
    assert_eq!(
        a.claim_bmc_step(&step("a", ca.fence, "power_cycle"))
            .await
            .unwrap(),
        StepClaim::Send
    );
    // "b" has no claim.
    assert_eq!(
        b.claim_bmc_step(&step("b", ca.fence, "power_cycle"))
            .await
            .unwrap(),
        StepClaim::NotHeld
    );
    // "a" stops renewing; "b" takes over.
    tokio::time::sleep(Duration::from_millis(450)).await;
    let cb = b
        .claim_node(1, "b", Duration::from_secs(30))
        .await
        .unwrap()
        .expect("lapsed");
    assert_eq!(
        a.claim_bmc_step(&step("a", ca.fence, "set_netboot"))
            .await
            .unwrap(),
        StepClaim::NotHeld
    );
    assert_eq!(
        b.claim_bmc_step(&step("b", cb.fence, "power_cycle"))
            .await
            .unwrap(),
        StepClaim::AlreadySent {
            at: "2026-12-02T13:00:00.000Z".into()
        }
    );
    // Within the margin of its lapse, a claim is not enough.
    let mut late = step("b", cb.fence, "set_netboot");
    late.margin = Duration::from_secs(60);
    assert_eq!(b.claim_bmc_step(&late).await.unwrap(), StepClaim::NotHeld);
    // The next attempt: the node moved on from attempt 1.
    cluster().psql(&db, "UPDATE nodes SET attempt = 2").unwrap();
    assert_eq!(
        b.claim_bmc_step(&step("b", cb.fence, "power_cycle"))
            .await
            .unwrap(),
        StepClaim::NotCurrent
    );
}

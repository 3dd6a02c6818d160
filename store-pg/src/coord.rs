//! What several pxed instances on one database agree through it, decided by the
//! database in one statement each, so no two instances can both win:
//!
//! - **Node owners.** One instance at a time runs a node's lifecycle effects (BMC
//!   calls, deadlines). A claim lasts `ttl` unless renewed; when its holder dies it
//!   expires and a survivor claims the node. Each change of holder raises the node's
//!   `fence`; a holder records each BMC step under its fence before sending it
//!   ([`PgStore::claim_bmc_step`]), so an instance that lost a node (paused, cut off)
//!   cannot go on stepping it, and a power cycle the previous owner already sent is
//!   checked, not sent again. Expiry is measured on the database's clock, never on an
//!   instance's, so clock skew between instances cannot make two holders.
//! - **Lease claims.** An address is given to a MAC only if no other MAC holds it
//!   unexpired ([`PgStore::claim_lease`]): a conditional upsert on the address's
//!   primary key, so two instances answering two clients at once cannot both bind one
//!   address; the loser is told who holds it and offers another.

use std::time::Duration;

use super::{PgError, PgStore};

/// A node claim that is held: its fence and when it lapses (database clock, ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    pub fence: i64,
    pub expires_at_ms: i64,
}

/// The outcome of a lease claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseClaim {
    /// The address is bound to this MAC until the given time.
    Granted,
    /// Another MAC holds it unexpired.
    Held { mac: String, expires_at: i64 },
}

/// A lease to claim (`expires_at` and `now` in seconds since the epoch, the DHCP
/// server's clock, as the leases table stores them).
#[derive(Debug, Clone)]
pub struct NewLease<'a> {
    pub ip: &'a str,
    pub mac: &'a str,
    pub client_id: Option<&'a str>,
    pub hostname: Option<&'a str>,
    pub expires_at: i64,
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl PgStore {
    /// Claims `node` for `owner` (a name unique to one run of one instance), or
    /// renews the claim it already holds, for `ttl`. `None` while another owner's
    /// claim is live.
    pub async fn claim_node(
        &self,
        node: i64,
        owner: &str,
        ttl: Duration,
    ) -> Result<Option<Claim>, PgError> {
        let row = sqlx::query!(
            r#"INSERT INTO node_owners (node_id, owner, fence, expires_at)
               VALUES ($1, $2, 1, (extract(epoch FROM clock_timestamp()) * 1000)::bigint + $3)
               ON CONFLICT (node_id) DO UPDATE
                  SET owner = EXCLUDED.owner,
                      fence = CASE WHEN node_owners.owner = EXCLUDED.owner
                                   THEN node_owners.fence ELSE node_owners.fence + 1 END,
                      expires_at = EXCLUDED.expires_at
                WHERE node_owners.owner = EXCLUDED.owner
                   OR node_owners.expires_at <= (extract(epoch FROM clock_timestamp()) * 1000)::bigint
               RETURNING fence, expires_at"#,
            node,
            owner,
            ms(ttl)
        )
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|r| Claim {
            fence: r.fence,
            expires_at_ms: r.expires_at,
        }))
    }

    /// Makes `owner` the holder of `node` for `ttl`, whoever held it: the instance that
    /// has just applied an event to the node runs its effects (deadlines, BMC steps),
    /// so it must be the one that answers for it. A change of holder raises the fence;
    /// the previous holder sees at its next renewal that the node is no longer its.
    pub async fn take_node(&self, node: i64, owner: &str, ttl: Duration) -> Result<Claim, PgError> {
        let r = sqlx::query!(
            r#"INSERT INTO node_owners (node_id, owner, fence, expires_at)
               VALUES ($1, $2, 1, (extract(epoch FROM clock_timestamp()) * 1000)::bigint + $3)
               ON CONFLICT (node_id) DO UPDATE
                  SET owner = EXCLUDED.owner,
                      fence = CASE WHEN node_owners.owner = EXCLUDED.owner
                                   THEN node_owners.fence ELSE node_owners.fence + 1 END,
                      expires_at = EXCLUDED.expires_at
               RETURNING fence, expires_at"#,
            node,
            owner,
            ms(ttl)
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(Claim {
            fence: r.fence,
            expires_at_ms: r.expires_at,
        })
    }

    /// Renews every claim `owner` holds for `ttl` more, in one statement; the nodes it
    /// still holds (those another instance took are not among them).
    pub async fn renew_nodes(&self, owner: &str, ttl: Duration) -> Result<Vec<i64>, PgError> {
        Ok(sqlx::query_scalar!(
            r#"UPDATE node_owners
                  SET expires_at = (extract(epoch FROM clock_timestamp()) * 1000)::bigint + $2
                WHERE owner = $1
                  AND expires_at > (extract(epoch FROM clock_timestamp()) * 1000)::bigint
               RETURNING node_id"#,
            owner,
            ms(ttl)
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// True if `owner` still holds `node` under `fence` for at least `margin` more
    /// (the longest a BMC step may take): the check before each step.
    pub async fn holds(
        &self,
        node: i64,
        owner: &str,
        fence: i64,
        margin: Duration,
    ) -> Result<bool, PgError> {
        Ok(sqlx::query_scalar!(
            r#"SELECT EXISTS (
                 SELECT 1 FROM node_owners
                  WHERE node_id = $1 AND owner = $2 AND fence = $3
                    AND expires_at > (extract(epoch FROM clock_timestamp()) * 1000)::bigint + $4
               ) AS "held!""#,
            node,
            owner,
            fence,
            ms(margin)
        )
        .fetch_one(&self.pool)
        .await?)
    }

    /// True if `owner`'s claim on `node` has not lapsed (whatever its fence): the check
    /// before a timer's event, so an instance that was paused past its claim does not
    /// fire a deadline for a node another instance now answers for.
    pub async fn answers_for(&self, node: i64, owner: &str) -> Result<bool, PgError> {
        Ok(sqlx::query_scalar!(
            r#"SELECT EXISTS (
                 SELECT 1 FROM node_owners
                  WHERE node_id = $1 AND owner = $2
                    AND expires_at > (extract(epoch FROM clock_timestamp()) * 1000)::bigint
               ) AS "held!""#,
            node,
            owner
        )
        .fetch_one(&self.pool)
        .await?)
    }

    /// Gives `node` up (at a clean stop), so another instance need not wait for the
    /// claim to lapse. False if `owner` did not hold it.
    pub async fn release_node(&self, node: i64, owner: &str) -> Result<bool, PgError> {
        let done = sqlx::query!(
            "DELETE FROM node_owners WHERE node_id = $1 AND owner = $2",
            node,
            owner
        )
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Gives up every node `owner` holds (a clean stop); how many.
    pub async fn release_nodes(&self, owner: &str) -> Result<u64, PgError> {
        let done = sqlx::query!("DELETE FROM node_owners WHERE owner = $1", owner)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }

    /// Nodes in a state with lifecycle effects to run whose claim is missing or has
    /// lapsed: what a survivor claims.
    pub async fn unowned_nodes(&self, states: &[&str]) -> Result<Vec<i64>, PgError> {
        let states: Vec<String> = states.iter().map(|s| s.to_string()).collect();
        Ok(sqlx::query_scalar!(
            r#"SELECT n.id FROM nodes n
                 LEFT JOIN node_owners o ON o.node_id = n.id
                WHERE n.state = ANY($1)
                  AND (o.node_id IS NULL
                       OR o.expires_at <= (extract(epoch FROM clock_timestamp()) * 1000)::bigint)
                ORDER BY n.id"#,
            &states
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// Binds `lease.ip` to `lease.mac` unless another MAC holds it past `now`: one
    /// statement, so of two instances claiming one address at once, one wins.
    pub async fn claim_lease(&self, lease: &NewLease<'_>, now: i64) -> Result<LeaseClaim, PgError> {
        let granted = sqlx::query_scalar!(
            r#"INSERT INTO leases (ip, mac, client_id, hostname, state, expires_at)
               VALUES ($1, $2, $3, $4, 'bound', $5)
               ON CONFLICT (ip) DO UPDATE
                  SET mac = EXCLUDED.mac, client_id = EXCLUDED.client_id,
                      hostname = EXCLUDED.hostname, state = 'bound',
                      expires_at = EXCLUDED.expires_at
                WHERE (leases.mac = EXCLUDED.mac AND leases.state = 'bound')
                   OR leases.expires_at <= $6
               RETURNING ip"#,
            lease.ip,
            lease.mac,
            lease.client_id,
            lease.hostname,
            lease.expires_at,
            now
        )
        .fetch_optional(&self.pool)
        .await?;
        if granted.is_some() {
            return Ok(LeaseClaim::Granted);
        }
        let holder = sqlx::query!("SELECT mac, expires_at FROM leases WHERE ip = $1", lease.ip)
            .fetch_optional(&self.pool)
            .await?;
        Ok(match holder {
            Some(h) => LeaseClaim::Held {
                mac: h.mac,
                expires_at: h.expires_at,
            },
            // Released between the two statements: claim again.
            None => Box::pin(self.claim_lease(lease, now)).await?,
        })
    }
}

/// A BMC step an owner is about to send (see [`PgStore::claim_bmc_step`]).
#[derive(Debug, Clone)]
pub struct StepIntent<'a> {
    pub node: i64,
    /// The claim it is sent under.
    pub owner: &'a str,
    pub fence: i64,
    /// The longest the step may take: the claim must outlast it.
    pub margin: Duration,
    pub generation: i64,
    pub attempt: i64,
    /// `set_netboot` or `power_cycle` (`model::BmcStep`).
    pub step: &'a str,
    /// When (RFC 3339), as the audit log writes it.
    pub sent_at: &'a str,
}

/// What the database says about a BMC step an owner is about to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepClaim {
    /// Recorded as sent under this claim: send it now.
    Send,
    /// This attempt's power cycle was already recorded as sent at `at` (by this
    /// instance before a restart, or by the node's previous owner): check the machine
    /// instead of cycling it again.
    AlreadySent { at: String },
    /// The node has moved on (another state, generation or attempt): skip the step.
    NotCurrent,
    /// The claim lapsed or passed to another instance (or would lapse within the
    /// margin): do not send.
    NotHeld,
}

impl PgStore {
    /// Records `intent` as sent, in one transaction with the checks that the claim is
    /// held under its fence for at least the margin, and that the node is still in
    /// `reclaiming` at that generation and attempt. The claim's row stays locked until
    /// the record commits, so a takeover cannot slip between the check and the record.
    pub async fn claim_bmc_step(&self, intent: &StepIntent<'_>) -> Result<StepClaim, PgError> {
        let mut tx = self.pool.begin().await?;
        let held = sqlx::query_scalar!(
            r#"SELECT fence FROM node_owners
                WHERE node_id = $1 AND owner = $2 AND fence = $3
                  AND expires_at > (extract(epoch FROM clock_timestamp()) * 1000)::bigint + $4
                FOR UPDATE"#,
            intent.node,
            intent.owner,
            intent.fence,
            ms(intent.margin)
        )
        .fetch_optional(&mut *tx)
        .await?;
        if held.is_none() {
            return Ok(StepClaim::NotHeld);
        }
        let current = sqlx::query!(
            "SELECT state, generation, attempt FROM nodes WHERE id = $1",
            intent.node
        )
        .fetch_optional(&mut *tx)
        .await?;
        match current {
            Some(n)
                if n.state == "reclaiming"
                    && n.generation == intent.generation
                    && n.attempt == intent.attempt => {}
            _ => return Ok(StepClaim::NotCurrent),
        }
        if intent.step == "power_cycle" {
            let sent = sqlx::query_scalar!(
                "SELECT sent_at FROM bmc_intents
                  WHERE node_id = $1 AND generation = $2 AND attempt = $3 AND step = $4",
                intent.node,
                intent.generation,
                intent.attempt,
                intent.step
            )
            .fetch_optional(&mut *tx)
            .await?;
            if let Some(at) = sent {
                return Ok(StepClaim::AlreadySent { at });
            }
        }
        sqlx::query!(
            "INSERT INTO bmc_intents (node_id, generation, attempt, step, sent_at)
             VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (node_id) DO UPDATE SET generation = EXCLUDED.generation,
               attempt = EXCLUDED.attempt, step = EXCLUDED.step, sent_at = EXCLUDED.sent_at",
            intent.node,
            intent.generation,
            intent.attempt,
            intent.step,
            intent.sent_at
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(StepClaim::Send)
    }
}

/// A change another instance (or this one) committed, announced by the database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// The lease of this address was bound, renewed, changed or deleted: reload it.
    Lease(String),
    /// A row was appended to the audit log (a transition, whichever instance made it).
    Event { node: i64, id: i64 },
    /// The connection was lost and is being made again: changes in between were not
    /// seen, so reload what is cached.
    Resync,
}

/// The stream of [`Change`]s (`LISTEN` on one connection of its own).
pub struct Changes {
    listener: sqlx::postgres::PgListener,
    /// This store's own sessions: what they committed is not announced again.
    own: super::OwnSessions,
}

impl std::fmt::Debug for Changes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Changes(..)")
    }
}

/// What a listener hears of (see [`PgStore::changes_of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Channel {
    /// [`Change::Lease`].
    Leases,
    /// [`Change::Event`].
    Events,
}

const LEASES: &str = "pxed_leases";
const EVENTS: &str = "pxed_events";

impl PgStore {
    /// Starts listening; changes other instances (other stores) commit from now on are
    /// announced in commit order. This store's own changes are not: its caller knows
    /// them already.
    pub async fn changes(&self) -> Result<Changes, PgError> {
        self.changes_of(&[Channel::Leases, Channel::Events]).await
    }

    /// [`PgStore::changes`] of the given kinds only: a listener hears (and the server
    /// sends it) nothing else. The DHCP server follows leases, the status page events.
    pub async fn changes_of(&self, channels: &[Channel]) -> Result<Changes, PgError> {
        let mut listener = sqlx::postgres::PgListener::connect_with(&self.pool).await?;
        listener
            .listen_all(channels.iter().map(|c| match c {
                Channel::Leases => LEASES,
                Channel::Events => EVENTS,
            }))
            .await?;
        Ok(Changes {
            listener,
            own: self.own.clone(),
        })
    }
}

impl Changes {
    /// The next change. An error means the server cannot be reached now (the caller
    /// waits and asks again: the next call reconnects and says [`Change::Resync`]).
    pub async fn next(&mut self) -> Result<Change, PgError> {
        loop {
            let Some(n) = self.listener.try_recv().await? else {
                return Ok(Change::Resync);
            };
            let mine = self
                .own
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(&n.process_id());
            if mine {
                continue;
            }
            let payload = n.payload();
            match n.channel() {
                LEASES => return Ok(Change::Lease(payload.to_owned())),
                EVENTS => {
                    let parsed = payload
                        .split_once(':')
                        .and_then(|(n, i)| Some((n.parse().ok()?, i.parse().ok()?)));
                    if let Some((node, id)) = parsed {
                        return Ok(Change::Event { node, id });
                    }
                }
                _ => {}
            }
        }
    }
}

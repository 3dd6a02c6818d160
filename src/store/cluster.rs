//! What several pxed instances on one PostgreSQL database agree through it (see
//! `store_pg::coord`): which instance answers for each node in progress, and which
//! one runs a job that must run once per database (webhook delivery). On SQLite there
//! is one pxed per file: every node and every job is its own, and these are no-ops.

use std::collections::HashSet;
use std::time::Duration;

use super::{Db, Store, StoreError};

/// A job that runs on one instance per database at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Duty {
    /// Webhook delivery: each transition is delivered once, whichever instance made it.
    Webhooks,
}

impl Duty {
    /// Its advisory-lock key (ASCII "pxed" and a letter).
    fn key(self) -> i64 {
        match self {
            Duty::Webhooks => 0x0070_7865_6477,
        }
    }
}

/// Held while this instance runs a [`Duty`]: on PostgreSQL a session advisory lock on
/// a connection of its own, which the database releases when the process dies or the
/// connection breaks.
#[derive(Debug)]
pub struct DutyLock(Option<store_pg::AdvisoryLock>);

impl DutyLock {
    /// False once the lock's connection is gone: the database has released the lock
    /// (or will), so another instance may take the duty; stop running it.
    pub async fn still_held(&mut self) -> bool {
        match &mut self.0 {
            None => true,
            Some(l) => l.alive().await,
        }
    }
}

impl Store {
    /// What other instances commit from now on, of one kind (leases, or audit rows);
    /// `None` on SQLite.
    pub async fn changes(
        &self,
        of: store_pg::coord::Channel,
    ) -> Result<Option<store_pg::coord::Changes>, StoreError> {
        let Db::Postgres(pg) = &self.db else {
            return Ok(None);
        };
        Ok(Some(pg.changes_of(&[of]).await?))
    }

    /// The lease rows of `ips`, as stored now (empty on SQLite: one pxed, whose lease
    /// table is the truth).
    pub async fn leases_at(
        &self,
        ips: &[std::net::Ipv4Addr],
    ) -> Result<Vec<super::leases::LeaseRow>, StoreError> {
        let Db::Postgres(pg) = &self.db else {
            return Ok(Vec::new());
        };
        let ips: Vec<String> = ips.iter().map(|i| i.to_string()).collect();
        Ok(pg
            .leases_at(&ips)
            .await?
            .into_iter()
            .filter_map(|r| {
                super::leases::lease_row(
                    r.ip,
                    r.mac,
                    r.client_id,
                    r.hostname,
                    r.state,
                    r.expires_at,
                )
            })
            .collect())
    }

    /// One audit row by id (`None` on SQLite, or when there is none).
    pub async fn event(
        &self,
        id: i64,
    ) -> Result<Option<crate::model::rows::EventView>, StoreError> {
        let Db::Postgres(pg) = &self.db else {
            return Ok(None);
        };
        Ok(pg.event(id).await?)
    }

    /// True when other pxed instances may share this database (PostgreSQL).
    pub fn is_shared(&self) -> bool {
        matches!(self.db, Db::Postgres(_))
    }

    /// Takes `duty` for this instance, or `None` while another instance holds it.
    pub async fn try_duty(&self, duty: Duty) -> Result<Option<DutyLock>, StoreError> {
        let Db::Postgres(pg) = &self.db else {
            return Ok(Some(DutyLock(None)));
        };
        Ok(pg.try_lock(duty.key()).await?.map(|l| DutyLock(Some(l))))
    }

    /// Makes `owner` answer for node `id` (it has just applied an event to it).
    pub async fn take_node(&self, id: i64, owner: &str, ttl: Duration) -> Result<(), StoreError> {
        if let Db::Postgres(pg) = &self.db {
            pg.take_node(id, owner, ttl).await?;
        }
        Ok(())
    }

    /// Whether `owner` still answers for node `id` (its claim has not lapsed); always
    /// on SQLite (one instance).
    pub async fn answers_for(&self, id: i64, owner: &str) -> Result<bool, StoreError> {
        match &self.db {
            Db::Postgres(pg) => Ok(pg.answers_for(id, owner).await?),
            Db::Sqlite(_) => Ok(true),
        }
    }

    /// Gives node `id` up (it has come to rest).
    pub async fn release_node(&self, id: i64, owner: &str) -> Result<(), StoreError> {
        if let Db::Postgres(pg) = &self.db {
            pg.release_node(id, owner).await?;
        }
        Ok(())
    }

    /// Gives up every node `owner` answers for (a clean stop: another instance need
    /// not wait for the claims to lapse); how many.
    pub async fn release_nodes(&self, owner: &str) -> Result<u64, StoreError> {
        match &self.db {
            Db::Postgres(pg) => Ok(pg.release_nodes(owner).await?),
            Db::Sqlite(_) => Ok(0),
        }
    }

    /// Renews `owner`'s claims; the nodes it still answers for, or `None` on SQLite
    /// (every node).
    pub async fn renew_nodes(
        &self,
        owner: &str,
        ttl: Duration,
    ) -> Result<Option<HashSet<i64>>, StoreError> {
        let Db::Postgres(pg) = &self.db else {
            return Ok(None);
        };
        Ok(Some(
            pg.renew_nodes(owner, ttl).await?.into_iter().collect(),
        ))
    }

    /// Claims for `owner` the nodes in `states` that no live instance answers for:
    /// their holder died (or none ever claimed them). `None` on SQLite: every node in
    /// those states is this instance's.
    pub async fn claim_orphans(
        &self,
        owner: &str,
        ttl: Duration,
        states: &[&str],
    ) -> Result<Option<HashSet<i64>>, StoreError> {
        let Db::Postgres(pg) = &self.db else {
            return Ok(None);
        };
        let mut got = HashSet::new();
        for id in pg.unowned_nodes(states).await? {
            // Another survivor may claim the same node at the same moment: one wins.
            if pg.claim_node(id, owner, ttl).await?.is_some() {
                got.insert(id);
            }
        }
        Ok(Some(got))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Mac;

    #[tokio::test]
    async fn one_instance_answers_for_a_node_and_a_survivor_takes_it_when_its_claim_lapses() {
        let dir = tempfile::tempdir().unwrap();
        let [lite, pg] = crate::store::test_stores(dir.path()).await;
        let ttl = Duration::from_millis(600);
        let states = ["discovered"];
        let mac = Mac([0x52, 0x54, 0, 0, 0x51, 1]);
        for s in [&lite, &pg] {
            s.discover_many(&[(mac, None)]).await.unwrap();
        }
        let id = pg.node_by_mac(mac).await.unwrap().unwrap().id;

        // SQLite: one pxed, every node its own.
        assert!(!lite.is_shared());
        assert_eq!(lite.claim_orphans("a", ttl, &states).await.unwrap(), None);
        assert_eq!(lite.renew_nodes("a", ttl).await.unwrap(), None);
        assert!(lite.answers_for(1, "a").await.unwrap());
        assert!(lite.try_duty(Duty::Webhooks).await.unwrap().is_some());

        assert!(pg.is_shared());
        let one = HashSet::from([id]);
        // A claims the unclaimed node; B finds nothing to take while A's claim lives.
        assert_eq!(
            pg.claim_orphans("a", ttl, &states).await.unwrap(),
            Some(one.clone())
        );
        assert_eq!(
            pg.claim_orphans("b", ttl, &states).await.unwrap(),
            Some(HashSet::new())
        );
        assert_eq!(pg.renew_nodes("a", ttl).await.unwrap(), Some(one.clone()));
        assert!(pg.answers_for(id, "a").await.unwrap());
        assert!(!pg.answers_for(id, "b").await.unwrap());
        // B applies an event to it: B answers for it now, and A's renewal says so.
        pg.take_node(id, "b", ttl).await.unwrap();
        assert!(!pg.answers_for(id, "a").await.unwrap());
        assert!(pg.answers_for(id, "b").await.unwrap());
        assert_eq!(
            pg.renew_nodes("a", ttl).await.unwrap(),
            Some(HashSet::new())
        );
        assert_eq!(
            pg.claim_orphans("a", ttl, &states).await.unwrap(),
            Some(HashSet::new())
        );
        // B dies (stops renewing): once its claim lapses, A takes the node over.
        tokio::time::sleep(ttl + Duration::from_millis(200)).await;
        assert!(!pg.answers_for(id, "b").await.unwrap(), "lapsed");
        assert_eq!(
            pg.claim_orphans("a", ttl, &states).await.unwrap(),
            Some(one.clone())
        );
        // A node at rest is given up.
        pg.release_node(id, "a").await.unwrap();
        assert_eq!(
            pg.renew_nodes("a", ttl).await.unwrap(),
            Some(HashSet::new())
        );

        // A duty is one instance's at a time, and free again when its holder lets go.
        let mut held = pg.try_duty(Duty::Webhooks).await.unwrap().expect("free");
        assert!(pg.try_duty(Duty::Webhooks).await.unwrap().is_none());
        assert!(held.still_held().await);
        drop(held);
        let mut again = None;
        for _ in 0..50 {
            again = pg.try_duty(Duty::Webhooks).await.unwrap();
            if again.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(again.is_some(), "the duty is free once its holder is gone");
    }
}

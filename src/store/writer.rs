//! Group commit: every write goes through one connection, and writes that queue up
//! behind each other share one COMMIT (one fsync).
//!
//! SQLite has one writer. With writes spread over the pool's connections, a writer
//! that finds the lock taken sleeps in SQLite's busy handler (1, 2, 5 … 100 ms) while
//! the lock may free much sooner, and every write pays its own fsync
//! (`synchronous=FULL`). Under a boot storm both showed: the script, `installed` and
//! first-boot callbacks each waited seconds for a commit, with the CPU half idle.
//!
//! Here a write is a `SAVEPOINT` inside the open batch transaction on the one writer
//! connection, taken in turn through a fair async lock (so no busy-handler sleeps).
//! [`Write::commit`] releases the savepoint; if no other write is queued (or the batch
//! is full) it commits the batch, else it leaves the batch open and waits for the write
//! that does. Either way it returns only once its write is durable, or with the error
//! that stopped the batch's COMMIT (then none of the batch's writes happened). A write
//! dropped without `commit` (an error, a cancelled request) is rolled back to its
//! savepoint by a task it spawns, which also commits the batch if it was the last
//! queued, so no waiter is left behind.
//!
//! (sqlx's nested `Transaction` would also give savepoints, but it borrows its parent
//! and so cannot be held across the requests that share one batch.)
//!
//! Every statement is a round trip to sqlx's SQLite worker thread (two thread wake-ups),
//! and under a boot storm those wake-ups, not SQLite, were most of the store's CPU. So
//! the bookkeeping statements travel together: a batch opens with `BEGIN IMMEDIATE;
//! SAVEPOINT w` in one round trip, and a write that leaves the batch open for a queued
//! one releases its savepoint and opens the next one's (`RELEASE w; SAVEPOINT w`), which
//! the next write then takes without a round trip of its own.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{ConnectOptions, Connection, SqliteConnection};
use tokio::sync::{Mutex, OwnedMutexGuard, watch};

use super::{StoreError, StoreHealth};

/// Writes per COMMIT at most: bounds how long a write waits for a busy batch.
const MAX_BATCH: usize = 64;

/// The outcome of one batch's COMMIT, shared by its writes.
type Done = Option<Result<(), String>>;

/// The one writer connection and its open batch.
#[derive(Debug)]
pub(super) struct Writer {
    slot: Arc<Mutex<Slot>>,
    /// Writes begun (or waiting to begin) whose savepoint is not released yet: while
    /// any is, the batch stays open for it.
    pending: AtomicUsize,
    opts: SqliteConnectOptions,
    health: Arc<StoreHealth>,
}

#[derive(Debug, Default)]
struct Slot {
    /// None after a failed COMMIT (reopened by the next write) or after close.
    conn: Option<SqliteConnection>,
    batch: Option<watch::Sender<Done>>,
    jobs: usize,
    /// A savepoint is open that no one released: roll it back before the next write.
    dirty: bool,
    /// An empty savepoint is open, opened by the last write for the next one.
    spare: bool,
    /// A batch was being opened when its caller went away: whether its `BEGIN` ran is
    /// unknown, so the connection is replaced (the batch held no write yet).
    opening: bool,
    closed: bool,
}

impl Writer {
    pub(super) fn new(
        conn: SqliteConnection,
        opts: SqliteConnectOptions,
        health: Arc<StoreHealth>,
    ) -> Writer {
        Writer {
            slot: Arc::new(Mutex::new(Slot {
                conn: Some(conn),
                ..Slot::default()
            })),
            pending: AtomicUsize::new(0),
            opts,
            health,
        }
    }

    /// Begins one write (waits for its turn).
    pub(super) async fn begin(self: &Arc<Self>) -> Result<Write, StoreError> {
        self.pending.fetch_add(1, Ordering::SeqCst);
        // From here on, dropping `w` (an error below, or a cancelled caller) gives the
        // count back and settles the batch.
        let mut w = Write {
            writer: self.clone(),
            slot: None,
            counted: true,
            turn: None,
        };
        let asked = Instant::now();
        self.health.write_queued.fetch_add(1, Ordering::Relaxed);
        let queued = Queued(&self.health);
        let mut slot = self.slot.clone().lock_owned().await;
        drop(queued);
        let turn = Instant::now();
        self.health
            .write_wait_us
            .fetch_add(micros(turn - asked), Ordering::Relaxed);
        w.turn = Some(turn);
        self.tidy(&mut slot).await;
        if slot.closed {
            return Err(StoreError::Db(sqlx::Error::PoolClosed));
        }
        if slot.conn.is_none() {
            slot.conn = Some(self.opts.connect().await?);
        }
        let s = &mut *slot;
        let conn = s.conn.as_mut().expect("connected");
        if s.batch.is_none() {
            s.opening = true;
            let opened = sqlx::raw_sql("BEGIN IMMEDIATE; SAVEPOINT w")
                .execute(&mut *conn)
                .await;
            s.opening = false;
            if let Err(e) = opened {
                // Whether the BEGIN ran is not known here (sqlx counts only its own
                // transactions): a new connection for the next write; this one's
                // transaction, if any, held nothing.
                s.conn = None;
                return Err(e.into());
            }
            s.batch = Some(watch::Sender::new(None));
            s.jobs = 0;
            s.dirty = true;
        } else if std::mem::take(&mut s.spare) {
            s.dirty = true;
        } else {
            // Marked first: a caller cancelled while SAVEPOINT is in flight leaves it
            // to the next write to undo.
            s.dirty = true;
            sqlx::query("SAVEPOINT w").execute(&mut *conn).await?;
        }
        w.slot = Some(slot);
        Ok(w)
    }

    /// Rolls back a savepoint a dropped write left open.
    async fn tidy(&self, slot: &mut Slot) {
        if std::mem::take(&mut slot.opening) {
            slot.conn = None;
            slot.dirty = false;
            return;
        }
        if !slot.dirty {
            return;
        }
        slot.dirty = false;
        let Some(conn) = slot.conn.as_mut() else {
            return;
        };
        // The RELEASE runs only if the ROLLBACK TO did.
        let released = sqlx::raw_sql("ROLLBACK TO w; RELEASE w")
            .execute(&mut *conn)
            .await;
        if let Err(e) = released {
            // No such savepoint: it was never opened or already released (a caller
            // cancelled mid-statement), or SQLite rolled the whole batch back itself
            // (an I/O error, a full disk), and then its COMMIT fails and tells every
            // write in it.
            tracing::warn!(error = %e, "could not roll back a dropped store write");
        }
    }

    /// Commits the open batch and tells its writes.
    async fn finish(&self, slot: &mut Slot) -> Result<(), StoreError> {
        let Some(batch) = slot.batch.take() else {
            return Ok(());
        };
        let jobs = std::mem::take(&mut slot.jobs);
        // COMMIT ends the spare savepoint with the rest.
        slot.spare = false;
        let conn = slot.conn.as_mut().expect("a batch has a connection");
        let result = sqlx::query("COMMIT").execute(&mut *conn).await.map(drop);
        match &result {
            Ok(()) => {
                self.health.commits.fetch_add(1, Ordering::Relaxed);
                self.health.writes.fetch_add(jobs as u64, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::warn!(error = %e, writes = jobs, "store commit failed; reopening the writer connection");
                let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
                // A fresh connection for the next write: this one may be left inside
                // a transaction no statement can end.
                self.health.recycled.fetch_add(1, Ordering::Relaxed);
                if let Some(c) = slot.conn.take() {
                    let _ = c.close().await;
                }
            }
        }
        batch.send_replace(Some(result.as_ref().map_err(ToString::to_string).copied()));
        result.map_err(StoreError::from)
    }

    /// After a dropped write: tidy, and commit the batch if no write is left to.
    async fn settle(&self, slot: Option<OwnedMutexGuard<Slot>>) {
        let mut slot = match slot {
            Some(s) => s,
            None => self.slot.clone().lock_owned().await,
        };
        self.tidy(&mut slot).await;
        if self.pending.load(Ordering::SeqCst) == 0 {
            let _ = self.finish(&mut slot).await;
        }
    }

    fn held_since(&self, turn: Option<Instant>) {
        if let Some(t) = turn {
            self.health
                .write_hold_us
                .fetch_add(micros(t.elapsed()), Ordering::Relaxed);
        }
    }

    /// Closes the connection (waits for the write in progress).
    pub(super) async fn close(&self) {
        let mut slot = self.slot.lock().await;
        self.tidy(&mut slot).await;
        let _ = self.finish(&mut slot).await;
        slot.closed = true;
        if let Some(c) = slot.conn.take() {
            let _ = c.close().await;
        }
    }
}

/// One write: a savepoint in the open batch. Dereferences to the connection; ends
/// with [`Write::commit`] (durable when it returns `Ok`), or rolls back when dropped.
pub struct Write {
    writer: Arc<Writer>,
    slot: Option<OwnedMutexGuard<Slot>>,
    /// Still counted in `pending`.
    counted: bool,
    /// When it got the writer connection (for `write_hold_us`).
    turn: Option<Instant>,
}

/// Counts a write in `write_queued` until dropped (also when its caller goes away).
struct Queued<'a>(&'a StoreHealth);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.write_queued.fetch_sub(1, Ordering::Relaxed);
    }
}

fn micros(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

impl std::fmt::Debug for Write {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Write").finish_non_exhaustive()
    }
}

impl Write {
    /// Ends the batch without committing it: its connection is closed (which rolls it
    /// back) and its waiting writes are told why.
    fn fail_batch(&mut self, slot: &mut Slot, e: &sqlx::Error) {
        tracing::warn!(error = %e, writes = slot.jobs, "store write failed between savepoints; rolling its batch back");
        if let Some(batch) = slot.batch.take() {
            batch.send_replace(Some(Err(e.to_string())));
        }
        slot.jobs = 0;
        slot.dirty = false;
        slot.spare = false;
        slot.conn = None;
        self.writer.health.recycled.fetch_add(1, Ordering::Relaxed);
    }

    /// Releases the savepoint and returns once the batch holding it is committed.
    pub async fn commit(mut self) -> Result<(), StoreError> {
        let mut slot = self.slot.take().expect("a begun write holds the slot");
        // Another write queued behind this one, in this batch: open its savepoint with
        // this RELEASE (one round trip).
        let next = self.writer.pending.load(Ordering::SeqCst) > 1 && slot.jobs + 1 < MAX_BATCH;
        let conn = slot.conn.as_mut().expect("a begun write has a connection");
        let sql = if next {
            "RELEASE w; SAVEPOINT w"
        } else {
            "RELEASE w"
        };
        if let Err(e) = sqlx::raw_sql(sql).execute(&mut *conn).await {
            if next {
                // Whether the RELEASE ran (this write is in the batch) is not known:
                // the batch fails as a whole, so that none of it happened.
                self.fail_batch(&mut slot, &e);
                return Err(e.into());
            }
            self.slot = Some(slot);
            return Err(e.into());
        }
        slot.dirty = false;
        slot.spare = next;
        slot.jobs += 1;
        self.counted = false;
        let held = self.turn.take();
        let left = self.writer.pending.fetch_sub(1, Ordering::SeqCst) - 1;
        if left == 0 || slot.jobs >= MAX_BATCH {
            // The COMMIT runs to its end even if this caller goes away (a client that
            // hung up): the batch's other writes wait on its outcome.
            let writer = self.writer.clone();
            let commit = tokio::spawn(async move {
                let r = writer.finish(&mut slot).await;
                writer.held_since(held);
                r
            });
            return commit.await.unwrap_or_else(|e| {
                Err(StoreError::Db(sqlx::Error::Protocol(format!(
                    "the commit task ended: {e}"
                ))))
            });
        }
        let mut done = slot.batch.as_ref().expect("open batch").subscribe();
        drop(slot);
        self.writer.held_since(held);
        let outcome = done
            .wait_for(Option::is_some)
            .await
            .map(|v| v.clone().expect("waited for Some"));
        match outcome {
            Ok(Ok(())) => Ok(()),
            Ok(Err(reason)) => Err(StoreError::Db(sqlx::Error::Protocol(format!(
                "the commit this write was part of failed: {reason}"
            )))),
            // The sender is dropped only after it sent.
            Err(_) => Err(StoreError::Db(sqlx::Error::WorkerCrashed)),
        }
    }
}

impl Deref for Write {
    type Target = SqliteConnection;
    fn deref(&self) -> &SqliteConnection {
        let slot = self.slot.as_ref().expect("a begun write holds the slot");
        slot.conn.as_ref().expect("a begun write has a connection")
    }
}

impl DerefMut for Write {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        let slot = self.slot.as_mut().expect("a begun write holds the slot");
        slot.conn.as_mut().expect("a begun write has a connection")
    }
}

impl Drop for Write {
    fn drop(&mut self) {
        let slot = self.slot.take();
        if !self.counted && slot.is_none() {
            return; // committed
        }
        if self.counted {
            self.writer.pending.fetch_sub(1, Ordering::SeqCst);
        }
        let turn = self.turn.take();
        if turn.is_some() {
            // It had its turn (a caller cancelled while waiting for one wrote nothing).
            self.writer
                .health
                .write_dropped
                .fetch_add(1, Ordering::Relaxed);
        }
        let writer = self.writer.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    writer.settle(slot).await;
                    writer.held_since(turn);
                });
            }
            // No runtime (a test tearing down): the connection goes with the process.
            Err(_) => drop(slot),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::Store;

    async fn store() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(dir.path()).await.unwrap();
        let mut w = store.write().await.unwrap();
        sqlx::query("CREATE TABLE t (k INTEGER PRIMARY KEY, p INTEGER REFERENCES parent(id) DEFERRABLE INITIALLY DEFERRED)")
            .execute(&mut *w)
            .await
            .unwrap();
        sqlx::query("CREATE TABLE parent (id INTEGER PRIMARY KEY)")
            .execute(&mut *w)
            .await
            .unwrap();
        w.commit().await.unwrap();
        (dir, store)
    }

    async fn put(store: &Store, k: i64, parent: Option<i64>) -> Result<(), super::StoreError> {
        let mut w = store.write().await?;
        sqlx::query("INSERT INTO t (k, p) VALUES (?, ?)")
            .bind(k)
            .bind(parent)
            .execute(&mut *w)
            .await?;
        w.commit().await
    }

    async fn keys(store: &Store) -> Vec<i64> {
        sqlx::query_scalar("SELECT k FROM t ORDER BY k")
            .fetch_all(store.pool().unwrap())
            .await
            .unwrap()
    }

    fn counts(store: &Store) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let h = &store.health;
        (h.commits.load(Relaxed), h.writes.load(Relaxed))
    }

    /// The pool only reads: a write that goes around the writer fails at once.
    #[tokio::test]
    async fn the_pool_refuses_writes() {
        let (_dir, store) = store().await;
        let e = sqlx::query("INSERT INTO t (k) VALUES (1)")
            .execute(store.pool().unwrap())
            .await
            .unwrap_err();
        assert!(e.to_string().contains("readonly"), "{e}");
        assert!(keys(&store).await.is_empty());
    }

    /// Writes that queue up share a commit, and each is durable (visible to the
    /// pool's readers) when its `commit` returns.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queued_writes_share_commits_and_each_is_visible_when_it_returns() {
        let (_dir, store) = store().await;
        let (c0, w0) = counts(&store);
        let tasks: Vec<_> = (0..200)
            .map(|k| {
                let store = store.clone();
                tokio::spawn(async move {
                    put(&store, k, None).await.unwrap();
                    let seen: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM t WHERE k = ?")
                        .bind(k)
                        .fetch_one(store.pool().unwrap())
                        .await
                        .unwrap();
                    assert_eq!(seen, 1, "write {k} not visible after its commit");
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(keys(&store).await, (0..200).collect::<Vec<_>>());
        let (c1, w1) = counts(&store);
        assert_eq!(w1 - w0, 200);
        assert!(c1 - c0 < 200, "{} commits for 200 queued writes", c1 - c0);
    }

    /// A write dropped half-way (an error, a cancelled request) is undone; the writes
    /// around it in the same batch are not, and none waits for it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_write_is_undone_and_its_batch_mates_commit() {
        let (_dir, store) = store().await;
        let mut first = store.write().await.unwrap();
        sqlx::query("INSERT INTO t (k) VALUES (1)")
            .execute(&mut *first)
            .await
            .unwrap();
        // Queued behind `first`: one that will be dropped mid-write, one that commits,
        // and one cancelled before its turn.
        let dropped = {
            let store = store.clone();
            tokio::spawn(async move {
                let mut w = store.write().await.unwrap();
                sqlx::query("INSERT INTO t (k) VALUES (2)")
                    .execute(&mut *w)
                    .await
                    .unwrap();
                drop(w);
            })
        };
        let third = {
            let store = store.clone();
            tokio::spawn(async move { put(&store, 3, None).await })
        };
        let cancelled = {
            let store = store.clone();
            tokio::spawn(async move { put(&store, 4, None).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        cancelled.abort();
        tokio::time::timeout(Duration::from_secs(5), first.commit())
            .await
            .expect("the batch was committed")
            .unwrap();
        dropped.await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), third)
            .await
            .expect("no write left waiting")
            .unwrap()
            .unwrap();
        assert_eq!(keys(&store).await, vec![1, 3]);
        // The writer is free afterwards.
        put(&store, 5, None).await.unwrap();
        assert_eq!(keys(&store).await, vec![1, 3, 5]);
        // What /metrics says of it: nothing queued (the cancelled waiter gave its
        // place back), one write rolled back, and the queued ones' wait counted.
        use std::sync::atomic::Ordering::Relaxed;
        let h = &store.health;
        assert_eq!(h.write_queued.load(Relaxed), 0);
        assert_eq!(h.write_dropped.load(Relaxed), 1);
        assert!(
            h.write_wait_us.load(Relaxed) >= 100_000,
            "waited {} µs behind a write held 100 ms",
            h.write_wait_us.load(Relaxed)
        );
        assert!(h.write_hold_us.load(Relaxed) >= 100_000);
    }

    /// A COMMIT that fails fails every write in its batch (none of them happened), and
    /// the next write gets a working connection.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_commit_fails_every_write_in_the_batch_and_the_next_one_works() {
        let (_dir, store) = store().await;
        let mut first = store.write().await.unwrap();
        // A deferred foreign key: the statement passes, the COMMIT refuses it.
        sqlx::query("INSERT INTO t (k, p) VALUES (1, 99)")
            .execute(&mut *first)
            .await
            .unwrap();
        let mate = {
            let store = store.clone();
            tokio::spawn(async move { put(&store, 2, None).await })
        };
        // `mate` is queued: `first` leaves the batch open for it; `mate` commits both.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (a, b) = tokio::join!(first.commit(), mate);
        let b = b.unwrap();
        assert!(a.is_err() && b.is_err(), "{a:?} {b:?}");
        assert!(b.unwrap_err().to_string().contains("FOREIGN KEY"));
        assert!(keys(&store).await.is_empty());
        put(&store, 3, None).await.unwrap();
        assert_eq!(keys(&store).await, vec![3]);
    }
}

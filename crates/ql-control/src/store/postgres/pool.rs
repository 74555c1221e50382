//! A small connection pool: a semaphore bounding the connections, a stack of idle ones,
//! and a per-connection cache of prepared statements.
//!
//! Why not a pool crate: the store needs exactly three things — a bound, reuse, and the
//! rule that a connection whose transaction ended in an error is *discarded* rather than
//! handed back (its state is unknown, and tokio-postgres only rolls back a dropped
//! transaction while the connection task still runs). That is less code than adapting a
//! general pool's recycling hooks to it, and adds no dependency.
//!
//! Connections are opened lazily and each one's connection task runs on the Tokio
//! runtime until its client is dropped. No session state is ever left on a pooled
//! connection: the store takes only transaction-level advisory locks.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_postgres::{Client, Config, NoTls, Statement};

use super::schema::Watch;
use super::Error;

/// One open connection with its prepared statements.
pub(super) struct Conn {
    client: Client,
    statements: HashMap<String, Statement>,
    /// Most statements kept prepared ([`PgOptions::prepared_max`](super::PgOptions::prepared_max)).
    most: usize,
}

impl Conn {
    /// The client, for queries with statements from [`Conn::prepare`].
    pub(super) fn client(&self) -> &Client {
        &self.client
    }

    /// A prepared statement for `sql`, prepared once per connection.
    pub(super) async fn prepare(&mut self, sql: &str) -> Result<Statement, Error> {
        if let Some(s) = self.statements.get(sql) {
            return Ok(s.clone());
        }
        let s = self.client.prepare(sql).await.map_err(Error::Pg)?;
        if self.statements.len() >= self.most {
            self.statements.clear();
        }
        self.statements.insert(sql.to_owned(), s.clone());
        Ok(s)
    }
}

/// A bounded pool of connections to one database as one role.
pub(super) struct Pool {
    config: Config,
    prepared_max: usize,
    idle: Mutex<Vec<Conn>>,
    permits: Arc<Semaphore>,
    /// Whether the schema may have moved since it was checked.
    watch: Arc<Watch>,
}

/// A connection taken from the pool. Dropped, it goes back only if [`Pooled::keep`] was
/// called; otherwise it is closed.
pub(super) struct Pooled<'a> {
    pool: &'a Pool,
    conn: Option<Conn>,
    keep: bool,
    _permit: OwnedSemaphorePermit,
}

impl Pool {
    /// A pool of at most `size` connections (at least one), each keeping at most
    /// `prepared_max` statements prepared; a connection is handed out only once `watch`
    /// finds the schema this build's.
    pub(super) fn new(
        mut config: Config,
        size: usize,
        connect_timeout: Duration,
        prepared_max: usize,
        watch: Arc<Watch>,
    ) -> Self {
        config.connect_timeout(connect_timeout);
        let permits = Arc::new(Semaphore::new(size.max(1)));
        Self { config, prepared_max, idle: Mutex::new(Vec::new()), permits, watch }
    }

    /// Opens one connection and starts its connection task.
    pub(super) async fn connect(config: &Config) -> Result<Client, Error> {
        let (client, connection) = config.connect(NoTls).await.map_err(Error::Pg)?;
        tokio::spawn(async move {
            // It ends when the client is dropped or the server goes away; the client
            // sees the latter as errors, so there is nothing to report here.
            let _ = connection.await;
        });
        Ok(client)
    }

    /// A connection: an idle one that is still open, else a new one.
    pub(super) async fn get(&self) -> Result<Pooled<'_>, Error> {
        let permit = self.permits.clone().acquire_owned().await.map_err(|_| Error::Closed)?;
        let reused = loop {
            let next = self.idle.lock().expect("pool lock").pop();
            match next {
                Some(c) if c.client.is_closed() => continue,
                other => break other,
            }
        };
        let conn = match reused {
            Some(c) => c,
            None => {
                let client = Self::connect(&self.config).await?;
                Conn { client, statements: HashMap::new(), most: self.prepared_max }
            }
        };
        let mut pooled = Pooled { pool: self, conn: Some(conn), keep: false, _permit: permit };
        match self.watch.confirm(pooled.client()).await {
            Ok(()) => Ok(pooled),
            Err(e) => {
                // A schema found moved leaves a sound connection; one whose read failed
                // is closed.
                if matches!(e, Error::Corrupt(_)) {
                    pooled.keep();
                }
                Err(e)
            }
        }
    }

    /// Closes every idle connection (the next [`Pool::get`] opens fresh ones).
    pub(super) fn clear(&self) {
        self.idle.lock().expect("pool lock").clear();
    }
}

impl Pooled<'_> {
    /// Hands the connection back to the pool when dropped (call after a clean commit or
    /// rollback).
    pub(super) fn keep(&mut self) {
        self.keep = true;
    }
}

impl std::ops::Deref for Pooled<'_> {
    type Target = Conn;
    fn deref(&self) -> &Conn {
        self.conn.as_ref().expect("present until dropped")
    }
}

impl std::ops::DerefMut for Pooled<'_> {
    fn deref_mut(&mut self) -> &mut Conn {
        self.conn.as_mut().expect("present until dropped")
    }
}

impl Drop for Pooled<'_> {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            if self.keep && !conn.client.is_closed() {
                self.pool.idle.lock().expect("pool lock").push(conn);
            }
        }
    }
}

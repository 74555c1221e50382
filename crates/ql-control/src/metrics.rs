//! What `serve` tells Prometheus: `GET /metrics` on the operator listener (a `read`
//! token), in the OpenMetrics text format, through `prometheus-client`.
//!
//! Two kinds of figures. Counted in this process as things happen: worker requests by
//! route and status, their latency, each store command's latency, sweeps and what they
//! changed, schedule fires, webhook sends, what the artifact store's collection removed,
//! and PostgreSQL's group commit (brought up to the store's totals at each scrape).
//! Read from the database (so every replica tells the same, each as of its last read) at
//! most once per `metrics_stats_ms`: runs, sessions, leases, fires and deliveries by
//! status, the oldest queued run's age, the bytes of the stored logs. Every label is a
//! route, a command, a status, an outcome or a kind: a bounded set; no run, worker or
//! session id is a label.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tokio::sync::watch;

use crate::blob::Collected;
use crate::core::{Command, Reply};
use crate::store::postgres::GroupCommits;
use crate::store::{Store, StoreError};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CommandLabels {
    command: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabels {
    status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: String,
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// Seconds from 0.5 ms to about 16 s.
fn latency() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

/// The figures of one `serve`.
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    request_seconds: Histograms<RouteLabels>,
    store_seconds: Histograms<CommandLabels>,
    swept: Counter,
    graced: Counter,
    fired: Counter,
    webhook_sends: Family<OutcomeLabels, Counter>,
    runs: Family<StatusLabels, Gauge>,
    attempts: Family<StatusLabels, Gauge>,
    sessions: Family<StatusLabels, Gauge>,
    leases: Family<StatusLabels, Gauge>,
    fires: Family<StatusLabels, Gauge>,
    deliveries: Family<StatusLabels, Gauge>,
    queued_age: Gauge<f64, AtomicU64>,
    artifact_bytes: Gauge,
    connections_open: Gauge,
    connections_max: Gauge,
    turned_away: Family<ReasonLabels, Counter>,
    operator_turned_away: Family<ReasonLabels, Counter>,
    runs_pruned: Counter,
    collected: Family<KindLabels, Counter>,
    collected_bytes: Family<KindLabels, Counter>,
    collections: Family<OutcomeLabels, Counter>,
    unanswered: Counter,
    groups: GroupFigures,
    /// The database's figures as last read, and when ([`Metrics::stats_every`]).
    stats: std::sync::Mutex<Option<(Instant, Vec<crate::store::Stat>)>>,
    /// Held across a read of them: scrapes that come together wait for one read.
    reading: tokio::sync::Mutex<()>,
    stats_every: Duration,
}

/// PostgreSQL's group commit on this replica ([`GroupCommits`]), brought up to the
/// store's own totals at each scrape; the lock makes two scrapes at once add each
/// increase once.
#[derive(Default)]
struct GroupFigures {
    synced: std::sync::Mutex<()>,
    transactions: Counter,
    commands: Counter,
    run_alone: Counter,
    saved: Counter,
    sessions: Gauge,
}

impl GroupFigures {
    fn sync(&self, now: &GroupCommits) {
        let _one = self.synced.lock().unwrap_or_else(|e| e.into_inner());
        for (counter, total) in [
            (&self.transactions, now.transactions),
            (&self.commands, now.commands),
            (&self.run_alone, now.run_alone),
            (&self.saved, now.saved),
        ] {
            counter.inc_by(total.saturating_sub(counter.get()));
        }
        self.sessions.set(i64::try_from(now.placed).unwrap_or(i64::MAX));
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

/// One `Metrics` is only ever equal to itself (settings that hold one compare by it).
impl PartialEq for Metrics {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

impl Eq for Metrics {}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Every metric, registered.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("ql");
        let m = Self {
            registry: Registry::default(),
            requests: Family::default(),
            request_seconds: Family::new_with_constructor(latency),
            store_seconds: Family::new_with_constructor(latency),
            swept: Counter::default(),
            graced: Counter::default(),
            fired: Counter::default(),
            webhook_sends: Family::default(),
            runs: Family::default(),
            attempts: Family::default(),
            sessions: Family::default(),
            leases: Family::default(),
            fires: Family::default(),
            deliveries: Family::default(),
            queued_age: Gauge::default(),
            artifact_bytes: Gauge::default(),
            connections_open: Gauge::default(),
            connections_max: Gauge::default(),
            turned_away: Family::default(),
            operator_turned_away: Family::default(),
            runs_pruned: Counter::default(),
            collected: Family::default(),
            collected_bytes: Family::default(),
            collections: Family::default(),
            unanswered: Counter::default(),
            groups: GroupFigures::default(),
            stats: std::sync::Mutex::new(None),
            reading: tokio::sync::Mutex::new(()),
            stats_every: Duration::ZERO,
        };
        registry.register("requests", "Worker requests answered, by route and HTTP status", m.requests.clone());
        registry.register("request_seconds", "Worker request latency, by route", m.request_seconds.clone());
        registry.register("store_seconds", "Store command latency, by command", m.store_seconds.clone());
        registry.register("swept_rows", "Rows the sweeper found lapsed and changed", m.swept.clone());
        registry.register("outage_graces", "Sweeps that gave an outage's time back", m.graced.clone());
        registry.register("schedule_fired", "Schedule fires decided by this replica", m.fired.clone());
        registry.register("webhook_sends", "Webhook sends by outcome (delivered, failed)", m.webhook_sends.clone());
        registry.register("runs", "Runs by status", m.runs.clone());
        registry.register("attempts", "Attempts by status (lost: their worker vanished)", m.attempts.clone());
        registry.register("sessions", "Worker sessions by state", m.sessions.clone());
        registry.register("leases", "Leases by state", m.leases.clone());
        registry.register("schedule_fires", "Schedule fires recorded, by outcome", m.fires.clone());
        registry.register("webhook_deliveries", "Webhook deliveries by state", m.deliveries.clone());
        registry.register(
            "queued_oldest_seconds",
            "Age of the oldest queued run (0: none queued)",
            m.queued_age.clone(),
        );
        registry.register("artifact_bytes", "Bytes of the stored logs", m.artifact_bytes.clone());
        registry.register(
            "worker_connections",
            "Worker connections open on this replica, in their handshake or served",
            m.connections_open.clone(),
        );
        registry.register(
            "worker_connections_max",
            "Worker connections this replica serves at once (max_connections)",
            m.connections_max.clone(),
        );
        registry.register(
            "worker_connections_turned_away",
            "Worker connections closed unserved at a limit, by reason (handshakes, slots, anonymous, accept)",
            m.turned_away.clone(),
        );
        registry.register(
            "operator_connections_turned_away",
            "Operator API connections closed unserved at a limit, by reason (address, all)",
            m.operator_turned_away.clone(),
        );
        registry.register(
            "runs_pruned",
            "Ended runs this replica removed past run_retention_ms, with their rows and stored logs",
            m.runs_pruned.clone(),
        );
        registry.register(
            "artifact_collected",
            "What the artifact store's collection removed, by kind (upload_leftover, log_chunk)",
            m.collected.clone(),
        );
        registry.register("artifact_collected_bytes", "Their bytes, by kind", m.collected_bytes.clone());
        registry.register(
            "artifact_collections",
            "Passes of the artifact store's collection, by outcome (done, failed)",
            m.collections.clone(),
        );
        registry.register(
            "artifact_collection_unanswered",
            "Attempts whose old live-log chunks a pass kept because the database did not answer",
            m.unanswered.clone(),
        );
        let g = &m.groups;
        registry.register(
            "pg_group_transactions",
            "PostgreSQL transactions of this replica that committed several commands (group commit)",
            g.transactions.clone(),
        );
        registry.register("pg_group_commands", "The commands those transactions carried", g.commands.clone());
        registry.register(
            "pg_group_run_alone",
            "Groups that failed and whose commands ran again, each alone",
            g.run_alone.clone(),
        );
        registry.register(
            "pg_group_saved_statements",
            "Statements the committed groups did not send (one statement for a wave's rows stands for several)",
            g.saved.clone(),
        );
        registry.register(
            "pg_lane_sessions",
            "Worker sessions with a command in flight on this replica's lanes",
            g.sessions.clone(),
        );
        Self { registry, ..m }
    }

    /// One pass of the artifact store's collection: what it removed, or that it failed.
    pub fn collection(&self, pass: Option<&Collected>) {
        let outcome = if pass.is_some() { "done" } else { "failed" };
        self.collections.get_or_create(&OutcomeLabels { outcome: outcome.into() }).inc();
        let Some(c) = pass else { return };
        for (kind, n, bytes) in [("upload_leftover", c.removed, c.bytes), ("log_chunk", c.chunks, c.chunk_bytes)] {
            let kind = KindLabels { kind: kind.into() };
            self.collected.get_or_create(&kind).inc_by(n);
            self.collected_bytes.get_or_create(&kind).inc_by(bytes);
        }
        self.unanswered.inc_by(c.unanswered);
    }

    /// A worker connection accepted (`true`) or ended (`false`).
    pub fn connection(&self, opened: bool) {
        if opened {
            self.connections_open.inc();
        } else {
            self.connections_open.dec();
        }
    }

    /// The most worker connections served at once.
    pub fn set_max_connections(&self, max: usize) {
        self.connections_max.set(i64::try_from(max).unwrap_or(i64::MAX));
    }

    /// A worker connection closed unserved at a limit: `handshakes` (too many in progress,
    /// from its address or at all), `slots` (every connection slot taken), `anonymous`
    /// (every slot for connections without a certificate taken), or `accept` (accepting
    /// failed: out of descriptors, say).
    pub fn turned_away(&self, reason: &'static str) {
        self.turned_away.get_or_create(&ReasonLabels { reason: reason.to_owned() }).inc();
    }

    /// An operator API connection closed unserved: `address` (its address holds
    /// `operator_max_connections_per_ip`) or `all` (every place taken, by no address
    /// holding two more).
    pub fn operator_turned_away(&self, reason: &'static str) {
        self.operator_turned_away.get_or_create(&ReasonLabels { reason: reason.to_owned() }).inc();
    }

    /// One worker request answered with `status` after `took`.
    pub fn request(&self, route: &str, status: u16, took: Duration) {
        self.requests.get_or_create(&RequestLabels { route: route.to_owned(), code: status.to_string() }).inc();
        self.request_seconds.get_or_create(&RouteLabels { route: route.to_owned() }).observe(took.as_secs_f64());
    }

    /// One store command named `name` that took `took`; `sent`: a webhook send's report,
    /// whether it delivered.
    fn command(
        &self,
        name: &str,
        sent: Option<bool>,
        took: Duration,
        reply: &Result<Result<Reply, ql_wire::ErrorCode>, StoreError>,
    ) {
        self.store_seconds.get_or_create(&CommandLabels { command: name.to_owned() }).observe(took.as_secs_f64());
        match reply {
            Ok(Ok(Reply::Swept(n))) => {
                self.swept.inc_by(*n as u64);
            }
            Ok(Ok(Reply::Graced(_))) => {
                self.graced.inc();
            }
            Ok(Ok(Reply::Fired(n))) => {
                self.fired.inc_by(*n as u64);
            }
            _ => {}
        }
        if let (Some(delivered), Ok(Ok(_))) = (sent, reply) {
            let outcome = if delivered { "delivered" } else { "failed" };
            self.webhook_sends.get_or_create(&OutcomeLabels { outcome: outcome.into() }).inc();
        }
    }

    /// Reuses the database's figures for `every` before a scrape reads them again
    /// (`metrics_stats_ms`): they count whole tables, and scrapes, however many and from
    /// whomever holds a read token, then cost the database one such read an interval.
    #[must_use]
    pub fn stats_every(self, every: Duration) -> Self {
        Self { stats_every: every, ..self }
    }

    /// The database's figures: the last read's while younger than `stats_every`, or than
    /// three times that while another scrape reads them (a database slow to answer then
    /// holds one scrape, not a queue of them, and a read that hangs shows as failed
    /// scrapes soon, not as figures that never move); else read now.
    async fn stats<S: Store>(&self, store: &S) -> Result<Vec<crate::store::Stat>, StoreError> {
        let last = |younger: Duration| {
            let last = self.stats.lock().unwrap_or_else(|e| e.into_inner());
            last.as_ref().filter(|(at, _)| at.elapsed() < younger).map(|(_, s)| s.clone())
        };
        if let Some(stats) = last(self.stats_every) {
            return Ok(stats);
        }
        let _reading = match self.reading.try_lock() {
            Ok(guard) => guard,
            Err(_) => match last(self.stats_every.saturating_mul(3)) {
                Some(stats) => return Ok(stats),
                None => self.reading.lock().await,
            },
        };
        // Read by the scrape this one waited for.
        if let Some(stats) = last(self.stats_every) {
            return Ok(stats);
        }
        let stats = store.stats().await?;
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = Some((Instant::now(), stats.clone()));
        Ok(stats)
    }

    /// The OpenMetrics text, after reading the database's figures from `store` (or taking
    /// the last read's, [`Metrics::stats_every`]).
    pub async fn render<S: Store>(&self, store: &S) -> Result<String, StoreError> {
        let stats = self.stats(store).await?;
        if let Some(groups) = store.commit_groups() {
            self.groups.sync(&groups);
        }
        for family in [&self.runs, &self.attempts, &self.sessions, &self.leases, &self.fires, &self.deliveries] {
            family.clear();
        }
        self.queued_age.set(0.0);
        for s in stats {
            let family = match s.kind.as_str() {
                "runs" => &self.runs,
                "attempts" => &self.attempts,
                "sessions" => &self.sessions,
                "leases" => &self.leases,
                "fires" => &self.fires,
                "deliveries" => &self.deliveries,
                "queued_age_ms" => {
                    self.queued_age.set(s.value.max(0) as f64 / 1000.0);
                    continue;
                }
                "artifact_bytes" => {
                    self.artifact_bytes.set(s.value);
                    continue;
                }
                _ => continue,
            };
            family.get_or_create(&StatusLabels { status: s.label }).set(s.value);
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).map_err(|e| StoreError(e.to_string()))?;
        Ok(out)
    }
}

/// A store whose every command is timed and counted in [`Metrics`]; everything else
/// passes through.
#[derive(Debug, Clone)]
pub struct Measured<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S> Measured<S> {
    /// `inner`, measured into `metrics`.
    pub fn new(inner: S, metrics: Arc<Metrics>) -> Self {
        Self { inner, metrics }
    }
}

impl<S: Store> Store for Measured<S> {
    async fn execute_audited(
        &self,
        cmd: Command,
        audit: Option<crate::store::Audit>,
    ) -> Result<Result<Reply, ql_wire::ErrorCode>, StoreError> {
        let started = Instant::now();
        let name = cmd.name();
        let sent = match &cmd {
            Command::DeliveryDone(_, _, sent, _) => Some(sent.is_ok()),
            _ => None,
        };
        let reply = self.inner.execute_audited(cmd, audit).await;
        self.metrics.command(name, sent, started.elapsed(), &reply);
        reply
    }
    async fn audit(&self, record: crate::model::AuditRecord) -> Result<(), StoreError> {
        self.inner.audit(record).await
    }
    async fn admit(
        &self,
        record: crate::model::AuditRecord,
        serial: String,
    ) -> Result<Option<ql_wire::ErrorCode>, StoreError> {
        self.inner.admit(record, serial).await
    }
    async fn prune_audit(&self, retention: crate::store::AuditRetention) -> Result<u64, StoreError> {
        self.inner.prune_audit(retention).await
    }
    async fn prune_sessions(&self, retention: crate::store::SessionRetention) -> Result<u64, StoreError> {
        self.inner.prune_sessions(retention).await
    }
    async fn prunable_runs(
        &self,
        retention: crate::store::RunRetention,
    ) -> Result<Vec<(ql_wire::ids::ProjectId, ql_wire::ids::RunId)>, StoreError> {
        self.inner.prunable_runs(retention).await
    }
    async fn prune_runs(
        &self,
        runs: Vec<ql_wire::ids::RunId>,
        retention: crate::store::RunRetention,
    ) -> Result<u64, StoreError> {
        let gone = self.inner.prune_runs(runs, retention).await?;
        self.metrics.runs_pruned.inc_by(gone);
        Ok(gone)
    }
    async fn twin_refusals(&self, within_ms: u64) -> Result<Vec<(ql_wire::ids::WorkerId, u64)>, StoreError> {
        self.inner.twin_refusals(within_ms).await
    }
    async fn audits(&self) -> Result<Vec<crate::model::AuditRecord>, StoreError> {
        self.inner.audits().await
    }
    async fn runs(&self, query: &crate::store::RunQuery) -> Result<Vec<crate::model::Run>, StoreError> {
        self.inner.runs(query).await
    }
    async fn schedules(&self) -> Result<Vec<crate::model::Schedule>, StoreError> {
        self.inner.schedules().await
    }
    async fn fires(&self, schedule: &str, limit: usize) -> Result<Vec<crate::model::Fire>, StoreError> {
        self.inner.fires(schedule, limit).await
    }
    async fn run_detail(&self, run: &ql_wire::ids::RunId) -> Result<Option<crate::store::RunDetail>, StoreError> {
        self.inner.run_detail(run).await
    }
    async fn probe(&self) -> Result<(), StoreError> {
        self.inner.probe().await
    }
    async fn log_chunks(
        &self,
        attempt: &ql_wire::ids::AttemptId,
        within: std::ops::Range<u64>,
    ) -> Result<Vec<crate::model::LogChunk>, StoreError> {
        self.inner.log_chunks(attempt, within).await
    }
    async fn certificates(
        &self,
        worker: Option<&ql_wire::ids::WorkerId>,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<crate::model::Certificate>, StoreError> {
        self.inner.certificates(worker, after, limit).await
    }
    async fn stats(&self) -> Result<Vec<crate::store::Stat>, StoreError> {
        self.inner.stats().await
    }
    async fn operators(&self) -> Result<Vec<crate::model::Operator>, StoreError> {
        self.inner.operators().await
    }
    async fn worker_page(
        &self,
        after: Option<&ql_wire::ids::WorkerId>,
        limit: usize,
    ) -> Result<Vec<crate::store::WorkerEntry>, StoreError> {
        self.inner.worker_page(after, limit).await
    }
    async fn snapshot(&self) -> Result<crate::store::Snapshot, StoreError> {
        self.inner.snapshot().await
    }
    fn changes(&self) -> watch::Receiver<u64> {
        self.inner.changes()
    }
    fn wakes_since(&self, seen: u64, now: u64) -> Option<Vec<crate::core::Want>> {
        self.inner.wakes_since(seen, now)
    }

    fn commit_groups(&self) -> Option<crate::store::postgres::GroupCommits> {
        self.inner.commit_groups()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::sqlite::SqliteStore;

    #[tokio::test]
    async fn a_collection_pass_is_counted_by_outcome_and_kind() {
        let dir = crate::pki::tests::TempDir::new("metrics-collection");
        let store = SqliteStore::open(dir.path().join("control.db"), crate::core::Timings::default()).unwrap();
        let metrics = Metrics::new();
        let pass = Collected { removed: 1, bytes: 9, chunks: 2, chunk_bytes: 12, unanswered: 3 };
        metrics.collection(Some(&pass));
        metrics.collection(Some(&pass));
        metrics.collection(None);
        let text = metrics.render(&store).await.unwrap();
        for line in [
            "ql_artifact_collections_total{outcome=\"done\"} 2",
            "ql_artifact_collections_total{outcome=\"failed\"} 1",
            "ql_artifact_collected_total{kind=\"upload_leftover\"} 2",
            "ql_artifact_collected_bytes_total{kind=\"upload_leftover\"} 18",
            "ql_artifact_collected_total{kind=\"log_chunk\"} 4",
            "ql_artifact_collected_bytes_total{kind=\"log_chunk\"} 24",
            "ql_artifact_collection_unanswered_total 6",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
    }

    #[tokio::test]
    async fn the_databases_figures_are_read_once_an_interval() {
        let dir = crate::pki::tests::TempDir::new("metrics-stats");
        let store = SqliteStore::open(dir.path().join("control.db"), crate::core::Timings::default()).unwrap();
        let submit = || async {
            let body = crate::admin::body_of(&crate::admin::SubmitArgs {
                project: "default".into(),
                argv: vec!["true".into()],
                timeout_ms: 60_000,
                log_limit: 1024,
                ..crate::admin::SubmitArgs::default()
            })
            .unwrap();
            let blobs = crate::admin::open_blobs(dir.path(), None).unwrap();
            crate::ops::Local { store: store.clone(), blobs }.submit(&body).await.unwrap();
        };
        let queued = |text: &str| text.lines().find(|l| l.starts_with("ql_runs{status=\"queued\"}")).map(str::to_owned);
        let reused = Metrics::new().stats_every(Duration::from_secs(3_600));
        let fresh = Metrics::new();
        submit().await;
        assert_eq!(queued(&reused.render(&store).await.unwrap()).as_deref(), Some("ql_runs{status=\"queued\"} 1"));
        submit().await;
        let text = reused.render(&store).await.unwrap();
        assert_eq!(queued(&text).as_deref(), Some("ql_runs{status=\"queued\"} 1"), "the last read's, within the hour");
        let text = fresh.render(&store).await.unwrap();
        assert_eq!(queued(&text).as_deref(), Some("ql_runs{status=\"queued\"} 2"), "0: every scrape reads");
    }

    #[test]
    fn group_commit_counters_follow_the_stores_totals_and_count_each_increase_once() {
        let figures = GroupFigures::default();
        let totals = |transactions, commands, placed| GroupCommits {
            transactions,
            commands,
            run_alone: 1,
            placed,
            saved: 3 * commands,
        };
        figures.sync(&totals(2, 9, 4));
        figures.sync(&totals(2, 9, 4));
        assert_eq!((figures.transactions.get(), figures.commands.get(), figures.saved.get()), (2, 9, 27));
        figures.sync(&totals(5, 20, 0));
        assert_eq!((figures.transactions.get(), figures.commands.get(), figures.run_alone.get()), (5, 20, 1));
        assert_eq!((figures.saved.get(), figures.sessions.get()), (60, 0));
    }
}

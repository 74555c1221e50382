//! The authority's rows: sessions, runs, attempts, offers, leases and events, as plain
//! values. Stores persist them column for column; the decision code in [`crate::core`]
//! reads and returns them. Times are DB-time milliseconds since the Unix epoch.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use ql_wire::artifact::Receipt;
use ql_wire::capability::Digest;
use ql_wire::ids::{ArtifactId, AttemptId, Counter, EventId, OfferId, ProjectId, RunId, SessionId, WorkerId};
use ql_wire::lease::StopIntent;
use ql_wire::spec::ExecutionSpec;
use ql_wire::text::ExecutorHandle;

/// DB time: milliseconds since the Unix epoch, read inside the transaction.
pub type Millis = i64;

/// The only executor type this control plane hands to remote workers.
pub const REMOTE_WORKER: &str = "remote_worker";

/// Declares a status enum with its stable text form (used in SQL and events).
macro_rules! status {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident = $text:literal),* $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[serde(rename_all = "snake_case")]
        pub enum $name { $($(#[$vmeta])* $variant),* }

        impl $name {
            /// The stable text form.
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $text),* }
            }

            /// Parses the text form.
            pub fn parse(s: &str) -> Option<Self> {
                match s { $($text => Some(Self::$variant),)* _ => None }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

status!(
    /// A worker session's life.
    SessionState {
        /// Takes offers.
        Online = "online",
        /// Finishes its work, takes nothing new.
        Draining = "draining",
        /// A newer session of the same worker took over.
        Replaced = "replaced",
        /// No heartbeat within its TTL.
        Expired = "expired",
        /// Its agent closed it on a clean exit.
        Closed = "closed",
    }
);

status!(
    /// A run's life.
    RunStatus {
        /// Waiting for placement.
        Queued = "queued",
        /// Offered or claimed, not yet running.
        Dispatching = "dispatching",
        /// The worker reported its executor running.
        Running = "running",
        /// Exit code 0.
        Succeeded = "succeeded",
        /// Non-zero exit, start failure, or lease lost beyond the retry budget.
        Failed = "failed",
        /// Cancelled by an operator.
        Cancelled = "cancelled",
        /// Over its time limit.
        TimedOut = "timed_out",
    }
);

status!(
    /// An attempt's life.
    AttemptStatus {
        /// Offered to a session.
        Offered = "offered",
        /// Claimed under a lease.
        Claimed = "claimed",
        /// The worker is setting up the executor.
        Starting = "starting",
        /// The executor runs.
        Running = "running",
        /// Exit code 0.
        Succeeded = "succeeded",
        /// Failed.
        Failed = "failed",
        /// Cancelled.
        Cancelled = "cancelled",
        /// Timed out.
        TimedOut = "timed_out",
        /// Its lease or offer lapsed.
        Lost = "lost",
    }
);

status!(
    /// An offer's life.
    OfferState {
        /// Waiting for a claim.
        Open = "open",
        /// Claimed.
        Claimed = "claimed",
        /// Lapsed unclaimed.
        Expired = "expired",
        /// Withdrawn (the run was cancelled before a claim).
        Withdrawn = "withdrawn",
    }
);

status!(
    /// A run lease's life.
    LeaseState {
        /// Held by a worker.
        Leased = "leased",
        /// Ended by start-failure or completion.
        Completed = "completed",
        /// Lapsed and swept.
        Expired = "expired",
    }
);

status!(
    /// What ended an attempt.
    EndKind {
        /// The worker could not start the executor.
        StartFailure = "start_failure",
        /// The worker completed it.
        Completion = "completion",
        /// The lease lapsed.
        LeaseLost = "lease_lost",
        /// The offer lapsed unclaimed.
        OfferExpired = "offer_expired",
        /// An operator cancelled the run before a claim.
        Withdrawn = "withdrawn",
    }
);

impl RunStatus {
    /// Whether the run has ended.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled | Self::TimedOut)
    }
}

impl AttemptStatus {
    /// Whether the attempt has ended.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled | Self::TimedOut | Self::Lost)
    }

    /// Whether the attempt occupies a slot of its session's capacity.
    pub fn is_active(self) -> bool {
        matches!(self, Self::Offered | Self::Claimed | Self::Starting | Self::Running)
    }
}

/// What the operator says of a worker identity, whatever its agents declare. A worker
/// without a row has no trusted labels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Worker {
    /// The worker (certificate principal).
    pub id: WorkerId,
    /// Labels the operator vouches for: placement by `--label`.
    pub labels: BTreeMap<String, String>,
    /// Disabled by the operator since: every certificate of the worker is refused until
    /// it is enabled again.
    pub disabled_at: Option<Millis>,
    /// Revoked whole by the operator (last) at: every certificate recorded until then is
    /// revoked, and a certificate the authority has no record of (issued before
    /// certificates were recorded) is refused from then on.
    pub revoked_at: Option<Millis>,
    /// First recorded at.
    pub created_at: Millis,
    /// Last changed at.
    pub updated_at: Millis,
}

impl Worker {
    /// A record with no labels and nothing refused (the default of a worker without one).
    pub fn new(id: WorkerId, now: Millis) -> Self {
        Self { id, labels: BTreeMap::new(), disabled_at: None, revoked_at: None, created_at: now, updated_at: now }
    }
}

/// A one-time enrolment token, known only by its digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enrolment {
    /// SHA-256 of the token.
    pub token_digest: ql_wire::capability::Digest,
    /// The worker it may enrol.
    pub worker: WorkerId,
    /// Made at.
    pub created_at: Millis,
    /// Useless from then on.
    pub expires_at: Millis,
    /// Spent at, with the certificate it was spent on.
    pub used_at: Option<Millis>,
    /// The serial of that certificate.
    pub serial: Option<String>,
}

/// A worker certificate the authority issued, by serial number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Certificate {
    /// The serial number, lowercase hex without leading zero bytes (as in the DER).
    pub serial: String,
    /// The worker it names.
    pub worker: WorkerId,
    /// Issued at (DB time of the record).
    pub issued_at: Millis,
    /// Its last valid moment.
    pub not_after: Millis,
    /// Revoked at, if it was.
    pub revoked_at: Option<Millis>,
    /// The serial of the certificate its worker renewed to get it, if it did (revoking
    /// that one revokes this one too).
    pub renewed_from: Option<String>,
}

/// A worker session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// Server-made id.
    pub id: SessionId,
    /// The worker (certificate principal).
    pub worker: WorkerId,
    /// One more than the worker's previous highest.
    pub generation: Counter,
    /// Life state.
    pub state: SessionState,
    /// Jobs at once.
    pub capacity: u32,
    /// The labels the agent declared: placement by `--agent-label` only, never trusted.
    pub labels: BTreeMap<String, String>,
    /// Agent version, for operators.
    pub agent_version: String,
    /// Agent architecture, for operators.
    pub arch: String,
    /// Opened at.
    pub created_at: Millis,
    /// Last heartbeat or poll.
    pub seen_at: Millis,
    /// Expires unless seen again.
    pub expires_at: Millis,
    /// Work was placed on it: an offer (and so maybe an attempt and a lease) names it.
    /// An ended session never offered anything is history nothing points at, and the
    /// sweeper prunes it ([`crate::store::Store::prune_sessions`]).
    pub offered: bool,
}

/// The lease fields an attempt carries as a projection of its lease. They must always
/// equal the lease's own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseFacts {
    /// Holder.
    pub worker: WorkerId,
    /// Holder's session.
    pub session: SessionId,
    /// Holder's session generation.
    pub session_generation: Counter,
    /// The offer claimed.
    pub offer: OfferId,
    /// The run's lease counter at claim.
    pub lease_generation: Counter,
    /// SHA-256 of the raw lease token.
    pub token_digest: Digest,
    /// Advanced by renewal and by the terminal step.
    pub version: Counter,
    /// Lapses at (DB time).
    pub expires_at: Millis,
}

/// A run: one requested execution of a spec, through one or more attempts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    /// Server-made id.
    pub id: RunId,
    /// Project.
    pub project: ProjectId,
    /// What to run.
    pub spec: ExecutionSpec,
    /// Labels the worker must carry by the operator's word ([`Worker::labels`]) to be
    /// offered this run.
    pub labels: BTreeMap<String, String>,
    /// Labels the agent must declare in its session ([`Session::labels`]): what it says
    /// of itself, which an operator cannot vouch for.
    pub agent_labels: BTreeMap<String, String>,
    /// Status.
    pub status: RunStatus,
    /// Stop intent.
    pub stop: Option<StopIntent>,
    /// Lost leases tolerated before the run fails.
    pub retry_budget: u32,
    /// Lost leases so far.
    pub retries_used: u32,
    /// Attempts made so far (offers included).
    pub attempts: u32,
    /// Leases issued so far; the next claim's lease generation is this plus one.
    pub lease_generations: u64,
    /// The attempt in flight, if any.
    pub current_attempt: Option<AttemptId>,
    /// When the run times out (set at claim).
    pub deadline_at: Option<Millis>,
    /// Submitted at.
    pub created_at: Millis,
    /// Running since.
    pub started_at: Option<Millis>,
    /// Ended at.
    pub finished_at: Option<Millis>,
    /// Fixed error code when it did not succeed.
    pub error_code: Option<String>,
    /// Low-sensitivity summary.
    pub summary: Option<String>,
    /// The schedule that submitted it, if one did.
    pub schedule: Option<String>,
}

status! {
    /// What a schedule's fire does while its previous run has not ended.
    Overlap {
        /// Record the fire as skipped.
        Skip = "skip",
        /// Hold the fire until the previous run ended, then fire once.
        Queue = "queue",
        /// Fire anyway.
        Allow = "allow",
    }
}

status! {
    /// What a fire found late (no replica ran at its time) does.
    CatchUp {
        /// Record it missed.
        None = "none",
        /// Fire it once.
        Once = "once",
    }
}

status! {
    /// What one fire of a schedule did.
    FireOutcome {
        /// It queued a run.
        Queued = "queued",
        /// The previous run had not ended (`overlap skip`).
        Skipped = "skipped",
        /// It was found late and not caught up (`catch_up none`).
        Missed = "missed",
    }
}

/// A schedule: a run submitted at each time its cron expression names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// Its name, unique.
    pub name: String,
    /// The cron expression (five fields, or six with seconds first).
    pub cron: String,
    /// The IANA time zone it is read in.
    pub tz: String,
    /// Each fire waits up to this long after its time, drawn per fire.
    pub random_delay_ms: u64,
    /// See [`Overlap`].
    pub overlap: Overlap,
    /// See [`CatchUp`].
    pub catch_up: CatchUp,
    /// The run each fire submits.
    pub submit: crate::core::Submit,
    /// Paused: fires nothing.
    pub paused: bool,
    /// The next fire's time (its key).
    pub next_fire_at: Millis,
    /// When the next fire is due: its time plus its random delay.
    pub due_at: Millis,
    /// The run its last fire (or run-now) submitted.
    pub last_run: Option<RunId>,
    /// Created at.
    pub created_at: Millis,
    /// Changed at.
    pub updated_at: Millis,
}

/// One fire of a schedule, keyed by (schedule, fire time): written once, with its run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fire {
    /// The schedule.
    pub schedule: String,
    /// The cron time it is for.
    pub fire_at: Millis,
    /// What it did.
    pub outcome: FireOutcome,
    /// The run it queued.
    pub run: Option<RunId>,
    /// When (DB time).
    pub at: Millis,
}

/// One attempt of a run on a remote worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    /// Server-made id.
    pub id: AttemptId,
    /// Its run.
    pub run: RunId,
    /// 1 for the first attempt.
    pub number: u32,
    /// Always [`REMOTE_WORKER`] here.
    pub executor_type: String,
    /// Status.
    pub status: AttemptStatus,
    /// The offer that made it.
    pub offer: OfferId,
    /// The session it was offered to.
    pub session: SessionId,
    /// The worker it was offered to.
    pub worker: WorkerId,
    /// Projection of its lease, once claimed.
    pub lease: Option<LeaseFacts>,
    /// Stable handle from `running`.
    pub executor_handle: Option<ExecutorHandle>,
    /// Log artifact declared by `running`.
    pub log_artifact: Option<ArtifactId>,
    /// Callback sequence a completion must present.
    pub callback_sequence: Option<Counter>,
    /// Digest of the callback token a completion must present.
    pub callback_digest: Option<Digest>,
    /// Worker evidence: exit code.
    pub exit_code: Option<i32>,
    /// Worker evidence: signal.
    pub signal: Option<i32>,
    /// Worker evidence: when it saw the process end.
    pub worker_finished_at: Option<Millis>,
    /// The stored log's receipt.
    pub artifact: Option<Receipt>,
    /// The receipt of the first upload confirmed for the attempt: what its artifact is,
    /// decided here rather than by the artifact store.
    pub claimed_artifact: Option<Receipt>,
    /// Bytes of the live log acknowledged so far (PROTOCOL §13), from offset 0.
    pub log_acked: u64,
    /// Whether the live log was sealed into the artifact: no chunk is accepted after.
    pub log_sealed: bool,
    /// What ended it.
    pub end: Option<EndKind>,
    /// Created (offered) at.
    pub created_at: Millis,
    /// Running since (DB time).
    pub started_at: Option<Millis>,
    /// Ended at.
    pub ended_at: Option<Millis>,
    /// Fixed error code when it did not succeed.
    pub error_code: Option<String>,
    /// Low-sensitivity summary.
    pub summary: Option<String>,
}

/// One acknowledged chunk of an attempt's live log (PROTOCOL §13). Its bytes are in the
/// artifact store under (attempt, offset, digest); the chunks of an attempt tile
/// `0..log_acked` without gaps or overlaps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogChunk {
    /// The attempt.
    pub attempt: AttemptId,
    /// Where the chunk starts.
    pub offset: u64,
    /// Its length, `1..=262144`.
    pub length: u64,
    /// SHA-256 of its bytes.
    pub sha256: Digest,
}

/// An execution offer to one session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    /// Server-made id.
    pub id: OfferId,
    /// Run offered.
    pub run: RunId,
    /// Attempt it would start.
    pub attempt: AttemptId,
    /// Worker offered to.
    pub worker: WorkerId,
    /// Session offered to.
    pub session: SessionId,
    /// That session's generation.
    pub session_generation: Counter,
    /// State.
    pub state: OfferState,
    /// Lapses at.
    pub expires_at: Millis,
    /// The claim's answer, kept so an exact repeat gets the same one.
    pub claim: Option<ClaimFacts>,
}

/// What a claim answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimFacts {
    /// Digest of the claiming token.
    pub token_digest: Digest,
    /// Lease generation issued.
    pub lease_generation: Counter,
    /// Lease expiry at claim.
    pub lease_expires_at: Millis,
    /// Lease TTL at claim.
    pub lease_ttl_ms: u64,
}

/// The run lease of one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The attempt (one lease per attempt).
    pub attempt: AttemptId,
    /// Its run.
    pub run: RunId,
    /// State.
    pub state: LeaseState,
    /// Holder, fence and expiry.
    pub facts: LeaseFacts,
    /// TTL each renewal grants.
    pub ttl_ms: u64,
}

/// An event, appended in the same transaction as the change it records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Server-made id.
    pub id: EventId,
    /// Run.
    pub run: RunId,
    /// Attempt, when the event concerns one.
    pub attempt: Option<AttemptId>,
    /// `attempt.starting`, `run.running`, ...
    pub kind: String,
    /// Status before.
    pub from_status: Option<String>,
    /// Status after.
    pub to_status: Option<String>,
    /// Details; never a token or a token digest.
    pub payload: serde_json::Value,
    /// DB time.
    pub at: Millis,
}

/// A security audit record, written before any body byte is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditRecord {
    /// DB time (filled by the store).
    pub at: Millis,
    /// The certificate principal, when there was one.
    pub principal: Option<WorkerId>,
    /// Route name (`attempt.starting`, ...) or `unknown`.
    pub route: String,
    /// `admitted` or the refusal code.
    pub outcome: String,
}

status! {
    /// What an operator credential may do on the operator API.
    Role {
        /// Look: runs, logs, workers, schedules.
        Read = "read",
        /// Look and change: submit, cancel, workers' access and labels, schedules.
        Admin = "admin",
    }
}

impl Role {
    /// Whether this role may do what `needed` allows.
    pub fn allows(self, needed: Role) -> bool {
        self == Role::Admin || needed == Role::Read
    }
}

/// An operator's credential for the operator API, known only by its token's digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operator {
    /// Its name, the part of the token before the dot.
    pub name: String,
    /// What it may do.
    pub role: Role,
    /// SHA-256 of the token's secret.
    pub token_digest: Digest,
    /// Made at.
    pub created_at: Millis,
}

status! {
    /// Which ends of a run its webhook is told of.
    NotifyOn {
        /// Every terminal status.
        All = "all",
        /// `failed` and `timed_out` only.
        Failure = "failure",
    }
}

/// A webhook asked for at submit: where to POST the run's end, and which ends.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Notify {
    /// An `http://` or `https://` URL.
    pub url: String,
    /// Which ends.
    pub on: NotifyOn,
}

status! {
    /// Where a run's webhook delivery stands.
    DeliveryState {
        /// The run has not ended.
        Waiting = "waiting",
        /// Claimed for a send, or waiting for the next one after a failure.
        Pending = "pending",
        /// A receiver answered 2xx.
        Delivered = "delivered",
        /// Every attempt failed.
        Failed = "failed",
        /// The run ended in a way the webhook did not ask for.
        Skipped = "skipped",
    }
}

/// A run's webhook delivery, one per run (the run id is its idempotency key).
#[derive(Clone, PartialEq, Eq)]
pub struct Delivery {
    /// The run.
    pub run: RunId,
    /// Where to POST.
    pub url: String,
    /// Which ends.
    pub on: NotifyOn,
    /// Where it stands.
    pub state: DeliveryState,
    /// Sends tried.
    pub attempts: u32,
    /// Not to be claimed before then (a claim, or the backoff after a failure).
    pub next_at: Millis,
    /// Why the last send failed.
    pub last_error: Option<String>,
    /// Written with its run at.
    pub created_at: Millis,
    /// Last changed at.
    pub updated_at: Millis,
}

/// `scheme://host[:port]` of a URL, nothing of its path, query or user: what is shown and
/// printed of a webhook's URL, whose rest may be its receiver's secret.
pub fn url_origin(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    format!("{scheme}://{host}")
}

impl std::fmt::Debug for Notify {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notify").field("url", &url_origin(&self.url)).field("on", &self.on).finish()
    }
}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery")
            .field("run", &self.run)
            .field("url", &url_origin(&self.url))
            .field("on", &self.on)
            .field("state", &self.state)
            .field("attempts", &self.attempts)
            .field("next_at", &self.next_at)
            .field("last_error", &self.last_error)
            .finish_non_exhaustive()
    }
}

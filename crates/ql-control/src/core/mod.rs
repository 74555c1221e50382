//! The decisions of the authority: pure functions of (loaded rows, request, DB time).
//!
//! Every store runs every command the same way, in one short transaction:
//!
//! 1. [`Command::keys`] names the rows the command needs;
//! 2. the store locks and loads them in the protocol's fixed order (attempt fence,
//!    worker session, run and attempt, run lease) into [`Rows`];
//! 3. the store reads DB time *after* the locks;
//! 4. [`decide`] returns a [`Decision`]: the reply, and the rows and events to write;
//! 5. the store writes them in the same transaction and commits — or rolls back on any
//!    error, so a refusal or a failure changes nothing.
//!
//! Nothing here touches a database, a clock or a socket, so each rule is unit-tested
//! directly. A refusal never carries writes (see [`Decision::refuse`]).

mod abandon;
mod credential;
mod delivery;
mod fence;
mod finish;
mod grace;
mod identity;
mod log;
mod notify;
mod operator;
mod schedule;
mod session;
mod start;
mod sweep;
#[cfg(test)]
pub(crate) mod testkit;
mod worker;

pub use abandon::WORKER_LOST;
pub use credential::{authorize, check_name as check_operator_name};
pub use delivery::{placement_room, Fit, Want, SUBSET_LABELS};
pub use finish::{terminal_status, COMPLETION_EVENT, EXECUTION_FAILED};
pub use grace::{absence, Grace, Graced};
pub use identity::{admission, Access, AccessChanged, Issuer, WORKER_DISABLED, WORKER_REVOKED};
pub use log::{same_bytes, ChunkAdmitted, ChunkPlan};
pub use notify::{backoff, wanted, DeliveryPolicy, Sent};
pub use operator::{check_labels, check_url, CancelOutcome, Submit};
pub use schedule::{
    check_name as check_schedule_name, check_random_delay, next_after, parse as parse_cron, ScheduleSpec,
    RANDOM_DELAY_MAX_MS,
};
pub use start::{EXECUTION_CANCELLED, EXECUTION_TIMED_OUT, EXECUTOR_START_FAILED};
pub use sweep::{LEASE_LOST, OFFER_EXPIRED};

use ql_wire::ack::{Abandon, AckReply, Running, StartFailure};
use ql_wire::artifact::{ArtifactHeader, Receipt};
use ql_wire::capability::Digest;
use ql_wire::completion::{Completion, CompletionReply};
use ql_wire::ids::{ArtifactId, AttemptId, EventId, OfferId, ProjectId, RunId, SessionId, WorkerId};
use ql_wire::lease::Renewed;
use ql_wire::log::{LogAppendReply, LogChunkHeader, Seal};
use ql_wire::offer::{Claim, Claimed, Offers, PollOffers};
use ql_wire::route::AttemptPath;
use ql_wire::session::{CloseSession, Heartbeat, HeartbeatReply, OpenSession, SessionClosed, SessionOpened};
use ql_wire::{ErrorCode, Fence};

use std::collections::BTreeMap;

use crate::model::{
    Attempt, Certificate, Delivery, Enrolment, Event, Fire, Lease, LogChunk, Millis, Offer, Operator, Role, Run,
    Schedule, Session, Worker,
};

/// Durations the authority hands out. Every one is configurable so tests run short.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timings {
    /// How often agents should heartbeat.
    pub heartbeat_ms: u64,
    /// How long a session lives without a heartbeat or poll.
    pub session_ttl_ms: u64,
    /// How long an offer waits for a claim.
    pub offer_ttl_ms: u64,
    /// How long a lease lives without renewal.
    pub lease_ttl_ms: u64,
    /// No replica sweeping for longer than this is an outage, whose time the next sweep
    /// gives back to live leases and sessions ([`grace`]).
    pub outage_after_ms: u64,
    /// A worker's online session seen within this is not taken over by a new one: a
    /// second agent with the same identity is refused (`session_conflict`).
    pub takeover_after_ms: u64,
    /// A schedule's fire found later than this after its time was missed (no replica
    /// ran): it follows the schedule's `catch_up`.
    pub missed_after_ms: u64,
    /// A worker's certificate is renewed at most once in this long ([`identity`]).
    pub renew_interval_ms: u64,
}

impl Default for Timings {
    fn default() -> Self {
        Self {
            heartbeat_ms: 10_000,
            session_ttl_ms: 45_000,
            offer_ttl_ms: 30_000,
            lease_ttl_ms: 30_000,
            outage_after_ms: 5_000,
            takeover_after_ms: 20_000,
            missed_after_ms: 60_000,
            renew_interval_ms: 3_600_000,
        }
    }
}

/// One request to the authority.
#[derive(Debug, Clone)]
pub enum Command {
    /// Open a session.
    OpenSession(WorkerId, OpenSession),
    /// Heartbeat a session.
    Heartbeat(WorkerId, SessionId, Heartbeat),
    /// Close a session for good.
    CloseSession(WorkerId, SessionId, CloseSession),
    /// Place queued runs on the session and list its open offers.
    PollOffers(WorkerId, SessionId, PollOffers),
    /// Claim an offer.
    Claim(WorkerId, SessionId, OfferId, Claim),
    /// `starting`.
    Starting(AttemptPath, Fence),
    /// `running`.
    Running(AttemptPath, Running),
    /// `start-failure`.
    StartFailure(AttemptPath, StartFailure),
    /// `lease:renew`.
    Renew(AttemptPath, Fence),
    /// `abandon`: the worker lost the job through no fault of the job.
    Abandon(AttemptPath, Abandon),
    /// The fence check before an artifact's content is read.
    AdmitArtifact(AttemptPath, ArtifactId, ArtifactHeader),
    /// The same check once the content has arrived, before it is stored, with the
    /// receipt it makes: claimed for the attempt, so other content for it is refused
    /// (the database arbitrates, whatever the artifact store's own conditional writes).
    ConfirmArtifact(AttemptPath, ArtifactId, ArtifactHeader, Receipt),
    /// The checks before a live-log chunk's content is read.
    AdmitLogChunk(AttemptPath, LogChunkHeader),
    /// A live-log chunk whose content (with this digest) is durable in the artifact store.
    AppendLog(AttemptPath, LogChunkHeader, Digest),
    /// Seal the live log into the artifact.
    SealLog(AttemptPath, ArtifactId, Seal),
    /// Completion, with what the artifact store holds for its receipt (inspected before
    /// the transaction, as ADR-0117 requires).
    Complete(AttemptPath, Completion, Option<Receipt>),
    /// Operator: submit a run.
    Submit(Submit),
    /// Operator: cancel a run.
    Cancel(RunId),
    /// Operator: set the labels it vouches for of a worker.
    LabelWorker(WorkerId, BTreeMap<String, String>),
    /// Operator: disable, enable or revoke a worker.
    SetAccess(WorkerId, Access),
    /// Operator: revoke one certificate of a worker by serial, with `true` also every
    /// certificate renewed from it.
    RevokeCertificate(WorkerId, String, bool),
    /// Record a certificate just issued (by an operator, or renewed by its worker).
    RecordCertificate(Certificate, Issuer),
    /// Operator: record a one-time enrolment token's digest, valid this long.
    CreateEnrolment(WorkerId, Digest, u64),
    /// An agent spends an enrolment token (this digest) on a certificate just issued.
    Enrol(Digest, Certificate),
    /// Operator: add a schedule.
    AddSchedule(Box<ScheduleSpec>),
    /// Operator: pause (`true`) or resume a schedule.
    PauseSchedule(String, bool),
    /// Operator: remove a schedule.
    RemoveSchedule(String),
    /// Operator: submit a schedule's run now.
    RunScheduleNow(String),
    /// Fire the schedules that are due, by DB time.
    FireSchedules,
    /// Operator: record an operator API credential (name, role, the token's digest).
    AddOperator(String, Role, Digest),
    /// Operator: remove an operator API credential.
    RemoveOperator(String),
    /// Claim the webhook deliveries that are due, by DB time.
    ClaimDeliveries(DeliveryPolicy),
    /// How the send of a delivery's attempt went.
    DeliveryDone(RunId, u32, Sent, DeliveryPolicy),
    /// Expire what has lapsed, by DB time.
    Sweep,
}

/// The rows a command needs, in lock order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Keys {
    /// Lock the attempt's advisory fence and load it with its run and lease.
    pub attempt: Option<AttemptId>,
    /// Load this session (and lock it).
    pub session: Option<SessionId>,
    /// Load this run (and lock it).
    pub run: Option<RunId>,
    /// Load this offer.
    pub offer: Option<OfferId>,
    /// Load every session of this worker (to open a new one).
    pub worker_sessions: Option<WorkerId>,
    /// Load this worker's record (its trusted labels).
    pub worker: Option<WorkerId>,
    /// Load every certificate recorded for this worker, and its enrolment tokens.
    pub worker_certificates: Option<WorkerId>,
    /// Load this worker's leased attempts and open offers, with their runs.
    pub worker_work: Option<WorkerId>,
    /// Load this certificate by serial.
    pub certificate: Option<String>,
    /// Load the certificate a request presented, by serial.
    pub presented: Option<String>,
    /// Load when this worker's certificate was last renewed.
    pub last_renewal: Option<WorkerId>,
    /// Load this enrolment by token digest.
    pub enrolment: Option<Digest>,
    /// Load this schedule by name (and lock it).
    pub schedule: Option<String>,
    /// Load the schedules due by DB time, each with its last run.
    pub due_schedules: bool,
    /// Load this operator credential by name.
    pub operator: Option<String>,
    /// Load this run's webhook delivery (and lock it).
    pub delivery: Option<RunId>,
    /// Load at most this many webhook deliveries due by DB time whose runs ended, with
    /// their runs.
    pub due_deliveries: Option<usize>,
    /// Load placement candidates: queued runs, and the session's open offers and
    /// active attempt count.
    pub placement: bool,
    /// Load the run's current attempt with its lease and offer (cancel).
    pub current_attempt: bool,
    /// Load the attempt's completion event (for replays).
    pub completion_event: bool,
    /// Load everything that has lapsed by DB time (sweeper).
    pub sweep: bool,
}

/// A due schedule, with its last run and the latest fire time recorded under its name (a
/// time at or before that fired already).
pub type DueSchedule = (Schedule, Option<Run>, Option<Millis>);

/// Rows loaded for a command. What is absent was not asked for or does not exist.
#[derive(Debug, Clone, Default)]
pub struct Rows {
    /// The session named by the path.
    pub session: Option<Session>,
    /// The run.
    pub run: Option<Run>,
    /// The attempt.
    pub attempt: Option<Attempt>,
    /// The attempt's lease.
    pub lease: Option<Lease>,
    /// The offer.
    pub offer: Option<Offer>,
    /// The attempt's completion event, when asked for.
    pub completion_event: Option<Event>,
    /// Every session of the worker, when asked for.
    pub worker_sessions: Vec<Session>,
    /// The worker's record, when asked for (placement loads the session's).
    pub worker: Option<Worker>,
    /// The worker's certificates, when asked for.
    pub certificates: Vec<Certificate>,
    /// The worker's enrolment tokens, with its certificates.
    pub enrolments: Vec<Enrolment>,
    /// The worker's leased attempts and open offers, when asked for.
    pub worker_work: Work,
    /// The certificate named by serial.
    pub certificate: Option<Certificate>,
    /// The certificate the request presented.
    pub presented: Option<Certificate>,
    /// When the worker's newest renewed certificate was issued, when asked for.
    pub last_renewal: Option<Millis>,
    /// The enrolment named by digest.
    pub enrolment: Option<Enrolment>,
    /// The schedule named.
    pub schedule: Option<Schedule>,
    /// Due schedules.
    pub due_schedules: Vec<DueSchedule>,
    /// The operator credential named.
    pub operator: Option<Operator>,
    /// The run's webhook delivery.
    pub delivery: Option<Delivery>,
    /// Due webhook deliveries of ended runs, with their runs.
    pub due_deliveries: Vec<(Delivery, Run)>,
    /// Queued runs, oldest first (placement).
    pub queued: Vec<Run>,
    /// The session's open offers (placement).
    pub open_offers: Vec<Offer>,
    /// Attempts occupying the session's capacity (placement).
    pub active_attempts: u32,
    /// Lapsed rows (sweep).
    pub lapsed: Lapsed,
    /// When a replica last swept (sweep).
    pub alive_at: Option<Millis>,
    /// The live rows an outage's grace extends, instead of the lapsed ones (sweep).
    pub grace: Option<Grace>,
}

/// What one worker holds: leases and open offers, each with its run and attempt.
#[derive(Debug, Clone, Default)]
pub struct Work {
    /// Leased leases.
    pub leases: Vec<(Lease, Run, Attempt)>,
    /// Open offers.
    pub offers: Vec<(Offer, Run, Attempt)>,
}

/// What the sweeper found lapsed, each with the rows its decision needs.
#[derive(Debug, Clone, Default)]
pub struct Lapsed {
    /// Online or draining sessions past their expiry.
    pub sessions: Vec<Session>,
    /// Open offers past expiry, with their run and attempt.
    pub offers: Vec<(Offer, Run, Attempt)>,
    /// Leased leases past expiry, with their run and attempt.
    pub leases: Vec<(Lease, Run, Attempt)>,
    /// Non-terminal runs past their deadline without a timeout intent.
    pub overdue: Vec<Run>,
}

/// A successful answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// To open.
    SessionOpened(SessionOpened),
    /// To heartbeat.
    Heartbeat(HeartbeatReply),
    /// To close.
    SessionClosed(SessionClosed),
    /// To poll.
    /// The offers, and what the polling session takes (for its wait: see [`Want`]).
    Offers(Offers, Box<Fit>),
    /// To claim.
    Claimed(Box<Claimed>),
    /// To a start ACK.
    Ack(AckReply),
    /// To renewal.
    Renewed(Renewed),
    /// The artifact may be stored under this project.
    ArtifactAdmitted(ProjectId),
    /// The live-log chunk may go on; what to do with its content.
    ChunkAdmitted(ChunkAdmitted),
    /// To `log:append`.
    LogAppended(LogAppendReply),
    /// The chunk or seal does not continue the log: `409 log_offset_conflict` with the
    /// acknowledged length. An answer, not a refusal, because it carries that length; it
    /// writes nothing either way.
    LogOffsetConflict(u64),
    /// The log is sealed: compose the artifact under this project.
    SealAdmitted(ProjectId),
    /// To completion.
    Completed(CompletionReply),
    /// To submit.
    Submitted(RunId),
    /// To cancel.
    Cancelled(CancelOutcome),
    /// To labelling a worker: its record now.
    WorkerLabelled(Box<Worker>),
    /// To disabling, enabling or revoking a worker: what it ended.
    AccessChanged(AccessChanged),
    /// To revoking a certificate: its record now, and how many certificates renewed from
    /// it were revoked with it.
    CertificateRevoked(Box<Certificate>, usize),
    /// A certificate was recorded (as issued, or on enrolment).
    CertificateRecorded(Box<Certificate>),
    /// An enrolment token was recorded, usable until then.
    EnrolmentCreated(Millis),
    /// A schedule, as it now is.
    Schedule(Box<Schedule>),
    /// How many schedules fired.
    Fired(usize),
    /// An operator credential, as added or removed.
    Operator(Box<Operator>),
    /// The deliveries claimed for a send, with their runs.
    Deliveries(Vec<(Delivery, Run)>),
    /// A delivery as it now is.
    Delivery(Box<Delivery>),
    /// To sweep: how many rows it changed.
    Swept(usize),
    /// To a sweep after an outage: what its grace gave back (nothing was swept).
    Graced(Graced),
}

/// A row or event to write.
// A decision holds a handful of writes; boxing the large rows would only add allocations.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write {
    /// Insert or replace a session.
    Session(Session),
    /// Insert or replace a run.
    Run(Run),
    /// Insert or replace an attempt.
    Attempt(Attempt),
    /// Insert or replace an offer.
    Offer(Offer),
    /// Insert or replace a lease.
    Lease(Lease),
    /// Append an event (never replaced).
    Event(Event),
    /// Append an acknowledged live-log chunk (never replaced).
    LogChunk(LogChunk),
    /// Insert or replace a worker's record.
    Worker(Worker),
    /// Insert or replace a certificate's record.
    Certificate(Certificate),
    /// Insert or replace an enrolment.
    Enrolment(Enrolment),
    /// Insert or replace a schedule.
    Schedule(Schedule),
    /// Delete a schedule.
    RemoveSchedule(String),
    /// Append a fire (never replaced: the key refuses a second one for the same time).
    Fire(Fire),
    /// Insert an operator credential.
    Operator(Operator),
    /// Delete an operator credential.
    RemoveOperator(String),
    /// Insert or replace a run's webhook delivery.
    Delivery(Delivery),
    /// Record that a replica swept at this DB time.
    Alive(Millis),
}

/// The outcome of one command: a reply and its writes, or a refusal that writes nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// What to answer.
    pub reply: Result<Reply, ErrorCode>,
    /// What to write, in order, in the same transaction.
    pub writes: Vec<Write>,
    /// Whether every waiting long-poll should look again.
    pub wake: bool,
    /// Runs queued for which only the long-polls of sessions that take them should look
    /// again (a submit, a re-queue, a fire): a wake-up that concerns a few sessions, not the fleet.
    pub wants: Vec<Want>,
}

impl Decision {
    /// A refusal: an error code and nothing written.
    pub fn refuse(code: ErrorCode) -> Self {
        Self { reply: Err(code), writes: Vec::new(), wake: false, wants: Vec::new() }
    }

    /// An answer with no writes.
    pub fn answer(reply: Reply) -> Self {
        Self { reply: Ok(reply), writes: Vec::new(), wake: false, wants: Vec::new() }
    }

    /// An answer with writes.
    pub fn apply(reply: Reply, writes: Vec<Write>) -> Self {
        Self { reply: Ok(reply), writes, wake: false, wants: Vec::new() }
    }

    /// Whether the decision changes nothing but when the session it was loaded with was
    /// last seen (an idle poll, a plain heartbeat), or nothing at all (a refusal, an
    /// answer repeated from state). Such a commit may reach the disk shortly after its
    /// answer leaves (the SQLite store's `lazy_sync`): a power cut can then only make the
    /// session look seen a moment earlier than its agent was told, well inside the margin
    /// between `heartbeat_ms` and `session_ttl_ms`. Everything else (an offer, a claim, an
    /// ACK, a renewal, a completion, a session opened, draining declared) is durable
    /// before it is answered.
    pub fn only_liveness(&self, rows: &Rows) -> bool {
        self.writes.iter().all(|write| match (write, &rows.session) {
            (Write::Session(new), Some(old)) => {
                Session { seen_at: old.seen_at, expires_at: old.expires_at, ..new.clone() } == *old
            }
            _ => false,
        })
    }

    fn waking(mut self) -> Self {
        self.wake = true;
        self
    }

    /// Wakes the long-polls of the sessions that take a run this decision leaves queued
    /// (a re-queue by a sweep or an abandon, a schedule's fire), and no other.
    fn waking_for_queued(mut self) -> Self {
        for write in &self.writes {
            if let Write::Run(run) = write {
                if run.status == crate::model::RunStatus::Queued {
                    self.wants.push(Want { labels: run.labels.clone(), agent_labels: run.agent_labels.clone() });
                }
            }
        }
        self
    }

    /// Wakes the long-polls of the sessions that take the run `submit` queued.
    fn waking_for(mut self, submit: &Submit) -> Self {
        self.wants.push(Want { labels: submit.labels.clone(), agent_labels: submit.agent_labels.clone() });
        self
    }
}

/// Makes server ids. Stores seed it with fresh randomness per transaction, which keeps
/// [`decide`] a pure function of its inputs.
#[derive(Debug, Clone)]
pub struct IdGen {
    /// Empty until the first id: most decisions (an idle poll, a renewal) make none, and
    /// drawing a seed costs a system call.
    prefix: String,
    next: u32,
}

impl IdGen {
    /// A generator whose ids start with 16 random bytes' worth of base-36-ish text.
    pub fn new(seed: [u8; 12]) -> Self {
        Self { prefix: Self::prefix(seed), next: 0 }
    }

    fn prefix(seed: [u8; 12]) -> String {
        const ALPHABET: &[u8; 32] = b"0123456789abcdefghjkmnpqrstvwxyz";
        let mut prefix = String::with_capacity(20);
        let bits = seed.iter().fold(0u128, |acc, &b| acc << 8 | u128::from(b));
        for i in 0..19 {
            prefix.push(char::from(ALPHABET[(bits >> (i * 5) & 31) as usize]));
        }
        prefix
    }

    /// A fresh random generator, seeded from the OS CSPRNG when it first makes something.
    pub fn random() -> Self {
        Self { prefix: String::new(), next: 0 }
    }

    fn seeded(&mut self) -> &str {
        if self.prefix.is_empty() {
            let mut seed = [0u8; 12];
            getrandom::getrandom(&mut seed).expect("the OS CSPRNG is available");
            self.prefix = Self::prefix(seed);
        }
        &self.prefix
    }

    fn make(&mut self, kind: &str) -> String {
        self.next += 1;
        let next = self.next;
        format!("{kind}_{}{next}", self.seeded())
    }

    /// A new session id.
    pub fn session(&mut self) -> SessionId {
        SessionId::parse(self.make("ses")).expect("generated ids are valid")
    }

    /// A new run id.
    pub fn run(&mut self) -> RunId {
        RunId::parse(self.make("run")).expect("generated ids are valid")
    }

    /// A new attempt id.
    pub fn attempt(&mut self) -> AttemptId {
        AttemptId::parse(self.make("att")).expect("generated ids are valid")
    }

    /// A new offer id.
    pub fn offer(&mut self) -> OfferId {
        OfferId::parse(self.make("off")).expect("generated ids are valid")
    }

    /// A new event id.
    pub fn event(&mut self) -> EventId {
        EventId::parse(self.make("evt")).expect("generated ids are valid")
    }

    /// A number below `below` (at least 1), drawn from the generator's seed: each call
    /// another (xorshift), so one transaction's draws differ.
    pub fn draw(&mut self, below: u64) -> u64 {
        self.next += 1;
        let mut x = self.seeded().bytes().fold(0x9e37_79b9_7f4a_7c15u64, |acc, b| acc.rotate_left(5) ^ u64::from(b));
        x ^= u64::from(self.next).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % below.max(1)
    }
}

impl Command {
    /// The rows this command needs.
    pub fn keys(&self) -> Keys {
        let attempt = |p: &AttemptPath| Keys {
            attempt: Some(p.attempt.clone()),
            session: Some(p.session.clone()),
            run: Some(p.run.clone()),
            ..Keys::default()
        };
        match self {
            Self::OpenSession(w, _) => Keys { worker_sessions: Some(w.clone()), ..Keys::default() },
            Self::Heartbeat(_, s, _) | Self::CloseSession(_, s, _) => {
                Keys { session: Some(s.clone()), ..Keys::default() }
            }
            Self::PollOffers(w, s, _) => {
                Keys { session: Some(s.clone()), worker: Some(w.clone()), placement: true, ..Keys::default() }
            }
            Self::Claim(_, s, o, body) => Keys {
                attempt: Some(body.attempt_id.clone()),
                session: Some(s.clone()),
                run: Some(body.run_id.clone()),
                offer: Some(o.clone()),
                ..Keys::default()
            },
            Self::Starting(p, _)
            | Self::Running(p, _)
            | Self::StartFailure(p, _)
            | Self::Renew(p, _)
            | Self::Abandon(p, _)
            | Self::AdmitArtifact(p, ..)
            | Self::ConfirmArtifact(p, ..)
            | Self::AdmitLogChunk(p, _)
            | Self::AppendLog(p, ..)
            | Self::SealLog(p, ..) => attempt(p),
            Self::Complete(p, ..) => Keys { completion_event: true, ..attempt(p) },
            Self::Submit(_) => Keys::default(),
            Self::Cancel(r) => Keys { run: Some(r.clone()), current_attempt: true, ..Keys::default() },
            Self::LabelWorker(w, _) => Keys { worker: Some(w.clone()), ..Keys::default() },
            Self::SetAccess(w, Access::Enable) => Keys { worker: Some(w.clone()), ..Keys::default() },
            Self::SetAccess(w, _) => Keys {
                worker_work: Some(w.clone()),
                worker_sessions: Some(w.clone()),
                worker: Some(w.clone()),
                worker_certificates: Some(w.clone()),
                ..Keys::default()
            },
            Self::RevokeCertificate(w, serial, _) => Keys {
                // The worker's lock (taken with its sessions), as a renewal takes it: a
                // renewal from this certificate either commits first, and its new one is
                // among the worker's certificates found here, or finds it revoked.
                worker_sessions: Some(w.clone()),
                worker_certificates: Some(w.clone()),
                certificate: Some(serial.clone()),
                ..Keys::default()
            },
            Self::RecordCertificate(c, issuer) => Keys {
                // The worker's lock (taken with its sessions), as revoking takes it.
                worker_sessions: Some(c.worker.clone()),
                worker: Some(c.worker.clone()),
                certificate: Some(c.serial.clone()),
                presented: match issuer {
                    Issuer::Worker(serial) => Some(serial.clone()),
                    Issuer::Operator => None,
                },
                last_renewal: matches!(issuer, Issuer::Worker(_)).then(|| c.worker.clone()),
                ..Keys::default()
            },
            Self::CreateEnrolment(_, digest, _) => Keys { enrolment: Some(digest.clone()), ..Keys::default() },
            Self::AddSchedule(spec) => Keys { schedule: Some(spec.name.clone()), ..Keys::default() },
            Self::PauseSchedule(name, _) | Self::RemoveSchedule(name) | Self::RunScheduleNow(name) => {
                Keys { schedule: Some(name.clone()), ..Keys::default() }
            }
            Self::FireSchedules => Keys { due_schedules: true, ..Keys::default() },
            Self::AddOperator(name, ..) | Self::RemoveOperator(name) => {
                Keys { operator: Some(name.clone()), ..Keys::default() }
            }
            Self::ClaimDeliveries(policy) => Keys { due_deliveries: Some(policy.batch), ..Keys::default() },
            Self::DeliveryDone(run, ..) => Keys { delivery: Some(run.clone()), ..Keys::default() },
            Self::Enrol(digest, c) => Keys {
                enrolment: Some(digest.clone()),
                worker: Some(c.worker.clone()),
                certificate: Some(c.serial.clone()),
                ..Keys::default()
            },
            Self::Sweep => Keys { sweep: true, ..Keys::default() },
        }
    }
}

impl Command {
    /// Its name, for metrics: one per variant.
    pub fn name(&self) -> &'static str {
        match self {
            Self::OpenSession(..) => "open_session",
            Self::Heartbeat(..) => "heartbeat",
            Self::CloseSession(..) => "close_session",
            Self::PollOffers(..) => "poll_offers",
            Self::Claim(..) => "claim",
            Self::Starting(..) => "starting",
            Self::Running(..) => "running",
            Self::StartFailure(..) => "start_failure",
            Self::Renew(..) => "renew",
            Self::Abandon(..) => "abandon",
            Self::AdmitArtifact(..) => "admit_artifact",
            Self::ConfirmArtifact(..) => "confirm_artifact",
            Self::AdmitLogChunk(..) => "admit_log_chunk",
            Self::AppendLog(..) => "append_log",
            Self::SealLog(..) => "seal_log",
            Self::Complete(..) => "complete",
            Self::Submit(_) => "submit",
            Self::Cancel(_) => "cancel",
            Self::LabelWorker(..) => "label_worker",
            Self::SetAccess(..) => "set_access",
            Self::RevokeCertificate(..) => "revoke_certificate",
            Self::RecordCertificate(..) => "record_certificate",
            Self::CreateEnrolment(..) => "create_enrolment",
            Self::Enrol(..) => "enrol",
            Self::AddSchedule(_) => "add_schedule",
            Self::PauseSchedule(..) => "pause_schedule",
            Self::RemoveSchedule(_) => "remove_schedule",
            Self::RunScheduleNow(_) => "run_schedule_now",
            Self::FireSchedules => "fire_schedules",
            Self::AddOperator(..) => "add_operator",
            Self::RemoveOperator(_) => "remove_operator",
            Self::ClaimDeliveries(_) => "claim_deliveries",
            Self::DeliveryDone(..) => "delivery_done",
            Self::Sweep => "sweep",
        }
    }
}

/// Decides one command. `now` is DB time read after the locks.
pub fn decide(cmd: &Command, rows: &Rows, now: Millis, timings: &Timings, ids: &mut IdGen) -> Decision {
    match cmd {
        Command::OpenSession(w, body) => session::open(w, body, rows, now, timings, ids),
        Command::Heartbeat(w, s, body) => session::heartbeat(w, s, body, rows, now, timings),
        Command::CloseSession(w, s, body) => session::close(w, s, body, rows, now),
        Command::PollOffers(w, s, body) => delivery::poll(w, s, body, rows, now, timings, ids),
        Command::Claim(w, s, o, body) => delivery::claim(w, s, o, body, rows, now, timings, ids),
        Command::Starting(p, fence) => start::starting(p, fence, rows, now, ids).unwrap_or_else(Decision::refuse),
        Command::Running(p, body) => start::running(p, body, rows, now, ids).unwrap_or_else(Decision::refuse),
        Command::StartFailure(p, body) => {
            start::start_failure(p, body, rows, now, ids).unwrap_or_else(Decision::refuse)
        }
        Command::Renew(p, fence) => start::renew(p, fence, rows, now).unwrap_or_else(Decision::refuse),
        Command::Abandon(p, body) => abandon::abandon(p, body, rows, now, ids).unwrap_or_else(Decision::refuse),
        Command::AdmitArtifact(p, artifact, header) => {
            finish::admit_artifact(p, artifact, header, None, rows, now).unwrap_or_else(Decision::refuse)
        }
        Command::ConfirmArtifact(p, artifact, header, receipt) => {
            finish::admit_artifact(p, artifact, header, Some(receipt), rows, now).unwrap_or_else(Decision::refuse)
        }
        Command::AdmitLogChunk(p, header) => log::admit_chunk(p, header, rows, now),
        Command::AppendLog(p, header, sha256) => log::append(p, header, sha256, rows, now),
        Command::SealLog(p, artifact, body) => log::seal(p, artifact, body, rows, now),
        Command::Complete(p, body, stored) => {
            finish::complete(p, body, stored.as_ref(), rows, now, ids).unwrap_or_else(Decision::refuse)
        }
        Command::Submit(s) => operator::submit(s, now, ids),
        Command::Cancel(_) => operator::cancel(rows, now, ids),
        Command::LabelWorker(w, labels) => worker::set_labels(w, labels, rows, now),
        Command::SetAccess(w, access) => identity::set_access(w, *access, rows, now, ids),
        Command::RevokeCertificate(w, serial, renewals) => {
            identity::revoke_certificate(w, serial, *renewals, rows, now)
        }
        Command::RecordCertificate(cert, issuer) => {
            identity::record_certificate(cert, issuer, rows, now, timings.renew_interval_ms)
        }
        Command::CreateEnrolment(w, digest, ttl_ms) => identity::create_enrolment(w, digest, *ttl_ms, rows, now),
        Command::Enrol(digest, cert) => identity::enrol(digest, cert, rows, now),
        Command::AddSchedule(spec) => schedule::add(spec, rows, now, ids),
        Command::PauseSchedule(name, paused) => schedule::set_paused(name, *paused, rows, now, ids),
        Command::RemoveSchedule(name) => schedule::remove(name, rows),
        Command::RunScheduleNow(name) => schedule::run_now(name, rows, now, ids),
        Command::FireSchedules => schedule::fire_due(rows, now, timings.missed_after_ms, ids),
        Command::AddOperator(name, role, digest) => credential::add(name, *role, digest, rows, now),
        Command::RemoveOperator(name) => credential::remove(name, rows),
        Command::ClaimDeliveries(policy) => notify::claim(rows, now, policy),
        Command::DeliveryDone(run, attempt, sent, policy) => notify::done(run, *attempt, sent, rows, now, policy),
        Command::Sweep => match &rows.grace {
            Some(grace) => grace::give_back(grace, now, timings),
            None => sweep::sweep(&rows.lapsed, now, ids),
        },
    }
}

/// Builds an event.
pub(crate) fn event(
    ids: &mut IdGen,
    run: &RunId,
    attempt: Option<&AttemptId>,
    kind: &str,
    transition: (Option<&str>, Option<&str>),
    payload: serde_json::Value,
    at: Millis,
) -> Write {
    Write::Event(Event {
        id: ids.event(),
        run: run.clone(),
        attempt: attempt.cloned(),
        kind: kind.to_owned(),
        from_status: transition.0.map(str::to_owned),
        to_status: transition.1.map(str::to_owned),
        payload,
        at,
    })
}

#[cfg(test)]
mod tests {
    use super::IdGen;

    #[test]
    fn a_random_generator_seeds_itself_once_and_two_of_them_differ() {
        let (mut a, mut b) = (IdGen::random(), IdGen::random());
        let (a1, a2) = (a.session().to_string(), a.session().to_string());
        let b1 = b.session().to_string();
        assert_eq!(a1.len(), a2.len());
        assert_eq!(a1[..a1.len() - 1], a2[..a2.len() - 1], "one prefix per generator: {a1} {a2}");
        assert_ne!(a1, a2);
        assert_ne!(a1[..a1.len() - 1], b1[..b1.len() - 1], "a fresh seed per generator: {a1} {b1}");
        assert_eq!(IdGen::new([7; 12]).event().to_string(), IdGen::new([7; 12]).event().to_string());
    }
}

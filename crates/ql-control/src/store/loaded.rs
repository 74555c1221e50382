//! The rows a command loaded, by table and key: both stores write a loaded row in place
//! rather than upsert it, and SQLite writes only the columns its decision changed.
//!
//! Every row here was read inside the command's transaction (under a row lock on
//! PostgreSQL, the file's write lock on SQLite), so it is the row's current content: a
//! write of it is a plain `UPDATE`, and a column whose value the decision kept needs no
//! writing. After a write the written row becomes the known one ([`Loaded::wrote`]), so
//! a decision that writes one row twice is compared with its own first write.
//!
//! The same rows vouch for the events a decision appends ([`Loaded::dangling`]): an
//! event may name only a run its command loaded or wrote, and an attempt of that run
//! that it loaded or wrote or that is the run's current attempt. Runs and attempts never
//! change their ids, and are deleted only with every row naming them once ended and past
//! their retention (`Store::prune_runs`), which on PostgreSQL skips a run a command holds
//! locked and on SQLite waits for the writer: so such a row still exists when the command
//! commits. That is the events' whole referential check on PostgreSQL, which keeps no
//! foreign key on them (migration 0017); SQLite keeps its own as well.

use std::collections::HashMap;

use crate::core::{Rows, Write};
use crate::model::{Attempt, Lease, Offer, Run, Session};

/// The loaded (or since written) rows of the tables a decision rewrites.
#[derive(Default)]
pub(super) struct Loaded<'a> {
    sessions: HashMap<&'a str, &'a Session>,
    runs: HashMap<&'a str, &'a Run>,
    attempts: HashMap<&'a str, &'a Attempt>,
    offers: HashMap<&'a str, &'a Offer>,
    leases: HashMap<&'a str, &'a Lease>,
}

/// A write of a known row: the row to write, and the row as the database holds it now.
pub(super) enum Known<'w, 'a> {
    Session(&'w Session, &'a Session),
    Run(&'w Run, &'a Run),
    Attempt(&'w Attempt, &'a Attempt),
    Offer(&'w Offer, &'a Offer),
    Lease(&'w Lease, &'a Lease),
}

impl<'a> Loaded<'a> {
    /// Every row of `r`, keyed by id (a lease by its attempt).
    pub(super) fn of(r: &'a Rows) -> Self {
        let mut l = Self::default();
        let lapsed = &r.lapsed;
        r.session.iter().chain(&r.worker_sessions).chain(&lapsed.sessions).for_each(|s| l.session(s));
        r.run.iter().chain(&r.queued).chain(&lapsed.overdue).for_each(|x| l.run(x));
        r.attempt.iter().for_each(|a| l.attempt(a));
        r.offer.iter().chain(&r.open_offers).for_each(|o| l.offer(o));
        r.lease.iter().for_each(|x| l.lease(x));
        for (o, x, a) in lapsed.offers.iter().chain(&r.worker_work.offers) {
            l.offer(o);
            l.run(x);
            l.attempt(a);
        }
        for (lease, x, a) in lapsed.leases.iter().chain(&r.worker_work.leases) {
            l.lease(lease);
            l.run(x);
            l.attempt(a);
        }
        if let Some(g) = &r.grace {
            g.sessions.iter().for_each(|s| l.session(s));
            g.offers.iter().for_each(|o| l.offer(o));
            for (lease, a) in &g.leases {
                l.lease(lease);
                l.attempt(a);
            }
        }
        l
    }

    fn session(&mut self, x: &'a Session) {
        self.sessions.insert(x.id.as_str(), x);
    }

    fn run(&mut self, x: &'a Run) {
        self.runs.insert(x.id.as_str(), x);
    }

    fn attempt(&mut self, x: &'a Attempt) {
        self.attempts.insert(x.id.as_str(), x);
    }

    fn offer(&mut self, x: &'a Offer) {
        self.offers.insert(x.id.as_str(), x);
    }

    fn lease(&mut self, x: &'a Lease) {
        self.leases.insert(x.attempt.as_str(), x);
    }

    /// `write` with the row it replaces, if that row is known; `None` for a row the
    /// command did not load (a new one) and for history, which is only ever appended.
    pub(super) fn known<'w>(&self, write: &'w Write) -> Option<Known<'w, 'a>> {
        match write {
            Write::Session(x) => self.sessions.get(x.id.as_str()).map(|old| Known::Session(x, old)),
            Write::Run(x) => self.runs.get(x.id.as_str()).map(|old| Known::Run(x, old)),
            Write::Attempt(x) => self.attempts.get(x.id.as_str()).map(|old| Known::Attempt(x, old)),
            Write::Offer(x) => self.offers.get(x.id.as_str()).map(|old| Known::Offer(x, old)),
            Write::Lease(x) => self.leases.get(x.attempt.as_str()).map(|old| Known::Lease(x, old)),
            _ => None,
        }
    }

    /// Why `write` must not be written, if it is an event that names a run this command
    /// neither loaded nor wrote, or an attempt that is neither such a row of the event's
    /// run nor that run's current attempt (which the run's own foreign key vouches for).
    pub(super) fn dangling(&self, write: &Write) -> Option<String> {
        let Write::Event(event) = write else { return None };
        let Some(run) = self.runs.get(event.run.as_str()) else {
            return Some(format!(
                "event {} names run {}, which its command neither loaded nor wrote",
                event.kind, event.run
            ));
        };
        let attempt = event.attempt.as_ref()?;
        let of_run = self.attempts.get(attempt.as_str()).is_some_and(|a| a.run == event.run);
        if of_run || run.current_attempt.as_ref() == Some(attempt) {
            return None;
        }
        Some(format!(
            "event {} names attempt {} of run {}, which its command neither loaded nor wrote",
            event.kind, attempt, event.run
        ))
    }

    /// `write` was applied: its row is now the known one.
    pub(super) fn wrote(&mut self, write: &'a Write) {
        match write {
            Write::Session(x) => self.session(x),
            Write::Run(x) => self.run(x),
            Write::Attempt(x) => self.attempt(x),
            Write::Offer(x) => self.offer(x),
            Write::Lease(x) => self.lease(x),
            _ => {}
        }
    }
}

//! Wake-ups for the long-polls of one process: a counter every waiting poll watches
//! ([`Store::changes`](super::Store::changes)), and the recent wake-ups that concern only
//! some sessions ([`Want`]s of runs just queued or queued again), so that a poll woken by
//! a run it cannot take goes back to waiting without asking the store.
//!
//! A wake-up for everyone (a worker enabled, disabled or labelled anew; a commit by
//! another process or replica) and a poll that fell more than [`RECENT`] wake-ups behind
//! both mean "look again".

use std::collections::VecDeque;
use std::sync::Mutex;

use tokio::sync::watch;

use crate::core::Want;

/// Wake-ups remembered for polls that have not looked yet.
const RECENT: usize = 1024;

/// The counter and the recent targeted wake-ups of one store.
pub struct Wakes {
    counter: watch::Sender<u64>,
    /// `(counter value, want)`: `None` is a wake-up for everyone.
    recent: Mutex<VecDeque<(u64, Option<Want>)>>,
}

impl std::fmt::Debug for Wakes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wakes").field("counter", &*self.counter.borrow()).finish_non_exhaustive()
    }
}

impl Default for Wakes {
    fn default() -> Self {
        Self { counter: watch::channel(0).0, recent: Mutex::default() }
    }
}

impl Wakes {
    /// Every waiting poll looks again.
    pub fn all(&self) {
        self.push(vec![None]);
    }

    /// The polls of sessions that take one of `wants` look again.
    pub fn runs(&self, wants: Vec<Want>) {
        if !wants.is_empty() {
            self.push(wants.into_iter().map(Some).collect());
        }
    }

    fn push(&self, wants: Vec<Option<Want>>) {
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        // Under the lock: a poll that reads the counter then the list sees each wake-up.
        self.counter.send_modify(|n| {
            *n = n.wrapping_add(1);
            for want in wants {
                recent.push_back((*n, want));
            }
        });
        while recent.len() > RECENT {
            recent.pop_front();
        }
    }

    /// The counter to wait on.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.counter.subscribe()
    }

    /// The wants of the wake-ups after `seen` up to `now`, or `None` when one of them was
    /// for everyone or some are no longer remembered.
    pub fn since(&self, seen: u64, now: u64) -> Option<Vec<Want>> {
        let recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        let first = recent.front().map(|(n, _)| *n)?;
        if seen.wrapping_add(1) < first {
            return None;
        }
        // From the newest back: a waiting poll is usually one wake-up behind, and every
        // poll of the fleet asks after each one.
        let mut wants: Option<Vec<Want>> = recent
            .iter()
            .rev()
            .skip_while(|(n, _)| *n > now)
            .take_while(|(n, _)| *n > seen)
            .map(|(_, want)| want.clone())
            .collect();
        if let Some(wants) = wants.as_mut() {
            wants.reverse();
        }
        wants
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn want(site: &str) -> Want {
        Want { agent_labels: [("site".to_owned(), site.to_owned())].into(), ..Want::default() }
    }

    #[test]
    fn a_poll_learns_which_runs_woke_it_and_looks_again_when_unsure() {
        let wakes = Wakes::default();
        let rx = wakes.subscribe();
        let seen = *rx.borrow();
        wakes.runs(vec![want("a"), want("b")]);
        wakes.runs(vec![]);
        let now = *rx.borrow();
        assert_eq!(now, seen + 1, "one wake-up, and none for nothing");
        assert_eq!(wakes.since(seen, now), Some(vec![want("a"), want("b")]));
        assert_eq!(wakes.since(now, now), Some(vec![]));
        wakes.all();
        assert_eq!(wakes.since(now, *rx.borrow()), None, "a wake-up for everyone");
        // Too far behind: the oldest wake-ups were forgotten.
        let behind = *rx.borrow();
        for _ in 0..=RECENT {
            wakes.runs(vec![want("c")]);
        }
        assert_eq!(wakes.since(behind, *rx.borrow()), None);
        let latest = *rx.borrow();
        assert_eq!(wakes.since(latest - 1, latest), Some(vec![want("c")]));
    }
}

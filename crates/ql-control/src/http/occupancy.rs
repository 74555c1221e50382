//! Who holds what of the worker ingress, to enforce the limits of the [module doc](super):
//! the places of handshakes in progress and of connections without a certificate, each
//! shared among addresses ([`Door`]), and each worker's connections ([`Occupancy::hold`]).
//! The operator API holds its connections through a [`Door`] of its own.
//!
//! Places are scarce on purpose and anyone who reaches the port can ask for one, so with
//! every place taken an address holding at least two fewer than the one holding most
//! takes that address's oldest place: fewer addresses than there are places cannot keep
//! everyone else out, only share the places with them.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use super::{IngressConfig, IngressStats};

/// Places shared among addresses, each address's oldest first: each place's id and what
/// tells its holder to let go.
#[derive(Default)]
pub(super) struct Places {
    total: usize,
    by_ip: HashMap<IpAddr, VecDeque<(u64, Arc<Notify>)>>,
}

/// Why no place was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Full {
    /// The address holds its own share.
    Address,
    /// Every place is taken, by no address holding two more than this one.
    All,
}

impl Places {
    /// A place for `ip` ([`address_of`] it), if it holds fewer than `per_ip` and either
    /// fewer than `all` are taken or an address holding at least two more gives up its
    /// oldest (whose `Notify` fires). With `all` 0 there is none.
    fn take(&mut self, ip: IpAddr, per_ip: usize, all: usize, id: u64) -> Result<Arc<Notify>, Full> {
        if all == 0 {
            return Err(Full::All);
        }
        let from_ip = self.by_ip.get(&ip).map_or(0, VecDeque::len);
        if from_ip >= per_ip.max(1) {
            return Err(Full::Address);
        }
        if self.total >= all {
            // The address holding most, the one with the oldest place among equals.
            let oldest_first = |held: &VecDeque<(u64, Arc<Notify>)>| held.front().map(|(id, _)| std::cmp::Reverse(*id));
            let heaviest = self.by_ip.iter().max_by_key(|(_, held)| (held.len(), oldest_first(held)));
            let (&heaviest, _) = heaviest.ok_or(Full::All)?;
            let held = self.by_ip.get_mut(&heaviest).ok_or(Full::All)?;
            if held.len() <= from_ip + 1 {
                return Err(Full::All);
            }
            let (_, oldest) = held.pop_front().ok_or(Full::All)?;
            oldest.notify_one();
            self.total -= 1;
        }
        let evicted = Arc::new(Notify::new());
        self.total += 1;
        self.by_ip.entry(ip).or_default().push_back((id, evicted.clone()));
        Ok(evicted)
    }

    /// Gives back `ip`'s place `id`, unless a newcomer took it already.
    fn give_back(&mut self, ip: IpAddr, id: u64) {
        if let Some(held) = self.by_ip.get_mut(&ip) {
            let before = held.len();
            held.retain(|(held, _)| *held != id);
            self.total -= before - held.len();
            if held.is_empty() {
                self.by_ip.remove(&ip);
            }
        }
    }
}

/// A worker's connections, oldest first: each one's id, its certificate's serial, what
/// tells it to close, and whether a request of it succeeded (it was admitted).
type Connections = VecDeque<(u64, String, Arc<Notify>, Arc<AtomicBool>)>;

/// Places of one kind shared among addresses ([`Places::take`]), each given as a [`Place`].
#[derive(Default)]
pub(crate) struct Door {
    places: Mutex<Places>,
    next: AtomicUsize,
}

impl Door {
    /// A place for `ip` (its [`address_of`]) if it holds fewer than `per_ip` and either
    /// fewer than `all` are taken or an address holding at least two more gives up its
    /// oldest.
    pub(crate) fn enter(self: &Arc<Self>, ip: IpAddr, per_ip: usize, all: usize) -> Result<Place, Full> {
        let ip = address_of(ip);
        let id = self.next.fetch_add(1, Ordering::Relaxed) as u64;
        let evicted = self.places.lock().unwrap_or_else(|e| e.into_inner()).take(ip, per_ip, all, id)?;
        Ok(Place { door: self.clone(), ip, id, evicted })
    }
}

/// Who holds what (see the module doc).
#[derive(Default)]
pub(crate) struct Occupancy {
    /// Handshakes in progress.
    handshakes: Arc<Door>,
    /// Connections without a certificate.
    anonymous: Arc<Door>,
    workers: Mutex<HashMap<ql_wire::ids::WorkerId, Connections>>,
    next: AtomicUsize,
}

/// A place held, given back when dropped; its `evicted` fires when a newcomer from an
/// address holding fewer took it.
pub(crate) struct Place {
    door: Arc<Door>,
    ip: IpAddr,
    id: u64,
    pub(crate) evicted: Arc<Notify>,
}

impl Drop for Place {
    fn drop(&mut self) {
        self.door.places.lock().unwrap_or_else(|e| e.into_inner()).give_back(self.ip, self.id);
    }
}

/// A worker's connection on record; its `Notify` fires when a newer one evicts it.
pub(super) struct Held<'a> {
    occupancy: &'a Occupancy,
    worker: ql_wire::ids::WorkerId,
    id: u64,
    pub(super) evicted: Arc<Notify>,
    /// Set once a request of the connection succeeded.
    pub(super) admitted: Arc<AtomicBool>,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let mut workers = self.occupancy.workers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(held) = workers.get_mut(&self.worker) {
            held.retain(|(id, ..)| *id != self.id);
            if held.is_empty() {
                workers.remove(&self.worker);
            }
        }
    }
}

impl Occupancy {
    /// A place for a handshake from `ip`, if the limits leave one ([`Places::take`]).
    pub(super) fn handshake(&self, ip: IpAddr, cfg: &IngressConfig) -> Result<Place, Full> {
        self.handshakes.enter(ip, cfg.max_handshakes_per_ip, cfg.max_handshakes)
    }

    /// A place for a connection without a certificate from `ip`, if the limits leave one
    /// ([`Places::take`]; `max_anonymous_connections` 0: never).
    pub(super) fn anonymous(&self, ip: IpAddr, cfg: &IngressConfig) -> Result<Place, Full> {
        self.anonymous.enter(ip, cfg.max_anonymous_connections_per_ip, cfg.max_anonymous_connections)
    }

    /// Records a connection of `worker` on the certificate `serial`. Beyond the limit it
    /// evicts the worker's oldest on the same certificate, else its oldest not yet
    /// admitted, else its oldest: a copy of a revoked certificate, whose requests never
    /// succeed, closes its own connections, never one on another certificate that has
    /// succeeded, nor the agent's fresh one whose first request (a 25 s long-poll, say)
    /// has not been answered yet.
    pub(super) fn hold(
        &self,
        worker: ql_wire::ids::WorkerId,
        serial: &str,
        cfg: &IngressConfig,
        stats: &IngressStats,
    ) -> Held<'_> {
        let id = self.next.fetch_add(1, Ordering::Relaxed) as u64;
        let (evicted, admitted) = (Arc::new(Notify::new()), Arc::new(AtomicBool::new(false)));
        let mut workers = self.workers.lock().unwrap_or_else(|e| e.into_inner());
        let held = workers.entry(worker.clone()).or_default();
        while held.len() >= cfg.max_connections_per_worker.max(1) {
            let oldest = held
                .iter()
                .position(|(_, s, ..)| s == serial)
                .or_else(|| held.iter().position(|(.., admitted)| !admitted.load(Ordering::Relaxed)))
                .unwrap_or(0);
            if let Some((_, _, oldest, _)) = held.remove(oldest) {
                oldest.notify_one();
                stats.evicted.fetch_add(1, Ordering::Relaxed);
            }
        }
        held.push_back((id, serial.to_owned(), evicted.clone(), admitted.clone()));
        Held { occupancy: self, worker, id, evicted, admitted }
    }
}

/// The address a peer's places count against: an IPv6 peer's /64 (one host commonly
/// holds a whole /64, so its single addresses would be a cap per connection), an IPv4
/// peer's own address (also when it comes mapped into IPv6).
fn address_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(std::net::Ipv6Addr::from(v6.to_bits() & !u128::from(u64::MAX))),
        },
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_count_against_an_ipv6_peers_slash_64_and_an_ipv4_peers_address() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let same = address_of(ip("2001:db8:1:2::1"));
        assert_eq!(same, ip("2001:db8:1:2::"));
        assert_eq!(address_of(ip("2001:db8:1:2:ffff:ffff:ffff:ffff")), same, "one /64, one count");
        assert_ne!(address_of(ip("2001:db8:1:3::1")), same, "the next /64 counts apart");
        assert_eq!(address_of(ip("::ffff:192.0.2.7")), ip("192.0.2.7"), "IPv4 mapped into IPv6");
        assert_eq!(address_of(ip("192.0.2.7")), ip("192.0.2.7"));
        assert_ne!(address_of(ip("192.0.2.8")), ip("192.0.2.7"));
    }

    #[test]
    fn at_the_cap_an_address_holding_two_fewer_takes_the_heaviest_addresses_oldest_place() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let (a, b, c) = (ip("192.0.2.1"), ip("192.0.2.2"), ip("192.0.2.3"));
        let mut places = Places::default();
        let a_places: Vec<_> = (0..3).map(|id| places.take(a, 3, 4, id).expect("room")).collect();
        assert_eq!(places.take(a, 3, 4, 3).unwrap_err(), Full::Address, "an address's own cap");
        let b0 = places.take(b, 3, 4, 4).expect("the last place");
        // All four taken, b holding one and a three: two more, so a's oldest goes.
        let b1 = places.take(b, 3, 4, 5).expect("a holds two more");
        assert!(futures_notified(&a_places[0]), "a's oldest was told to close");
        assert!(!futures_notified(&a_places[1]));
        // Now a and b hold two each: c, holding none, takes the oldest place of the two, a's.
        assert!(places.take(c, 3, 4, 6).is_ok());
        assert!(futures_notified(&a_places[1]));
        // a holds one, b two, c one: c holds only one fewer than b, so no place.
        assert_eq!(places.take(c, 3, 4, 7).unwrap_err(), Full::All, "one fewer is not enough");
        assert!(!futures_notified(&b0) && !futures_notified(&b1));
        // Given back, a place is free again; a place taken away is given back as nothing.
        places.give_back(a, 0);
        assert_eq!(places.total, 4, "a's oldest was taken already");
        places.give_back(b, 4);
        assert_eq!(places.total, 3);
        assert!(places.take(c, 3, 4, 8).is_ok());
        assert_eq!(Places::default().take(a, 3, 0, 9).unwrap_err(), Full::All, "no places at all");
    }

    /// Whether `notify` holds a permit (`notify_one` on a `Notify` nobody waits on
    /// stores one), taking it.
    fn futures_notified(notify: &Notify) -> bool {
        let notified = notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable()
    }
}

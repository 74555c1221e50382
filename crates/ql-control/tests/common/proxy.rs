//! A round-robin TCP proxy of the tests' own, in front of several `serve` replicas: each
//! new connection goes to the next replica, as a layer-4 balancer sends them, and one
//! connection in `cut_one_in` is cut at a random byte of its answers (an answer lost,
//! or a request cut off, mid-way). TLS passes through untouched: the agents' mTLS ends
//! at the replica.
//!
//! Included as `#[path = "common/proxy.rs"] mod proxy;`.

#![allow(dead_code)] // Not every includer uses every helper.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// A running proxy; stops accepting when dropped (open connections end with their peers).
pub(crate) struct Proxy {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    counts: Arc<Vec<AtomicUsize>>,
    cuts: Arc<AtomicUsize>,
}

impl Proxy {
    /// Listens on a free loopback port in front of `backends`.
    pub(crate) fn start(backends: Vec<SocketAddr>, cut_one_in: u64) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let counts: Arc<Vec<AtomicUsize>> = Arc::new(backends.iter().map(|_| AtomicUsize::new(0)).collect());
        let cuts = Arc::new(AtomicUsize::new(0));
        let (s, c, k) = (stop.clone(), counts.clone(), cuts.clone());
        std::thread::spawn(move || accept_loop(listener, backends, cut_one_in, s, c, k));
        Self { addr, stop, counts, cuts }
    }

    /// `https://127.0.0.1:PORT`.
    pub(crate) fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// Connections sent to each backend so far.
    pub(crate) fn connections(&self) -> Vec<usize> {
        self.counts.iter().map(|c| c.load(Ordering::SeqCst)).collect()
    }

    /// Connections cut so far.
    pub(crate) fn cuts(&self) -> usize {
        self.cuts.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop, which then sees `stop`.
        let _ = TcpStream::connect(self.addr);
    }
}

/// A tiny deterministic generator (xorshift) for which connection is cut, and where.
fn next(state: &AtomicU64) -> u64 {
    let mut x = state.load(Ordering::SeqCst);
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    state.store(x, Ordering::SeqCst);
    x
}

fn accept_loop(
    listener: TcpListener,
    backends: Vec<SocketAddr>,
    cut_one_in: u64,
    stop: Arc<AtomicBool>,
    counts: Arc<Vec<AtomicUsize>>,
    cuts: Arc<AtomicUsize>,
) {
    let rng = AtomicU64::new(0x2545_f491_4f6c_dd1d);
    let mut turn = 0usize;
    while !stop.load(Ordering::SeqCst) {
        let Ok((client, _)) = listener.accept() else { continue };
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let index = turn % backends.len();
        turn += 1;
        let Ok(backend) = TcpStream::connect(backends[index]) else {
            // A replica that is down refuses; the client sees its connection closed.
            continue;
        };
        counts[index].fetch_add(1, Ordering::SeqCst);
        // One connection in `cut_one_in` dies after a random number of answer bytes,
        // mostly past the TLS handshake (about 2 KB here).
        let cut_after = (cut_one_in > 0 && next(&rng).is_multiple_of(cut_one_in)).then(|| 2_048 + next(&rng) % 30_000);
        let (c2, b2) = (client.try_clone().unwrap(), backend.try_clone().unwrap());
        std::thread::spawn(move || pipe(c2, b2, None, None));
        let cuts = cuts.clone();
        std::thread::spawn(move || pipe(backend, client, cut_after, Some(cuts)));
    }
}

/// Copies `from` to `to` until either ends, or until `cut_after` bytes when given, then
/// closes both.
fn pipe(mut from: TcpStream, mut to: TcpStream, cut_after: Option<u64>, cuts: Option<Arc<AtomicUsize>>) {
    let mut buf = [0u8; 16 * 1024];
    let mut moved = 0u64;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(limit) = cut_after {
            if moved + n as u64 > limit {
                if let Some(cuts) = &cuts {
                    cuts.fetch_add(1, Ordering::SeqCst);
                }
                break;
            }
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
        moved += n as u64;
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

//! A rate-limiting TCP proxy of the tests' own, on loopback: a slow uplink between an
//! agent and ql-control. Bytes from the client to the server go through at most `rate`
//! bytes a second, shared by every connection as on one link; answers come back at full
//! speed (a router's downlink is the fast one). TLS passes through untouched: the agent
//! still speaks to the server's certificate.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A running proxy; its threads end with the test process.
pub struct Throttle {
    /// Where the client connects.
    pub addr: SocketAddr,
}

impl Throttle {
    /// Listens on a free loopback port and forwards each connection to `upstream`.
    pub fn start(upstream: &str, rate: u64) -> Throttle {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let upstream = upstream.to_owned();
        // When the link is next free: every connection's bytes queue on it.
        let link = Arc::new(Mutex::new(Instant::now()));
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(&upstream) else { continue };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let link = link.clone();
                std::thread::spawn(move || pump(client, server, Some((link, rate))));
                std::thread::spawn(move || pump(s2, c2, None));
            }
        });
        Throttle { addr }
    }

    /// The URL to give the agent instead of the server's.
    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }
}

/// Copies `from` to `to`, at `rate` bytes a second on the shared link when one is given.
fn pump(mut from: TcpStream, mut to: TcpStream, limit: Option<(Arc<Mutex<Instant>>, u64)>) {
    let mut buf = [0u8; 4096];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some((link, rate)) = &limit {
            // Reserve the link for these bytes, then wait until they have "crossed" it.
            let done = {
                let mut free = link.lock().unwrap();
                let start = (*free).max(Instant::now());
                *free = start + Duration::from_secs_f64(n as f64 / *rate as f64);
                *free
            };
            let now = Instant::now();
            if done > now {
                std::thread::sleep(done - now);
            }
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    let _ = from.shutdown(Shutdown::Read);
}

//! Requests through [`ql_client::agent`] to a plain-HTTP server on loopback: each arrives
//! in one write, and a request that waits for `100 Continue` still works.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::Duration;

/// A server on loopback that serves one connection with `serve`: the URL of `path` on it,
/// and what `serve` returns.
fn server<T: Send + 'static>(
    path: &str,
    serve: impl FnOnce(TcpStream) -> T + Send + 'static,
) -> (String, JoinHandle<T>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}{path}", listener.local_addr().unwrap());
    (url, std::thread::spawn(move || serve(listener.accept().unwrap().0)))
}

/// One read of what the peer has sent (blocking until something has come).
fn read_once(stream: &mut TcpStream) -> Vec<u8> {
    let mut buf = vec![0; 64 * 1024];
    let n = stream.read(&mut buf).unwrap();
    assert!(n > 0, "the client closed the connection");
    buf.truncate(n);
    buf
}

fn agent() -> ureq::Agent {
    let config =
        ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(Duration::from_secs(30)));
    ql_client::agent(config.build())
}

#[test]
fn a_request_arrives_in_one_write() {
    let (url, server) = server("/x", |mut stream| {
        let mut reads = Vec::new();
        for _ in 0..2 {
            // A single send arrives whole on loopback, so one read holds the whole request.
            reads.push(read_once(&mut stream));
            stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok").unwrap();
        }
        reads
    });
    let agent = agent();
    for _ in 0..2 {
        let mut resp = agent.post(&url).send(&b"{\"a\":1}"[..]).unwrap();
        assert_eq!(resp.body_mut().read_to_string().unwrap(), "ok");
    }
    for read in server.join().unwrap() {
        let text = String::from_utf8(read).unwrap();
        assert!(text.starts_with("POST /x HTTP/1.1\r\n"), "{text}");
        assert!(text.ends_with("\r\n\r\n{\"a\":1}"), "head and body in one read: {text:?}");
    }
}

#[test]
fn a_request_that_waits_for_100_continue_sends_its_body_after_it() {
    let (url, server) = server("/up", |mut stream| {
        let head = String::from_utf8(read_once(&mut stream)).unwrap();
        assert!(head.to_ascii_lowercase().contains("expect: 100-continue"), "{head}");
        assert!(head.ends_with("\r\n\r\n"), "the head alone, before 100 Continue: {head:?}");
        stream.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").unwrap();
        let mut body = Vec::new();
        while body.len() < 5 {
            body.extend(read_once(&mut stream));
        }
        stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n").unwrap();
        body
    });
    let mut source = &b"hello"[..];
    let resp = agent()
        .put(&url)
        .header("Expect", "100-continue")
        .header("Content-Length", "5")
        .send(ureq::SendBody::from_reader(&mut source))
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(server.join().unwrap(), b"hello");
}

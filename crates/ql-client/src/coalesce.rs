//! A request's head that leaves with its body.
//!
//! ureq hands its transport a request's head and then its body, each to send at once: two
//! TLS records, two TCP segments and two wake-ups of the server for every request, the
//! smallest heartbeat included. On a router's slow uplink that is a packet and a record's
//! overhead more per request; on a busy server, a second read for a request it could have
//! read whole. [`Coalesced`] holds the head and sends it with the body's first part, or
//! when ureq turns to read the answer (a request without a body, or one that waits for
//! `100 Continue`); later parts of a body go out as they come, so an upload streams at its
//! source's pace.

use ureq::unversioned::transport::{Buffers, ConnectionDetails, Connector, LazyBuffers, NextTimeout, Transport};
use ureq::Timeout;

/// The most this transport buffers of a request on its own: ureq's default is 128 KiB, a
/// request's head, a TLS record and the JSON bodies here are far smaller, and larger
/// bodies go in parts.
const OWN_OUTPUT: usize = 16 * 1024;

/// The least input buffer: ureq takes scratch space for a body from the input buffer's
/// free room and, given less than 10 KiB of it, resizes the buffer in a way that can cut
/// below what it holds (a `100 Continue` with several KiB more in one read).
const MIN_INPUT: usize = 20 * 1024;

/// The connector that wraps ureq's transport (TLS, or TCP for `http://`) in [`Coalesced`].
#[derive(Debug)]
pub struct Coalesce;

impl Connector<Box<dyn Transport>> for Coalesce {
    type Out = Coalesced;

    fn connect(
        &self,
        details: &ConnectionDetails,
        chained: Option<Box<dyn Transport>>,
    ) -> Result<Option<Coalesced>, ureq::Error> {
        let config = details.config;
        // One byte past ureq's limit on an answer's head, so that ureq sees a head too long
        // and says so, as with its own buffer.
        let input = config.input_buffer_size().min(config.max_response_header_size() + 1).max(MIN_INPUT);
        let output = config.output_buffer_size().min(OWN_OUTPUT);
        Ok(chained.map(|inner| Coalesced::new(inner, input, output)))
    }
}

/// A transport that holds a request's head until the body's first part joins it, or until
/// ureq awaits input (the answer, or `100 Continue`); once anything of the request has
/// left, the rest goes as it comes. It has buffers of its own: ureq writes each part from the start
/// of the output buffer, so the held head must live where the next part does not land,
/// and ureq reads through whichever buffers the transport hands out.
#[derive(Debug)]
pub struct Coalesced {
    inner: Box<dyn Transport>,
    buffers: LazyBuffers,
    /// Bytes at the start of `buffers`' output written and not yet sent.
    held: usize,
    /// Whether the request has begun to leave: its later parts go out as they come. Reset
    /// by the pool's check before the connection serves again ([`Transport::is_open`]).
    sending: bool,
}

impl Coalesced {
    fn new(inner: Box<dyn Transport>, input_size: usize, output_size: usize) -> Self {
        Self { inner, buffers: LazyBuffers::new(input_size, output_size), held: 0, sending: false }
    }

    /// Sends everything held, in as few writes as the inner transport's buffer allows; the
    /// request has then begun to leave. What could not be sent stays counted as held, so
    /// the connection is not reused.
    fn flush(&mut self, timeout: NextTimeout) -> Result<(), ureq::Error> {
        if self.held > 0 {
            self.sending = true;
        }
        let mut sent = 0;
        while sent < self.held {
            let out = self.inner.buffers().output();
            let n = out.len().min(self.held - sent);
            out[..n].copy_from_slice(&self.buffers.output()[sent..sent + n]);
            self.inner.transmit_output(n, timeout).map_err(|e| match e {
                // Sent while ureq waits for `100 Continue` (whose timeout ureq takes as leave
                // to send the body) or for the answer: either way the request did not leave.
                ureq::Error::Timeout(Timeout::Await100 | Timeout::RecvResponse) => {
                    ureq::Error::Timeout(Timeout::SendRequest)
                }
                e => e,
            })?;
            sent += n;
        }
        self.held = 0;
        Ok(())
    }
}

impl Transport for Coalesced {
    fn buffers(&mut self) -> &mut dyn Buffers {
        self
    }

    fn transmit_output(&mut self, amount: usize, timeout: NextTimeout) -> Result<(), ureq::Error> {
        let joins = self.held > 0;
        self.held += amount;
        // A first part more than half the buffer (a long head) goes at once, so that the
        // next part always has at least half the buffer to be written into.
        if self.sending || joins || self.held > self.buffers.output().len() / 2 {
            self.flush(timeout)?;
        }
        Ok(())
    }

    // ureq reaches this through `Box<dyn Transport>`, whose `maybe_await_input` is ureq's
    // default: it comes here only when `can_use_input` is false, which it is while
    // anything is held.
    fn await_input(&mut self, timeout: NextTimeout) -> Result<bool, ureq::Error> {
        self.flush(timeout)?;
        if self.buffers.can_use_input() {
            return Ok(true);
        }
        // Full: ureq has what it can take (it then finds an answer's head too long), and a
        // read of the inner transport now could only wait.
        if self.buffers.input_append_buf().is_empty() {
            return Ok(false);
        }
        // What the inner transport read and this one had no room for comes first.
        if self.inner.buffers().input().is_empty() && !self.inner.await_input(timeout)? {
            return Ok(false);
        }
        let from = self.inner.buffers().input();
        let to = self.buffers.input_append_buf();
        let n = from.len().min(to.len());
        to[..n].copy_from_slice(&from[..n]);
        self.buffers.input_appended(n);
        self.inner.buffers().input_consume(n);
        Ok(n > 0)
    }

    /// A connection holding part of a request (ureq gave up on it midway), or bytes read
    /// past an answer, is never reused: the next request would follow that part, and its
    /// answer would start with those bytes.
    fn is_open(&mut self) -> bool {
        // Asked before the connection serves again: its next request starts held, even if
        // ureq read the last answer without awaiting input.
        self.sending = false;
        self.held == 0 && self.inner.buffers().input().is_empty() && self.inner.is_open()
    }

    fn is_tls(&self) -> bool {
        self.inner.is_tls()
    }
}

impl Buffers for Coalesced {
    fn output(&mut self) -> &mut [u8] {
        let held = self.held;
        &mut self.buffers.output()[held..]
    }

    fn input(&self) -> &[u8] {
        self.buffers.input()
    }

    fn input_append_buf(&mut self) -> &mut [u8] {
        self.buffers.input_append_buf()
    }

    fn input_appended(&mut self, amount: usize) {
        self.buffers.input_appended(amount)
    }

    fn input_consume(&mut self, amount: usize) {
        self.buffers.input_consume(amount)
    }

    fn tmp_and_output(&mut self) -> (&mut [u8], &mut [u8]) {
        let held = self.held;
        let (tmp, output) = self.buffers.tmp_and_output();
        (tmp, &mut output[held..])
    }

    fn can_use_input(&self) -> bool {
        self.held == 0 && self.buffers.can_use_input()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};

    type Sent = Arc<Mutex<Vec<Vec<u8>>>>;

    /// An in-memory transport: records each write it is asked to send (or fails it with
    /// ureq's `100 Continue` timeout), and answers reads from a queue of chunks.
    #[derive(Debug)]
    struct Recorder {
        buffers: LazyBuffers,
        sent: Sent,
        answers: VecDeque<Vec<u8>>,
        fail: bool,
    }

    impl Transport for Recorder {
        fn buffers(&mut self) -> &mut dyn Buffers {
            &mut self.buffers
        }

        fn transmit_output(&mut self, amount: usize, _: NextTimeout) -> Result<(), ureq::Error> {
            if self.fail {
                return Err(ureq::Error::Timeout(Timeout::Await100));
            }
            let out = self.buffers.output()[..amount].to_vec();
            self.sent.lock().unwrap().push(out);
            Ok(())
        }

        fn await_input(&mut self, _: NextTimeout) -> Result<bool, ureq::Error> {
            let Some(chunk) = self.answers.pop_front() else { return Ok(false) };
            let buf = self.buffers.input_append_buf();
            buf[..chunk.len()].copy_from_slice(&chunk);
            self.buffers.input_appended(chunk.len());
            Ok(true)
        }

        fn is_open(&mut self) -> bool {
            true
        }
    }

    /// A [`Coalesced`] with `size`-byte buffers over a [`Recorder`] with `inner`-byte ones
    /// answering `answers`, boxed as ureq holds it (so ureq's own `maybe_await_input`).
    fn coalesced(inner: usize, size: usize, answers: &[&[u8]], fail: bool) -> (Box<dyn Transport>, Sent) {
        let sent = Sent::default();
        let answers = answers.iter().map(|a| a.to_vec()).collect();
        let recorder = Recorder { buffers: LazyBuffers::new(inner, inner), sent: sent.clone(), answers, fail };
        (Box::new(Coalesced::new(Box::new(recorder), size, size)), sent)
    }

    /// Writes `part` as ureq does: into the output buffer from its start, then transmits it.
    fn write(t: &mut Box<dyn Transport>, part: &[u8]) -> Result<(), ureq::Error> {
        t.buffers().output()[..part.len()].copy_from_slice(part);
        t.transmit_output(part.len(), NextTimeout::default())
    }

    /// Reads what is there (awaiting it as ureq does) and consumes `take` bytes of it, or all.
    fn read(t: &mut Box<dyn Transport>, take: Option<usize>) -> Option<Vec<u8>> {
        if !t.maybe_await_input(NextTimeout::default()).unwrap() {
            return None;
        }
        let got = t.buffers().input().to_vec();
        let n = take.unwrap_or(got.len()).min(got.len());
        t.buffers().input_consume(n);
        Some(got[..n].to_vec())
    }

    const HEAD: &[u8] = b"POST /x HTTP/1.1\r\nContent-Length: 2\r\n\r\n";

    #[test]
    fn a_head_leaves_with_its_bodys_first_part() {
        let (mut t, sent) = coalesced(1024, 1024, &[b"HTTP/1.1 200 OK\r\n"], false);
        write(&mut t, HEAD).unwrap();
        assert!(sent.lock().unwrap().is_empty(), "the head is held");
        assert!(!t.is_open(), "a connection holding part of a request is not reused");
        write(&mut t, b"{}").unwrap();
        assert_eq!(*sent.lock().unwrap(), [[HEAD, b"{}"].concat()], "head and body in one write");
        assert!(t.is_open());
        assert_eq!(read(&mut t, None).as_deref(), Some(&b"HTTP/1.1 200 OK\r\n"[..]));
    }

    #[test]
    fn a_head_alone_leaves_when_input_is_awaited_and_its_body_after_100_continue_at_once() {
        let (mut t, sent) = coalesced(1024, 1024, &[b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200"], false);
        write(&mut t, b"GET / HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!(read(&mut t, Some(25)).as_deref(), Some(&b"HTTP/1.1 100 Continue\r\n\r\n"[..]));
        assert_eq!(*sent.lock().unwrap(), [b"GET / HTTP/1.1\r\n\r\n".to_vec()]);
        // The request has begun to leave: its body goes at once.
        write(&mut t, b"body").unwrap();
        assert_eq!(sent.lock().unwrap().len(), 2, "the body after a 100 Continue is not held");
        assert_eq!(read(&mut t, None).as_deref(), Some(&b"HTTP/1.1 200"[..]));
        assert_eq!(sent.lock().unwrap()[1..], [b"body".to_vec()], "the part went out before the answer was read");
    }

    #[test]
    fn a_reused_connection_holds_its_next_head_even_if_no_input_was_awaited() {
        let (mut t, sent) = coalesced(1024, 1024, &[], false);
        write(&mut t, HEAD).unwrap();
        write(&mut t, b"{").unwrap();
        write(&mut t, b"}").unwrap();
        assert_eq!(sent.lock().unwrap().len(), 2, "the body's later part went as it came");
        // The answer was read from input already there: no await, then the pool's check.
        assert!(t.is_open());
        write(&mut t, HEAD).unwrap();
        assert_eq!(sent.lock().unwrap().len(), 2, "the next head is held");
    }

    #[test]
    fn a_body_streams_in_order_after_its_first_part() {
        let (mut t, sent) = coalesced(64, 64, &[], false);
        write(&mut t, b"PUT /a HTTP/1.1\r\n\r\n").unwrap();
        let chunks: Vec<Vec<u8>> = (0..5u8).map(|i| vec![b'a' + i; 10]).collect();
        for chunk in &chunks {
            write(&mut t, chunk).unwrap();
        }
        let sent = sent.lock().unwrap();
        assert_eq!(sent[0], [&b"PUT /a HTTP/1.1\r\n\r\n"[..], &chunks[0]].concat());
        assert_eq!(sent[1..], chunks[1..], "every later part as it comes");
    }

    #[test]
    fn an_answer_larger_than_this_transports_room_arrives_whole_and_blocks_reuse_meanwhile() {
        // ql-control's inner buffers are ureq's 128 KiB, its own 64 KiB: the inner
        // transport can read more than this one has room for.
        let answer: Vec<u8> = (0..100u8).collect();
        let (mut t, _) = coalesced(128, 32, &[&answer], false);
        let first = read(&mut t, None).unwrap();
        assert_eq!(first, answer[..32]);
        assert!(!t.is_open(), "bytes left in the inner transport keep the connection from reuse");
        let mut got = first;
        while let Some(piece) = read(&mut t, None) {
            got.extend(piece);
        }
        // The inner transport is asked for more only once all it read was handed on:
        // asking earlier would have met its end of input.
        assert_eq!(got, answer);
        assert!(t.is_open());
    }

    #[test]
    fn a_head_that_could_not_be_sent_keeps_the_connection_from_reuse() {
        let (mut t, _) = coalesced(1024, 1024, &[], true);
        write(&mut t, b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let err = t.maybe_await_input(NextTimeout::default()).unwrap_err();
        assert!(matches!(err, ureq::Error::Timeout(Timeout::SendRequest)), "{err:?}");
        assert!(!t.is_open());
    }
}

//! Requests that leave in one write.
//!
//! ureq hands its transport a request's head and then its body, each to send at once: two
//! TLS records, two TCP segments and two wake-ups of the server for every request, the
//! smallest heartbeat included. On a router's slow uplink that is a packet and a record's
//! overhead more per request; on a busy server, a second read for a request it could have
//! read whole. [`Coalesced`] holds what ureq writes until ureq turns to read the answer
//! (or half its buffer is full, so an upload still streams), then sends it as one.

use ureq::unversioned::transport::{Buffers, ConnectionDetails, Connector, LazyBuffers, NextTimeout, Transport};

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
        Ok(chained.map(|inner| Coalesced::new(inner, config.input_buffer_size(), config.output_buffer_size())))
    }
}

/// A transport that sends what ureq writes only when ureq awaits the answer, or once more
/// than half its output buffer is held. It has buffers of its own: ureq writes each part
/// from the start of the output buffer, so the held part must live where the next one
/// does not land, and reads go through whichever buffers the transport hands out.
#[derive(Debug)]
pub struct Coalesced {
    inner: Box<dyn Transport>,
    buffers: LazyBuffers,
    /// Bytes at the start of `buffers`' output written and not yet sent.
    held: usize,
}

impl Coalesced {
    fn new(inner: Box<dyn Transport>, input_size: usize, output_size: usize) -> Self {
        Self { inner, buffers: LazyBuffers::new(input_size, output_size), held: 0 }
    }

    /// Sends everything held, in as few writes as the inner transport's buffer allows.
    fn flush(&mut self, timeout: NextTimeout) -> Result<(), ureq::Error> {
        let held = std::mem::take(&mut self.held);
        let mut sent = 0;
        while sent < held {
            let out = self.inner.buffers().output();
            let n = out.len().min(held - sent);
            out[..n].copy_from_slice(&self.buffers.output()[sent..sent + n]);
            self.inner.transmit_output(n, timeout)?;
            sent += n;
        }
        Ok(())
    }
}

impl Transport for Coalesced {
    fn buffers(&mut self) -> &mut dyn Buffers {
        self
    }

    fn transmit_output(&mut self, amount: usize, timeout: NextTimeout) -> Result<(), ureq::Error> {
        self.held += amount;
        if self.held > self.buffers.output().len() / 2 {
            self.flush(timeout)?;
        }
        Ok(())
    }

    // ureq's default returns at once when input is already buffered, which would leave a
    // request held while ureq reads.
    fn maybe_await_input(&mut self, timeout: NextTimeout) -> Result<bool, ureq::Error> {
        self.flush(timeout)?;
        if self.buffers.can_use_input() {
            return Ok(true);
        }
        self.await_input(timeout)
    }

    fn await_input(&mut self, timeout: NextTimeout) -> Result<bool, ureq::Error> {
        self.flush(timeout)?;
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

    /// A connection holding part of a request (ureq gave up on it midway) is never reused:
    /// the next request would follow that part.
    fn is_open(&mut self) -> bool {
        self.held == 0 && self.inner.is_open()
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
        self.buffers.can_use_input()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};

    /// An in-memory transport: records each write it is asked to send, and answers reads
    /// from a queue of chunks.
    #[derive(Debug)]
    struct Recorder {
        buffers: LazyBuffers,
        sent: Arc<Mutex<Vec<Vec<u8>>>>,
        answers: VecDeque<Vec<u8>>,
        open: bool,
    }

    impl Transport for Recorder {
        fn buffers(&mut self) -> &mut dyn Buffers {
            &mut self.buffers
        }

        fn transmit_output(&mut self, amount: usize, _: NextTimeout) -> Result<(), ureq::Error> {
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
            self.open
        }
    }

    type Sent = Arc<Mutex<Vec<Vec<u8>>>>;

    /// A [`Coalesced`] of `size`-byte buffers over a [`Recorder`] of `inner`-byte ones
    /// answering `answers`.
    fn coalesced(inner: usize, size: usize, answers: &[&[u8]]) -> (Coalesced, Sent) {
        let sent = Sent::default();
        let recorder = Recorder {
            buffers: LazyBuffers::new(inner, inner),
            sent: sent.clone(),
            answers: answers.iter().map(|a| a.to_vec()).collect(),
            open: true,
        };
        (Coalesced::new(Box::new(recorder), size, size), sent)
    }

    /// Writes `part` as ureq does: into the output buffer from its start, then transmits it.
    fn write(t: &mut Coalesced, part: &[u8]) {
        t.buffers().output()[..part.len()].copy_from_slice(part);
        t.transmit_output(part.len(), NextTimeout::default()).unwrap();
    }

    /// Reads one chunk of the answer and consumes it.
    fn read(t: &mut Coalesced) -> Option<Vec<u8>> {
        if !t.maybe_await_input(NextTimeout::default()).unwrap() {
            return None;
        }
        let got = t.buffers().input().to_vec();
        t.buffers().input_consume(got.len());
        Some(got)
    }

    #[test]
    fn a_head_and_its_body_leave_in_one_write_when_the_answer_is_awaited() {
        let (mut t, sent) = coalesced(1024, 1024, &[b"HTTP/1.1 200 OK\r\n"]);
        write(&mut t, b"POST /x HTTP/1.1\r\nContent-Length: 2\r\n\r\n");
        write(&mut t, b"{}");
        assert!(sent.lock().unwrap().is_empty(), "nothing leaves before the answer is awaited");
        assert!(!t.is_open(), "a connection holding part of a request is not reused");

        assert_eq!(read(&mut t).as_deref(), Some(&b"HTTP/1.1 200 OK\r\n"[..]));
        assert_eq!(*sent.lock().unwrap(), [b"POST /x HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}".to_vec()]);
        assert!(t.is_open());

        write(&mut t, b"GET /y HTTP/1.1\r\n\r\n");
        assert_eq!(read(&mut t), None, "the end of the answers");
        assert_eq!(sent.lock().unwrap().len(), 2, "the next request leaves on its own");
    }

    #[test]
    fn a_body_larger_than_half_the_buffer_streams_in_order() {
        let (mut t, sent) = coalesced(64, 64, &[]);
        write(&mut t, b"PUT /a HTTP/1.1\r\n\r\n");
        let chunks: Vec<Vec<u8>> = (0..5u8).map(|i| vec![b'a' + i; 40]).collect();
        for chunk in &chunks {
            write(&mut t, chunk);
        }
        let before = sent.lock().unwrap().len();
        assert!(before >= 4, "each write past half the buffer leaves at once ({before} writes)");
        read(&mut t);
        let all: Vec<u8> = sent.lock().unwrap().concat();
        let expected: Vec<u8> = [b"PUT /a HTTP/1.1\r\n\r\n".to_vec(), chunks.concat()].concat();
        assert_eq!(all, expected, "every byte once, in order");
    }

    #[test]
    fn an_answer_larger_than_this_transports_room_arrives_whole_in_pieces() {
        let answer: Vec<u8> = (0..100u8).collect();
        let (mut t, _) = coalesced(128, 32, &[&answer]);
        let mut got = Vec::new();
        while let Some(piece) = read(&mut t) {
            assert!(piece.len() <= 32);
            got.extend(piece);
        }
        // The inner transport read the answer in one go and is asked for more only once
        // all of it has been handed on: asking earlier would read its end of input.
        assert_eq!(got, answer);
    }
}

//! Two clocks a connection runs between requests, kept apart on purpose.
//!
//! - The **idle** clock runs while the connection waits for the next request and no byte
//!   of it has arrived: an agent's one keep-alive connection is quiet between its
//!   heartbeats, so this one is long ([`super::IngressConfig::idle_timeout`]).
//! - The **head** clock starts with the first byte of a request and runs until its head
//!   is complete ([`super::IngressConfig::header_read_timeout`]). A head is a few hundred
//!   bytes that an honest client sends at once, so this one is short, and more bytes do
//!   not extend it: a trickle of header bytes cannot hold a connection longer than a
//!   silent client could.
//!
//! While a request is being answered (its body read, a long-poll waiting) neither runs;
//! the body has its own deadline (`ingress::BodyClock`).
//!
//! hyper's own `header_read_timeout` starts as soon as the previous response is written,
//! so it can only be one of the two; the connection turns it off and races
//! [`HeadClock::overstayed`] instead, fed by [`Watched`], which notes the first byte.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tokio::time::{sleep_until, Instant};

/// Where a connection stands between two answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for a request, nothing of it arrived, since then.
    Idle(Instant),
    /// The first byte of a request's head arrived then.
    Head(Instant),
    /// A request is being answered.
    Busy,
}

/// The phase of one connection and what tells its watcher that it changed.
#[derive(Debug)]
pub(super) struct HeadClock {
    phase: Mutex<Phase>,
    changed: Notify,
    /// Set once a request of the connection was being answered, and never cleared.
    begun: std::sync::atomic::AtomicBool,
}

impl HeadClock {
    /// A fresh connection, waiting for its first request.
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Self {
            phase: Mutex::new(Phase::Idle(Instant::now())),
            changed: Notify::new(),
            begun: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn set(&self, change: impl FnOnce(Phase) -> Phase) {
        let mut phase = self.phase.lock().unwrap_or_else(|e| e.into_inner());
        let next = change(*phase);
        if next != *phase {
            *phase = next;
            self.changed.notify_one();
        }
    }

    /// Bytes arrived: if the connection was idle, a head has begun.
    fn bytes_arrived(&self) {
        self.set(|phase| match phase {
            Phase::Idle(_) => Phase::Head(Instant::now()),
            other => other,
        });
    }

    /// A head was complete and its request is being answered.
    pub(super) fn answering(&self) {
        self.begun.store(true, std::sync::atomic::Ordering::Relaxed);
        self.set(|_| Phase::Busy);
    }

    /// Whether a request of the connection was ever answered, or is being answered now
    /// (its answer may still be on its way out after [`HeadClock::answered`]).
    pub(super) fn has_answered(&self) -> bool {
        self.begun.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The answer is out: the connection waits for the next request.
    pub(super) fn answered(&self) {
        self.set(|_| Phase::Idle(Instant::now()));
    }

    /// Resolves once the connection has been idle longer than `idle`, or a head has taken
    /// longer than `head`; never while a request is being answered.
    pub(super) async fn overstayed(&self, idle: Duration, head: Duration) {
        loop {
            // Registered before the phase is read, so no change between the two is missed.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let deadline = match *self.phase.lock().unwrap_or_else(|e| e.into_inner()) {
                Phase::Idle(since) => Some(since + idle),
                Phase::Head(since) => Some(since + head),
                Phase::Busy => None,
            };
            match deadline {
                Some(deadline) => tokio::select! {
                    () = sleep_until(deadline) => return,
                    () = &mut changed => {}
                },
                None => changed.await,
            }
        }
    }
}

/// A connection's stream that tells its [`HeadClock`] when bytes arrive.
pub(super) struct Watched<T> {
    inner: T,
    clock: Arc<HeadClock>,
}

impl<T> Watched<T> {
    pub(super) fn new(inner: T, clock: Arc<HeadClock>) -> Self {
        Self { inner, clock }
    }

    pub(super) fn into_inner(self) -> T {
        self.inner
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.clock.bytes_arrived();
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IDLE: Duration = Duration::from_secs(300);
    const HEAD: Duration = Duration::from_secs(10);

    /// Whether `overstayed` has resolved after the paused clock moved by `by`.
    async fn overstayed_after(clock: &Arc<HeadClock>, by: Duration) -> bool {
        let watcher = clock.clone();
        let task = tokio::spawn(async move { watcher.overstayed(IDLE, HEAD).await });
        tokio::time::sleep(by).await;
        tokio::task::yield_now().await;
        let done = task.is_finished();
        task.abort();
        done
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_has_the_idle_timeout() {
        let clock = HeadClock::new();
        assert!(!overstayed_after(&clock, IDLE - Duration::from_secs(1)).await);
        let clock = HeadClock::new();
        assert!(overstayed_after(&clock, IDLE + Duration::from_millis(1)).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_head_has_the_short_timeout_from_its_first_byte_and_more_bytes_do_not_extend_it() {
        let clock = HeadClock::new();
        clock.bytes_arrived();
        tokio::time::advance(HEAD / 2).await;
        clock.bytes_arrived();
        assert!(overstayed_after(&clock, HEAD / 2 + Duration::from_millis(1)).await);
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_runs_while_a_request_is_answered_and_the_idle_clock_restarts_after() {
        let clock = HeadClock::new();
        clock.bytes_arrived();
        clock.answering();
        assert!(!overstayed_after(&clock, IDLE * 2).await, "a long-poll is not idle");
        clock.answered();
        assert!(!overstayed_after(&clock, HEAD * 2).await, "idle, not a head");
    }
}

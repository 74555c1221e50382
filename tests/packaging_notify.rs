//! The agent's systemd notifications (`src/notify.rs`): READY, WATCHDOG, STOPPING and
//! STATUS datagrams proved against a socket bound as `$NOTIFY_SOCKET` would be. The module
//! is compiled here on its own, with its unit tests, so the systemd unit's `Type=notify`
//! has a tested sender before the agent's main loop calls it.

#[path = "../src/notify.rs"]
mod notify;

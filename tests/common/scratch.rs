//! What every test of this package may share, the packaging tests included: a scratch
//! directory per test, and a command that must succeed. The end-to-end tests reach it
//! through `common`; the packaging tests, which need nothing else of it, include only this
//! file (`#[path = "common/scratch.rs"] mod scratch;`).
// `pub` for `common`'s re-export; a test crate that includes this file directly has no
// public API to reach.
#![allow(unreachable_pub)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A directory removed when the test ends.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// A fresh, empty directory under the system's temporary directory, named after the
    /// test crate, `tag`, the process and a counter.
    pub fn new(tag: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let name = format!("ql-{}-{tag}-{}-{n}", env!("CARGO_CRATE_NAME"), std::process::id());
        let dir = std::env::temp_dir().join(name);
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Runs `cmd` and returns its output; the test fails, showing both streams, unless the
/// command started and exited successfully.
pub fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?} does not start: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

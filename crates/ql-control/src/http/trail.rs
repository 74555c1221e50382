//! A request's admission and audit trail, from its head to its answer.
//!
//! An admitted request costs one commit, not two: its `admitted` record goes on record
//! with its first command, in that command's atomic unit ([`Store::execute_audited`]), so
//! no decision is ever durable without the record of the request that asked for it. The
//! admission itself is decided either
//! - before the body ([`Trail::admitted`], after [`Store::admit`], which records only a
//!   refusal): for the framed uploads, and for any request that sends
//!   `Expect: 100-continue`, whose body is not asked for until it is admitted; or
//! - with the first command, in its transaction ([`Trail::deferred`]): for a small JSON
//!   body the client sent with its head unasked, which is read (at most the route's cap)
//!   but used for nothing until the admission in the same unit as the decision passed.
//!
//! A request that ends before any command (a framing refusal, a body that never came)
//! is admitted (if that is still to be decided) and recorded when it ends; one whose
//! connection drops first, from [`Drop`].

use std::sync::{Mutex, PoisonError};

use ql_wire::ErrorCode;

use crate::core::{Command, Reply};
use crate::model::AuditRecord;
use crate::store::{Audit, Store, StoreError};

/// What is not on record yet of one request.
#[derive(Default)]
struct Pending {
    /// The `admitted` record still waits for a command or the request's end.
    record: bool,
    /// The certificate's serial while the admission is still to be decided.
    admit: Option<String>,
    /// The refusal recorded with the first command, when that command was refused.
    refused: Option<ErrorCode>,
}

/// One request's admission and audit records (see the module doc).
pub(super) struct Trail<S: Store> {
    store: S,
    /// The request's `admitted` record.
    record: AuditRecord,
    pending: Mutex<Pending>,
}

/// The codes of a refused admission: the connection ends with them.
pub(super) fn is_admission_refusal(code: ErrorCode) -> bool {
    matches!(code, ErrorCode::WorkerDisabled | ErrorCode::CertificateRevoked | ErrorCode::Unauthenticated)
}

impl<S: Store> Trail<S> {
    /// The trail of a request [`Store::admit`] admitted.
    pub(super) fn admitted(store: S, record: AuditRecord) -> Self {
        Self { store, record, pending: Mutex::new(Pending { record: true, ..Pending::default() }) }
    }

    /// The trail of a request whose admission (of the certificate `serial`) is decided
    /// with its first command.
    pub(super) fn deferred(store: S, record: AuditRecord, serial: String) -> Self {
        let pending = Pending { record: true, admit: Some(serial), refused: None };
        Self { store, record, pending: Mutex::new(pending) }
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `cmd`; the first command carries the admission still to be decided and the
    /// `admitted` record (and, if it is refused, the refusal's). A command the store could
    /// not run keeps nothing, so they wait for the next one or the request's end.
    pub(super) async fn execute(&self, cmd: Command) -> Result<Result<Reply, ErrorCode>, StoreError> {
        let audit = {
            let mut pending = self.pending();
            std::mem::take(&mut pending.record)
                .then(|| Audit { record: self.record.clone(), admit: pending.admit.take() })
        };
        let Some(audit) = audit else {
            return self.store.execute(cmd).await;
        };
        let admit = audit.admit.clone();
        let result = self.store.execute_audited(cmd, Some(audit)).await;
        let mut pending = self.pending();
        match &result {
            Err(_) => (pending.record, pending.admit) = (true, admit),
            Ok(Err(code)) => pending.refused = Some(*code),
            Ok(Ok(_)) => {}
        }
        result
    }

    /// Decides the admission if it is still to be decided (a request that ends before
    /// its first command): the refusal's code, which then answers the request.
    pub(super) async fn settle(&self) -> Result<Option<ErrorCode>, StoreError> {
        let Some(serial) = self.pending().admit.take() else {
            return Ok(None);
        };
        let refused = self.store.admit(self.record.clone(), serial).await?;
        if let Some(code) = refused {
            let mut pending = self.pending();
            (pending.record, pending.refused) = (false, Some(code));
        }
        Ok(refused)
    }

    /// Records what is not on record yet when the request ends with `outcome` (a
    /// refusal's code, or `None` when it was answered): the `admitted` record, then the
    /// refusal's. Call [`Trail::settle`] first. Returns false when a record could not be
    /// written.
    pub(super) async fn finish(&self, outcome: Option<ErrorCode>) -> bool {
        let (record, recorded) = {
            let mut pending = self.pending();
            (std::mem::take(&mut pending.record), pending.refused)
        };
        let mut written = true;
        if record {
            written &= self.store.audit(self.record.clone()).await.is_ok();
        }
        if let Some(code) = outcome.filter(|c| Some(*c) != recorded) {
            let record = AuditRecord { outcome: code.as_str().to_owned(), ..self.record.clone() };
            written &= self.store.audit(record).await.is_ok();
        }
        written
    }
}

impl<S: Store> Drop for Trail<S> {
    fn drop(&mut self) {
        // The connection ended while the request was being read or answered: its
        // admission still goes on record (or its refusal, if it is decided only now).
        let pending = std::mem::take(self.pending.get_mut().unwrap_or_else(PoisonError::into_inner));
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        if pending.record {
            let (store, record) = (self.store.clone(), self.record.clone());
            runtime.spawn(async move {
                let admitted = match pending.admit {
                    Some(serial) => matches!(store.admit(record.clone(), serial).await, Ok(None)),
                    None => true,
                };
                if admitted {
                    let _ = store.audit(record).await;
                }
            });
        }
    }
}

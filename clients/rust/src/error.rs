//! Errors of executor calls: the gRPC status, the `google.rpc.ErrorInfo` reason from its
//! details, and the error table's retry and unknown-outcome flags.

use tonic::Code;
use tonic_types::StatusExt;

/// The domain every ferrum-rpc `ErrorInfo` carries.
pub const ERROR_DOMAIN: &str = "ferrum.executor.v1";

/// One row of the error table: an `ErrorReason` value and its options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReasonRow {
    /// The reason's name, as `ErrorInfo.reason` carries it.
    pub name: &'static str,
    /// Its number in the `ErrorReason` enum.
    pub number: i32,
    /// The gRPC status code a failure with this reason carries.
    pub status_code: i32,
    /// The call changed nothing and may succeed later or elsewhere.
    pub retryable: bool,
    /// The caller cannot tell whether the call took effect.
    pub outcome_unknown: bool,
}

include!(concat!(env!("OUT_DIR"), "/error_table.rs"));

/// The table's row for a reason name.
pub fn reason_row(name: &str) -> Option<&'static ReasonRow> {
    REASONS.iter().find(|r| r.name == name)
}

/// A failed executor call.
#[derive(Debug, Clone)]
pub struct ExecutorError {
    /// The gRPC status code.
    pub code: Code,
    /// The `ErrorInfo` reason when the details carry one of this domain that names a
    /// row of the table (as the Python client, a status without one has None).
    pub reason: Option<String>,
    /// The `ErrorInfo` reason as sent, a name of the table or not.
    pub raw_reason: Option<String>,
    /// The status message.
    pub message: String,
    /// `ErrorInfo.metadata`, when there is one.
    pub metadata: std::collections::HashMap<String, String>,
}

impl ExecutorError {
    /// The error a gRPC status stands for: its ErrorInfo (domain ferrum.executor.v1)
    /// names the reason.
    pub fn from_status(status: &tonic::Status) -> Self {
        let info = status
            .get_details_error_info()
            .filter(|info| info.domain == ERROR_DOMAIN);
        // tonic ends a call whose own timer fired as CANCELLED "Timeout expired"; that is
        // the caller's deadline passing, DEADLINE_EXCEEDED as every other gRPC library
        // reports it.
        // A connection that fails or is lost under a call surfaces from tonic/hyper as
        // CANCELLED or UNKNOWN ("transport error") with the transport error as its
        // source; gRPC's rule (and the Python and C++ clients) call that UNAVAILABLE.
        // A status the server sent has no source.
        let from_transport = std::error::Error::source(status).is_some();
        let code = match status.code() {
            Code::Cancelled if status.message() == "Timeout expired" => Code::DeadlineExceeded,
            Code::Cancelled | Code::Unknown if from_transport => Code::Unavailable,
            c => c,
        };
        let raw_reason = info.as_ref().map(|i| i.reason.clone());
        ExecutorError {
            code,
            reason: raw_reason.clone().filter(|r| reason_row(r).is_some()),
            raw_reason,
            message: status.message().to_string(),
            metadata: info.map(|i| i.metadata.into_iter().collect()).unwrap_or_default(),
        }
    }

    /// The error a `google.rpc.Status` message stands for (DecodeSession replies carry
    /// one in `error`).
    pub fn from_rpc_status(status: &tonic_types::pb::Status) -> Self {
        let mut reason = None;
        let mut metadata = Default::default();
        for any in &status.details {
            if any.type_url.ends_with("google.rpc.ErrorInfo") {
                if let Ok(info) = <tonic_types::pb::ErrorInfo as prost::Message>::decode(any.value.as_slice()) {
                    if info.domain == ERROR_DOMAIN {
                        reason = Some(info.reason);
                        metadata = info.metadata.into_iter().collect();
                    }
                }
            }
        }
        ExecutorError {
            code: Code::from_i32(status.code),
            raw_reason: reason.clone(),
            reason: reason.filter(|r| reason_row(r).is_some()),
            message: status.message.clone(),
            metadata,
        }
    }

    /// A local failure (the client's own checks), outside the table.
    pub fn local(code: Code, message: impl Into<String>) -> Self {
        ExecutorError { code, reason: None, raw_reason: None, message: message.into(), metadata: Default::default() }
    }

    /// The table's row for this error's reason, when it has one this build knows.
    pub fn row(&self) -> Option<&'static ReasonRow> {
        self.reason.as_deref().and_then(reason_row)
    }

    /// The call changed nothing and may succeed if made again (later, or elsewhere): the
    /// reason's `retryable` option; without a reason, UNAVAILABLE.
    pub fn retryable(&self) -> bool {
        match self.row() {
            Some(row) => row.retryable,
            None => self.code == Code::Unavailable,
        }
    }

    /// The caller cannot tell whether the call took effect: the reason's
    /// `outcome_unknown` option; without a reason, CANCELLED, DEADLINE_EXCEEDED,
    /// UNAVAILABLE, UNKNOWN or INTERNAL.
    pub fn outcome_unknown(&self) -> bool {
        match self.row() {
            Some(row) => row.outcome_unknown,
            None => matches!(
                self.code,
                Code::Cancelled | Code::DeadlineExceeded | Code::Unavailable | Code::Unknown | Code::Internal
            ),
        }
    }

    /// The reason's name, or the status code's name (as the Python client prints it).
    pub fn tag(&self) -> String {
        match &self.reason {
            Some(r) => r.clone(),
            None => code_name(self.code).to_string(),
        }
    }
}

/// A gRPC code's canonical upper-case name (e.g. "DEADLINE_EXCEEDED").
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

impl std::fmt::Display for ExecutorError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.tag(), self.message)
    }
}

impl std::error::Error for ExecutorError {}

impl From<tonic::Status> for ExecutorError {
    fn from(status: tonic::Status) -> Self {
        ExecutorError::from_status(&status)
    }
}

/// Result of an executor call.
pub type Result<T> = std::result::Result<T, ExecutorError>;

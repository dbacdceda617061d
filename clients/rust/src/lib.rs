//! A typed async client for ferrum-rpc's `ferrum.executor.v1.ModelExecutor` contract
//! (protos/ferrum_rpc/v1/executor.proto), and [`RemoteExecutor`], Ferrum's
//! `ferrum_interfaces::ModelExecutor` implemented over it.
//!
//! The stubs and the error table are generated from the proto at build time (build.rs).

/// The contract's messages and the generated tonic client.
pub mod pb {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("ferrum.executor.v1");
}

pub mod ahead;
pub mod client;
pub mod engine_setup;
pub mod error;
pub mod executor;
pub mod logits;
pub mod session;

pub use client::{ClientOptions, ClientTls, ExecutorClient, Keepalive};
pub use error::{ExecutorError, ReasonRow, REASONS};
pub use executor::{RemoteExecutor, RemoteKvCacheHandle};
pub use logits::LogitsView;
pub use session::DecodeSession;
